"""Edit rewards: how an edited image relates to its input image.

``input_ssim(images, prompts, input_images, window=11, sigma=1.5)``: the structural similarity
(SSIM, Wang et al. 2004) of each output to its input image, computed in torch on the CPU: a
Gaussian window (``window`` px, at most the image's smaller side, ``sigma`` px), constants
``C1 = (0.01 * 255)^2`` and ``C2 = (0.03 * 255)^2`` on 0-255 values, the SSIM map averaged
over the valid positions and the three RGB channels. In [-1, 1]; 1 for an unchanged image.
It measures how much of the input an edit preserves; weigh it against a term that scores the
edit itself (the VLM judge, which also sees the input image), or the policy learns to change
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from digenrl.rl.rewards.base import RewardError


def _gaussian(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    return torch.outer(g, g)


def ssim(a: torch.Tensor, b: torch.Tensor, *, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Mean SSIM (B,) of uint8 or 0-255 float images ``a`` and ``b`` (B, C, H, W)."""
    if a.shape != b.shape or a.dim() != 4:
        raise ValueError(f"ssim: expected two (B, C, H, W) batches of one shape, got {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    size = min(window, a.shape[-2], a.shape[-1])
    size -= 1 - size % 2  # odd
    c = a.shape[1]
    k = _gaussian(size, sigma).to(torch.float64).expand(c, 1, size, size)
    x, y = a.to(torch.float64), b.to(torch.float64)

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, k, groups=c)

    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx * mx, blur(y * y) - my * my, blur(x * y) - mx * my
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return s.mean(dim=(1, 2, 3)).to(torch.float32)


def input_ssim(images: torch.Tensor, prompts: Sequence[str], input_images: torch.Tensor, *,
               window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """SSIM of each output to its input image (module doc)."""
    if window < 1 or sigma <= 0:
        raise RewardError(f"input_ssim: expected window >= 1 and sigma > 0, got {window}, {sigma}")
    return ssim(images, input_images, window=window, sigma=sigma)
