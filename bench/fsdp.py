"""FSDP2 on CPU: per-rank bytes of parameters, gradients and AdamW state, sharded vs not.

    .venv/bin/python bench/fsdp.py [--ranks 2] [--passes 4]

Spawns ``--ranks`` gloo processes; each builds the default config's policy (full fine-tune),
unsharded and then sharded (``model.fsdp``), runs ``--passes`` training passes and one
optimizer step, and reports what it holds locally and the time per pass. The shards should
hold ~1/ranks of the bytes; time per pass grows by the all-gathers / reduce-scatters.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    from torch.distributed.tensor import DTensor
    out = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        out += t.numel() * t.element_size()
    return out


def _measure(shard: bool, passes: int) -> dict[str, float]:
    from digenrl.config import load_config
    from digenrl.rl.learner import Learner
    from digenrl.rl.policy import build_policy

    cfg = load_config(None, [f"model.fsdp={str(shard).lower()}"])
    policy = build_policy(cfg, world_size=dist.get_world_size())
    learner = Learner(policy, cfg)
    t0 = time.perf_counter()
    for _ in range(passes):
        policy.idle_pass() if shard else _plain_pass(policy)
    t_pass = (time.perf_counter() - t0) / passes
    grads = _local_bytes([p.grad for p in policy.params if p.grad is not None])
    if not shard:  # the unsharded runtime all-reduces the flat gradient, as the trainer does
        learner.finish_step(lambda t: dist.all_reduce(t))
    else:
        learner.finish_step(pad_to=learner.stats.passes)
    opt = _local_bytes([v for s in policy.optimizer.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0])
    return {"params": _local_bytes(policy.params), "grads": grads, "optimizer": opt, "pass_s": t_pass}


def _plain_pass(policy) -> None:  # the same dummy pass as Policy.idle_pass, unsharded
    x = torch.zeros(1, *policy.model.latent_shape)
    cond = policy.model.encode_prompts([""])
    (policy.model.velocity(x, torch.tensor([0.5]), cond).sum() * 0.0).backward()


def _rank(rank: int, world: int, store: str, passes: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    plain = _measure(False, passes)
    sharded = _measure(True, passes)
    if rank == 0:
        print(f"{'per rank':<12}{'unsharded':>12}{'sharded':>12}{'ratio':>8}")
        for k in ("params", "grads", "optimizer"):
            print(f"{k + ' MB':<12}{plain[k] / 1e6:>12.3f}{sharded[k] / 1e6:>12.3f}"
                  f"{sharded[k] / plain[k]:>8.2f}")
        print(f"{'s / pass':<12}{plain['pass_s']:>12.4f}{sharded['pass_s']:>12.4f}"
              f"{sharded['pass_s'] / plain['pass_s']:>8.2f}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--passes", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(args.ranks, os.path.join(d, "store"), args.passes), nprocs=args.ranks)


if __name__ == "__main__":
    main()
