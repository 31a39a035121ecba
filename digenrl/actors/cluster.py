"""Serve the coordinator, optionally with a local cluster of child node processes.

``run_local_cluster`` is what ``digenrl launch`` uses for disagg-sync and digenrl modes: the
coordinator runs in this process; rollout and trainer nodes are children on loopback. A child
that dies while the run is live is restarted: a rollout at once (the coordinator is told, so
its uncommitted fragments are re-assigned without waiting for the heartbeat timeout); a
trainer rank by rewinding the whole run to its last checkpoint (``CoordinatorActor.reset``:
every child is killed and restarted, trainers load the checkpoint). The run's accounting
stays exact because attempts, not nodes, own trajectories. Child pids are kept in
``run_dir/logs/pids.json`` for operators and the fault-injection bench.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from digenrl.actors import forkserver
from digenrl.actors.base import COORDINATOR_STOPPED, RunFailed, stop_on_signals, stopped_by_signal
from digenrl.actors.coordinator import CoordinatorActor
from digenrl.actors.resume import drain_wait_s
from digenrl.config import CONFIG_ERROR_EXIT, Config, ResolvedConfig
from digenrl.core.scheduler import Scheduler, SchedulerParams
from digenrl.data.prompts import load_splits
from digenrl.fileio import remove_temp_files, write_json_atomic
from digenrl.rl.checkpoint import (
    CheckpointError,
    dedupe_metrics,
    latest_checkpoint,
    trim_metrics,
    why_no_checkpoint,
)
from digenrl.telemetry import sdnotify
from digenrl.telemetry.logging import get_logger
from digenrl.telemetry.metrics import MetricsWriter
from digenrl.telemetry.progress import Progress
from digenrl.telemetry.trace import SpanRecorder
from digenrl.telemetry.tracking import open_trackers
from digenrl.transport import factory as zs
from digenrl.transport.endpoints import free_port, rendezvous_endpoint
from digenrl.transport.options import node_context


def bytes_per_trajectory(cfg: Config, latent_numel: int) -> int:
    """Latent bytes one trajectory puts in flight (the algorithm's: the GRPO family sends
    (x_t, x_next) per trained step, the forward-process algorithms only the final latents)."""
    from digenrl.rl.algorithm import algorithm_for
    return algorithm_for(cfg.train).bytes_per_trajectory(cfg, latent_numel)


def make_scheduler(cfg: ResolvedConfig, prompt_count: int) -> Scheduler:
    """The run's scheduler. The latent shape comes from the config (and a checkpoint folder's
    ``config.json``): the coordinator never builds, or even reads the weights of, the model."""
    from math import prod

    from digenrl.core.plan import plan_for_step
    from digenrl.models.meta import latent_shape_of
    numel = prod(latent_shape_of(cfg.model))
    params = SchedulerParams.from_config(cfg, prompt_count=prompt_count,
                                         bytes_per_trajectory=bytes_per_trajectory(cfg, numel))
    return Scheduler(params, plan_timesteps=lambda step: plan_for_step(cfg, step))


def forks(cfg: Config) -> bool:
    """Whether the launcher forks its nodes from a pre-imported server (actors/forkserver.py)."""
    return cfg.cluster.spawn == "fork" and forkserver.available()


def start_fork_server(cfg: Config, run_dir: Path) -> None:
    """Start the fork server (idempotent): as early as the launch can, so its imports overlap
    the coordinator's own set-up; its output goes to ``logs/forkserver.stderr``."""
    forkserver.start_server(run_dir / "logs" / "forkserver.stderr",
                            {"OMP_NUM_THREADS": str(cfg.run.threads)})


class Children:
    """Child node processes of a local cluster, restarted when they die during the run."""

    def __init__(self, cfg: Config, run_dir: Path, coordinator: str, max_restarts: int = 10) -> None:
        self.cfg, self.run_dir, self.coordinator = cfg, run_dir, coordinator
        self.procs: dict[str, asyncio.subprocess.Process | forkserver.ForkedNode] = {}
        #: nodes are forked from a pre-imported server (actors/forkserver.py), or exec'd
        self.fork = forks(cfg)
        self.restarts: dict[str, int] = {}
        self.ports: dict[str, int] = {}  # reward workers' fixed ports
        self.max_restarts = max_restarts
        self.log = get_logger("launcher", "launcher")
        self.hurry = asyncio.Event()  # a second Ctrl-C: the end of run waits for no one

    def specs(self) -> list[tuple[str, str]]:
        return [(f"reward-{r}", "reward") for r in range(self.cfg.cluster.rewards)] + \
               [(f"trainer-{r}", "trainer") for r in range(self.cfg.cluster.trainers)] + \
               [(f"rollout-{r}", "rollout") for r in range(self.cfg.cluster.rollouts)]

    def gpu(self, role: str) -> str:
        """The GPU type a child of ``role`` declares (cluster.rollout_gpu / trainer_gpu / gpu)."""
        cl = self.cfg.cluster
        if role == "reward":
            return cl.gpu
        return (cl.rollout_gpu if role == "rollout" else cl.trainer_gpu) or cl.gpu

    def gpu_env(self) -> dict[str, dict[str, str]]:
        """Each child's ``CUDA_VISIBLE_DEVICES`` (none without GPUs): slices in order, trainer
        ranks first (one GPU each), then rollouts (``cluster.rollout_gpus`` each: a rollout
        group's leader and followers), then reward workers (:func:`digenrl.devices.child_gpu_envs`)."""
        from digenrl.devices import child_gpu_envs

        order = sorted(self.specs(), key=lambda s: ("trainer", "rollout", "reward").index(s[1]))
        widths = [self.cfg.cluster.rollout_gpus if role == "rollout" else 1 for _, role in order]
        return {name: env for (name, _), env in zip(order, child_gpu_envs(widths), strict=True)}

    async def start(self, node_id: str, role: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.cfg.run.threads), PYTHONUNBUFFERED="1",
                   **self.gpu_env()[node_id])
        bind: list[str] = []
        if role == "reward":  # one address for the worker's life: a restart binds it again
            host = self.cfg.cluster.host
            port = self.ports.setdefault(node_id, free_port(host))
            bind = ["--bind", f"tcp://{host}:{port}"]
        argv = ["node", "--role", role, "--coordinator", self.coordinator, "--node-id", node_id,
                "--run-dir", str(self.run_dir), "--gpu", self.gpu(role), *bind]
        log_path = self.run_dir / "logs" / f"{node_id}.stderr"
        if self.fork:  # the server was started with the coordinator (serve_coordinator)
            self.procs[node_id] = await forkserver.fork_node(argv, env, log_path)
        else:
            err = open(log_path, "ab")  # noqa: SIM115 - the child owns it
            self.procs[node_id] = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "digenrl.cli", *argv, stdout=err, stderr=err, env=env)
            err.close()
        write_json_atomic(self.run_dir / "logs" / "pids.json",
                          {n: p.pid for n, p in self.procs.items() if p.returncode is None})

    def last_error(self, node_id: str) -> str:
        """The last line of ``node_id``'s stderr that is not a log record (a traceback's
        last line says why it died: ``OSError: [Errno 28] No space left on device``), or ''."""
        try:
            with (self.run_dir / "logs" / f"{node_id}.stderr").open("rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 16384))
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        said = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith(("{", "File ", "^", "~"))
                and not ln.startswith(" ")]
        return said[-1][:300] if said else ""

    async def kill_all(self) -> None:
        for p in self.procs.values():
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):  # exited by itself, not yet reaped
                    p.kill()
        for p in self.procs.values():
            await p.wait()

    async def supervise(self, actor: CoordinatorActor) -> None:
        try:
            await self._supervise(actor)
        except OSError as e:  # the run dir is full or read-only: the run cannot go on
            actor.request_stop(f"failed: {_os_error(e)}")

    async def _supervise(self, actor: CoordinatorActor) -> None:
        for node_id, role in self.specs():
            await self.start(node_id, role)
        while True:
            await asyncio.sleep(0.2)  # poll: child exit codes are not awaitable all at once
            if actor.stopping:
                continue
            if actor.restart_requested.is_set():
                # a trainer rank was lost: every child goes (ranks may hang in a collective)
                actor.restart_requested.clear()
                await self.kill_all()
                for node_id, role in self.specs():
                    self.restarts[node_id] = self.restarts.get(node_id, 0) + 1
                    await self.start(node_id, role)
                continue
            for node_id, role in self.specs():
                p = self.procs[node_id]
                if p.returncode is None or actor.stopping:
                    continue
                if p.returncode == CONFIG_ERROR_EXIT:  # it would refuse again: no restart
                    actor.request_stop(f"failed: {node_id} refused the configuration: "
                                      f"{self.last_error(node_id) or '(no stderr)'}")
                    break
                n = self.restarts.get(node_id, 0) + 1
                if n > self.max_restarts:
                    actor.request_stop(f"failed: {node_id} exited {n} times")
                    break
                self.log.warning("node died", node=node_id, role=role, code=p.returncode)
                await actor.node_exited(node_id, p.returncode, why=self.last_error(node_id))
                if actor.restart_requested.is_set() or actor.stopping:
                    break  # a rewind: every child restarts above, on the next poll
                self.restarts[node_id] = n
                await self.start(node_id, role)

    async def wait_all(self, timeout: float, told: set[int]) -> None:
        """At the end of a run: children whose process the coordinator told to stop (``told``:
        the pids of the nodes it knows) get ``timeout`` seconds to exit on their own, then are
        killed. Any other child is terminated at once: a node restarted late in the run that
        had not joined yet will never hear the Shutdown (the launcher used to wait the whole
        timeout for it). Before it joins a node has no SIGTERM handler, so it just exits.
        :attr:`hurry` set (a second Ctrl-C) ends the wait at once: what is left is killed."""
        for node_id, p in self.procs.items():
            if p.returncode is None and p.pid not in told:
                self.log.info("stopping a node that had not joined", node=node_id)
                with contextlib.suppress(ProcessLookupError):  # exited by itself, not yet reaped
                    p.terminate()
        procs = list(self.procs.values())

        async def every_exit() -> None:
            for p in procs:
                await p.wait()

        exits, hurry = asyncio.ensure_future(every_exit()), asyncio.ensure_future(self.hurry.wait())
        await asyncio.wait({exits, hurry}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        exits.cancel()
        hurry.cancel()
        for p in procs:  # those still there after the timeout, or once someone insisted
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()


async def serve_coordinator(cfg: ResolvedConfig, run_dir: Path, *, bind: str | None, spawn: bool,
                            allow_plaintext: bool = False, resume: bool | None = None,
                            record_sink: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the coordinator (and with ``spawn`` the local children) to the end; writes summary.json.

    ``resume``: True continues from run_dir's checkpoint (CheckpointError if there is none),
    False starts fresh, None (a coordinator restarted by its supervisor) resumes if a
    checkpoint exists.

    Its service-manager duties (docs/deployment.md; no-ops outside systemd): ``READY=1`` once
    its sockets are bound and its checkpoint restored, ``WATCHDOG=1`` while its tick loop
    runs, and on SIGTERM or Ctrl-C ``STOPPING=1`` and a drain: the nodes are told to stop, the
    children (``spawn``) waited for (a second Ctrl-C kills them at once), summary.json
    written. Nodes it did not start (``digenrl-node``) hear :data:`COORDINATOR_STOPPED` and
    exit non-zero, so their supervisors restart them and they rejoin a restarted
    coordinator; children hear the signal's name (``SIGTERM``, ``SIGINT``) and exit 0.
    """
    ckpt = latest_checkpoint(run_dir) if resume is not False else None
    if resume and ckpt is None:
        raise CheckpointError(f"resume {run_dir}: no checkpoint/manifest.json there "
                              f"({why_no_checkpoint(cfg.run.checkpoint_every)})")
    if ckpt is not None:
        trim_metrics(run_dir, below_step=ckpt.version)
    run_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("trace", "samples", "logs"):
        (run_dir / sub).mkdir(exist_ok=True)
    if spawn and forks(cfg):
        start_fork_server(cfg, run_dir)
    log = get_logger("coordinator", "coordinator")
    ctx = node_context()
    host = cfg.cluster.host
    try:
        # no ROUTER_HANDOVER: a newcomer must not take over a live node's connection (a
        # restarted node's old one is gone with its process, or after the ZMTP heartbeat timeout)
        control = zs.bind(ctx, "router", bind or f"tcp://{host}:*", cfg)
        try:
            pub = zs.bind(ctx, "pub", f"tcp://{host}:*", cfg)
        except BaseException:
            control.close()
            raise
    except BaseException:  # refused (plain text off loopback, no keys): nothing left open
        ctx.term()
        raise
    train_set = load_splits(cfg.prompts)[0]
    prompts = train_set.prompts
    sched = make_scheduler(cfg, len(prompts))

    def new_scheduler() -> Scheduler:  # same params (no model build), for a rewind
        from digenrl.core.plan import plan_for_step
        return Scheduler(sched.params, plan_timesteps=lambda step: plan_for_step(cfg, step))

    metrics = MetricsWriter(run_dir, sink=record_sink, trackers=open_trackers(cfg, run_dir))
    recorder = SpanRecorder("coordinator", "coordinator")
    trace_path = run_dir / "trace" / "coordinator.jsonl"
    actor = CoordinatorActor(cfg=cfg, scheduler=sched, control=control, pub=pub, prompts=prompts,
                             metadata=train_set.metadata,
                             run_dir=run_dir, dist_endpoint=rendezvous_endpoint(cfg, run_dir),
                             metrics=metrics, progress=Progress(cfg.run.steps),
                             expected_trainers=cfg.cluster.trainers, node_id="coordinator",
                             recorder=recorder, log=log, scheduler_factory=new_scheduler,
                             trace_path=trace_path, trace_flush_s=cfg.runtime.trace_flush_s)
    try:
        actor.restore_from(ckpt)
    except ValueError as e:  # a snapshot of another run shape (CreditError, SchedulerError)
        raise CheckpointError(f"checkpoint {ckpt.path if ckpt else run_dir}: {e}") from None
    if ckpt is not None:
        for why in ckpt.skipped:  # a newer checkpoint did not verify (launch prints it too)
            log.warning("checkpoint skipped", reason=why)
        log.info("resumed from checkpoint", version=ckpt.version, path=str(ckpt.path))
    print(f"digenrl: coordinator listening on {control.endpoint}", flush=True)
    children = Children(cfg, run_dir, control.endpoint) if spawn else None
    # a launch's children hear the signal's name and exit 0; nodes started apart exit 1
    unhandle = stop_on_signals(actor.request_stop if spawn else
                               lambda name: actor.request_stop(f"{COORDINATOR_STOPPED} ({name})"),
                               again=children.hurry.set if children else None)
    sdnotify.ready()
    sdnotify.status(f"coordinator on {control.endpoint}" + (f", resumed at v{ckpt.version}" if ckpt else ""))
    t0 = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as tg:
            dog = tg.create_task(_service_watchdog(actor))
            sup = tg.create_task(children.supervise(actor)) if children else None
            try:
                await actor.run()
            except (OSError, BaseExceptionGroup) as e:  # a full or read-only disk: fail cleanly
                err = _os_error_in(e)
                if err is None:
                    raise
                actor.stop_reason = f"failed: {_os_error(err)}"
                log.error("run dir not writable", error=str(err))
            if children is not None:
                if actor.stop_reason.startswith("failed"):
                    await children.kill_all()
                else:
                    await children.wait_all(30.0, told={n.get("pid", -1) for n in actor.nodes.values()})
            dog.cancel()
            if sup is not None:
                sup.cancel()
        if stopped_by_signal(actor.stop_reason):
            wait_s = drain_wait_s(cfg, spawned_nodes=spawn)
            if wait_s:
                sdnotify.extend_timeout(wait_s + 30)  # the wait may outlast the unit's stop timeout
            await actor.drain(wait_s=wait_s)
    finally:
        unhandle()
        if children is not None:
            await children.kill_all()  # whatever happened, no child outlives the launcher
            remove_temp_files(run_dir)  # every writer is gone: a killed one's half-written files
        control.close()
        pub.close()
        ctx.term()
        for close in (actor.flush_metrics, metrics.close, lambda: recorder.dump(trace_path)):
            try:
                close()
            except OSError as e:  # already failing for it (a full disk): the run's error says so
                log.error("could not flush", error=str(e))
    wall = time.perf_counter() - t0
    try:
        dedupe_metrics(run_dir)
    except OSError as e:
        if not actor.stop_reason.startswith("failed"):
            actor.stop_reason = f"failed: {_os_error(e)}"
    summary = actor.summary(wall_s=wall, started_at=t0, restarts=children.restarts if children else {})
    try:
        write_json_atomic(run_dir / "summary.json", summary)
    except OSError as e:
        if not actor.stop_reason.startswith("failed"):
            actor.stop_reason = f"failed: {_os_error(e)}"
    if actor.stop_reason.startswith("failed"):
        raise RunFailed(f"run failed: {actor.stop_reason.removeprefix('failed: ')}; see {run_dir}/logs")
    return summary


async def _service_watchdog(actor: CoordinatorActor) -> None:
    """``WATCHDOG=1`` every half ``WatchdogSec`` while the coordinator's tick loop (where it
    notices lost nodes, stalls and the run's end) has run since the last ping; until cancelled."""
    seen = [-1]

    def alive() -> bool:
        moved = actor.ticks != seen[0]
        seen[0] = actor.ticks
        return moved

    await sdnotify.Watchdog().run(alive)


def _os_error_in(e: BaseException) -> OSError | None:
    """``e`` if it is an OSError, or the first of a group made only of OSErrors, else None."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, BaseExceptionGroup):
        match, rest = e.split(OSError)
        while match is not None and rest is None:
            first = match.exceptions[0]
            if isinstance(first, OSError):
                return first
            match = first if isinstance(first, BaseExceptionGroup) else None
    return None


def _os_error(e: OSError) -> str:
    return f"{e.strerror or e}" + (f" writing {e.filename}" if e.filename else "")


def run_local_cluster(cfg: ResolvedConfig, run_dir: Path, *, resume: bool = False) -> dict[str, Any]:
    """The coordinator here, the nodes as supervised children; ``resume``: from run_dir's checkpoint."""
    from digenrl.actors.base import loop_factory
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(serve_coordinator(cfg, run_dir, bind=None, spawn=True, resume=resume))
