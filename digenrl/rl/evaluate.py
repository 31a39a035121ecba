"""Held-out evaluation: the policy samples the test prompts with fixed seeds, deterministically.

As flow_grpo's evaluation: ODE sampling (no injected noise), ``eval.num_steps`` steps (default
the training sampler's), the training sampler's shift and guidance; each (test prompt, sample
k) has its own noise seed ``stable_int("eval", eval.seed, prompt index, k)``, independent of
``run.seed`` and of the batch it lands in, so every evaluation of a run -- and of runs with
other seeds -- sees the same noise for the same prompt. The scores are every value of the
``[eval] terms`` (default: the training reward's terms), unweighted.

:func:`evaluate` returns the metrics row's ``eval/`` entries (the mean of each value, keys in
docs/metrics.md) and writes, when given a run dir, ``samples/eval_v<version>.png`` (a grid of
the first :data:`GRID_MAX` samples) and ``eval/v<version>.jsonl`` (one line per sample: prompt
index, seed, every value), from which per-seed rates and standard errors are computed. With
several samples per prompt it also reports ``eval/diversity``, how different one prompt's
samples are from each other (:mod:`digenrl.rl.diversity`).

With an EMA of the weights (``train.ema_decay > 0``), :func:`evaluate_policy` scores the EMA
(``eval_ema/`` keys, ``samples/eval_ema_v<version>.png``, ``eval_ema/v<version>.jsonl``), the
trained policy, or both, per ``eval.policy``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from digenrl.config import Config, RewardTerm
from digenrl.core.plan import stable_int
from digenrl.data.prompts import PromptSet
from digenrl.fileio import write_text_atomic
from digenrl.models.base import FlowModel, encode_inputs
from digenrl.rl.diversity import diversity_features, within_prompt_diversity
from digenrl.rl.rewards import Reward, build_reward
from digenrl.rl.rewards.video import video_frames
from digenrl.rl.sampler import rollout, seeded_generators
from digenrl.telemetry.images import grid_array, save_grid
from digenrl.telemetry.tracking import grid_caption

if TYPE_CHECKING:
    from digenrl.rl.policy import Policy

GRID_MAX = 64
"""Samples shown in an evaluation's grid (the first ones, in prompt order)."""


def eval_terms(cfg: Config) -> list[RewardTerm]:
    """What evaluation scores: ``[eval] terms``, or the training reward's terms."""
    return list(cfg.eval.terms or cfg.reward.terms)


def build_eval_reward(cfg: Config, device: Any = None) -> Reward:
    """The evaluation reward; class terms that take a ``device`` get this one (the node's)."""
    return build_reward(eval_terms(cfg), device=device, frames=video_frames(cfg.model))


def eval_due(version: int, cfg: Config) -> bool:
    """Whether ``version`` is evaluated: 0, every ``run.eval_every`` versions, and the last."""
    every = cfg.run.eval_every
    return every > 0 and (version % every == 0 or version == cfg.run.steps)


def eval_samples(cfg: Config, test: PromptSet) -> list[tuple[int, int]]:
    """(prompt index, seed) of every evaluation sample, prompt-major."""
    n = min(len(test), cfg.eval.prompts) if cfg.eval.prompts else len(test)
    k = cfg.eval.samples_per_prompt
    return [(i, stable_int("eval", cfg.eval.seed, i, j)) for i in range(n) for j in range(k)]


def generate(model: FlowModel, cfg: Config, test: PromptSet) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Every evaluation sample's image (uint8 (N, 3, H, W), CPU) and its (prompt index, seed)."""
    sampler = dataclasses.replace(cfg.sampler, sde_type="ode",
                                  num_steps=cfg.eval.num_steps or cfg.sampler.num_steps)
    plan = eval_samples(cfg, test)
    out: list[torch.Tensor] = []
    for lo in range(0, len(plan), cfg.eval.batch_size):
        batch = plan[lo:lo + cfg.eval.batch_size]
        with torch.no_grad():
            cond = encode_inputs(model, [test.prompts[i] for i, _ in batch],
                                 [test.images[i] for i, _ in batch])  # edits: their input images
            x = None
            for rec in rollout(model, cond, generator=seeded_generators([s for _, s in batch]),
                               sampler_cfg=sampler, sde_steps=set()):
                x = rec.x_next
            assert x is not None  # num_steps >= 1
            out.append(model.decode(x).cpu())
    return torch.cat(out), plan


ShowGrid = Callable[[str, torch.Tensor, str], None]
"""Receives an evaluation's grid for the experiment trackers: (prefix, uint8 (H, W, 3), caption)."""


def evaluate(model: FlowModel, cfg: Config, test: PromptSet, reward: Reward | None, *,
             version: int, run_dir: Path | None = None, prefix: str = "eval",
             show: ShowGrid | None = None) -> dict[str, Any]:
    """Sample the test prompts with ``model`` and score them; the ``<prefix>/`` metrics.

    ``reward`` None: generate only (a sharded rank joining rank 0's forward passes); returns {}.
    ``prefix``: of the metric keys and files (``eval``: the policy's; ``eval_ema``: its EMA's).
    ``show``: also gets the grid (the first :data:`GRID_MAX` samples) and its prompts.
    """
    t0 = time.perf_counter()
    images, plan = generate(model, cfg, test)
    if reward is None:
        return {}
    prompts = [test.prompts[i] for i, _ in plan]
    values = reward.evaluate(images, prompts, [test.metadata[i] for i, _ in plan])
    metrics: dict[str, Any] = {f"{prefix}/{k}": float(v.double().mean()) for k, v in values.items()}
    features = diversity_features(cfg, images.device)
    if features is not None:
        metrics[f"{prefix}/diversity"] = within_prompt_diversity(features(images), [i for i, _ in plan])
    metrics[f"{prefix}/samples"] = len(plan)
    metrics[f"{prefix}/seconds"] = time.perf_counter() - t0
    k = cfg.eval.samples_per_prompt
    nrow = k if k > 1 else 8
    if show is not None:
        show(prefix, grid_array(images[:GRID_MAX], nrow), grid_caption(prompts[:GRID_MAX], nrow))
    if run_dir is not None:
        save_grid(images[:GRID_MAX], run_dir / "samples" / f"{prefix}_v{version:04d}.png", nrow=nrow)
        lines = [json.dumps({"version": version, "prompt_index": i, "prompt": test.prompts[i], "seed": s,
                             **{k_: float(v[n]) for k_, v in values.items()}})
                 for n, (i, s) in enumerate(plan)]
        (run_dir / prefix).mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / prefix / f"v{version:04d}.jsonl", "".join(x + "\n" for x in lines))
    return metrics


def eval_policies(cfg: Config) -> list[str]:
    """What ``eval.policy`` evaluates: ``policy`` (the trained weights) and/or ``ema``."""
    choice = cfg.eval.policy
    if choice == "auto":
        choice = "ema" if cfg.train.ema_decay > 0 else "policy"
    return ["policy", "ema"] if choice == "both" else [choice]


def evaluate_policy(policy: Policy, cfg: Config, test: PromptSet, reward: Reward | None, *,
                    version: int, run_dir: Path | None = None, show: ShowGrid | None = None) -> dict[str, Any]:
    """:func:`evaluate` of the trained weights (``eval/`` keys), of their EMA (``eval_ema/``,
    the EMA loaded into the model for the time of it), or both, per ``eval.policy``."""
    from digenrl.rl.ema import ema_weights

    row: dict[str, Any] = {}
    for which in eval_policies(cfg):
        if which == "policy":
            row.update(evaluate(policy.model, cfg, test, reward, version=version, run_dir=run_dir,
                                show=show))
        else:
            with ema_weights(policy):
                row.update(evaluate(policy.model, cfg, test, reward, version=version, run_dir=run_dir,
                                    prefix="eval_ema", show=show))
    return row
