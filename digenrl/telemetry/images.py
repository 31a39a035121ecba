"""Sample grids: uint8 image batches to one PNG (nearest-neighbour upscaled so tiny images show)."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image


def grid(images: torch.Tensor, nrow: int, *, scale: int = 4, pad: int = 2) -> Image.Image:
    """(B, 3, H, W) uint8 -> one RGB image, ``nrow`` images per row."""
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"expected uint8 images (B, 3, H, W), got {images.dtype} {tuple(images.shape)}")
    b, _, h, w = images.shape
    nrow = max(1, min(nrow, b))
    ncol = (b + nrow - 1) // nrow
    canvas = torch.full((3, ncol * (h + pad) + pad, nrow * (w + pad) + pad), 255, dtype=torch.uint8)
    for i in range(b):
        r, c = divmod(i, nrow)
        y, x = pad + r * (h + pad), pad + c * (w + pad)
        canvas[:, y:y + h, x:x + w] = images[i]
    img = Image.fromarray(canvas.permute(1, 2, 0).contiguous().numpy())
    return img.resize((img.width * scale, img.height * scale), Image.NEAREST) if scale > 1 else img


def save_grid(images: torch.Tensor, path: Path, nrow: int, *, scale: int = 4) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    grid(images, nrow, scale=scale).save(tmp)
    tmp.replace(path)
    return path
