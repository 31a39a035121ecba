"""Generate one fragment: the work a rollout node (or a TAG helper) does for an Assign.

Shared by the rollout actor and trainer-assisted generation so both produce byte-identical
chunks for the same task. ``FragmentJob.steps()`` yields each trained denoising step the
moment it is computed (the caller streams it); ``finish()`` decodes and scores after the
last step, and its result carries the final latents (what the forward-process algorithms
train on: their jobs have no trained steps to yield). All torch work here is synchronous; actors run it in a thread.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from digenrl.config import Config
from digenrl.data.prompts import prompt_images
from digenrl.models.base import Cond, FlowModel, cond_repeat, encode_inputs
from digenrl.rl.rewards import Reward
from digenrl.rl.sampler import StepRecord, rollout, seeded_generators


@dataclass
class FragmentResult:
    rewards: list[float]
    reward_terms: dict[str, list[float]]
    cond: Cond
    images: torch.Tensor
    gen_seconds: float
    final: torch.Tensor  # the clean latents (B, ...), wire-dtype values in float32

    def to_host(self) -> FragmentResult:
        """``cond`` and ``images`` copied to the host (what a Commit carries on the wire); a
        rollout calls it on its compute thread, never on the event loop."""
        from digenrl.devices import host

        return dataclasses.replace(self, cond={k: host(v).contiguous() for k, v in self.cond.items()},
                                   images=host(self.images))


@dataclass
class FragmentJob:
    """One fragment of ``len(prompts)`` groups x ``group_size`` trajectories."""

    model: FlowModel
    cfg: Config
    prompts: Sequence[str]
    seeds: Sequence[int]
    sde_steps: Sequence[int]
    trained_steps: Sequence[int]
    reward_fn: Reward | None  # None: decode only (reward workers score elsewhere)
    metadata: Sequence[Mapping[str, Any]] | None = None  # per prompt; None: {"prompt": text}
    _final: torch.Tensor | None = field(default=None, init=False)
    _cond: Cond | None = field(default=None, init=False)
    _t0: float = field(default=0.0, init=False)

    def steps(self) -> Iterator[StepRecord]:
        """Yield the records of the trained steps, in denoising order, as they are produced."""
        self._t0 = time.perf_counter()
        g = self.cfg.train.group_size
        cond = cond_repeat(encode_inputs(self.model, list(self.prompts), self.input_images()), g)
        self._cond = cond
        trained = set(self.trained_steps)
        for rec in rollout(self.model, cond, generator=seeded_generators(self.seeds),
                           sampler_cfg=self.cfg.sampler, sde_steps=set(self.sde_steps)):
            self._final = rec.x_next
            if rec.index in trained:
                yield rec

    def input_images(self) -> list[list[str]] | None:
        """Each prompt's input image paths (an edit prompt set), or None: text only."""
        images = None if self.metadata is None else [prompt_images(m) for m in self.metadata]
        return images if images is not None and any(images) else None

    def start_batched(self, cond: Cond) -> None:
        """Generation by a step batcher (``rl/batching.py``) instead of :meth:`steps`: ``cond``
        is the fragment's conditioning (each prompt's row repeated ``group_size`` times)."""
        self._t0 = time.perf_counter()
        self._cond = cond

    def record_batched(self, rec: StepRecord) -> bool:
        """One of this fragment's steps from the batcher; True when it is a trained step."""
        self._final = rec.x_next
        return rec.index in set(self.trained_steps)

    def finish(self, images: torch.Tensor | None = None) -> FragmentResult:
        """Decode the final latents and score them (after the last step; without a reward_fn
        the rewards are empty and a reward worker scores the images). ``images``: the final
        latents already decoded (a step batcher decodes the fragments that finish together in
        one call)."""
        assert self._final is not None and self._cond is not None, "steps() must run first"
        g = self.cfg.train.group_size
        if images is None:
            images = self.model.decode(self._final)
        prompts = [p for p in self.prompts for _ in range(g)]
        meta = None if self.metadata is None else [m for m in self.metadata for _ in range(g)]
        terms: dict[str, torch.Tensor]
        if self.reward_fn is None:
            total, terms = torch.zeros(0), {}
        else:
            total, terms = self.reward_fn(images, prompts, meta)
        return FragmentResult(
            rewards=[float(r) for r in total],
            reward_terms={k: [float(x) for x in v] for k, v in terms.items()},
            cond=self._cond,
            images=images,
            gen_seconds=time.perf_counter() - self._t0,
            final=self._final,
        )

    def run_all(self) -> tuple[dict[int, StepRecord], FragmentResult]:
        """Generate without streaming (colocated loop, tests)."""
        records = {rec.index: rec for rec in self.steps()}
        return records, self.finish()
