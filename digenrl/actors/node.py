"""Entry of one node process (``digenrl-node``): sockets, join, build the role's actor, run.

The event loop (uvloop), the zmq context and logging are made here, once, and passed down.
A node needs only the coordinator's address: Welcome brings the run's config and peers.

Service-manager duties live here too (docs/deployment.md): ``READY=1`` once Welcome has
come and the model is built, watchdog pings while the node makes progress (its control
socket keeps moving), ``STOPPING=1`` and a graceful drain on SIGTERM or Ctrl-C (a second
Ctrl-C leaves at once). Exit code 0 when the run finished (or was drained on a signal), 1
when the coordinator stopped it for another reason (a coordinator that was itself stopped,
so that a supervisor restarts the node and it rejoins), 3 when it was refused. The
coordinator's own duties are :func:`~digenrl.actors.cluster.serve_coordinator`'s. Transport
security is decided by the node's *own* config (``--config``/``--set``,
``--allow-plaintext``), never by the run config Welcome brings.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket as pysocket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from digenrl.actors.base import (
    DRAINED,
    STOP_GRACE_S,
    ActorArgs,
    Loop,
    NodeHooks,
    default_node_id,
    incarnation,
    loop_factory,
    stop_on_signals,
)
from digenrl.actors.connect import ConnectPolicy, wait_welcome
from digenrl.config import Config, ConfigError, ResolvedConfig, read_resolved
from digenrl.devices import group_devices, resolve_device, use_device
from digenrl.faults import failpoints, node_slowdown
from digenrl.telemetry import sdnotify
from digenrl.telemetry.logging import configure_logging, get_logger
from digenrl.telemetry.trace import SpanRecorder
from digenrl.transport import allocator
from digenrl.transport import factory as zs
from digenrl.transport.options import node_context
from digenrl.transport.protocol import Hello, Role, Shutdown, Welcome
from digenrl.transport.security import node_security, process_counters
from digenrl.transport.socketio import Socket

if TYPE_CHECKING:  # imported where they are built: a node loads only its own role's code
    from digenrl.actors.reward import RewardActor
    from digenrl.actors.rollout import RolloutActor
    from digenrl.actors.trainer import TrainerActor
    from digenrl.telemetry.prometheus import MetricsServer


@dataclass(frozen=True, kw_only=True)
class NodeOptions:
    """How ``digenrl-node`` runs this node, besides its config (digenrl/cli.py builds it from
    the flags, with the node's own config, resolved)."""

    role: str
    """--role: coordinator, rollout, trainer or reward."""
    coordinator: str | None = None
    """--coordinator: the coordinator's control endpoint (every role but the coordinator)."""
    bind: str | None = None
    """--bind: the endpoint to bind (coordinator: control ROUTER; trainer: data PULL; reward:
    requests ROUTER); None = loopback, any port."""
    gpu: str | None = None
    """--gpu: the GPU type this node declares; None = cpu."""
    device: str | None = None
    """--device: cpu, cuda or cuda:N; None = :func:`digenrl.devices.resolve_device`'s choice."""
    node_id: str | None = None
    """--node-id: a stable node id; None = role-host-pid."""
    run_dir: str | None = None
    """--run-dir: the run folder (logs, and the coordinator's metrics)."""
    prometheus_port: int | None = None
    """--prometheus-port: serve this node's metrics there; None = not served."""
    prometheus_addr: str = "0.0.0.0"
    """--prometheus-addr: the address the Prometheus endpoint binds."""
    allow_plaintext: bool = False
    """--allow-plaintext: permit an unencrypted bind on a non-loopback address (warns)."""
    connect_timeout_s: float = 30.0
    """--connect-timeout: no Welcome within this many seconds: say what answers at the address."""
    exit_on_connect_failure: bool = False
    """--exit-on-connect-failure: exit with a one-line error after the timeout instead of retrying."""
    gpus: int | None = None
    """--gpus: a rollout's processes (devices) per trajectory, for this node alone; None = the
    run's ``cluster.rollout_gpus`` (actors/rolloutgroup.py)."""


def run_node(cfg: ResolvedConfig, opts: NodeOptions) -> int:
    """Run one node to its end; its exit code. ``cfg`` is the node's own config (digenrl/cli.py
    loads and resolves it): the run's for a coordinator, and for the other roles the transport
    settings used until Welcome brings the run's."""
    node_id = opts.node_id or default_node_id(opts.role)
    run_dir = Path(opts.run_dir) if opts.run_dir else None
    configure_logging(log_file=(run_dir / "logs" / f"{node_id}.log") if run_dir else None)
    allocator.tune()  # received chunks reuse heap memory instead of faulting in fresh pages
    latest = LatestStats()
    prometheus = _start_prometheus(opts, latest, node_id)
    latest.served = prometheus is not None  # else nobody reads it: no snapshot per heartbeat
    try:
        if opts.role == "coordinator":
            from digenrl.actors.cluster import serve_coordinator
            # READY, the watchdog and the SIGTERM drain are serve_coordinator's own
            with asyncio.Runner(loop_factory=loop_factory()) as runner:
                runner.run(serve_coordinator(cfg, run_dir or Path("runs") / "node-run", bind=opts.bind,
                                             spawn=False, allow_plaintext=opts.allow_plaintext,
                                             record_sink=latest.update))
            return 0
        if not opts.coordinator:
            raise SystemExit("digenrl-node: --coordinator ENDPOINT is required for rollout, trainer and reward")
        roles: dict[str, Role] = {"rollout": "rollout", "trainer": "trainer", "reward": "reward"}
        role = roles[opts.role]  # the --role choices checked it (cli.py)
        device = resolve_device(opts.device)
        if opts.gpus is not None:  # before anything starts: the devices this process sees
            group_devices(device, opts.gpus, f"--gpus {opts.gpus}")
        use_device(device)
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            connect = ConnectPolicy(timeout_s=opts.connect_timeout_s, exit_on_failure=opts.exit_on_connect_failure)
            return int(runner.run(_node(role, node_id, opts.coordinator, opts.gpu or "cpu", opts.bind,
                                        run_dir, cfg, device, latest, connect, opts.gpus)))
    finally:
        if prometheus is not None:
            prometheus.close()


class LatestStats:
    """The latest heartbeat stats of this process's node, read by the Prometheus endpoint
    (its own thread: the dict is replaced whole, never mutated, so a reader sees one beat).

    Each update also snapshots what :meth:`watch` names, on the event loop (never from the
    scrape's thread): the node's policy version, GPU reading and sockets' counters."""

    def __init__(self) -> None:
        self.stats: Mapping[str, Any] = {}
        self.served = True  # False without --prometheus-port: updates are skipped
        self._more: Callable[[], Mapping[str, Any]] = dict

    def watch(self, more: Callable[[], Mapping[str, Any]]) -> None:
        self._more = more

    def update(self, stats: Mapping[str, float]) -> None:
        if self.served:
            self.stats = {**stats, **self._more()}


SOCKET_COUNTERS = ("sent", "received", "bad_frames", "waits")
"""The fields of ``Socket.statistics()`` a node's Prometheus endpoint serves per socket."""


def socket_counters(sockets: list[Socket]) -> dict[str, Any]:
    """Each socket's counters, summed by socket name (a rollout's weight fetches from its
    successive upstreams share one), as a list Prometheus labels by ``socket``
    (``digenrl_node_socket_received{socket="data"}``, docs/metrics.md)."""
    by_name: dict[str, dict[str, float]] = {}
    for s in sockets:
        st = s.statistics()
        row = by_name.setdefault(s.name, dict.fromkeys(SOCKET_COUNTERS, 0.0))
        for counter in SOCKET_COUNTERS:
            row[counter] += getattr(st, counter)
    return {"sockets": [{"index": name, **row} for name, row in sorted(by_name.items())]}


def _start_prometheus(opts: NodeOptions, latest: LatestStats, node_id: str) -> MetricsServer | None:
    """Serve ``--prometheus-port`` (None without it): a coordinator, the run's last step record
    as ``digenrl_<name>`` gauges; any other node, its heartbeat counters, policy version, GPU
    reading and sockets as ``digenrl_node_<name>{node=...}`` (docs/metrics.md). Bound to
    ``--prometheus-addr`` (every interface by default: Prometheus scrapes from another host)."""
    port = opts.prometheus_port
    if port is None:
        return None
    from digenrl.telemetry.metrics import MissingExtraError
    from digenrl.telemetry.prometheus import serve_node_metrics, start_prometheus
    addr = opts.prometheus_addr or "0.0.0.0"
    try:
        if opts.role == "coordinator":
            return start_prometheus(port, lambda: {**process_counters(), **latest.stats}, addr=addr)
        return serve_node_metrics(port, lambda: latest.stats, node_id=node_id, addr=addr)
    except MissingExtraError as e:
        raise SystemExit(f"digenrl-node: --prometheus-port: {e}") from None
    except OSError as e:  # the port is taken, or the address is not this host's
        raise SystemExit(f"digenrl-node: --prometheus-port {port} on {addr}: {e.strerror or e}") from None


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``) in MiB; -1 if unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:  # not Linux: the figure is simply absent
        return -1.0
    return -1.0


def freeze_startup_objects() -> int:
    """Move every object alive now (the imported stack, the model, the node's sockets) to the
    garbage collector's permanent generation; returns how many there are.

    A node with torch, diffusers and peft loaded tracks ~400k objects: each full collection
    walked all of them (~220 ms on a 2-core CPU, the event loop stalled meanwhile) and so did
    the interpreter's exit (~1.5 s, which the launcher waits for at the end of every run).
    Frozen, they are skipped by both (docs/benchmarks.md, Start-up). One collection first, so
    that the imports' garbage is freed rather than frozen. Called just before the actor is
    made: the collection's pause (~0.2 s) then falls before the actor's busy clock starts.
    What was alive at the freeze and later becomes cyclic garbage is not reclaimed: the node's
    start-up state lives as long as the node, and the one exception, a sharded model whose
    modules must be collected before its process group is destroyed, unfreezes first
    (the teardown at the end of :func:`_node`)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def traffic(sockets: list[Socket]) -> dict[str, float]:
    """Messages and frame bytes these sockets sent so far (``net_messages`` / ``net_bytes``)."""
    stats = [s.statistics() for s in sockets]
    return {"net_messages": float(sum(st.sent for st in stats)),
            "net_bytes": float(sum(st.bytes_sent for st in stats))}


def hard_exit(code: int) -> NoReturn:
    """Flush the logs and leave now, without joining threads (one of them never returns)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watchdog_loops(control: Socket) -> tuple[Loop, ...]:
    """The systemd watchdog as a background loop for the actor; none when it is not armed.

    Alive means the control socket moved since the last ping: heartbeats go out every
    ``heartbeat_s``, so a node whose loop is wedged or whose coordinator link is stuck stops
    pinging and systemd restarts it.
    """
    wd = sdnotify.Watchdog()
    if not wd.enabled:
        return ()
    last = [-1]

    def alive() -> bool:
        st = control.statistics()
        moved = st.sent + st.received != last[0]
        last[0] = st.sent + st.received
        return moved

    async def watchdog() -> None:
        await wd.run(alive)

    return (watchdog,)


async def _free_text_encoders(model: Any, cfg: Config, log: Any) -> None:
    """``model.free_text_encoders``: this node's text encoders leave once the run's prompts are
    encoded (digenrl/models/text.py), before it serves any work."""
    from digenrl.models.text import free_text_encoders

    freed = await asyncio.to_thread(free_text_encoders, model, cfg)
    if freed is not None:
        log.info("text_encoders_freed", **freed)


def welcome_config(msg: Welcome, coordinator: str) -> ResolvedConfig:
    """The run's config a Welcome carries, resolved; an error says that the coordinator sent it."""
    try:
        return read_resolved(msg.config_toml, "Welcome's config")
    except (ConfigError, RecursionError) as e:
        raise ConfigError(f"the coordinator at {coordinator} sent a config that does not validate "
                          f"here ({e}); is it another DigenRL version?") from None


async def _node(role: Role, node_id: str, coordinator: str, gpu: str, bind: str | None,
                run_dir: Path | None, boot: Config, device: torch.device, latest: LatestStats,
                connect: ConnectPolicy | None = None, gpus: int | None = None) -> int:
    """``boot`` is the local config: transport settings (keys, limits) until Welcome brings the run's.
    Models (policy, reference, text encoders, VAE) go on ``device``; trainer ranks group over
    NCCL on CUDA, gloo on the CPU. ``gpus``: a rollout's group size (``--gpus``), else the run's."""
    log = get_logger(role, node_id)
    ctx = node_context()  # one I/O thread for control, one for bulk data
    inc = incarnation()
    opened: list[Socket] = []

    def track(s: Socket) -> Socket:
        opened.append(s)
        return s

    try:
        control = track(zs.connect(ctx, "dealer", coordinator, boot, identity=node_id.encode(), name="control"))
        data = weights = None
        host = bind or "tcp://127.0.0.1:*"
        if role == "trainer":
            data = track(zs.bind(ctx, "pull", host, boot, lane="bulk", name="data"))
        elif role == "reward":  # Score requests from rollouts and TAG helpers
            data = track(zs.bind(ctx, "router", host, boot, lane="bulk", name="data"))
        if role != "reward":
            # rank 0 serves, a rollout relays
            weights = track(zs.bind(ctx, "router", host, boot, lane="bulk", name="weights"))
        hello = Hello(node_id=node_id, role=role, gpu=gpu, incarnation=inc, pid=os.getpid(),
                      host=pysocket.gethostname(), data_endpoint=data.endpoint if data else "",
                      weights_endpoint=weights.endpoint if weights else "")
        msg = await wait_welcome(control, coordinator, connect or ConnectPolicy(), log, hello)
        if isinstance(msg, Shutdown):
            log.error("refused by coordinator", reason=msg.reason)
            return 3
        cfg = welcome_config(msg, coordinator)  # the coordinator's, resolved
        if gpus is not None:  # --gpus: this rollout's group size, whatever the run's is
            from digenrl.actors.rolloutgroup import with_group_size
            cfg = with_group_size(cfg, gpus, f"--gpus {gpus}")
        torch.set_num_threads(cfg.run.threads)
        rdir = run_dir or Path("runs") / msg.run_id
        recorder = SpanRecorder(node_id, role)
        endpoints = dict(msg.endpoints)
        trainer_eps = {int(k.split("/")[1]): v for k, v in endpoints.items() if k.startswith("trainer/")}
        pushes = {r: track(zs.connect(ctx, "push", ep, cfg, lane="bulk", name=f"chunks_to_{r}"))
                  for r, ep in sorted(trainer_eps.items())}
        from digenrl.actors.peers import NodePeers
        from digenrl.models import build_model
        from digenrl.rl.rewards import build_reward
        from digenrl.rl.rewards.video import video_frames
        # with reward workers, only they build the reward (its models may need a GPU each)
        workers = cfg.cluster.rewards > 0 and role != "reward"
        reward_fn = None if workers else build_reward(cfg.reward.terms, device=device,
                                                      frames=video_frames(cfg.model))
        scorers = {k.split("/", 1)[1]: track(zs.connect(ctx, "dealer", v, cfg, lane="bulk", name="scores"))
                   for k, v in sorted(endpoints.items()) if k.startswith("reward/")} if workers else {}
        sec = node_security(ctx)
        limit = cfg.runtime.stall_timeout_s
        trace_path = rdir / "trace" / f"{node_id}.jsonl"
        kw = ActorArgs(
            node_id=node_id, recorder=recorder, log=log.bind(policy_version=0),
            hooks=NodeHooks(extra_stats=lambda: {**sec.counters(), "rss_mb": rss_mb(), **traffic(opened)},
                            stats_sink=latest.update, loops=_watchdog_loops(control),
                            compute_init=partial(use_device, device)),
            slowdown=node_slowdown(failpoints(), node_id=node_id, role=role),
            stop_grace_s=min(STOP_GRACE_S, limit) if limit > 0 else STOP_GRACE_S,
            trace_path=trace_path, trace_flush_s=cfg.runtime.trace_flush_s)
        actor: RolloutActor | TrainerActor | RewardActor
        trainer: TrainerActor | None = None
        group: Any = None  # a rollout's followers (cluster.rollout_gpus > 1)
        if role == "reward":
            from digenrl.actors.reward import RewardActor
            assert data is not None and reward_fn is not None  # bound above; no workers here
            peers = NodePeers(node_id=node_id, incarnation=inc, cfg=cfg, control=control)
            frozen = freeze_startup_objects()
            actor = RewardActor(peers=peers, cfg=cfg, router=data, reward_fn=reward_fn, **kw)
        elif role == "rollout":
            sub = track(zs.connect(ctx, "sub", endpoints["pub"], cfg, name="announcements"))
            wdealer = track(zs.connect(ctx, "dealer", endpoints["weights"], cfg, lane="bulk", name="weights_fetch"))
            peers = NodePeers(node_id=node_id, incarnation=inc, cfg=cfg, control=control, sub=sub,
                              pushes=pushes, weights=wdealer, relay=weights, scorers=scorers,
                              connect=lambda ep: track(zs.connect(ctx, "dealer", ep, cfg, lane="bulk",
                                                                name="weights_fetch")))
            n = cfg.cluster.rollout_gpus
            if n > 1:  # followers split each forward (actors/rolloutgroup.py); they build
                # their models meanwhile, and are started from this thread, the node's main one
                from digenrl.actors.rolloutgroup import RolloutGroup
                devices = group_devices(device, n, f"--gpus {n}" if gpus is not None else f"cluster.rollout_gpus = {n}")
                group = RolloutGroup.spawn(cfg, devices, folder=rdir / "logs", node_id=node_id)
            model = await asyncio.to_thread(build_model, cfg.model, seed=cfg.run.seed, gpu=gpu, device=device,
                                            embedded_guidance=cfg.sampler.embedded_guidance)
            await _free_text_encoders(model, cfg, log)
            if group is not None:
                model = await asyncio.to_thread(group.join, model)
            from digenrl.actors.rollout import RolloutActor
            frozen = freeze_startup_objects()
            actor = RolloutActor(peers=peers, cfg=cfg, model=model, reward_fn=reward_fn, **kw)
        else:
            import torch.distributed as dist

            from digenrl.actors.trainer import TrainerActor
            from digenrl.rl.policy import build_policy
            peers = NodePeers(node_id=node_id, incarnation=inc, cfg=cfg, control=control,
                              pushes=pushes, data=data, weights=weights, scorers=scorers)
            if msg.world_size > 1:  # before the policy: FSDP shards over this group
                from digenrl.devices import init_process_group
                await asyncio.to_thread(init_process_group, device, init_method=endpoints["dist"],
                                        rank=msg.rank, world_size=msg.world_size)
            policy = await asyncio.to_thread(partial(build_policy, cfg, msg.world_size, gpu, device=device,
                                                     rank=msg.rank))
            await _free_text_encoders(policy.model, cfg, log)
            held = getattr(policy.model.transformer, "held", None)
            if held is not None:  # two experts: what this rank loaded and trains (rl/experts.py)
                log.info("experts held", rank=msg.rank, experts=list(held),
                         trained={e: sum(policy.params[i].numel() for i in idx)
                                  for e, idx in policy.expert_index.items()})
            if cfg.train.sequence_parallel > 1:  # groups of N consecutive ranks (models/seqpar.py)
                from digenrl.models.seqpar import enable_sequence_parallel, group_of
                group = await asyncio.to_thread(group_of, msg.rank, msg.world_size, cfg.train.sequence_parallel)
                enable_sequence_parallel(policy.model, group)
            test_set = eval_reward = None
            if cfg.run.eval_every and (msg.rank == 0 or policy.sharded):
                from digenrl.data.prompts import load_splits
                from digenrl.rl.evaluate import build_eval_reward
                test_set = load_splits(cfg.prompts)[1]  # the test file must be readable here
                eval_reward = build_eval_reward(cfg, device) if msg.rank == 0 else None
            frozen = freeze_startup_objects()
            actor = trainer = TrainerActor(peers=peers, cfg=cfg, policy=policy, rank=msg.rank,
                                           world_size=msg.world_size, run_dir=rdir, reward_fn=reward_fn,
                                           test_set=test_set, eval_reward=eval_reward, **kw)
            del policy  # the actor holds it (and drops it before the process group goes)
        latest.watch(lambda: {"policy_version": actor.policy_version, "gpu": peers.gpu_reading,
                              "socket": socket_counters(opened)})
        # SIGTERM or Ctrl-C drains; a second Ctrl-C leaves at once (a terminal's user insists)
        unhandle = stop_on_signals(actor.request_stop, again=partial(hard_exit, 128 + signal.SIGINT))
        rss_ready = rss_mb()
        log.info("joined", rank=msg.rank, world_size=msg.world_size, rss_mb=rss_ready, device=str(device),
                 sequence_parallel=(cfg.train.sequence_parallel if trainer is not None
                                    else cfg.cluster.rollout_gpus if role == "rollout" else 1),
                 frozen_objects=frozen)
        sdnotify.ready()
        stuck: str | None = None
        try:
            await actor.run()
            if trainer is not None and actor.compute_stuck() is None:
                await trainer.drain_checkpoint()  # after a drain: the step boundary it holds, for the resume
        finally:
            unhandle()
            recorder.dump(trace_path)
            stuck = actor.compute_stuck() or ("checkpoint_save" if trainer is not None and trainer.resume.drain_stuck
                                              else None)
            if stuck is not None:
                # a torch call that never returns cannot be interrupted, and the interpreter
                # would wait for its thread at exit (or hang in the group's teardown): the node
                # leaves without either, so that its supervisor can restart it
                log.error("compute thread wedged at stop; exiting hard", call=stuck,
                          grace_s=actor.stop_grace_s, stop_reason=actor.stop_reason)
            elif trainer is not None and msg.world_size > 1:
                import torch.distributed as dist
                # a sharded model (FSDP) holds the process group: drop it first, so the group
                # is really torn down here and not in the interpreter's exit (gloo aborts there);
                # its modules' cycles were frozen at the join: unfreeze, or they stay
                gc.unfreeze()
                trainer.drop_model()
                gc.collect()
                if dist.is_initialized():
                    dist.destroy_process_group()
            elif group is not None:
                codes = await asyncio.to_thread(group.close)
                if any(codes):
                    log.error("rollout followers exited abnormally", codes=codes)
        code = 0 if actor.stop_reason in DRAINED else 1
        log.info("node_final", exit_code=code, stop_reason=actor.stop_reason, rss_ready_mb=rss_ready,
                 rss_peak_mb=rss_mb("VmHWM"), **sec.counters())
        if stuck is not None:
            hard_exit(code or 1)
        return code
    finally:
        for s in opened:
            s.close()
        ctx.term()

