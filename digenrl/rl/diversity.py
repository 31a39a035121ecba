"""Within-prompt diversity: how different one prompt's evaluation samples are from each other.

GRPO on images is known to collapse what a prompt's samples look like (one pose, one size,
one place) while the reward rises; the reward cannot show it, so evaluation measures it. For
each test prompt with several samples (``eval.samples_per_prompt`` >= 2), the mean pairwise
Euclidean distance between its samples' L2-normalised features; the metric is the mean over
prompts (0: identical samples; at most 2). Features come from:

* ``eval.diversity = "judge"``: the shipped eval judge's last convolution map (4 x 4 positions
  x 40 channels for its 32 x 32 input), flattened: it sees what the judge sees (shape, colour,
  background) and, before the judge pools it away, where and how large the shape is;
* a path: a local transformers CLIP folder (``CLIPModel``, or a ``CLIPVisionModelWithProjection``
  / ``CLIPVisionModel``), its normalised image embedding, for real models;
* ``"auto"`` (the default): the judge when the evaluation scores with a shapes term, otherwise
  none; ``"off"``: none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch

from digenrl.config import Config
from digenrl.rl.rewards import RewardError
from digenrl.rl.rewards.judge import conv_features, load_judge, spread_per_sample
from digenrl.rl.rewards.local import clip_pixels

Features = Callable[[torch.Tensor], torch.Tensor]
"""uint8 images (N, 3, H, W) -> float32 features (N, F), on the CPU."""

_SHAPES_TERMS = ("shapes_attributes", "shapes_judge")
_BATCH = 64


def within_prompt_diversity(features_NF: torch.Tensor, prompt_index: Sequence[int]) -> float:
    """Mean over prompts of the mean pairwise distance between that prompt's L2-normalised
    feature rows; prompts with one sample do not count. NaN when no prompt has two."""
    index = list(prompt_index)
    spread = spread_per_sample(features_NF, index)  # each sample's mean distance to the others
    per_prompt = [float(spread[[i for i, k in enumerate(index) if k == p]].mean())
                  for p in dict.fromkeys(index) if index.count(p) > 1]
    return sum(per_prompt) / len(per_prompt) if per_prompt else float("nan")


def judge_features(which: str = "eval") -> Features:
    """The shapes judge's last convolution map, flattened (see the module docstring)."""
    load_judge(which)  # a missing judge file fails here, not at the first evaluation
    return functools.partial(conv_features, which=which)


def _clip_arch(folder: str | Path) -> str:
    """The CLIP class a folder's config.json names; RewardError naming the folder otherwise."""
    import json

    config = Path(folder) / "config.json"
    try:
        arch = (json.loads(config.read_text()).get("architectures") or ["CLIPModel"])[0]
    except (OSError, ValueError, AttributeError):
        raise RewardError(f"eval.diversity = {str(folder)!r}: expected \"auto\", \"judge\", \"off\" or a "
                          "local CLIP folder (a readable config.json + weights)") from None
    if arch not in _CLIP_CLASSES:
        raise RewardError(f"eval.diversity = {str(folder)!r}: a {arch} folder; expected one of "
                          f"{', '.join(_CLIP_CLASSES)}")
    return str(arch)


_CLIP_CLASSES = ("CLIPModel", "CLIPVisionModelWithProjection", "CLIPVisionModel")


def check_diversity(cfg: Config) -> None:
    """Refuse, before any process starts, an ``eval.diversity`` folder that is not a CLIP folder."""
    if cfg.eval.diversity not in ("auto", "judge", "off"):
        _clip_arch(cfg.eval.diversity)


def clip_features(folder: str, device: str = "cpu") -> Features:
    """A local CLIP folder's normalised image embedding (``CLIPModel`` or a CLIP vision model);
    loaded once per process and device."""
    return _clip_features(str(folder), str(device))


@cache
def _clip_features(folder: str, device: str) -> Features:
    arch = _clip_arch(folder)
    import transformers
    model = getattr(transformers, arch).from_pretrained(str(folder), local_files_only=True)
    dev = torch.device(device)
    model = model.to(dev).eval().requires_grad_(False)
    vision_cfg = model.config.vision_config if arch == "CLIPModel" else model.config
    size = int(vision_cfg.image_size)
    dtype = next(model.parameters()).dtype

    @torch.no_grad()
    def features(images: torch.Tensor) -> torch.Tensor:
        out = []
        for i in range(0, images.shape[0], _BATCH):
            x = clip_pixels(images[i:i + _BATCH], size, dev, dtype)
            if arch == "CLIPModel":
                e = model.visual_projection(model.vision_model(pixel_values=x).pooler_output)
            elif arch == "CLIPVisionModelWithProjection":
                e = model(pixel_values=x).image_embeds
            else:
                e = model(pixel_values=x).pooler_output
            out.append(e.float().cpu())
        return torch.cat(out)
    return features


def diversity_features(cfg: Config, device: Any = None) -> Features | None:
    """The feature map ``eval.diversity`` names, or None when diversity is not measured
    (``off``, ``auto`` without a shapes term, or one sample per prompt)."""
    choice = cfg.eval.diversity
    if choice == "off" or cfg.eval.samples_per_prompt < 2:
        return None
    if choice == "auto":
        terms = cfg.eval.terms or cfg.reward.terms
        return judge_features() if any(t.name in _SHAPES_TERMS for t in terms) else None
    if choice == "judge":
        return judge_features()
    return clip_features(choice, str(device or "cpu"))
