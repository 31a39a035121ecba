"""The cheap built-in rewards: JPEG size and pixel statistics (no model weights, offline).

Each is a plain function ``(images uint8 (B, 3, H, W), prompts) -> float32 (B,)``; the table
of what each computes is in :mod:`digenrl.rl.rewards`.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence

import torch
from PIL import Image

from digenrl.data.shapes import BACKGROUND_WORDS, COLOURS
from digenrl.rl.rewards.base import RewardError


def _jpeg_kb(images: torch.Tensor) -> torch.Tensor:
    sizes = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img.permute(1, 2, 0).contiguous().numpy()).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


def jpeg_compressibility(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """``-kB`` of each image saved as JPEG at quality 95 (higher = more compressible)."""
    return -_jpeg_kb(images)


def jpeg_incompressibility(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """``+kB`` of each image saved as JPEG at quality 95 (higher = more detail / noise)."""
    return _jpeg_kb(images)


def _rgb(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = images.float() / 255.0
    return x[:, 0], x[:, 1], x[:, 2]


def brightness(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """Mean BT.709 luma of the sRGB values, in [0, 1]."""
    r, g, b = _rgb(images)
    return (0.2126 * r + 0.7152 * g + 0.0722 * b).mean(dim=(1, 2))


def saturation(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """Mean HSV saturation, in [0, 1] (black pixels count as 0)."""
    x = images.float()
    mx, mn = x.amax(dim=1), x.amin(dim=1)
    return torch.where(mx > 0, (mx - mn) / mx.clamp_min(1e-6), torch.zeros_like(mx)).mean(dim=(1, 2))


def colourfulness(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """Hasler & Suesstrunk colourfulness M / 100 (0 for grey images)."""
    x = images.float()
    rg = x[:, 0] - x[:, 1]
    yb = 0.5 * (x[:, 0] + x[:, 1]) - x[:, 2]
    std = torch.sqrt(rg.flatten(1).var(dim=1, unbiased=False) + yb.flatten(1).var(dim=1, unbiased=False))
    mean = torch.sqrt(rg.flatten(1).mean(dim=1) ** 2 + yb.flatten(1).mean(dim=1) ** 2)
    return (std + 0.3 * mean) / 100.0


def redness(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """Mean ``(R - (G + B) / 2)``, in [-0.5, 1]."""
    r, g, b = _rgb(images)
    return (r - 0.5 * (g + b)).mean(dim=(1, 2))


def pixel_std(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """Spatial standard deviation of each image's values / 255 (per channel, averaged over R, G,
    B), in [0, 0.5].

    Not a reward to train on: an evaluation term that shows collapse (an image erased to a flat
    colour field scores 0), e.g. ``[eval] terms = [..., { name = "pixel_std" }]``.
    """
    return images.float().flatten(2).std(dim=2).mean(dim=1) / 255.0


_COLOUR_OF_WORD = {**{c: c for c in COLOURS}, **{w: c for c, w in BACKGROUND_WORDS.items()}}
_COLOUR_WORD = re.compile(r"\b(" + "|".join(_COLOUR_OF_WORD) + r")\b")
_MAX_RGB_DIST = math.sqrt(3) * 255.0
#: The shape is scored on its best-matching 5% of pixels, the background on its best 50%:
#: the smallest shapes of the data set cover about 6% of the image, backgrounds at least 55%.
SHAPE_FRACTION = 0.05
BACKGROUND_FRACTION = 0.5


def prompt_colours(prompt: str) -> list[str]:
    """Colours named in ``prompt`` in order of appearance ("blue" and "bluish" both name blue)."""
    return [_COLOUR_OF_WORD[w] for w in _COLOUR_WORD.findall(prompt.lower())]


def _best_closeness(pixels: torch.Tensor, rgb: tuple[int, int, int], fraction: float) -> torch.Tensor:
    """Mean closeness (1 - distance / max distance) of the best ``fraction`` of pixels (N, 3)."""
    dist = (pixels - torch.tensor(rgb, dtype=torch.float32)).norm(dim=1)
    k = max(1, round(fraction * pixels.shape[0]))
    return 1.0 - torch.topk(dist, k, largest=False).values.mean() / _MAX_RGB_DIST


def prompt_colour_match(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """How well the pixels show the colours the prompt names, in [0, 1].

    The first colour word is the shape's, the second the background's ("a red triangle on a
    bluish background"; "blue" works too). The shape term is the mean closeness to the shape colour of the 5% of
    pixels nearest to it (so a shape of that colour must be there); the background term is the
    same over the best 50% of pixels (so the background colour must dominate). The reward is
    their mean (only the shape term when the prompt names one colour). Closeness is
    ``1 - |rgb - named| / (sqrt(3) * 255)``. A prompt naming no colour is an error: this reward
    is for the shapes world and would otherwise be silently constant.
    """
    out = torch.empty(images.shape[0], dtype=torch.float32)
    pixels_all = images.float().flatten(2).transpose(1, 2)  # (B, H*W, 3)
    for i, prompt in enumerate(prompts):
        named = prompt_colours(prompt)
        if not named:
            raise RewardError(
                f"prompt_colour_match: prompt {prompt!r} names no colour; expected one of "
                f"{', '.join(COLOURS)}")
        score = _best_closeness(pixels_all[i], COLOURS[named[0]], SHAPE_FRACTION)
        if len(named) > 1:
            bg = _best_closeness(pixels_all[i], COLOURS[named[1]], BACKGROUND_FRACTION)
            score = 0.5 * (score + bg)
        out[i] = score
    return out


STATS = {
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "brightness": brightness,
    "saturation": saturation,
    "colourfulness": colourfulness,
    "redness": redness,
    "pixel_std": pixel_std,
    "prompt_colour_match": prompt_colour_match,
}
