"""BTS: the makespan predictor that decides whether a waiting trainer should generate.

A trainer that offers help (TAG) takes one fragment of ``h`` trajectories. While it
generates it cannot train, and switching roles costs ``switch_s`` (weights and memory).
The predictor compares when the step would finish with and without that helper:

    G   = now + gen_remaining / rollout_rate                (rollouts generate everything)
    T   = train_remaining * train_spt / groups              (groups train fragments at once)
    without = max(now + T,                                  (trainer-bound)
                  G + h * train_spt)                        (the last fragment still trains)

    H   = switch_s + h * trainer_gen_spt                    (the helper's detour)
    G'  = now + (gen_remaining - h) / rollout_rate          (rollouts do the rest)
    with = max(now + H + T, G' + h * train_spt, now + H + h * train_spt)

``spt`` = seconds per trajectory (measured EWMAs, or priors from the GPU table);
``train_spt`` is one owner group's time per trajectory of a fragment, and ``groups`` the
TSP x DP groups that train different fragments in parallel. No
rollout capacity (colocated mode) makes G infinite, so any helper shortens the step.
The same functions serve the simulator's planner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class StepForecast:
    """Inputs of the BTS predictor, in trajectories and seconds."""

    now: float
    gen_remaining: int
    """Trajectories of steps up to the helper fragment's step not yet generated."""
    rollout_rate: float
    """Trajectories per second over all live rollout nodes (0 when there are none)."""
    train_remaining: int
    """Trajectories of steps v .. the helper fragment's step not yet trained."""
    train_spt: float
    """Seconds per trajectory for one owner group to train a fragment (its slowest rank; 0
    until measured)."""
    trainer_gen_spt: float
    """Seconds per trajectory when this trainer generates."""
    switch_s: float
    """Cost of switching a trainer to generation and back."""
    helper_traj: int
    """Trajectories in the fragment the helper would take."""
    train_groups: int = 1
    """Owner groups training different fragments at once (TSP x DP; 1 = one group)."""


def _gen_end(now: float, trajectories: int, rate: float) -> float:
    if trajectories <= 0:
        return now
    return now + trajectories / rate if rate > 0 else math.inf


def predict_step_finish(f: StepForecast, *, with_helper: bool) -> float:
    """Predicted time the step finishes training; see the module doc for the formula."""
    h = min(f.helper_traj, f.gen_remaining)
    train = f.train_remaining * f.train_spt / max(1, f.train_groups)
    if not with_helper:
        gen_end = _gen_end(f.now, f.gen_remaining, f.rollout_rate)
        return max(f.now + train, gen_end + h * f.train_spt)
    detour = f.switch_s + h * f.trainer_gen_spt
    gen_end = _gen_end(f.now, f.gen_remaining - h, f.rollout_rate)
    return max(f.now + detour + train,
               gen_end + h * f.train_spt,
               f.now + detour + h * f.train_spt)


def helper_shortens_step(f: StepForecast) -> bool:
    """BTS: grant TAG work only if it strictly shortens the predicted step."""
    return predict_step_finish(f, with_helper=True) < predict_step_finish(f, with_helper=False)


def ewma(previous: float | None, sample: float, alpha: float) -> float:
    """Exponentially weighted mean; the first sample replaces the prior outright."""
    return sample if previous is None else (1 - alpha) * previous + alpha * sample
