"""What a fragment contains, as pure functions of the run seed (torch-free, sans-I/O).

A slot's content is deterministic, so a re-queued slot regenerates exactly the same
prompts with the same noise seeds, and a restarted coordinator hands out the same work:

* prompts: a shuffled-epoch cursor. Prompt positions ``s*P .. s*P+P-1`` index an endless
  sequence of permutations of ``range(prompt_count)``; epoch ``e``'s permutation comes
  from ``random.Random(h(seed, e))``. Every prompt is used once per epoch.
* seeds: a stable 63-bit integer per trajectory from ``blake2b(seed, step, prompt slot, g)``.
* timesteps: :func:`plan_for_step` (the run's plan: which denoising steps are SDE and
  trained, from ``train.timesteps`` and a seed per step). The scheduler takes it injected as
  ``plan_timesteps(step) -> (trained, sde)``; :func:`all_timesteps` is its default. The
  coordinator, every trainer rank, every rollout and the simulator use this one plan.
* owners: the trainer rank of each trained timestep (TSP), a contiguous balanced split.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from digenrl.config import Config

PlanFn = Callable[[int], tuple[list[int], list[int]]]

DEFAULT_GPU_SPEEDS: MappingProxyType[str, float] = MappingProxyType({
    "cpu": 1.0, "H100": 1.0, "H800": 1.0, "H200": 1.15, "A100": 0.45, "H20": 0.3, "L40S": 0.5,
})
"""Relative generation speed per GPU type (H100 = 1), the prior before a node is measured."""


def stable_int(*parts: int | str) -> int:
    """A 63-bit integer hash of ``parts``, stable across processes and Python versions."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, prompt_count: int) -> tuple[int, ...]:
    order = list(range(prompt_count))
    random.Random(stable_int("epoch", seed, epoch)).shuffle(order)
    return tuple(order)


def _prompt_at(seed: int, pos: int, prompt_count: int) -> int:
    epoch, i = divmod(pos, prompt_count)
    return _epoch_order(seed, epoch, prompt_count)[i]


def step_prompts(seed: int, step: int, prompts_per_step: int, prompt_count: int) -> list[int]:
    """Prompt ids of step ``step`` (length ``prompts_per_step``; repeats only across epochs)."""
    return [_prompt_at(seed, pos, prompt_count)
            for pos in range(step * prompts_per_step, (step + 1) * prompts_per_step)]


def trajectory_seed(seed: int, step: int, prompt_slot: int, g: int) -> int:
    """Noise seed of generation ``g`` of prompt slot ``prompt_slot`` (0..P-1) in ``step``."""
    return stable_int("traj", seed, step, prompt_slot, g)


def fragment_content(seed: int, step: int, fragment: int, *, prompts_per_step: int,
                     fragments_per_step: int, group_size: int,
                     prompt_count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prompt ids, seeds) of slot (step, fragment); seeds group-major (``seeds[p*G + g]``)."""
    per = prompts_per_step // fragments_per_step
    slots = range(fragment * per, (fragment + 1) * per)
    seeds = tuple(trajectory_seed(seed, step, q, g) for q in slots for g in range(group_size))
    # only this fragment's slots of step_prompts (the whole step per fragment is O(P^2) a step)
    return tuple(_prompt_at(seed, step * prompts_per_step + q, prompt_count) for q in slots), seeds


def all_timesteps(num_steps: int) -> PlanFn:
    """The default plan: train every denoising step, and every step is an SDE step."""
    steps = list(range(num_steps))

    def plan(step: int) -> tuple[list[int], list[int]]:
        return list(steps), list(steps)

    return plan


def owners_for(trained: Sequence[int], ranks: int, tsp: bool, fragment: int = 0,
               fragments: int = 1, sp: int = 1) -> tuple[int, ...]:
    """Rank owning each trained timestep of fragment ``fragment`` (TSP x data parallelism).

    ``sp`` (``train.sequence_parallel``): the ranks form ``ranks / sp`` sequence-parallel groups
    of ``sp`` consecutive ranks that train the same timesteps of the same samples together;
    the plan below is over those groups, and each owner is a group's first rank (its
    *leader*: chunks are addressed to it and its ``sp - 1`` followers get copies).

    The ranks form ``D`` groups of ``g``: within a group, TSP spreads the fragment's ``n``
    trained timesteps (contiguous, balanced); fragments go round-robin over the groups (data
    parallelism over fragments). ``g`` minimises the step's training time in timestep-units,
    ``ceil(fragments / D) * ceil(n / g)`` with ``D = min(ranks // g, fragments)`` (more groups
    than fragments would idle), preferring the wider group on ties (per-timestep streaming starts training
    sooner). With TSP off every group is one rank: fragment ``f`` trains whole on rank
    ``f % ranks``.
    """
    if sp > 1:
        return tuple(o * sp for o in _owners(tuple(trained), ranks // sp, tsp, fragment, fragments))
    return _owners(tuple(trained), ranks, tsp, fragment, fragments)


@lru_cache(maxsize=4096)  # called per assignment and per commit; pure, so cached
def _owners(trained: tuple[int, ...], ranks: int, tsp: bool, fragment: int,
            fragments: int) -> tuple[int, ...]:
    n = len(trained)
    if ranks <= 1 or n == 0:
        return (0,) * n
    fragments = max(1, fragments)
    if tsp:
        g = min(range(1, min(ranks, n) + 1),
                key=lambda w: (-(-fragments // min(ranks // w, fragments)) * -(-n // w), -w))
    else:
        g = 1
    groups = min(ranks // g, fragments) if tsp else ranks
    base = (fragment % groups) * g
    # within the group, member m owns positions [m*n//g, (m+1)*n//g): sizes differ by at most one
    return tuple(base + next(m for m in range(g) if i < (m + 1) * n // g) for i in range(n))


def train_groups(trained: Sequence[int], ranks: int, tsp: bool, fragments: int, sp: int = 1) -> int:
    """How many fragments of a step train at once: the distinct owner groups of
    :func:`owners_for` over the step's fragments (1 without data parallelism)."""
    return len({owners_for(trained, ranks, tsp, f, fragments, sp) for f in range(max(1, fragments))})


def check_plan(step: int, trained: Sequence[int], sde: Sequence[int], num_steps: int) -> None:
    """Reject a plan that names a timestep outside [0, T) or repeats one (a plugin bug)."""
    for name, seq in (("trained", trained), ("sde", sde)):
        if list(seq) != sorted(set(seq)) or any(not 0 <= t < num_steps for t in seq):
            raise ValueError(f"plan_timesteps({step}) {name} = {list(seq)!r}: expected "
                             f"ascending distinct indices in [0, {num_steps})")

@dataclass
class TimestepPlan:
    """Which denoising steps of a training step are trained and which inject noise."""

    trained: list[int]
    sde: list[int] = field(default_factory=list)

def mix_window_start(step: int, *, window_size: int, window_lo: int, window_hi: int,
                     shift_every: int, stride: int, decay: float = 0.0, decay_from: int = 0) -> int:
    """MixGRPO's progressive sliding window: where the window starts at optimizer step ``step``.

    The window starts at ``lo`` and stays for ``shift_every`` steps (the paper's shift interval
    tau), then moves ``stride`` denoising steps later; once it would end past ``hi`` it rolls back
    to ``lo`` (the reference code's ``roll_back``). With ``decay > 0`` (the reference's
    ``exp_decay`` strategy) the interval shrinks as the window moves to low noise: at start
    ``p`` the window stays ``ceil(shift_every * exp(-decay * max(0, p - decay_from)))`` steps
    (at least 1). A pure function of the step, so every node and a resumed run agree without
    carrying state.
    """
    if shift_every < 1 or stride < 1:
        raise ValueError(f"shift_every = {shift_every}, stride = {stride}: expected both >= 1")
    if not (decay >= 0 and math.isfinite(decay)) or decay_from < 0:
        raise ValueError(f"decay = {decay}, decay_from = {decay_from}: expected both >= 0")
    positions = (window_hi - window_size - window_lo) // stride + 1
    if positions < 1:
        raise ValueError(f"window_size = {window_size}: the window [{window_lo}, {window_lo}+"
                         f"{window_size}) must fit below hi = {window_hi}")
    if decay == 0:
        return window_lo + stride * ((step // shift_every) % positions)
    starts = [window_lo + stride * i for i in range(positions)]
    # ceil of a float a hair above an integer would add a step: round to 9 places first
    stays = [max(1, math.ceil(round(shift_every * math.exp(-decay * max(0, p - decay_from)), 9)))
             for p in starts]
    left = step % sum(stays)
    for p, n in zip(starts, stays):
        if left < n:
            return p
        left -= n
    raise AssertionError("unreachable: left < sum(stays)")


def select_timesteps(
    mode: Literal["all", "fraction", "window", "mix"],
    num_steps: int,
    *,
    fraction: float = 1.0,
    window_size: int = 2,
    window_lo: int = 0,
    window_hi: int = 0,
    rng: random.Random,
    step: int = 0,
    shift_every: int = 10,
    stride: int = 1,
    decay: float = 0.0,
    decay_from: int = 0,
) -> TimestepPlan:
    """The steps to train and to sample with noise for one training step.

    * ``all``: every step trained, every step SDE.
    * ``fraction``: the first ``max(1, int(fraction * T))`` steps trained (Flow-GRPO's
      ``timestep_fraction``), every step SDE.
    * ``window`` (Flow-GRPO-Fast): start ``k`` drawn uniformly from ``[lo, hi - W]``
      (``hi = 0`` means ``T // 2``); only ``[k, k + W)`` is SDE and trained, the rest ODE.
    * ``mix`` (MixGRPO): the same window, placed by :func:`mix_window_start` from ``step``
      instead of at random: it slides from ``lo`` towards ``hi`` as training advances.

    Rollouts and every trainer rank must agree on the plan, so seed ``rng`` from the run
    seed and the step.
    """
    t_all = list(range(num_steps))
    if mode == "all":
        return TimestepPlan(trained=t_all, sde=list(t_all))
    if mode == "fraction":
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction = {fraction}: expected 0 < fraction <= 1")
        return TimestepPlan(trained=t_all[:max(1, int(fraction * num_steps))], sde=list(t_all))
    if mode in ("window", "mix"):
        hi = window_hi or max(num_steps // 2, 1)
        # the same acceptance rule as config._check_consistency (a 1-step window may sit at lo)
        if window_size < 1 or window_lo + window_size > min(max(hi, window_lo + 1), num_steps):
            raise ValueError(f"window_size = {window_size}: the window [{window_lo}, "
                             f"{window_lo}+{window_size}) must fit in hi = {hi} and {num_steps} steps")
        if mode == "mix":
            k = mix_window_start(step, window_size=window_size, window_lo=window_lo,
                                 window_hi=min(max(hi, window_lo + window_size), num_steps),
                                 shift_every=shift_every, stride=stride, decay=decay,
                                 decay_from=decay_from)
        else:
            k = rng.randint(window_lo, max(hi - window_size, window_lo))
        window = list(range(k, k + window_size))
        return TimestepPlan(trained=window, sde=list(window))
    raise ValueError(f"timestep mode {mode!r}: expected 'all', 'fraction', 'window' or 'mix'")


FORWARD_ALGORITHMS = ("nft", "awm")
"""Algorithms that train on final clean samples at timesteps the trainer draws (no chunks)."""


def plan_for_step(cfg: Config, step: int) -> tuple[list[int], list[int]]:
    """(trained steps, SDE steps) of ``step``; deterministic from the run seed.

    For the forward-process algorithms (``train.algorithm`` nft / awm) "trained" are the
    trainer's draw slots ``0 .. forward_timesteps - 1`` (not denoising steps: the trainer draws
    each slot's noise level itself) and every denoising step is SDE unless the sampler is an
    ODE; TSP owners are assigned to those slots as to timesteps.
    """
    t = cfg.train
    if t.algorithm in FORWARD_ALGORITHMS:
        sde = list(range(cfg.sampler.num_steps)) if cfg.sampler.sde_type != "ode" else []
        return list(range(t.forward_timesteps)), sde
    plan = select_timesteps(t.timesteps, cfg.sampler.num_steps, fraction=t.timestep_fraction,
                            window_size=t.window_size, window_lo=t.window_lo,
                            window_hi=t.window_hi,
                            rng=random.Random(stable_int("timesteps", cfg.run.seed, step)),
                            step=step, shift_every=t.window_shift_every, stride=t.window_stride,
                            decay=t.window_shift_decay, decay_from=t.window_decay_from)
    sde = list(plan.sde) if cfg.sampler.sde_type != "ode" else []
    return list(plan.trained), sde
