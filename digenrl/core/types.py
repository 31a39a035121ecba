"""Parameters and commands of :mod:`digenrl.core.scheduler` (plain data, torch-free)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from digenrl.config import ResolvedConfig
from digenrl.core.plan import DEFAULT_GPU_SPEEDS

Role = Literal["rollout", "trainer", "reward"]


class SchedulerError(ValueError):
    """An event a peer or user caused is invalid; the message names the bad value."""


@dataclass(frozen=True, kw_only=True)
class SchedulerParams:
    """Plain numbers the scheduler needs; build from a config with :meth:`from_config`."""

    steps: int
    prompts_per_step: int
    group_size: int
    fragments_per_step: int
    staleness: int
    trainer_ranks: int
    tsp: bool
    sequence_parallel: int = 1
    """Trainer ranks per sequence-parallel group (``train.sequence_parallel``): owners are
    group leaders (:func:`~digenrl.core.plan.owners_for`)."""
    tag: Literal["bts", "always", "never"]
    lease_s: float
    heartbeat_timeout: float
    byte_window: int
    bytes_per_trajectory: int
    num_steps_T: int
    seed: int
    prompt_count: int
    max_outstanding: int = 2
    """Uncommitted fragments a rollout node may hold (running + queued)."""
    running_per_node: int = 1
    """Fragments a rollout node generates at once: 1, or with step-level batching
    ``sampler.max_batch // fragment rows`` (their leases run together)."""
    speeds: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_GPU_SPEEDS))
    """Relative generation speed per GPU type; unknown types count as 1.0."""
    switch_s: float = 1.0
    """BTS: seconds a trainer loses switching to generation and back."""
    ewma_alpha: float = 0.3
    lease_factor: float = 4.0
    """A lease also stretches to this many times the node's measured seconds per fragment
    (its EWMA): a slow or large-image rollout is not re-assigned for being slow. 0 = fixed."""
    fault_limit: int = 3
    """Consecutive consumed fragments of one node holding non-finite values that make it broken."""
    fault_action: Literal["drop", "stop"] = "drop"
    """A broken node: "drop" (lost, its work reassigned; the run stops when it is the last
    rollout, or a trainer) or "stop" (the run stops, naming it)."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "fragments_per_step",
                     "trainer_ranks", "num_steps_T", "prompt_count", "max_outstanding", "fault_limit",
                     "running_per_node"):
            if getattr(self, name) < 1:
                raise SchedulerError(f"{name} = {getattr(self, name)!r}: expected >= 1")
        for name in ("lease_s", "heartbeat_timeout"):
            if not getattr(self, name) > 0:
                raise SchedulerError(f"{name} = {getattr(self, name)!r}: expected > 0")
        if self.running_per_node > self.max_outstanding:
            raise SchedulerError(f"running_per_node = {self.running_per_node}: expected at most "
                                 f"max_outstanding = {self.max_outstanding}")
        if self.fault_action not in ("drop", "stop"):
            raise SchedulerError(f"fault_action = {self.fault_action!r}: expected 'drop' or 'stop'")
        if self.tag not in ("bts", "always", "never"):
            raise SchedulerError(f"tag = {self.tag!r}: expected 'bts', 'always' or 'never'")
        if not self.lease_factor >= 0 or math.isinf(self.lease_factor):
            raise SchedulerError(f"lease_factor = {self.lease_factor!r}: expected finite >= 0")
        if not 0 < self.ewma_alpha <= 1 or self.switch_s < 0:
            raise SchedulerError(f"ewma_alpha = {self.ewma_alpha!r}, switch_s = {self.switch_s!r}:"
                                 " expected 0 < alpha <= 1 and switch_s >= 0")

    @classmethod
    def from_config(cls, cfg: ResolvedConfig, *, prompt_count: int,
                    bytes_per_trajectory: int) -> SchedulerParams:
        """Params for a resolved config (its mode's K, fragments, TSP and TAG)."""
        rt = cfg.runtime
        frag_rows = cfg.train.prompts_per_step // rt.fragments_per_step * cfg.train.group_size
        running = max(1, cfg.sampler.max_batch // frag_rows)  # max_batch = 0: one at a time
        return cls(steps=cfg.run.steps, prompts_per_step=cfg.train.prompts_per_step,
                   max_outstanding=running + 1, running_per_node=running,
                   group_size=cfg.train.group_size, fragments_per_step=rt.fragments_per_step,
                   staleness=rt.staleness, trainer_ranks=cfg.cluster.trainers, tsp=rt.tsp,
                   sequence_parallel=cfg.train.sequence_parallel,
                   tag=rt.tag, lease_s=rt.lease_s, lease_factor=rt.lease_factor,
                   heartbeat_timeout=rt.heartbeat_s * rt.heartbeat_misses,
                   byte_window=max(1, int(rt.byte_window_mb * 2**20)),
                   bytes_per_trajectory=bytes_per_trajectory, num_steps_T=cfg.sampler.num_steps,
                   seed=cfg.run.seed, prompt_count=prompt_count, switch_s=rt.tag_switch_s,
                   fault_limit=cfg.run.node_fault_limit, fault_action=cfg.run.node_fault_action)


@dataclass(frozen=True, kw_only=True)
class AssignCmd:
    """Generate fragment ``fragment`` of step ``step`` (task ``task_id``) on ``node_id``."""

    node_id: str
    task_id: int
    step: int
    fragment: int
    prompt_ids: tuple[int, ...]
    """One per GRPO group in the fragment."""
    seeds: tuple[int, ...]
    """Per trajectory, group-major: seeds[p * group_size + g]."""
    group_size: int
    version_floor: int
    """Generate with a policy version >= this (fetch weights first if behind): max(0, step - K)."""
    lease_s: float
    trained_steps: tuple[int, ...]
    sde_steps: tuple[int, ...]
    owners: tuple[int, ...]
    """owners[i] = trainer rank that trains timestep trained_steps[i] (chunks go there)."""


@dataclass(frozen=True, kw_only=True)
class RevokeCmd:
    """Attempt ``task_id`` held by ``node_id`` is dead (reason: node_lost, lease_expired, stale)."""

    node_id: str
    task_id: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class ShutdownCmd:
    """The run is over: "done" (all steps trained), "trainer_lost: ..." (rewound to a
    checkpoint) or "failed: ..." (stopped with that one-line error: a broken node)."""

    reason: str


Command = AssignCmd | RevokeCmd | ShutdownCmd
