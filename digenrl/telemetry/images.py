"""Sample grids: uint8 image batches to one PNG.

Small images are upscaled (nearest neighbour, at most 4x) so a 32 px sample is visible;
large ones never are, and a grid whose longer side would pass :data:`MAX_SIDE` pixels is
shrunk to fit (16 FLUX samples of 1024 px make a 2048 px grid, 9 MB for noise-like samples,
not a 16424 px one of 62 MB). Writing a grid is file I/O and PNG compression: callers on an event loop run
:func:`save_grid` in a worker thread.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

#: Longest side of a saved grid, in pixels.
MAX_SIDE = 2048
#: Images up to this many pixels on their longer side are upscaled (to about this size).
SMALL = 128


def auto_scale(h: int, w: int) -> int:
    """Integer upscale for an ``h`` x ``w`` image: up to 4x for small ones, 1 from 128 px on."""
    return max(1, min(4, SMALL // max(h, w, 1)))


def grid(images: torch.Tensor, nrow: int, *, scale: int | None = None, pad: int = 2,
         max_side: int = MAX_SIDE) -> Image.Image:
    """(B, 3, H, W) uint8 -> one RGB image, ``nrow`` images per row, at most ``max_side`` px."""
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"expected uint8 images (B, 3, H, W), got {images.dtype} {tuple(images.shape)}")
    images = images.cpu()
    b, _, h, w = images.shape
    nrow = max(1, min(nrow, b))
    ncol = (b + nrow - 1) // nrow
    canvas = torch.full((3, ncol * (h + pad) + pad, nrow * (w + pad) + pad), 255, dtype=torch.uint8)
    for i in range(b):
        r, c = divmod(i, nrow)
        y, x = pad + r * (h + pad), pad + c * (w + pad)
        canvas[:, y:y + h, x:x + w] = images[i]
    img = Image.fromarray(canvas.permute(1, 2, 0).contiguous().numpy())
    scale = auto_scale(h, w) if scale is None else scale
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.Resampling.NEAREST)
    if max(img.size) > max_side:
        shrink = max_side / max(img.size)
        img = img.resize((max(1, round(img.width * shrink)), max(1, round(img.height * shrink))), Image.Resampling.BILINEAR)
    return img


def save_grid(images: torch.Tensor, path: Path, nrow: int, *, scale: int | None = None) -> Path:
    """Write :func:`grid` to ``path`` atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    grid(images, nrow, scale=scale).save(tmp)
    tmp.replace(path)
    return path


def grid_array(images: torch.Tensor, nrow: int) -> torch.Tensor:
    """:func:`grid` as a uint8 (H, W, 3) tensor (what the experiment trackers are sent)."""
    return torch.from_numpy(np.array(grid(images, nrow), dtype=np.uint8))
