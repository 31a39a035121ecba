"""Video rewards: how many frames a model's samples hold, and the temporal-consistency term.

A video family's decoded sample is its frames side by side (``models/pixels.py``); the reward
framework (:mod:`digenrl.rl.rewards.base`) needs the frame count to take them apart again, for
``per_frame`` image terms and for terms that take ``frames`` (B, T, H, W, 3). Every builder of
a run's reward passes :func:`video_frames` of the model config.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch

from digenrl.config import ModelConfig

__all__ = ["temporal_consistency", "video_frames"]


def video_frames(model_cfg: ModelConfig) -> int:
    """Frames side by side in one decoded sample of ``model_cfg``: ``model.num_frames`` or the
    family's default (its pipeline's, or the tiny models' 2) for wan and hunyuanvideo, 1 for
    image families and for emulated models (whose decode shows frame 0). Reads config files
    only, like :func:`digenrl.models.meta.latent_shape_of`."""
    from digenrl.models import catalog, meta

    if model_cfg.path == "emulated":
        return 1
    config, pipeline = meta.transformer_config(model_cfg)
    vae = SimpleNamespace(config=SimpleNamespace(**meta.vae_config(model_cfg))) if pipeline else None
    geometry = catalog.GEOMETRY[model_cfg.family](SimpleNamespace(**config), vae)
    return (model_cfg.num_frames or geometry.default_frames) if geometry.video else 1


def temporal_consistency(frames: torch.Tensor, prompts: Sequence[str], size: int = 32) -> torch.Tensor:
    """How alike consecutive frames are, in [0, 1] (1: a still video).

    Space: each frame's RGB values in [0, 1], area-averaged down to at most ``size`` pixels on
    its longer side (so that a few pixels' noise or a one-pixel shift counts for little and a
    change of content for much); the similarity of two frames is 1 - their mean absolute
    difference; the term is the mean over the T - 1 consecutive pairs (a 1-frame sample: 1).
    ``frames``: uint8 (B, T, H, W, 3). Pair it with a per-frame image term: it alone rewards a
    video that does not move.
    """
    if size < 1:
        raise ValueError(f"temporal_consistency: size = {size}: expected at least 1 pixel")
    b, t, h, w, _ = frames.shape
    if t < 2:
        return torch.ones(b)
    x = frames.permute(0, 1, 4, 2, 3).reshape(b * t, 3, h, w).float() / 255.0
    if max(h, w) > size:
        scale = size / max(h, w)
        x = torch.nn.functional.adaptive_avg_pool2d(x, (max(1, round(h * scale)), max(1, round(w * scale))))
    x = x.reshape(b, t, *x.shape[1:])
    return 1.0 - (x[:, 1:] - x[:, :-1]).abs().mean(dim=(2, 3, 4)).mean(dim=1)
