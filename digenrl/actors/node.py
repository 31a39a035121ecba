"""Entry of one node process (``digenrl-node``): sockets, join, build the role's actor, run.

The event loop (uvloop), the zmq context and logging are made here, once, and passed down.
A node needs only the coordinator's address: Welcome brings the run's config and peers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket as pysocket
from pathlib import Path
from typing import Any

import torch
import zmq.asyncio

from digenrl.actors import sockets as zs
from digenrl.actors.base import default_node_id, incarnation
from digenrl.config import Config, config_from_dict, load_config
from digenrl.protocol import Hello, Shutdown, Welcome
from digenrl.telemetry.logging import configure_logging, get_logger
from digenrl.telemetry.trace import SpanRecorder


def loop_factory() -> Any:
    try:
        import uvloop
        return uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.new_event_loop


def run_node(args: argparse.Namespace) -> int:
    node_id = args.node_id or default_node_id(args.role)
    run_dir = Path(args.run_dir) if args.run_dir else None
    configure_logging(log_file=(run_dir / "logs" / f"{node_id}.log") if run_dir else None)
    if args.role == "coordinator":
        from digenrl.actors.cluster import serve_coordinator
        cfg = load_config(args.config, args.overrides)
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(serve_coordinator(cfg, run_dir or Path("runs") / "node-run", bind=args.bind,
                                         spawn=False, allow_plaintext=args.allow_plaintext))
        return 0
    if not args.coordinator:
        raise SystemExit("digenrl-node: --coordinator ENDPOINT is required for rollout and trainer")
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return int(runner.run(_node(args.role, node_id, args.coordinator, args.gpu or "cpu", args.bind,
                                    run_dir, load_config(args.config, args.overrides))))


async def _node(role: str, node_id: str, coordinator: str, gpu: str, bind: str | None,
                run_dir: Path | None, boot: Config) -> int:
    """``boot`` is the local config: transport settings (keys, limits) until Welcome brings the run's."""
    log = get_logger(role, node_id)
    ctx = zmq.asyncio.Context()
    inc = incarnation()
    opened: list[Any] = []

    def track(s: Any) -> Any:
        opened.append(s)
        return s

    try:
        control = track(zs.connect(ctx, "dealer", coordinator, boot, identity=node_id.encode()))
        data = weights = None
        host = bind or "tcp://127.0.0.1:*"
        endpoint = ""
        if role == "trainer":
            data = track(zs.bind(ctx, "pull", host, boot))
            weights = track(zs.bind(ctx, "router", host, boot))
            endpoint = f"{data.endpoint}|{weights.endpoint}"
        await control.send(Hello(node_id=node_id, role=role, gpu=gpu, incarnation=inc,
                                 pid=os.getpid(), host=endpoint or pysocket.gethostname()))
        while True:
            _, msg = await control.recv()
            if isinstance(msg, Welcome):
                break
            if isinstance(msg, Shutdown):
                log.error("refused by coordinator", reason=msg.reason)
                return 3
        import tomllib
        cfg: Config = config_from_dict(tomllib.loads(msg.config_toml))
        torch.set_num_threads(cfg.run.threads)
        rdir = run_dir or Path("runs") / msg.run_id
        recorder = SpanRecorder(node_id, role)
        endpoints = dict(msg.endpoints)
        trainer_eps = {int(k.split("/")[1]): v.split("|")[0] for k, v in endpoints.items()
                       if k.startswith("trainer/")}
        pushes = {r: track(zs.connect(ctx, "push", ep, cfg)) for r, ep in sorted(trainer_eps.items())}
        from digenrl.actors.peers import NodePeers
        from digenrl.models import build_model
        from digenrl.rl.rewards import build_reward
        reward_fn = build_reward(cfg.reward.terms)
        kw = dict(node_id=node_id, recorder=recorder, log=log.bind(policy_version=0))
        if role == "rollout":
            sub = track(zs.connect(ctx, "sub", endpoints["pub"], cfg))
            w0 = endpoints["trainer/0"].split("|")[1]
            wdealer = track(zs.connect(ctx, "dealer", w0, cfg))
            peers = NodePeers(node_id=node_id, incarnation=inc, cfg=cfg, control=control, sub=sub,
                              pushes=pushes, weights=wdealer)
            model = await asyncio.to_thread(build_model, cfg.model, seed=cfg.run.seed)
            from digenrl.actors.rollout import RolloutActor
            actor: Any = RolloutActor(peers=peers, cfg=cfg, model=model, reward_fn=reward_fn, **kw)
        else:
            import torch.distributed as dist

            from digenrl.actors.trainer import TrainerActor
            from digenrl.colocated import build_policy
            peers = NodePeers(node_id=node_id, incarnation=inc, cfg=cfg, control=control,
                              pushes=pushes, data=data, weights=weights)
            policy = await asyncio.to_thread(build_policy, cfg)
            if msg.world_size > 1:
                await asyncio.to_thread(dist.init_process_group, "gloo", init_method=endpoints["dist"],
                                        rank=msg.rank, world_size=msg.world_size)
            actor = TrainerActor(peers=peers, cfg=cfg, policy=policy, rank=msg.rank,
                                 world_size=msg.world_size, run_dir=rdir, reward_fn=reward_fn, **kw)
        log.info("joined", rank=msg.rank, world_size=msg.world_size)
        try:
            await actor.run()
        finally:
            recorder.dump(rdir / "trace" / f"{node_id}.jsonl")
            if role == "trainer" and msg.world_size > 1:
                import torch.distributed as dist
                if dist.is_initialized():
                    dist.destroy_process_group()
        return 0
    finally:
        for s in opened:
            s.close()
        ctx.term()


if __name__ == "__main__":
    import sys

    from digenrl.cli import node_main

    sys.exit(node_main())
