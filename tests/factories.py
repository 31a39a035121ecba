"""The builders tests share: a run's config, and the data-plane messages a rollout sends.

Each builder sets every field to a value an honest peer could send and takes keywords for
what a test varies, so a field added to a message or a config section is added here once.
``tests/hostile.py`` builds its chunks and commits with these too (mypy checks both files).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from digenrl.config import Config, load_config, resolve_mode
from digenrl.transport.protocol import Chunk, CleanSample, Commit, JSONDict


def tiny_config(*sets: str, mode: str | None = None) -> Config:
    """The suite's tiny run (``tests/conftest.py`` SMALL) with ``sets`` after it; resolved for
    ``mode`` when one is given (as ``digenrl launch --mode`` would)."""
    from tests.conftest import SMALL  # not at import: bench/faults.py imports hostile.py, then this
    cfg = load_config(None, [*SMALL, *sets])
    return resolve_mode(cfg, mode) if mode is not None else cfg


def batch_config(steps: int, prompts: int, group: int, *sets: str) -> Config:
    """The embedded config with one fragment per step of ``prompts`` x ``group`` trajectories
    and ``steps`` denoising steps (the loss tests' batches), then ``sets``."""
    return load_config(None, [f"sampler.num_steps={steps}", f"train.prompts_per_step={prompts}",
                              f"train.group_size={group}", "runtime.fragments_per_step=1", *sets])


def chunk(task_id: int = 1, step: int = 0, fragment: int = 0, t_index: int = 0, *,
          x_t: torch.Tensor | None = None, x_next: torch.Tensor | None = None,
          log_prob: torch.Tensor | None = None, sigma: float = 0.9, sigma_next: float = 0.8,
          policy_version: int = 0) -> Chunk:
    """One denoising step of ``x_t.shape[0]`` trajectories (default: 2 of 4 zeros); ``x_next``
    defaults to ``x_t``, ``log_prob`` to one zero per trajectory."""
    x = torch.zeros(2, 4) if x_t is None else x_t
    return Chunk(task_id=task_id, step=step, fragment=fragment, t_index=t_index, sigma=sigma,
                 sigma_next=sigma_next, policy_version=policy_version, x_t=x,
                 x_next=x if x_next is None else x_next,
                 log_prob=torch.zeros(x.shape[0]) if log_prob is None else log_prob)


def commit(task_id: int = 1, step: int = 0, fragment: int = 0, *, node_id: str = "rollout-0", n: int = 2,
           rewards: Sequence[float] | None = None, prompt_ids: list[int] | None = None, policy_version: int = 0,
           reward_terms: JSONDict | None = None, cond: dict[str, torch.Tensor] | None = None,
           images: torch.Tensor | None = None, gen_seconds: float = 0.1, discard: str = "") -> Commit:
    """A fragment's commit: ``n`` trajectories rewarded 0.5 each unless ``rewards`` are given."""
    return Commit(task_id=task_id, step=step, fragment=fragment, node_id=node_id, policy_version=policy_version,
                  prompt_ids=[0] if prompt_ids is None else prompt_ids,
                  rewards=[0.5] * n if rewards is None else list(rewards),
                  reward_terms={} if reward_terms is None else reward_terms, gen_seconds=gen_seconds,
                  cond={} if cond is None else cond,
                  images=torch.zeros(0, dtype=torch.uint8) if images is None else images, discard=discard)


def clean_sample(task_id: int = 1, step: int = 0, fragment: int = 0, *, x0: torch.Tensor | None = None,
                 policy_version: int = 0) -> CleanSample:
    """A forward-process fragment's clean latents (default: 4 of 2 x 3 zeros, bfloat16)."""
    return CleanSample(task_id=task_id, step=step, fragment=fragment, policy_version=policy_version,
                       x0=torch.zeros(4, 2, 3, dtype=torch.bfloat16) if x0 is None else x0)
