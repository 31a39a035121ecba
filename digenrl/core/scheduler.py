"""The coordinator's brain: who generates which fragment, when (sans-I/O).

Events go in (each with an explicit ``now``), commands come out; no sockets, no clock,
no asyncio, no torch. The coordinator actor feeds it real messages, the simulator a
virtual clock, the property tests random programs::

    node_joined / heartbeat / tick ----> liveness: lost nodes, expired leases -> RevokeCmd
    fragment_committed (rollout) ------> ledger.commit, per-node speed EWMA
    fragment_consumed (trainer ranks) -> ledger.consume once every owning rank reported
    version_published (trainer) -------> ledger.publish (admission moves on)
    tag_offer (waiting trainer) -------> TAG / BTS grant or drop
                    every event ends with: dispatch -> AssignCmd ..., maybe ShutdownCmd

Admission is the ledger's (:mod:`digenrl.core.credits`); this module picks the node. A rollout
node holds up to ``max_outstanding`` uncommitted fragments (``running_per_node`` running,
one for each when step-level batching is on, plus one queued, so it never idles on a round
trip); a fragment's lease (``lease_s``) counts from when it starts running, among the first
``running_per_node`` of its node's queue, not from its assignment. Among nodes with room, a fragment goes to the one with
the earliest predicted completion ``now + (queued + fragment) * spt(node)``, where
``spt`` (seconds per trajectory) is the node's measured EWMA, or before its first commit
``ref / gpu_speed`` with ``ref`` calibrated on the measured nodes. A slow GPU thus
gets proportionally fewer fragments.

Consumption with TSP: every trainer rank that owns a trained timestep reports the
fragment. It is consumed when all owning ranks have reported; its outcome (trained and
per-reason discards) is the *lowest owning rank's* report (all ranks compute the same
advantages from the same rewards; disagreements are counted), and its training time is
the *maximum* over ranks (ranks train in parallel, the slowest one sets the pace).

A node's fault: a consumed fragment it generated in which some rank discarded trajectories as
``nonfinite`` (NaN or infinite latents, log-probs or rewards). Counted per node; after
``fault_limit`` such fragments in a row (a clean one resets the count) the node is *broken*:
with ``fault_action = "drop"`` it is lost as a silent node is (its uncommitted attempts
revoked and re-queued) and never re-joins; with "stop", or when it is a trainer or the last
rollout, the run stops (ShutdownCmd "failed: node ... is broken: ...").

Once committed, a fragment belongs to the trainer: a lost rollout node or an expired
lease discards only *uncommitted* attempts. A RevokeCmd names the attempt's holder; the
actor delivers it there if it can and also tells the trainer ranks, which drop any
staged chunks of that task. Losing a trainer rank ends the run (ShutdownCmd
"trainer_lost"); it restarts from a checkpoint (:meth:`Scheduler.snapshot`).
The scheduler never publishes versions: only the trainer steps the optimizer.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from digenrl.core.bts import StepForecast, ewma, helper_shortens_step
from digenrl.core.credits import (
    NONFINITE,
    CreditError,
    CreditLedger,
    untrainable_version,
    version_floor,
)
from digenrl.core.plan import (
    PlanFn,
    all_timesteps,
    check_plan,
    fragment_content,
    owners_for,
    train_groups,
)
from digenrl.core.types import (
    AssignCmd,
    Command,
    RevokeCmd,
    Role,
    SchedulerError,
    SchedulerParams,
    ShutdownCmd,
)

SNAPSHOT_FORMAT = 1

__all__ = ["AssignCmd", "Command", "RevokeCmd", "Role", "Scheduler", "SchedulerError",
           "SchedulerParams", "ShutdownCmd"]


@dataclass(eq=False)
class _Node:
    node_id: str
    role: Role
    gpu: str
    rank: int | None
    prior_speed: float
    last_seen: float
    spt: float | None = None  # measured seconds per generated trajectory (EWMA)
    outstanding: list[int] = field(default_factory=list)  # uncommitted task ids, oldest first
    started: dict[int, float] = field(default_factory=dict)  # running task -> when it started: its lease counts from there
    lost: bool = False
    lost_why: str = ""  # "no heartbeat for 5.2 s", "reported lost", ...
    assigned: int = 0
    committed: int = 0
    revoked: int = 0
    nonfinite: int = 0  # trajectories of its fragments discarded as non-finite
    faults: int = 0  # consecutive consumed fragments of it holding non-finite values


@dataclass
class _Task:
    ranks: frozenset[int]
    tag: bool
    reports: dict[int, tuple[int, dict[str, int], float]] = field(default_factory=dict)


class Scheduler:
    """GAP/TSP/TAG/BTS scheduling over a :class:`CreditLedger`; every event returns commands."""

    def __init__(self, params: SchedulerParams, plan_timesteps: PlanFn | None = None) -> None:
        self.params = params
        self.ledger = CreditLedger(
            steps=params.steps, prompts_per_step=params.prompts_per_step,
            group_size=params.group_size, fragments_per_step=params.fragments_per_step,
            staleness=params.staleness, byte_window=params.byte_window,
            bytes_per_trajectory=params.bytes_per_trajectory)
        self._plan = plan_timesteps or all_timesteps(params.num_steps_T)
        self._plans: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
        self._nodes: dict[str, _Node] = {}
        self._departed: list[_Node] = []
        self._tasks: dict[int, _Task] = {}
        self._train_spt: float | None = None
        self._closed: str | None = None
        self._broken: dict[str, str] = {}  # node id -> why it is broken (it never re-joins)
        self._c: Counter[str] = Counter()

    # ------------------------------------------------------------------ content

    def fragment_content(self, step: int, fragment: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prompt ids, seeds) of slot (step, fragment): fixed by the run seed."""
        p = self.params
        return fragment_content(p.seed, step, fragment, prompts_per_step=p.prompts_per_step,
                                fragments_per_step=p.fragments_per_step, group_size=p.group_size,
                                prompt_count=p.prompt_count)

    def step_plan(self, step: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(trained timesteps, SDE timesteps, owner rank per trained timestep) of ``step``."""
        if step not in self._plans:
            trained, sde = self._plan(step)
            check_plan(step, trained, sde, self.params.num_steps_T)
            owners = owners_for(trained, self.params.trainer_ranks, self.params.tsp,
                                sp=self.params.sequence_parallel)
            self._plans[step] = (tuple(trained), tuple(sde), owners)
        return self._plans[step]

    # ------------------------------------------------------------------ node events

    def node_joined(self, node_id: str, role: Role, gpu: str, now: float, rank: int | None = None,
                    speed: float | None = None) -> list[Command]:
        """A node said hello. A known live id re-joining counts as its old incarnation lost."""
        if role not in ("rollout", "trainer"):
            raise SchedulerError(f"node {node_id!r} role = {role!r}: expected 'rollout' or 'trainer'")
        if role == "trainer" and (not isinstance(rank, int) or not 0 <= rank < self.params.trainer_ranks):
            raise SchedulerError(f"trainer node {node_id!r} rank = {rank!r}: expected an integer "
                                 f"in [0, {self.params.trainer_ranks})")
        if speed is not None and not speed > 0:
            raise SchedulerError(f"node {node_id!r} speed = {speed!r}: expected > 0")
        if role == "trainer" and any(n.rank == rank and n.node_id != node_id
                                     for n in self._nodes.values() if n.role == "trainer"):
            raise SchedulerError(f"trainer node {node_id!r} rank = {rank}: already held")
        if node_id in self._broken:
            self._c["broken_rejoins"] += 1  # refused: its work went elsewhere for good
            return []
        cmds: list[Command] = []
        if node_id in self._nodes:
            cmds += self._lose(self._nodes[node_id], now, "re-joined as a new incarnation")
            if self._closed:
                return cmds
        prior = speed if speed is not None else float(self.params.speeds.get(gpu, 1.0))
        self._nodes[node_id] = _Node(node_id, role, gpu, rank if role == "trainer" else None,
                                     prior, now)
        return cmds + self._after(now)

    def node_lost(self, node_id: str, now: float, why: str = "reported lost") -> list[Command]:
        """The transport (or the launcher, ``why``: "exited with code 1") says ``node_id`` is gone."""
        node = self._nodes.get(node_id)
        if node is None:
            self._c["unknown_node_events"] += 1
            return []
        return self._lose(node, now, why) + self._after(now)

    def heartbeat(self, node_id: str, now: float) -> list[Command]:
        node = self._nodes.get(node_id)
        if node is None:
            self._c["unknown_node_events"] += 1
            return []
        node.last_seen = max(node.last_seen, now)
        return []

    def tick(self, now: float) -> list[Command]:
        """Timer: nodes silent for > heartbeat_timeout are lost; leases older than lease_s expire."""
        cmds: list[Command] = []
        for node in list(self._nodes.values()):
            if now - node.last_seen > self.params.heartbeat_timeout and not self._closed:
                cmds += self._lose(node, now, f"no heartbeat for {now - node.last_seen:.1f} s")
        for attempt in self.ledger.live_attempts():
            start = self._lease_start(attempt.node_id, attempt.task_id, attempt.assigned_at)
            if not attempt.committed and start is not None and \
                    now - start > self._lease_s(attempt.node_id, attempt.trajectories):
                cmds += self._revoke(attempt.task_id, "lease_expired", now)
        return cmds + self._after(now)

    # ------------------------------------------------------------------ fragment events

    def fragment_committed(self, task_id: int, node_id: str, gen_version: int, gen_seconds: float,
                           now: float, *, step: int | None = None,
                           fragment: int | None = None) -> list[Command]:
        """``node_id`` finished task ``task_id`` with policy ``gen_version`` in ``gen_seconds``.

        ``step`` / ``fragment``, when given, must be the attempt's slot: a commit that cannot
        belong to the task it names is rejected alone (counted as ``rejected_commits``).
        """
        if not gen_seconds >= 0 or math.isinf(gen_seconds):
            raise SchedulerError(f"task {task_id} gen_seconds = {gen_seconds!r}: expected >= 0")
        node = self._nodes.get(node_id)
        if node is not None:
            node.last_seen = max(node.last_seen, now)
        attempt = self.ledger.attempt(task_id)
        if attempt is not None and attempt.node_id != node_id:
            self._c["misdirected_commits"] += 1  # fencing: only the holder may commit
            return []
        outcome = self.ledger.commit(task_id, gen_version, now, step=step, fragment=fragment)
        if attempt is None or outcome in ("duplicate", "rejected"):
            return []
        holder = self._holder(attempt.node_id)
        self._drop(holder, task_id, now)
        if outcome == "stale":
            self._tasks.pop(task_id, None)
            holder.revoked += 1
            return [RevokeCmd(node_id=node_id, task_id=task_id, reason="stale"), *self._after(now)]
        holder.committed += 1
        if gen_seconds > 0:
            holder.spt = ewma(holder.spt, gen_seconds / attempt.trajectories, self.params.ewma_alpha)
        return self._after(now)

    def fragment_consumed(self, task_id: int, rank: int, trained: int, discarded: dict[str, int],
                          train_seconds: float, now: float, *, step: int | None = None,
                          fragment: int | None = None,
                          gen_version: int | None = None) -> list[Command]:
        """Trainer rank ``rank`` trained its timesteps of task ``task_id``, generated by policy
        ``gen_version`` (needed only when the consume overtakes the commit).

        Raises SchedulerError, changing nothing, for a report that cannot be the task's
        (never-issued id, counts that are not a fragment's, another slot, a rank that owns
        none of its timesteps); a report of a task no longer live is a counted zombie.
        """
        try:
            self.ledger.check_counts(task_id, trained, discarded)
        except CreditError as e:
            raise SchedulerError(str(e)) from None
        attempt = self.ledger.attempt(task_id)
        task = self._tasks.get(task_id)
        if attempt is None or task is None:
            self.ledger.consume(task_id, trained, discarded)  # counted there as a zombie
            return []
        if (step is not None and step != attempt.step) or (fragment is not None and fragment != attempt.fragment):
            raise SchedulerError(f"task {task_id} consumed as (step, fragment) = ({step!r}, {fragment!r}): "
                                 f"expected {attempt.slot}")
        if rank not in task.ranks:
            raise SchedulerError(f"task {task_id} consumed by rank = {rank!r}: expected one of "
                                 f"the owning ranks {sorted(task.ranks)}")
        if not train_seconds >= 0 or math.isinf(train_seconds):
            raise SchedulerError(f"task {task_id} train_seconds = {train_seconds!r}: expected >= 0")
        if rank in task.reports:
            self._c["duplicate_reports"] += 1
            return []
        version = attempt.gen_version if attempt.committed else gen_version
        why = untrainable_version(attempt.step, version, self.ledger.staleness) if trained else None
        if why is not None:
            raise SchedulerError(f"task {task_id} rank {rank}: trained = {trained} {why}")
        task.reports[rank] = (trained, dict(discarded), train_seconds)
        if len(task.reports) < len(task.ranks):
            return []
        first = task.reports[min(task.ranks)]
        if any(r[:2] != first[:2] for r in task.reports.values()):
            self._c["rank_disagreements"] += 1
        self.ledger.consume(task_id, first[0], first[1], gen_version=gen_version)
        del self._tasks[task_id]
        self._c["tag_consumed"] += task.tag
        if not attempt.committed:  # the consume overtook the commit on another path
            holder = self._holder(attempt.node_id)
            self._drop(holder, task_id, now)
            holder.committed += 1
        slowest = max(r[2] for r in task.reports.values())
        if slowest > 0:
            self._train_spt = ewma(self._train_spt, slowest / attempt.trajectories,
                                   self.params.ewma_alpha)
        nonfinite = max(r[1].get(NONFINITE, 0) for r in task.reports.values())
        return self._fault(attempt.node_id, nonfinite, now) + self._after(now)

    def version_published(self, version: int, now: float) -> list[Command]:
        """The trainer finished optimizer step ``version - 1``; older/duplicate publishes are no-ops."""
        self.ledger.publish(version)
        return self._after(now)

    def tag_offer(self, node_id: str, now: float) -> list[Command]:
        """A trainer rank with nothing to train offers to generate. One-shot: granted now or dropped."""
        node = self._nodes.get(node_id)
        if node is None or node.role != "trainer":
            raise SchedulerError(f"tag_offer from {node_id!r}: expected a joined trainer node")
        cmds = self._after(now)  # rollout nodes with room come first
        self._c["tag_offers"] += 1
        node.last_seen = max(node.last_seen, now)
        slot = self.ledger.peek()
        if self._closed or self.params.tag == "never" or node.outstanding or slot is None:
            self._c["tag_dropped"] += 1
            return cmds
        if self.params.tag == "bts" and not helper_shortens_step(self.forecast(node_id, now)):
            self._c["tag_refused"] += 1
            return cmds
        self._c["tag_granted"] += 1
        return [*cmds, self._assign(node, now, tag=True)]

    # ------------------------------------------------------------------ prediction

    def node_spt(self, node_id: str) -> float:
        """Predicted seconds per generated trajectory on ``node_id`` (measured, else prior)."""
        node = self._nodes[node_id]
        if node.spt is not None:
            return node.spt
        measured = [n.spt * n.prior_speed for n in self._nodes.values() if n.spt is not None]
        ref = sum(measured) / len(measured) if measured else 1.0
        return ref / node.prior_speed

    def forecast(self, node_id: str, now: float) -> StepForecast:
        """BTS inputs if trainer ``node_id`` took the next admissible fragment now."""
        led = self.ledger
        slot = led.peek()
        last = slot[0] if slot else led.version
        fs = led.fragment_size
        uncommitted = sum(1 for a in led.live_attempts() if not a.committed and a.step <= last)
        consumed = sum(led.step_consumed(s) for s in range(led.version, last + 1))
        rollouts = [n for n in self._nodes.values() if n.role == "rollout"]
        return StepForecast(
            now=now, gen_remaining=(led.pending_count(last) + uncommitted) * fs,
            rollout_rate=sum(1.0 / self.node_spt(n.node_id) for n in rollouts),
            train_remaining=((last - led.version + 1) * led.fragments_per_step - consumed) * fs,
            train_spt=self._train_spt or 0.0, trainer_gen_spt=self.node_spt(node_id),
            switch_s=self.params.switch_s, helper_traj=fs,
            train_groups=train_groups(self.step_plan(last)[0], self.params.trainer_ranks,
                                      self.params.tsp, led.fragments_per_step,
                                      self.params.sequence_parallel))

    # ------------------------------------------------------------------ internals

    def _holder(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:  # a departed node's committed fragment being consumed
            node = next(n for n in reversed(self._departed) if n.node_id == node_id)
        return node

    def _lease_s(self, node_id: str, trajectories: int) -> float:
        """The lease of a fragment of ``trajectories`` on ``node_id``: ``lease_s``, stretched to
        ``lease_factor`` times the node's measured time for such a fragment once it has one."""
        node = self._nodes.get(node_id)
        if node is None or node.spt is None:
            return self.params.lease_s
        return max(self.params.lease_s, self.params.lease_factor * node.spt * trajectories)

    def _lease_start(self, node_id: str, task_id: int, assigned_at: float) -> float | None:
        """When the lease of ``task_id`` started: when it began running, among the first
        ``running_per_node`` of its node's queue (a queued fragment waits for room and has no
        lease yet: None)."""
        node = self._nodes.get(node_id)
        if node is None or task_id not in node.outstanding:
            return assigned_at
        if task_id not in node.started:
            return None
        return max(assigned_at, node.started[task_id])

    def _drop(self, node: _Node, task_id: int, now: float) -> None:
        """``task_id`` leaves ``node``'s queue; the first queued one, if there is room, starts now."""
        node.outstanding.remove(task_id)
        node.started.pop(task_id, None)
        for t in node.outstanding[:self.params.running_per_node]:
            node.started.setdefault(t, now)

    def _revoke(self, task_id: int, reason: str, now: float) -> list[Command]:
        attempt = self.ledger.discard(task_id, reason)
        assert attempt is not None, task_id
        self._tasks.pop(task_id, None)
        holder = self._holder(attempt.node_id)
        self._drop(holder, task_id, now)
        holder.revoked += 1
        return [RevokeCmd(node_id=attempt.node_id, task_id=task_id, reason=reason)]

    def _lose(self, node: _Node, now: float, why: str) -> list[Command]:
        cmds: list[Command] = []
        for task_id in list(node.outstanding):
            cmds += self._revoke(task_id, "node_lost", now)
        node.lost, node.lost_why = True, why
        del self._nodes[node.node_id]
        self._departed.append(node)
        if node.role == "trainer" and not self._closed:
            # torch.distributed cannot lose a rank: the run restarts from a checkpoint.
            self._closed = f"trainer_lost: rank {node.rank} node {node.node_id} ({why})"
            cmds.append(ShutdownCmd(reason=self._closed))
        return cmds

    def _fault(self, node_id: str, nonfinite: int, now: float) -> list[Command]:
        """A consumed fragment of ``node_id`` held ``nonfinite`` non-finite trajectories (as
        the rank that saw most reported): count it; past ``fault_limit`` in a row the node is
        broken (see the module doc)."""
        node = self._nodes.get(node_id)
        rec = node if node is not None else self._holder(node_id)
        if not nonfinite:
            rec.faults = 0
            return []
        rec.nonfinite += nonfinite
        rec.faults += 1
        if node is None or rec.faults < self.params.fault_limit or self._closed:
            return []  # a departed node's late fragments are only counted
        why = (f"{rec.faults} fragments in a row held non-finite values "
               f"({rec.nonfinite} trajectories discarded)")
        self._broken[node_id] = why
        self._c["nodes_broken"] += 1
        others = [n for n in self._nodes.values() if n.role == "rollout" and not n.lost and n is not node]
        if self.params.fault_action == "stop" or node.role != "rollout" or not others:
            self._closed = f"failed: node {node_id} is broken: {why}"
            return [ShutdownCmd(reason=self._closed)]
        return self._lose(node, now, f"broken: {why}")

    def is_broken(self, node_id: str) -> str:
        """Why ``node_id`` is broken (it is dropped and never re-joins), or "" if it is not."""
        return self._broken.get(node_id, "")

    def _assign(self, node: _Node, now: float, *, tag: bool = False) -> AssignCmd:
        attempt = self.ledger.admit(node.node_id, now)
        trained, sde, _ = self.step_plan(attempt.step)
        owners = owners_for(trained, self.params.trainer_ranks, self.params.tsp, attempt.fragment,
                            self.params.fragments_per_step, self.params.sequence_parallel)
        prompts, seeds = self.fragment_content(attempt.step, attempt.fragment)
        self._tasks[attempt.task_id] = _Task(ranks=frozenset(owners) or frozenset({0}), tag=tag)
        node.outstanding.append(attempt.task_id)
        if len(node.outstanding) <= self.params.running_per_node:
            node.started[attempt.task_id] = now  # it runs at once
        node.assigned += 1
        return AssignCmd(node_id=node.node_id, task_id=attempt.task_id, step=attempt.step,
                         fragment=attempt.fragment, prompt_ids=prompts, seeds=seeds,
                         group_size=self.params.group_size,
                         version_floor=version_floor(attempt.step, self.ledger.staleness),
                         lease_s=self.params.lease_s, trained_steps=trained, sde_steps=sde,
                         owners=owners)

    def _after(self, now: float) -> list[Command]:
        """Every event ends here: hand out admissible fragments, then check for the end."""
        cmds: list[Command] = []
        if self._closed:
            return cmds
        fs = self.ledger.fragment_size
        while self.ledger.peek() is not None:
            live = [n for n in self._nodes.values() if n.role == "rollout" and not n.lost]
            if not live:
                break
            # the node that would finish this fragment first, counting its queue; if that
            # is a node with no room, hold the fragment for it rather than give it to a
            # slower node that would finish later (the step would wait on that tail); on a
            # tie the node with room takes it
            best = min(live, key=lambda n: (now + (len(n.outstanding) + 1) * fs
                                            * self.node_spt(n.node_id),
                                            len(n.outstanding) >= self.params.max_outstanding,
                                            n.node_id))
            if len(best.outstanding) >= self.params.max_outstanding:
                break
            cmds.append(self._assign(best, now))
        if self.ledger.done:
            self._closed = "done"
            cmds.append(ShutdownCmd(reason="done"))
        return cmds

    # ------------------------------------------------------------------ reporting

    def is_live(self, node_id: str) -> bool:
        """Whether ``node_id`` is joined and not lost (a node lost by silence must re-join)."""
        node = self._nodes.get(node_id)
        return node is not None and not node.lost

    def live_count(self, role: str) -> int:
        """Joined nodes of ``role`` not (yet) lost."""
        return sum(1 for n in self._nodes.values() if n.role == role and not n.lost)

    def statistics(self) -> dict[str, Any]:
        """Ledger counts plus per-node counts, TAG decisions and fencing counters."""
        stats = self.ledger.statistics()
        nodes = {}
        keyed = [(f"{n.node_id}#lost{i}", n) for i, n in enumerate(self._departed)]
        for key, n in [*keyed, *self._nodes.items()]:
            nodes[key] = {"role": n.role, "gpu": n.gpu, "rank": n.rank, "lost": n.lost, "lost_why": n.lost_why,
                          "assigned": n.assigned, "committed": n.committed, "revoked": n.revoked,
                          "nonfinite": n.nonfinite, "broken": self._broken.get(n.node_id, ""),
                          "outstanding": len(n.outstanding), "s_per_traj": n.spt}
        nonfinite: Counter[str] = Counter()
        for n in [*self._departed, *self._nodes.values()]:
            nonfinite[n.node_id] += n.nonfinite
        stats.update(nodes=nodes, closed=self._closed, train_s_per_traj=self._train_spt,
                     nonfinite_by_node={k: v for k, v in sorted(nonfinite.items()) if v},
                     broken_nodes=dict(self._broken),
                     **{k: self._c[k] for k in (
                         "tag_offers", "tag_granted", "tag_refused", "tag_dropped", "tag_consumed",
                         "misdirected_commits", "duplicate_reports", "rank_disagreements",
                         "unknown_node_events", "nodes_broken", "broken_rejoins")})
        return stats

    def snapshot(self) -> dict[str, Any]:
        """Plain msgpack-able state for a checkpoint (nodes re-join after a restart; broken
        nodes stay out)."""
        p = self.params
        return {"format": SNAPSHOT_FORMAT, "seed": p.seed, "prompt_count": p.prompt_count,
                "ledger": self.ledger.snapshot(), "train_s_per_traj": self._train_spt,
                "counters": dict(self._c), "broken": dict(self._broken)}

    def restore(self, snap: dict[str, Any]) -> None:
        """Load a snapshot into a scheduler with the same params and no live work.

        In-flight attempts at snapshot time count as discarded ("restart") and their slots
        are re-queued; the cursor is a function of (seed, step), so it needs no state.
        """
        p = self.params
        if snap.get("format") != SNAPSHOT_FORMAT:
            raise SchedulerError(f"snapshot format = {snap.get('format')!r}: expected {SNAPSHOT_FORMAT}")
        if (snap["seed"], snap["prompt_count"]) != (p.seed, p.prompt_count):
            raise SchedulerError(f"snapshot (seed, prompt_count) = ({snap['seed']}, "
                                 f"{snap['prompt_count']}): expected ({p.seed}, {p.prompt_count})")
        self.ledger.restore(snap["ledger"])
        self._tasks.clear()
        self._train_spt = snap["train_s_per_traj"]
        self._c = Counter(snap["counters"])
        self._broken = {str(k): str(v) for k, v in snap.get("broken", {}).items()}  # stays out

