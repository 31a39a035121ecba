"""Discrete-event simulator: rollout GPUs, trainer ranks and the network around the REAL scheduler.

The coordinator logic is :class:`digenrl.core.scheduler.Scheduler` itself, fed events with a virtual
``now``; its commands (assign, revoke, shutdown) drive simulated nodes whose work takes the
seconds of :mod:`digenrl.core.costmodel`. Nodes behave like ``actors/rollout.py`` and
``actors/trainer.py``::

    rollout:  every announced version is fetched in the background (one fetch at a time, as
              actors/peers.py prefetches; it lands after the relay's time for the node's place
              in the tree, costmodel.weight_sync_s) while the node generates; Assign -> (catch up at the
              trajectory boundary: wait for the newest version's fetch if still running, apply
              it) -> generate
              T steps x n samples -> rewards -> commit reaches every trainer rank
    trainer:  commits of step s are trained as they arrive (GAP; without GAP only once all F
              fragments of s are in); a rank trains n x (timesteps it owns) (TSP; without TSP
              the fragment's samples are split data-parallel, ceil(n / R) each); when every rank
              has consumed all F fragments: all-reduce + optimizer step -> rank 0 publishes s+1.
              A rank with nothing to train offers itself for TAG (the scheduler decides).
    colocated: no rollouts; trainers generate everything (TAG "always") and pay a switch cost
              each time they change between generation and training state.
    sequence parallelism: ``train.sequence_parallel`` = N lays the R trainer ranks out in R / N
              groups; the scheduler plans over the groups (owners are their leaders) and every
              rank of a group trains its leader's share, at one rank's share of a sample's cost
              (costmodel.sp_seconds, the group's slowest GPU); such ranks offer no TAG work.
              ``cluster.rollout_gpus`` = G makes each rollout node G consecutive rollout GPUs
              generating at the G-device cost (a remainder of fewer than G GPUs stays idle).

Events are ordered by (time, seq) in a heap, so runs are deterministic; jitter and injected
rollout losses draw from one seeded ``random.Random``. Heartbeats and ticks are simulated as
one round every ``heartbeat_s`` (coarsened to the workload, see :func:`sim_config`).
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from digenrl.config import Config, ConfigError, ResolvedConfig
from digenrl.core.costmodel import (
    GPUS,
    Network,
    NodeCosts,
    Workload,
    chunk_bytes,
    node_costs,
    step_sync_s,
    weight_sync_s,
)
from digenrl.core.credits import within_staleness
from digenrl.core.plan import plan_for_step
from digenrl.core.scheduler import AssignCmd, RevokeCmd, Scheduler, SchedulerParams, ShutdownCmd


class SimulationError(RuntimeError):
    """The simulated run could not finish (deadlock or event budget); carries the statistics."""


@dataclass(frozen=True, kw_only=True)
class SimSetup:
    """Everything a simulation needs besides the (mode-resolved) Config."""

    rollout_gpus: tuple[str, ...]
    trainer_gpus: tuple[str, ...]
    network: Network = field(default_factory=Network)
    gap: bool = True
    """Train fragments as they commit; False waits for the whole step (disagg-sync)."""
    calibration: dict[str, Any] | None = None
    seed: int = 0
    jitter: float = 0.0
    """Relative std of every work item's duration (truncated Gaussian, >= 0)."""
    loss_rate_per_h: float = 0.0
    """Injected rollout losses per rollout-node-hour; a lost node rejoins after ``rejoin_s``."""
    rejoin_s: float = 60.0
    timeline_steps: int = 3
    """Record spans of the last N steps (0: none)."""
    keep_timeouts: bool = False
    """Use the config's heartbeat/lease values verbatim instead of scaling them to the work."""


@dataclass
class SimResult:
    """What :func:`simulate` returns; ``to_dict`` is what the planner prints as JSON."""

    steps: int
    samples_per_s: float
    s_per_step: float
    step_times: list[float]
    busy: dict[str, float]
    busy_by_role: dict[str, float]
    bubble_s_per_step: float
    wall_s: float
    timeline: list[tuple[str, str, float, float]]
    scheduler: dict[str, Any]
    rejected_stale: int
    losses: int
    sequence_parallel: int = 1
    """Trainer ranks per sequence-parallel group (``train.sequence_parallel``)."""
    rollout_gpus: int | None = 1
    """Devices per rollout node (``cluster.rollout_gpus``); None without rollout nodes (colocated)."""
    train_step_s: float = 0.0
    """One trainer rank's seconds per sample and trained timestep (its group's share)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def workload_from_config(cfg: Config) -> Workload:
    """The cost-relevant shape of ``cfg`` (trained timesteps from the config; no torch, except
    that a FLUX.2 folder's transformer config is read to tell dev from klein)."""
    model: str = cfg.model.family
    if model == "flux2" and cfg.model.path not in ("random", "emulated"):
        from digenrl.models.meta import cost_model_name

        model = cost_model_name(cfg.model)
    return Workload(model=model, num_steps=cfg.sampler.num_steps,
                    trained_steps=len(trained_timesteps(cfg)), cfg_gen=cfg.sampler.guidance_scale > 1,
                    cfg_train=cfg.sampler.guidance_scale > 1, grad_ckpt=cfg.model.gradient_checkpointing,
                    kl=cfg.train.kl_beta > 0, lora_rank=cfg.model.lora_rank, fsdp=cfg.model.fsdp,
                    rows_per_forward=rows_per_forward(cfg), sequence_parallel=cfg.train.sequence_parallel,
                    rollout_gpus=cfg.cluster.rollout_gpus)


def rows_per_forward(cfg: Config) -> int:
    """Trajectory rows a rollout's forward carries as planned: a fragment's (``sampler.max_batch
    = 0``), else as many whole fragments as ``max_batch`` holds, at most those a node may have
    in flight (a step's fragments times K + 1 versions)."""
    frag = cfg.train.prompts_per_step // cfg.runtime.fragments_per_step * cfg.train.group_size
    if not cfg.sampler.max_batch:
        return frag
    fragments = min(max(1, cfg.sampler.max_batch // frag), cfg.runtime.fragments_per_step * (cfg.runtime.staleness + 1))
    return frag * fragments


def trained_timesteps(cfg: Config) -> list[int]:
    """Trained denoising steps of step 0 of the run's plan (:func:`~digenrl.core.plan.plan_for_step`;
    every step trains as many, only a window's position moves)."""
    return plan_for_step(cfg, 0)[0]


def sim_config(cfg: ResolvedConfig, setup: SimSetup, costs: NodeCosts) -> ResolvedConfig:
    """Heartbeat and lease scaled to the work: a 200 s fragment needs a lease above 200 s, and
    heartbeats every 0.5 s would cost millions of events without changing the schedule."""
    if setup.keep_timeouts:
        return cfg
    n = cfg.batch_size // cfg.runtime.fragments_per_step
    frag = n * cfg.sampler.num_steps * max(costs.gen_step_s, costs.colo_gen_step_s)
    rt = dataclasses.replace(cfg.runtime, heartbeat_s=max(cfg.runtime.heartbeat_s, frag / 4),
                             lease_s=max(cfg.runtime.lease_s, 4 * frag + 60))
    return ResolvedConfig(dataclasses.replace(cfg, runtime=rt))  # no mode fixes these two


@dataclass
class _Node:
    id: str
    role: str
    gpu: str
    costs: NodeCosts
    rank: int = -1
    alive: bool = True
    version: int = 0
    queue: deque[Any] = field(default_factory=deque)
    task: Any = None
    until: float = 0.0
    token: int = 0           # bumps when work is aborted, so its completion event is ignored
    state: str = "train"     # colocated switch state
    busy: float = 0.0
    offered: bool = False
    working: bool = False
    fetched: int = 0         # rollout: newest version whose weights have arrived (prefetch)
    fetching: int = -1       # rollout: version being fetched in the background, -1 none
    position: int = 1        # rollout: 1-based place in the weights relay (join order)


class Simulator:
    """One simulated run; call :meth:`run` once."""

    def __init__(self, cfg: ResolvedConfig, setup: SimSetup) -> None:
        self.setup = setup
        self.wl = workload_from_config(cfg)
        self.R = len(setup.trainer_gpus)
        self.sp, self.G = self.wl.sequence_parallel, self.wl.rollout_gpus
        if self.R % self.sp:
            raise ConfigError(f"{self.R} trainer GPUs: train.sequence_parallel = {self.sp} lays them "
                                  f"out in groups of {self.sp}; expected a multiple of {self.sp}")
        # a group runs at its slowest member's pace; a rollout node is G consecutive rollout GPUs
        groups = [setup.trainer_gpus[i:i + self.sp] for i in range(0, self.R, self.sp)]
        self.rank_gpu = [min(grp, key=lambda t: GPUS[t].train_tflops) for grp in groups for _ in grp]
        rollout_nodes = [min(setup.rollout_gpus[i:i + self.G], key=lambda t: GPUS[t].gen_tflops)
                         for i in range(0, len(setup.rollout_gpus) - self.G + 1, self.G)]
        if setup.rollout_gpus and not rollout_nodes:
            raise ConfigError(f"{len(setup.rollout_gpus)} rollout GPUs: cluster.rollout_gpus = {self.G} "
                                  f"needs at least {self.G}")
        self.rollout_node_gpus = tuple(rollout_nodes)
        probe = node_costs(self.rank_gpu[0], self.wl, trainer_ranks=self.R,
                           calibration=setup.calibration)
        self.cfg = sim_config(cfg, setup, probe)
        self.F = self.cfg.runtime.fragments_per_step
        self.colocated = self.cfg.run.mode == "colocated"
        self.rng = random.Random(setup.seed)
        self.heap: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.seq = 0
        self.now = 0.0
        per_traj = chunk_bytes(self.wl.model, self.cfg.sampler.wire_dtype == "float32") * self.wl.trained_steps
        params = SchedulerParams.from_config(self.cfg, prompt_count=max(1, self.cfg.train.prompts_per_step),
                                             bytes_per_trajectory=per_traj)
        params = dataclasses.replace(
            params, trainer_ranks=self.R, switch_s=probe.switch_s, sequence_parallel=self.sp,
            speeds={g: GPUS["H100"].gen_tflops / spec.gen_tflops for g, spec in GPUS.items()} | {"cpu": 1.0})
        cfg_sim = self.cfg
        self.sched = Scheduler(params, plan_timesteps=lambda step: plan_for_step(cfg_sim, step))
        cal = setup.calibration or {}
        # a rollout fetches each announced version in the background (trainable bytes over the
        # weight link) and applies it at a trajectory boundary (a device copy: ~0 on a GPU)
        # the relay (core/relay.py): a rollout's fetch ends when its position in the tree has
        # the version; without it (weights_fanout = 0) every rollout shares rank 0's link
        fanout, n_roll = self.cfg.runtime.weights_fanout, len(self.rollout_node_gpus)
        self.fetch_by_position = [
            float(cal.get("weight_fetch_s", weight_sync_s(self.wl.model, self.wl.lora_rank, setup.network,
                                                          position=j, fanout=fanout, rollouts=n_roll)))
            for j in range(1, max(1, n_roll) + 1)]
        self.apply_s = float(cal.get("weight_apply_s", 0.0))
        self.latency_s = float(cal.get("latency_s", setup.network.latency_s))
        self.ar_s = step_sync_s(self.wl.model, self.wl.lora_rank, setup.trainer_gpus, setup.network)
        self.nodes: dict[str, _Node] = {}
        self.trainers: list[_Node] = []
        for r, g in enumerate(self.rank_gpu):
            n = _Node(id=f"trainer-{r}", role="trainer", gpu=g, rank=r,
                      costs=node_costs(g, self.wl, trainer_ranks=self.R, calibration=setup.calibration))
            self.nodes[n.id] = n
            self.trainers.append(n)
        for i, g in enumerate(() if self.colocated else self.rollout_node_gpus):
            self.nodes[f"rollout-{i}"] = _Node(id=f"rollout-{i}", role="rollout", gpu=g, position=i + 1,
                                               costs=node_costs(g, self.wl, calibration=setup.calibration))
        self.announced = 0
        # per rank: step -> committed fragments not yet trained by that rank, in arrival order
        self.pending: list[dict[int, deque[tuple[Any, int, int, bool, float]]]] = [
            defaultdict(deque) for _ in self.trainers]
        self.arrived: dict[int, set[int]] = defaultdict(set)  # step -> fragments committed
        self.consumed: dict[tuple[int, int], int] = defaultdict(int)  # (rank, step) -> fragments
        self.ready_ranks: set[int] = set()
        self.version = 0
        self.publish_t: list[float] = []
        self.spans: list[tuple[str, str, float, float]] = []
        self.rejected_stale = 0
        self.losses = 0
        self.done = False
        self.idle_rounds = 0
        self.incarnations = 0

    # ------------------------------------------------------------------ event plumbing
    def _at(self, t: float, kind: str, *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, args))

    def _dur(self, base: float) -> float:
        j = self.setup.jitter
        return base if j <= 0 or base <= 0 else base * max(0.0, self.rng.gauss(1.0, j))

    def _work(self, node: _Node, name: str, seconds: float, kind: str, *args: Any) -> None:
        node.working, node.until = True, self.now + seconds
        node.busy += seconds
        if self.setup.timeline_steps:
            self.spans.append((node.id, name, self.now, self.now + seconds))
        self._at(self.now + seconds, kind, node.id, node.token, *args)

    def _apply(self, cmds: list[Any]) -> None:
        for c in cmds:
            if isinstance(c, AssignCmd):
                node = self.nodes.get(c.node_id)
                if node is not None and node.alive:
                    node.queue.append(c)
                    node.offered = False
                    self._kick(node)
            elif isinstance(c, RevokeCmd):
                node = self.nodes.get(c.node_id)
                if node is not None:
                    node.queue = deque(t for t in node.queue if t.task_id != c.task_id)
                    if node.task is not None and node.task.task_id == c.task_id:
                        node.token += 1
                        node.busy -= node.until - self.now  # the aborted rest never ran
                        node.task, node.working = None, False
                        self._kick(node)
            elif isinstance(c, ShutdownCmd):
                self.done = True

    # ------------------------------------------------------------------ run
    def run(self, max_events: int = 50_000_000) -> SimResult:
        for t in self.trainers:
            self._apply(self.sched.node_joined(t.id, "trainer", t.gpu, 0.0, rank=t.rank))
        self._apply(self.sched.version_published(0, 0.0))
        for n in self.nodes.values():
            if n.role == "rollout":
                self._apply(self.sched.node_joined(n.id, "rollout", n.gpu, 0.0))
        # a round (every node heartbeats, then tick) three times per liveness timeout is enough
        # to keep live nodes alive and detects a lost one within 4/3 of the timeout
        rt = self.cfg.runtime
        self.round_s = rt.heartbeat_s if self.setup.keep_timeouts else rt.heartbeat_s * rt.heartbeat_misses / 3
        self._at(self.round_s, "round")
        if self.setup.loss_rate_per_h > 0 and not self.colocated:
            self._schedule_loss()
        for t in self.trainers:
            self._kick(t)
        events = 0
        while self.heap and not self.done and self.version < self.cfg.run.steps:
            self.now, _, kind, args = heapq.heappop(self.heap)
            getattr(self, "_on_" + kind)(*args)
            events += 1
            if events > max_events:
                raise SimulationError(f"event budget {max_events} exhausted at t={self.now:.1f} s, "
                                      f"version {self.version}: {self.sched.statistics()}")
        if self.version < self.cfg.run.steps:
            raise SimulationError(f"simulation stalled at t={self.now:.1f} s, version "
                                  f"{self.version}/{self.cfg.run.steps}: {self.sched.statistics()}")
        return self._result()

    def _on_round(self) -> None:
        if not self.heap and not any(n.working for n in self.nodes.values()):
            self.idle_rounds += 1  # nothing will ever happen again but heartbeats: a deadlock
            rt = self.cfg.runtime
            if self.idle_rounds * self.round_s > rt.heartbeat_s * rt.heartbeat_misses + rt.lease_s + 2 * self.round_s:
                raise SimulationError(f"deadlock at t={self.now:.1f} s, version {self.version}: "
                                      f"{self.sched.statistics()}")
        else:
            self.idle_rounds = 0
        for n in self.nodes.values():
            if n.alive:
                self._apply(self.sched.heartbeat(n.id, self.now))
        self._apply(self.sched.tick(self.now))
        self._at(self.now + self.round_s, "round")

    # ------------------------------------------------------------------ failures
    def _schedule_loss(self) -> None:
        rollouts = len(self.rollout_node_gpus)  # lost nodes come back, so the fleet size is fixed
        rate = self.setup.loss_rate_per_h * rollouts / 3600.0
        self._at(self.now + self.rng.expovariate(rate), "loss")

    def _on_loss(self) -> None:
        alive = sorted(n.id for n in self.nodes.values() if n.role == "rollout" and n.alive)
        if len(alive) > 1:  # keep one rollout so the run can always finish
            node = self.nodes[self.rng.choice(alive)]
            node.alive, node.token = False, node.token + 1
            if node.working:
                node.busy -= node.until - self.now
            node.queue.clear()
            node.task, node.working = None, False
            self.losses += 1
            self._at(self.now + self.setup.rejoin_s, "rejoin", node.id)
        self._schedule_loss()

    def _on_rejoin(self, old_id: str) -> None:
        old = self.nodes[old_id]
        self.incarnations += 1
        new = _Node(id=f"{old_id.split('.')[0]}.{self.incarnations}", role="rollout", gpu=old.gpu,
                    costs=old.costs, position=len(self.rollout_node_gpus))  # rejoins at the end
        self.nodes[new.id] = new
        self._apply(self.sched.node_joined(new.id, "rollout", new.gpu, self.now))

    # ------------------------------------------------------------------ nodes
    def _kick(self, node: _Node) -> None:
        if node.working or not node.alive or self.done:
            return
        if node.role == "rollout":
            self._rollout_next(node)
        else:
            self._trainer_next(node)

    def _rollout_next(self, node: _Node) -> None:
        while node.queue:
            task = node.queue[0]
            if self.announced < task.version_floor:
                return  # wait for the announcement (an "announce" event kicks us)
            if node.version < self.announced and node.fetched < self.announced:
                self._prefetch(node)
                return  # wait for the weights (a "prefetched" event kicks us)
            node.queue.popleft()
            node.task = task
            if node.version < self.announced:  # TCSS: weights change only between trajectories
                node.version = self.announced
                self._work(node, "weight_apply", self.apply_s, "fetched", task)
            else:
                self._start_gen(node, task)
            return

    def _prefetch(self, node: _Node) -> None:
        """Fetch the newest announced version in the background, one fetch at a time."""
        if node.fetching >= 0 or node.fetched >= self.announced or not node.alive:
            return
        node.fetching = self.announced
        self._at(self.now + self.fetch_by_position[min(node.position, len(self.fetch_by_position)) - 1],
                 "prefetched", node.id, self.announced)

    def _on_prefetched(self, nid: str, version: int) -> None:
        node = self.nodes[nid]
        if not node.alive:
            return
        node.fetching, node.fetched = -1, max(node.fetched, version)
        self._prefetch(node)  # a newer version may have been announced meanwhile
        self._kick(node)

    def _on_fetched(self, nid: str, token: int, task: Any) -> None:
        node = self.nodes[nid]
        if token == node.token:
            node.working = False
            self._start_gen(node, task)

    def _gen_seconds(self, node: _Node, task: Any) -> float:
        n = len(task.seeds)
        per = node.costs.colo_gen_step_s if node.role == "trainer" else node.costs.gen_step_s
        return self._dur(n * self.cfg.sampler.num_steps * per + n * node.costs.reward_s)

    def _start_gen(self, node: _Node, task: Any) -> None:
        node.task = task
        gen = self._gen_seconds(node, task)
        switch = 0.0
        if node.role == "trainer" and self.colocated and node.state != "gen":
            node.state, switch = "gen", node.costs.switch_s
        name = "tag_generate" if node.role == "trainer" else "generate"
        self._work(node, name, switch + gen, "generated", task, node.version, gen)

    def _on_generated(self, nid: str, token: int, task: Any, gen_v: int, gen_s: float) -> None:
        node = self.nodes[nid]
        if token != node.token:
            return
        node.working, node.task = False, None
        n = len(task.seeds)
        net = self.setup.network
        # chunks stream during generation, so only the tail (last chunk + commit) is exposed,
        # unless the link is slower than generation.
        total = n * chunk_bytes(self.wl.model, self.cfg.sampler.wire_dtype == "float32") * len(task.trained_steps)
        link = (net.link_gbs if node.role == "rollout" else GPUS[node.gpu].nvlink_gbs) * 1e9
        arrive = max(self.now, self.now - gen_s + total / link) + self.latency_s
        self._at(arrive, "commit", task, nid, gen_v, n, gen_s)
        self._kick(node)

    def _on_commit(self, task: Any, nid: str, gen_v: int, n: int, gen_s: float) -> None:
        self._apply(self.sched.fragment_committed(task.task_id, nid, gen_v, gen_s, self.now))
        if task.step < self.version or task.fragment in self.arrived[task.step]:
            return  # a slot already trained or staged (the real trainer drops these too)
        self.arrived[task.step].add(task.fragment)
        owners = set(task.owners) or {0}
        if self.cfg.runtime.tsp and self.R > 1:
            counts = Counter(task.owners)  # group leaders; a follower trains its leader's share
            units: list[float] = [float(n * counts[r - r % self.sp]) for r in range(self.R)]
        else:
            units = [self._train_units(task, n, 0)] * self.R
        for r, q in enumerate(self.pending):
            q[task.step].append((task, n, gen_v, r in owners, units[r]))
        if task.step != self.version or (not self.setup.gap and len(self.arrived[task.step]) < self.F):
            # No rank can train this yet, and an idle rank has already done what a kick would
            # do (every path that idles a trainer kicks it), so kicking every rank per commit
            # would only cost time: R x F calls a step.
            return
        for t in self.trainers:
            self._kick(t)

    def _trainer_next(self, node: _Node) -> None:
        s = self.version
        if node.rank in self.ready_ranks:
            return
        pending = self.pending[node.rank].get(s)
        if pending and (self.setup.gap or len(self.arrived[s]) >= self.F):
            # Everything this rank can train now becomes one work item (one event, not one per
            # fragment); with GAP commits trickle in, so that is usually a single fragment.
            batch, units = [], 0.0
            while pending:
                task, n, gen_v, owns, u = pending.popleft()
                self.consumed[(node.rank, s)] += 1
                if not within_staleness(s, gen_v, self.sched.ledger.staleness):  # the trainer's oracle: must never fire
                    self.rejected_stale += n
                    if owns:
                        self._apply(self.sched.fragment_consumed(task.task_id, node.rank, 0, {"stale": n}, 0.0, self.now))
                    continue
                if u == 0 and not owns:
                    continue  # TSP gave this rank none of the fragment's timesteps
                batch.append((task, n, owns))
                units += u
            if batch:
                switch = 0.0
                if self.colocated and node.state != "train":
                    node.state, switch = "train", node.costs.switch_s
                secs = self._dur(units * node.costs.train_step_s)
                self._work(node, "fragment_train", switch + secs, "trained", batch, secs)
                return
        if self.consumed[(node.rank, s)] >= self.F:
            self.ready_ranks.add(node.rank)
            if len(self.ready_ranks) == self.R:
                self._optimizer_step()
            return
        if node.queue:
            task = node.queue.popleft()
            self._start_gen(node, task)
            return
        if not node.offered and self.cfg.runtime.tag != "never" and self.sp == 1:
            node.offered = True
            self._apply(self.sched.tag_offer(node.id, self.now))

    def _train_units(self, task: AssignCmd, n: int, rank: int) -> float:
        """Sample-timesteps this rank trains for the fragment (TSP or data-parallel)."""
        if self.cfg.runtime.tsp and self.R > 1:
            return n * task.owners.count(rank - rank % self.sp)
        # TSP off: the scheduler routes every chunk to rank 0; the simulator assumes the
        # baselines' data parallelism instead (each group of sequence-parallel ranks trains
        # n / groups of the samples; ideal FSDP micro-batching over the whole step, so no
        # rounding per fragment).
        return n / (self.R // self.sp) * len(task.trained_steps)

    def _on_trained(self, nid: str, token: int, batch: list[tuple[Any, int, bool]], secs: float) -> None:
        node = self.nodes[nid]
        # offers are one-shot; like actors/trainer.py, a rank that trained may offer again
        node.working, node.offered = False, False
        for task, n, owns in batch:
            if owns:  # only owning ranks report (scheduler contract)
                self._apply(self.sched.fragment_consumed(task.task_id, node.rank, n, {}, secs / len(batch), self.now))
        self._kick(node)

    def _optimizer_step(self) -> None:
        t0 = self.trainers[0]
        secs = self.ar_s + t0.costs.optimizer_s
        for t in self.trainers:
            t.working = True
            t.busy += secs
            if self.setup.timeline_steps:
                self.spans.append((t.id, "optimizer_step", self.now, self.now + secs))
        self._at(self.now + secs, "stepped")

    def _on_stepped(self) -> None:
        s = self.version
        self.version = s + 1
        self.ready_ranks.clear()
        self.arrived.pop(s, None)
        for q in self.pending:
            q.pop(s, None)
        for t in self.trainers:
            # offers are one-shot: a rank offers again after an Assign, after training, and here
            t.working, t.version, t.offered = False, s + 1, False
            self.consumed.pop((t.rank, s), None)
        self.publish_t.append(self.now)
        self._apply(self.sched.version_published(s + 1, self.now))
        self._at(self.now + self.latency_s, "announce", s + 1)
        for t in self.trainers:
            self._kick(t)

    def _on_announce(self, version: int) -> None:
        self.announced = max(self.announced, version)
        for n in self.nodes.values():
            if n.role == "rollout":
                self._prefetch(n)
                self._kick(n)

    # ------------------------------------------------------------------ results
    def _result(self) -> SimResult:
        steps = len(self.publish_t)
        times = [b - a for a, b in zip([0.0, *self.publish_t], self.publish_t)]
        warm = min(2, steps // 4)
        span = self.publish_t[-1] - (self.publish_t[warm - 1] if warm else 0.0)
        s_per_step = span / (steps - warm)
        wall = self.publish_t[-1]
        busy = {n.id: min(1.0, n.busy / wall) for n in self.nodes.values()}
        roles: dict[str, list[float]] = defaultdict(list)
        for n in self.nodes.values():
            roles[n.role].append(busy[n.id])
        by_role = {r: sum(v) / len(v) for r, v in sorted(roles.items())}
        bubble = (1.0 - by_role["trainer"]) * s_per_step
        cut = self.publish_t[max(0, steps - 1 - self.setup.timeline_steps)] if self.setup.timeline_steps else wall
        tl = [sp for sp in self.spans if sp[3] > cut]
        return SimResult(steps=steps, samples_per_s=self.cfg.batch_size / s_per_step, s_per_step=s_per_step,
                         step_times=times, busy=busy, busy_by_role=by_role, bubble_s_per_step=bubble,
                         wall_s=wall, timeline=tl, scheduler=_plain(self.sched.statistics()),
                         rejected_stale=self.rejected_stale, losses=self.losses,
                         sequence_parallel=self.sp, rollout_gpus=None if self.colocated else self.G,
                         train_step_s=self.trainers[0].costs.train_step_s)


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def simulate(cfg: ResolvedConfig, setup: SimSetup) -> SimResult:
    """Simulate ``cfg`` (resolved for its mode) on ``setup``'s GPUs."""
    return Simulator(cfg, setup).run()
