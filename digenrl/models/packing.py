"""2x2 latent packing shared by FLUX and Qwen-Image (their pipelines' ``_pack_latents``)."""

from __future__ import annotations

import torch


def pack_2x2(x_BCHW: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): each 2x2 patch becomes one token, channels outermost."""
    b, c, h, w = x_BCHW.shape
    if h % 2 or w % 2:
        raise ValueError(f"2x2 packing needs even latent height/width, got {h}x{w}")
    return x_BCHW.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens_BNF: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`pack_2x2` for an (h, w) latent."""
    b, _, f = tokens_BNF.shape
    c = f // 4
    return tokens_BNF.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
