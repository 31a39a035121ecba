"""What a step's settings cost in memory, estimated from the config before anything is built.

The launcher refuses a setting whose estimate cannot fit (:func:`check_footprint`) with one line
naming the keys and the estimate, instead of a process that exhausts memory or swaps for an
hour. The estimates are lower bounds of the buffers the settings size directly, not a profile:

* a fragment's latents, what a rollout streams and a trainer rank holds at least at once
  (``runtime.byte_window_mb`` bounds what is in flight beyond it): prompts_per_step /
  fragments_per_step x group_size trajectories, each (x_t, x_next) per trained denoising step
  in the wire dtype (the final latents alone for nft / awm) -- the whole step's B trajectories
  when a mode cuts no fragments;
* the evaluation: every sample's decoded image (uint8, kept for the scores and the grid) and one
  batch's latents;
* LoRA: a rank past the transformer's width adds parameters without adding capacity;
* ``model.free_text_encoders``: the table of every prompt's conditioning, for the families
  whose encoders give every prompt the same token count, against ``model.text_cache_mb``.

What is compared is this host's physical memory: a step's buffers do not fit a cluster's GPUs
if they do not fit in one host's memory either.
"""

from __future__ import annotations

import os
from math import prod
from typing import Any

from digenrl.config import Config, ConfigError

VAE_PIXELS_PER_LATENT = 64
"""Pixels per latent position (an 8x8 VAE); video's time factor is left out (a lower bound)."""


def host_memory_bytes() -> int:
    """This host's physical memory (0 where the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def transformer_width(cfg: Config) -> int | None:
    """The transformer's hidden width (heads x head dim) from its config; None if unknown."""
    if cfg.model.path == "emulated":
        return None
    from digenrl.models.meta import transformer_config
    config: dict[str, Any] = transformer_config(cfg.model)[0]
    heads, dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    if isinstance(heads, int) and isinstance(dim, int):
        return heads * dim
    width = config.get("dim")  # Z-Image names its width
    return width if isinstance(width, int) else None


def step_footprint(cfg: Config, latent_shape: tuple[int, ...], test_prompts: int = 0) -> dict[str, int]:
    """Estimated bytes of the buffers the settings size, by the keys that size them.
    ``test_prompts``: prompts in the test split (0 when unknown)."""
    from digenrl.core.plan import plan_for_step
    numel = prod(latent_shape)
    elem = 2 if cfg.sampler.wire_dtype == "bfloat16" else 4
    trained = max(1, len(plan_for_step(cfg, 0)[0]))
    per_sample = numel * elem * (1 if cfg.train.algorithm != "grpo" else 2 * trained)
    fragments = cfg.runtime.fragments_per_step
    key = "train.prompts_per_step x train.group_size" + (
        f" / runtime.fragments_per_step ({fragments})" if fragments > 1 else "")
    out = {key: cfg.batch_size // fragments * per_sample}
    if cfg.run.eval_every:
        n = min(cfg.eval.prompts or test_prompts, test_prompts or cfg.eval.prompts)
        pixels = numel // max(1, latent_shape[0]) * VAE_PIXELS_PER_LATENT
        out["eval.prompts x eval.samples_per_prompt"] = n * cfg.eval.samples_per_prompt * 3 * pixels
        out["eval.batch_size"] = cfg.eval.batch_size * numel * 4 * 3  # x, velocity, x_next
    return out


def check_footprint(cfg: Config, latent_shape: tuple[int, ...], *, test_prompts: int = 0,
                    available: int | None = None) -> None:
    """ConfigError (one line: the keys, the estimate, what there is) for a setting that cannot fit."""
    rank = cfg.model.lora_rank
    width = transformer_width(cfg) if rank else None
    if width is not None and rank > width:
        raise ConfigError(f"model.lora_rank = {rank}: more than the transformer's width {width} "
                          f"({cfg.model.family}, model.path = {cfg.model.path!r}); a LoRA rank is at "
                          "most the width of the layers it adapts")
    have = host_memory_bytes() if available is None else available
    if not have:
        return
    for keys, need in step_footprint(cfg, latent_shape, test_prompts).items():
        if need > have:
            raise ConfigError(f"{keys}: these buffers alone take about {gib(need)} (latent shape "
                              f"{list(latent_shape)}), more than this host's {gib(have)} of memory")


#: Families whose pipeline gives every prompt the same token count: the tokens beyond
#: ``model.max_text_tokens`` (SD3 joins CLIP's 77 before T5's), and the transformer config key
#: of the token width. The others pad a prompt to its own length (no fixed lower bound).
FIXED_TEXT = {"sd3": (77, "joint_attention_dim"), "flux": (0, "joint_attention_dim"),
              "flux_kontext": (0, "joint_attention_dim"), "flux2": (0, "joint_attention_dim"),
              "wan": (0, "text_dim")}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def text_table_bytes(cfg: Config, prompts: int) -> int:
    """A lower bound of the bytes ``model.free_text_encoders``' table takes for ``prompts``
    prompts (each prompt's token embeddings; masks and pooled vectors left out); 0 where the
    setting is off, the model has no pipeline text encoders, or its rows vary in length."""
    from digenrl.models.meta import transformer_config
    from digenrl.models.text import DEFAULT_TEXT_TOKENS

    m = cfg.model
    if (not m.free_text_encoders or m.family not in FIXED_TEXT or m.text_encoder == "hash"
            or m.path in ("random", "emulated") or (m.path == "builtin" and m.text_encoder == "auto")):
        return 0
    config, pipeline = transformer_config(m)
    extra, key = FIXED_TEXT[m.family]
    width = config.get(key)
    if not pipeline or not isinstance(width, int):
        return 0
    tokens = extra + (m.max_text_tokens or DEFAULT_TEXT_TOKENS[m.family])
    return prompts * tokens * width * DTYPE_BYTES[m.dtype]


def check_text_table(cfg: Config, prompts: int) -> None:
    """ConfigError (one line) when ``model.free_text_encoders``' table cannot fit its budget;
    ``prompts``: the distinct prompts of the run's train and test sets."""
    need = text_table_bytes(cfg, prompts)
    budget = cfg.model.text_cache_mb << 20
    if need > budget:
        raise ConfigError(f"model.free_text_encoders = true: the conditioning of the run's {prompts} prompts "
                          f"takes at least {need / 2**20:.3g} MiB of host memory, above "
                          f"model.text_cache_mb = {cfg.model.text_cache_mb}; raise model.text_cache_mb or "
                          "set model.free_text_encoders = false")
