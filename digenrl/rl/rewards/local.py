"""What every model reward shares: its weights folder, its device and dtype, its batches.

Model rewards load weights only from a local folder named in their ``args`` (``weights``);
nothing is downloaded at run time. A missing folder or file is one line naming the path and
what belongs there. Device ``"auto"`` is the first CUDA device when there is one, else the
CPU; dtype ``"auto"`` is bfloat16 on CUDA (the scorers' towers tolerate it; their heads and
the final similarities run in float32) and float32 on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from digenrl.rl.rewards.base import RewardError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def weights_folder(path: object, who: str, what: str) -> Path:
    """``path`` as an existing folder, else a one-line RewardError saying what belongs there."""
    if not isinstance(path, str) or not path:
        raise RewardError(f"{who}: args.weights = {path!r}: expected the local folder holding {what}")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise RewardError(f"{who}: weights folder {str(p)!r} does not exist; it should hold {what}")
    return p


def weights_file(folder: Path, patterns: tuple[str, ...], who: str, what: str) -> Path:
    """The first file in ``folder`` matching one of ``patterns`` (globs, in order of preference)."""
    for pattern in patterns:
        found = sorted(folder.glob(pattern))
        if found:
            return found[0]
    raise RewardError(f"{who}: no {' or '.join(patterns)} in {str(folder)!r}; it should hold {what}")


def pick_device(device: str, who: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise RewardError(f"{who}: args.device = {device!r}: {e}") from None


def pick_dtype(dtype: str, device: torch.device, who: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise RewardError(f"{who}: args.dtype = {dtype!r}: expected auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def batches(n: int, size: int) -> Iterator[slice]:
    """Slices of ``range(n)`` of at most ``size``."""
    for lo in range(0, n, max(1, size)):
        yield slice(lo, min(lo + size, n))


def clip_pixels(images: torch.Tensor, size: int, device: torch.device, dtype: torch.dtype,
                mean: tuple[float, ...] = CLIP_MEAN, std: tuple[float, ...] = CLIP_STD) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> CLIP input: shorter side resized to ``size`` (bicubic,
    antialiased), centre crop ``size`` x ``size``, scaled to [0, 1], normalised. On ``device``.

    The same steps as CLIP's image processor, in torch so that it batches on the GPU; its PIL
    bicubic and torch's differ by interpolation rounding (~1e-2 in pixel values at most)."""
    x = images.to(device=device, dtype=torch.float32) / 255.0
    h, w = x.shape[-2:]
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    if (nh, nw) != (h, w):
        x = F.interpolate(x, size=(nh, nw), mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    top, left = (nh - size) // 2, (nw - size) // 2
    x = x[..., top:top + size, left:left + size]
    m = torch.tensor(mean, device=device).view(1, 3, 1, 1)
    s = torch.tensor(std, device=device).view(1, 3, 1, 1)
    return ((x - m) / s).to(dtype)
