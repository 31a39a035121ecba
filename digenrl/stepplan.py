"""What a step contains, derived from (run seed, step) alone.

Prompts, per-trajectory seeds and the trained-timestep plan of step ``s`` are pure functions
of the run seed and ``s``. So every mode (colocated, disagg-sync, digenrl), every fragment
split and a resumed run generate exactly the same trajectories for the same step, and a
re-assigned fragment after a node loss regenerates the same content. No torch here.
"""

from __future__ import annotations

import hashlib
import random
import struct


def _u63(*parts: int | str) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\x00")
    return struct.unpack("<Q", h.digest())[0] >> 1


def step_rng(seed: int, step: int, purpose: str) -> random.Random:
    """A private RNG for one (seed, step, purpose), independent of everything else."""
    return random.Random(_u63(seed, step, purpose))


def step_prompt_ids(seed: int, step: int, prompts_per_step: int, prompt_count: int) -> list[int]:
    """Prompt indices of step ``step``: an epoch-shuffled cursor over the prompt set.

    Epoch e covers steps whose prompt slots fall in [e*N, (e+1)*N); each epoch is a fresh
    permutation, so every prompt is used once per epoch.
    """
    if prompt_count < 1:
        raise ValueError(f"prompt_count = {prompt_count}: expected at least one prompt")
    out = []
    for slot in range(step * prompts_per_step, (step + 1) * prompts_per_step):
        epoch, pos = divmod(slot, prompt_count)
        perm = list(range(prompt_count))
        random.Random(_u63(seed, epoch, "epoch")).shuffle(perm)
        out.append(perm[pos])
    return out


def trajectory_seed(seed: int, step: int, group: int, member: int) -> int:
    """The noise seed of trajectory ``member`` of group ``group`` in step ``step``."""
    return _u63(seed, step, group, member, "noise")


def fragment_groups(prompts_per_step: int, fragments: int, fragment: int) -> range:
    """Group indices (within the step) that fragment ``fragment`` holds."""
    per = prompts_per_step // fragments
    return range(fragment * per, (fragment + 1) * per)


def fragment_seeds(seed: int, step: int, groups: range, group_size: int) -> list[int]:
    return [trajectory_seed(seed, step, g, m) for g in groups for m in range(group_size)]


def timestep_owners(trained: list[int], world_size: int, tsp: bool) -> dict[int, int]:
    """TSP: trained timestep -> trainer rank, contiguous and balanced (all to rank 0 without TSP)."""
    if not tsp or world_size <= 1:
        return {t: 0 for t in trained}
    n = len(trained)
    return {t: min(i * world_size // max(n, 1), world_size - 1) for i, t in enumerate(trained)}
