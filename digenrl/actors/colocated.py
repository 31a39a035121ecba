"""The colocated loop: flow_grpo-style SPMD, every rank generates then trains, in turn.

This is the baseline DigenRL is measured against, and the shortest path from a config to a
trained policy (one process, no sockets). With ``world_size > 1`` each rank generates its
share of the step's groups and trains them; gradients are all-reduced (NCCL on GPUs, gloo on
the CPU).

    for step in range(steps):
        prompts, seeds = step content (core.plan: the same for every mode)
        records, result = generate my groups            # sample + reward
        learner.train_fragment(records, result)         # advantages, loss, backward
        learner.finish_step(all_reduce)                 # optimizer step -> version step+1
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TypedDict

import torch
import torch.distributed as dist

from digenrl.config import ResolvedConfig
from digenrl.core.plan import plan_for_step, step_prompts, trajectory_seed
from digenrl.data.prompts import load_splits
from digenrl.devices import init_process_group, resolve_device, use_device
from digenrl.faults import crash_point
from digenrl.rl.checkpoint import colocated_checkpoint, colocated_resume
from digenrl.rl.evaluate import build_eval_reward, eval_due, evaluate_policy
from digenrl.rl.fragment import FragmentJob
from digenrl.rl.learner import Learner, save_final
from digenrl.rl.policy import build_policy
from digenrl.rl.rewards import build_reward
from digenrl.rl.rewards.video import video_frames
from digenrl.rl.sde import sigma_schedule
from digenrl.telemetry.images import grid_array, save_grid
from digenrl.telemetry.metrics import MetricsWriter, StepMetrics
from digenrl.telemetry.progress import Progress
from digenrl.telemetry.trace import BusyClock, SpanRecorder, busy_share
from digenrl.telemetry.tracking import images_due, open_trackers


def _all_reduce(t: torch.Tensor) -> None:
    dist.all_reduce(t, op=dist.ReduceOp.SUM)



class ColocatedResult(TypedDict):
    """What :func:`run_colocated` returns (rank 0 of several: summed over the ranks)."""

    samples_per_s: float
    wall_s: float
    trained: int
    discarded: dict[str, int]
    busy: float


def run_colocated(cfg: ResolvedConfig, run_dir: Path, *, rank: int = 0, world_size: int = 1,
                  progress: Progress | None = None, log: object | None = None,
                  resume: bool = False, device: torch.device | None = None) -> ColocatedResult:
    """Train ``cfg.run.steps`` steps; rank 0 writes metrics.jsonl and sample grids.

    ``resume`` continues from run_dir's checkpoint; checkpoints follow run.checkpoint_every.
    ``device``: where the models go (default: :func:`digenrl.devices.resolve_device`).
    """
    torch.set_num_threads(cfg.run.threads)
    device = resolve_device() if device is None else device
    use_device(device)
    P, G = cfg.train.prompts_per_step, cfg.train.group_size
    if P % world_size:
        raise ValueError(f"train.prompts_per_step = {P}: colocated mode with {world_size} ranks "
                         "needs a multiple of the rank count")
    policy = build_policy(cfg, world_size, device=device, rank=rank)
    from digenrl.models.text import free_text_encoders
    free_text_encoders(policy.model, cfg)  # model.free_text_encoders: the run's prompts, then no encoders
    learner = Learner(policy, cfg)
    algorithm = learner.algorithm  # what the sampler hands out and what trains on it
    start, done_trained, done_discarded = (colocated_resume(run_dir, policy, rank) if resume
                                           else (0, 0, {}))
    reward_fn = build_reward(cfg.reward.terms, device=device, frames=video_frames(cfg.model))
    train_set, test_set = load_splits(cfg.prompts)
    prompts = train_set.prompts
    # evaluation: rank 0 scores; a sharded policy's other ranks join its forward passes
    evaluating = cfg.run.eval_every > 0 and test_set is not None and (rank == 0 or policy.sharded)
    eval_reward = build_eval_reward(cfg, device) if evaluating and rank == 0 else None
    sigma_max = float(sigma_schedule(cfg.sampler.num_steps, cfg.sampler.shift)[1])
    node = f"colocated-{rank}"
    recorder = SpanRecorder(node, "colocated")
    # rank 0 is the coordinator here: it alone opens the experiment trackers
    writer = MetricsWriter(run_dir, trackers=open_trackers(cfg, run_dir)) if rank == 0 else None
    per_rank = P // world_size
    my_groups = range(rank * per_rank, (rank + 1) * per_rank)
    t_start = time.perf_counter()
    busy_clock = BusyClock(recorder)
    trace_path, flushed = run_dir / "trace" / f"{node}.jsonl", time.perf_counter()
    last: dict[str, float] = {}
    trained_total = done_trained
    discarded: dict[str, int] = dict(done_discarded)

    def maybe_eval(version: int) -> None:
        if not (evaluating and test_set is not None and eval_due(version, cfg)):
            return
        show = (lambda kind, grid, caption: writer.write_samples(version, kind, grid, caption)) \
            if writer is not None else None
        with recorder.span("evaluate", version=version):
            row = evaluate_policy(policy, cfg, test_set, eval_reward, version=version,
                                  run_dir=run_dir if rank == 0 else None, show=show)
        if writer is not None:
            writer.write_eval(version, time.perf_counter() - t_start, row)

    maybe_eval(start)
    for step in range(start, cfg.run.steps):
        t0 = time.perf_counter()
        busy_before = busy_clock.stats()
        ids = step_prompts(cfg.run.seed, step, P, len(prompts))
        trained, sde = plan_for_step(cfg, step)
        seeds = [trajectory_seed(cfg.run.seed, step, q, g) for q in my_groups for g in range(G)]
        job = FragmentJob(model=policy.model, cfg=cfg, prompts=[prompts[ids[g]] for g in my_groups],
                          seeds=seeds, sde_steps=sde, trained_steps=algorithm.streamed_steps(trained),
                          reward_fn=reward_fn, metadata=[train_set.metadata[ids[g]] for g in my_groups])
        with recorder.span("generate", step=step):
            records, result = job.run_all()
        crash_point("generate", step)  # TEST-ONLY (digenrl/faults.py)
        inputs = algorithm.local(records, result, trained, seeds)
        with recorder.span("fragment_train", step=step):
            learner.train_fragment(records=inputs.records,
                                   cond=result.cond, rewards=result.rewards,
                                   gen_version=policy.version, n_trained_total=len(trained),
                                   sigma_max=sigma_max, reward_terms=result.reward_terms,
                                   final=inputs.final, seeds=inputs.seeds)
        with recorder.span("optimizer_step", step=step):
            metrics = learner.finish_step(_all_reduce if world_size > 1 else None, pad_to=len(trained))
        if world_size > 1:
            # rewards of every rank for the step's reward statistics
            r = torch.tensor([metrics["reward_mean"], metrics["reward_std"] ** 2], dtype=torch.float64,
                             device=device)  # NCCL reduces device tensors only
            dist.all_reduce(r)
            metrics["reward_mean"] = float(r[0]) / world_size
            metrics["reward_std"] = float(r[1] / world_size) ** 0.5
        trained_total += int(metrics["trained"])
        for k, v in learner.last_discarded.items():
            discarded[k] = discarded.get(k, 0) + v
        dt = time.perf_counter() - t0
        busy_after = busy_clock.stats()
        step_busy = busy_share(busy_after["busy_s"] - busy_before["busy_s"],
                               busy_after["wall_s"] - busy_before["wall_s"])
        if rank == 0 and (step == 0 or step == cfg.run.steps - 1 or
                          (cfg.run.sample_grid_every and step % cfg.run.sample_grid_every == 0)):
            save_grid(result.images, run_dir / "samples" / f"step_{step:04d}.png", nrow=G)
        if writer is not None and result.images.numel() and images_due(step, cfg):
            writer.write_samples(step, "train", grid_array(result.images, G),
                                 row_prompts=[prompts[ids[g]] for g in my_groups])
        last = {"step": step, "policy_version": policy.version, **metrics,
                "samples_per_s": P * G / dt, "step_seconds": dt,
                "wall_time": time.perf_counter() - t_start,
                f"busy/{node}": step_busy}
        if writer is not None:
            writer.write(StepMetrics.from_record(last))
            if progress is not None:
                progress.update(last)
        if time.perf_counter() - flushed >= cfg.runtime.trace_flush_s:  # memory stays flat
            recorder.dump(trace_path)
            flushed = time.perf_counter()
        maybe_eval(policy.version)
        colocated_checkpoint(run_dir, policy, rank=rank, world_size=world_size, trained=trained_total,
                             discarded=discarded, steps=cfg.run.steps, every=cfg.run.checkpoint_every)
    total = time.perf_counter() - t_start
    totals = busy_clock.stats()
    busy = busy_share(totals["busy_s"], totals["wall_s"])
    recorder.dump(trace_path)
    if rank == 0 or policy.sharded:
        save_final(policy, run_dir, write=rank == 0)  # sharded: every rank joins the gather
    if writer is not None:
        writer.close()
    return {"samples_per_s": (cfg.run.steps - start) * P * G / total, "wall_s": total,
            "trained": trained_total, "discarded": discarded, "busy": busy}


SUMMARY = "colocated-summary.json"
"""Rank 0 writes the run's totals here once every rank has finished its run, before the ranks
tear their process group down: its presence says the run completed (digenrl/launch.py)."""


def _rank_main(argv: list[str]) -> int:
    """Entry of one colocated rank process: RUN_DIR RANK WORLD INIT_METHOD [resume]."""
    import json

    from digenrl.config import read_resolved
    from digenrl.fileio import write_text_atomic

    run_dir, rank, world, init = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    cfg = read_resolved((run_dir / "config.toml").read_text(), str(run_dir / "config.toml"))
    device = resolve_device()  # the launcher gives each rank its GPU (CUDA_VISIBLE_DEVICES)
    init_process_group(device, init_method=init, rank=rank, world_size=world)
    try:
        result = run_colocated(cfg, run_dir, rank=rank, world_size=world,
                               resume=len(argv) > 4 and argv[4] == "resume", device=device)
        # every rank's trained/discarded counts add up to the step's batch
        counts: list[tuple[int, dict[str, int]] | None] = [None] * world
        dist.all_gather_object(counts, (result["trained"], result["discarded"]))
        if rank == 0:  # written before the teardown: every rank has finished its run here
            gathered = [c for c in counts if c is not None]  # all_gather_object filled every slot
            result["trained"] = sum(trained for trained, _ in gathered)
            merged: dict[str, int] = {}
            for _, d in gathered:
                for k, v in d.items():
                    merged[k] = merged.get(k, 0) + v
            result["discarded"] = merged
            write_text_atomic(run_dir / SUMMARY, json.dumps(result))
        dist.barrier()  # the teardown starts once every rank is done, the summary written
        crash_point("teardown", rank)  # TEST-ONLY (digenrl/faults.py): "teardown:1" kills ranks >= 1
    finally:
        import gc
        gc.collect()  # FSDP modules (hook cycles) must go before the group they shard over
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_rank_main(sys.argv[1:]))
