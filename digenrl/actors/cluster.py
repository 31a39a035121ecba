"""Serve the coordinator, optionally with a local cluster of child node processes.

``run_local_cluster`` is what ``digenrl launch`` uses for disagg-sync and digenrl modes: the
coordinator runs in this process; rollout and trainer nodes are children on loopback. A child
that dies while the run is live is restarted (a rollout's fragments are re-assigned by the
scheduler when its heartbeats stop); the run's accounting stays exact because attempts, not
nodes, own trajectories.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import zmq.asyncio

from digenrl.actors import sockets as zs
from digenrl.actors.base import Actor
from digenrl.actors.coordinator import CoordinatorActor
from digenrl.config import Config
from digenrl.launch import free_port, write_json_atomic
from digenrl.prompts import load_prompts
from digenrl.scheduler import Scheduler, SchedulerParams
from digenrl.telemetry.logging import get_logger
from digenrl.telemetry.metrics import MetricsWriter
from digenrl.telemetry.progress import Progress
from digenrl.telemetry.trace import SpanRecorder


def bytes_per_trajectory(cfg: Config, latent_numel: int) -> int:
    """Latent bytes one trajectory puts in flight: (x_t, x_next) per trained step, wire dtype."""
    from digenrl.learner import plan_for_step
    elem = 2 if cfg.sampler.wire_dtype == "bfloat16" else 4
    return 2 * latent_numel * elem * max(1, len(plan_for_step(cfg, 0)[0]))


def make_scheduler(cfg: Config, prompt_count: int) -> Scheduler:
    from math import prod

    from digenrl.learner import plan_for_step
    from digenrl.models import build_model
    # TODO(scale): read the latent shape from the model's config.json instead of building it;
    # fine for the tiny CPU models, wasteful for a 12B checkpoint on the coordinator host.
    numel = prod(build_model(cfg.model, seed=cfg.run.seed).latent_shape)
    params = SchedulerParams.from_config(cfg, prompt_count=prompt_count,
                                         bytes_per_trajectory=bytes_per_trajectory(cfg, numel))
    return Scheduler(params, plan_timesteps=lambda step: plan_for_step(cfg, step))


class Children:
    """Child node processes of a local cluster, restarted when they die during the run."""

    def __init__(self, cfg: Config, run_dir: Path, coordinator: str) -> None:
        self.cfg, self.run_dir, self.coordinator = cfg, run_dir, coordinator
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.restarts: dict[str, int] = {}
        self.log = get_logger("launcher", "launcher")

    def specs(self) -> list[tuple[str, str]]:
        return [(f"trainer-{r}", "trainer") for r in range(self.cfg.cluster.trainers)] + \
               [(f"rollout-{r}", "rollout") for r in range(self.cfg.cluster.rollouts)]

    async def start(self, node_id: str, role: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.cfg.run.threads), PYTHONUNBUFFERED="1")
        err = open(self.run_dir / "logs" / f"{node_id}.stderr", "ab")  # noqa: SIM115 - child owns it
        self.procs[node_id] = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "digenrl.actors.node", "--role", role, "--coordinator", self.coordinator,
            "--node-id", node_id, "--run-dir", str(self.run_dir), "--gpu", self.cfg.cluster.gpu,
            stdout=err, stderr=err, env=env)
        err.close()

    async def supervise(self, actor: Actor) -> None:
        for node_id, role in self.specs():
            await self.start(node_id, role)
        while True:
            await asyncio.sleep(0.2)
            for node_id, role in self.specs():
                p = self.procs[node_id]
                if p.returncode is None or actor.stopping:
                    continue
                if role == "trainer":
                    actor.request_stop(f"failed: {node_id} exited with code {p.returncode}")
                    continue
                self.restarts[node_id] = self.restarts.get(node_id, 0) + 1
                self.log.warning("node died, restarting", node=node_id, code=p.returncode)
                await self.start(node_id, role)

    async def wait_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                await asyncio.wait_for(p.wait(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                p.kill()
                await p.wait()


async def serve_coordinator(cfg: Config, run_dir: Path, *, bind: str | None, spawn: bool,
                            allow_plaintext: bool = False) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("trace", "samples", "logs"):
        (run_dir / sub).mkdir(exist_ok=True)
    log = get_logger("coordinator", "coordinator")
    ctx = zmq.asyncio.Context()
    host = cfg.cluster.host
    control = zs.bind(ctx, "router", bind or f"tcp://{host}:*", cfg, handover=True)
    pub = zs.bind(ctx, "pub", f"tcp://{host}:*", cfg)
    prompts = load_prompts(cfg.prompts.file)
    sched = make_scheduler(cfg, len(prompts))
    metrics = MetricsWriter(run_dir)
    recorder = SpanRecorder("coordinator", "coordinator")
    actor = CoordinatorActor(cfg=cfg, scheduler=sched, control=control, pub=pub, prompts=prompts,
                             run_dir=run_dir, dist_endpoint=f"tcp://{host}:{free_port(host)}",
                             metrics=metrics, progress=Progress(cfg.run.steps),
                             expected_trainers=cfg.cluster.trainers, node_id="coordinator",
                             recorder=recorder, log=log)
    print(f"digenrl: coordinator listening on {control.endpoint}", flush=True)
    children = Children(cfg, run_dir, control.endpoint) if spawn else None
    t0 = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as tg:
            sup = tg.create_task(children.supervise(actor)) if children else None
            await actor.run()
            if children is not None:
                await children.wait_all(timeout=30.0)
            if sup is not None:
                sup.cancel()
    finally:
        control.close()
        pub.close()
        ctx.term()
        metrics.close()
        recorder.dump(run_dir / "trace" / "coordinator.jsonl")
    wall = time.perf_counter() - t0
    stats = sched.statistics()
    steps_done = stats["version"]
    # throughput from the first assignment to the last step: process start-up (imports,
    # model build) is reported apart as startup_s, as the colocated loop's figure excludes it
    t_a, t_b = actor.t_first_assign, actor.t_last_step
    train_wall = (t_b - t_a) if (t_a is not None and t_b is not None and t_b > t_a) else wall
    summary = {
        "mode": cfg.run.mode, "steps": steps_done, "wall_s": wall,
        "startup_s": (t_a - t0) if t_a is not None else wall,
        "samples_per_s": cfg.batch_size * steps_done / train_wall,
        "accounting": {k: stats[k] for k in ("admitted", "trained", "discarded", "in_flight")},
        "scheduler": {k: v for k, v in stats.items() if k not in ("nodes",)},
        "nodes": stats["nodes"],
        "staleness_hist": actor.staleness_hist,
        "busy": {n: (b / w if w else 0.0) for n, (b, w) in actor.busy_total.items()},
        "restarts": children.restarts if children else {},
        "stop_reason": actor.stop_reason,
    }
    write_json_atomic(run_dir / "summary.json", summary)
    if actor.stop_reason.startswith("failed"):
        raise RuntimeError(f"run failed: {actor.stop_reason}; see {run_dir}/logs")
    return summary


def run_local_cluster(cfg: Config, run_dir: Path) -> dict[str, Any]:
    from digenrl.actors.node import loop_factory
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(serve_coordinator(cfg, run_dir, bind=None, spawn=True))
