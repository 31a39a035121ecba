"""Trainer ranks for tests/test_fsdp.py's sharded-checkpoint test (three processes, one wave).

    python -m tests.dcp_worker RANK RUN_DIR STORE_DIR        (RANK 0, 1 or 2)

1. Ranks 0 and 1 (a gloo group of two): a sharded policy of the tiny random SD3 takes one
   real optimizer step and writes its checkpoint through ``save_trainer_state`` (each rank
   its own shard); rank 0 commits it as the coordinator would and writes ``reference.pt``:
   the whole weights and optimizer state, gathered after the save, by parameter name.
2. All three ranks (a new group of three): a fresh sharded policy loads the checkpoint (it
   resharded over three); rank 0 writes ``loaded-3.pt`` the same way. Then they gather the
   weights as a publish does (only rank 0 keeps them): ``kept-3.pt``, and ranks 1 and 2 write
   how many tensors they kept (``kept-by-rank-R.txt``: none).
3. Rank 0 alone, no process group: an unsharded float32 policy and an unsharded bfloat16
   one (float32 masters) load it; ``loaded-1.pt`` and ``loaded-1-bf16.pt``.

Rank 2 has nothing to do in 1: its init for 2 waits until the other two join.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from digenrl.config import load_config
from digenrl.rl.checkpoint import (
    commit_checkpoint,
    latest_checkpoint,
    load_trainer_state,
    save_trainer_state,
)
from digenrl.rl.policy import Policy, build_policy
from tests.conftest import SUITE_SETS

# the suite's default (tests/conftest.py: a full fine-tune, no tail), in this child process too
CFG = [*SUITE_SETS, "model.path=\"random\"", "train.group_size=2"]


def whole_state(policy: Policy) -> dict[str, Any]:
    """Weights and optimizer state, whole and keyed by parameter name (sharded: a collective)."""
    if policy.has_masters:  # the optimizer holds the masters, not the module's parameters
        index = policy._master_keys()
        optim = {name: dict(policy.optimizer.state[policy.params[i]]) for name, i in index.items()}
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )
        optim = get_optimizer_state_dict(policy.model.transformer, policy.optimizer,
                                         options=StateDictOptions(full_state_dict=True))["state"]
    return {"weights": policy.state_dict_for_sync(), "optim": optim, "version": policy.version}


def group(store: Path, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def main() -> None:
    rank, run_dir, stores = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    if rank < 2:
        group(stores / "save", rank, 2)
        policy = build_policy(load_config(None, [*CFG, "model.fsdp=true"]), world_size=2)
        x = torch.randn(2, *policy.model.latent_shape, generator=torch.Generator().manual_seed(1))
        cond = policy.model.encode_prompts(["a red circle", "a blue square"])
        policy.model.velocity(x, 0.5, cond).pow(2).mean().backward()
        policy.optimizer_step()
        save_trainer_state(run_dir, policy, {"rejected_stale": 0}, write=rank == 0)
        if rank == 0:  # the coordinator's half, so that the checkpoint verifies
            commit_checkpoint(run_dir, policy.version, {"scheduler": {}})
        ref = whole_state(policy)
        if rank == 0:
            torch.save(ref, run_dir / "reference.pt")
        dist.destroy_process_group()
    group(stores / "load", rank, 3)
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.trainer["layout"] == "dcp", ckpt
    policy = build_policy(load_config(None, [*CFG, "model.fsdp=true"]), world_size=3)
    load_trainer_state(ckpt, policy)
    got = whole_state(policy)
    # what a publish does: every rank joins the gathers, only rank 0 keeps the whole set
    kept = policy.state_dict_for_sync(keep=rank == 0)
    if rank == 0:
        torch.save(got, run_dir / "loaded-3.pt")
        torch.save(kept, run_dir / "kept-3.pt")
    else:
        (run_dir / f"kept-by-rank-{rank}.txt").write_text(str(len(kept)))
    dist.destroy_process_group()
    if rank == 0:
        for name, extra in (("loaded-1", []), ("loaded-1-bf16", ["model.dtype=\"bfloat16\""])):
            policy = build_policy(load_config(None, [*CFG, *extra]))
            assert policy.has_masters == bool(extra)
            load_trainer_state(ckpt, policy)
            torch.save(whole_state(policy), run_dir / f"{name}.pt")


if __name__ == "__main__":
    import os
    import sys

    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # every result is on disk (the test checks each file): leave without the interpreter's
    # teardown, where gloo's threads can still abort the process ("terminate called without an
    # active exception", seen rarely under load; the launcher tolerates it the same way)
    os._exit(0)
