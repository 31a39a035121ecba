"""Reward functions: decoded images + prompts -> one float per image.

Every reward function, built-in or plug-in, has one signature::

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor
        # images: uint8 (B, 3, H, W) RGB; prompts: B strings
        # returns a floating tensor of shape (B,); it is cast to float32

A plug-in is named ``"package.module:function"`` in ``[reward] terms`` and imported with
:mod:`importlib` when the reward is built. :func:`build_reward` returns a :class:`Reward` whose
call gives the weighted sum and each term's own values (for logging and hacking monitors).
Anything wrong with a term -- unknown name, import failure, an exception inside it, a result
of the wrong type, shape or dtype, NaN or infinity -- raises :class:`RewardError` naming the
term and what was wrong.

Built-ins (all cheap, offline, no model weights):

========================  ==================================================================
``jpeg_compressibility``  ``-kB`` of the image as JPEG at quality 95 (Pillow, 4:2:0, no
                          optimise), kB = 1000 bytes. We do *not* apply Flow-GRPO's ``/500``:
                          on 32x32 images sizes are ~0.5-2 kB, and GRPO normalises per group
                          anyway; multiply the term's ``weight`` by 1/500 to reproduce it.
``jpeg_incompressibility`` ``+kB`` of the same JPEG.
``brightness``            mean BT.709 luma ``0.2126 R + 0.7152 G + 0.0722 B`` of the sRGB
                          values (no linearisation), in [0, 1].
``saturation``            mean HSV saturation ``(max - min) / max`` per pixel, in [0, 1].
``colourfulness``         Hasler & Suesstrunk (2003) M = sigma_rgyb + 0.3 mu_rgyb, divided by
                          100 (about 0-1.5 for natural images).
``redness``               mean ``(R - (G + B) / 2) / 255``, in [-0.5, 1].
``prompt_colour_match``   how well the pixels show the colours the prompt names (shapes
                          world): see :func:`prompt_colour_match`. In [0, 1].
========================  ==================================================================
"""

from __future__ import annotations

import importlib
import io
import math
import re
from collections.abc import Callable, Sequence

import torch
from PIL import Image

from digenrl.config import RewardTerm
from digenrl.data.shapes import BACKGROUND_WORDS, COLOURS

RewardFn = Callable[[torch.Tensor, Sequence[str]], torch.Tensor]


class RewardError(ValueError):
    """A reward term is unknown, failed or returned something unusable; names the term."""


# ----------------------------------------------------------------------------- built-ins


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


BUILTIN: dict[str, RewardFn] = {
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "brightness": brightness,
    "saturation": saturation,
    "colourfulness": colourfulness,
    "redness": redness,
    "prompt_colour_match": prompt_colour_match,
}


# ----------------------------------------------------------------------------- resolving


def resolve_reward(name: str) -> RewardFn:
    """The function for a built-in name or a ``module:function`` plug-in."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise RewardError(
            f"reward {name!r}: unknown; expected a built-in ({', '.join(BUILTIN)}) or "
            "'module:function'")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"reward {name!r}: cannot import module {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward {name!r}: module {module_name!r} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def check_images(images: torch.Tensor, prompts: Sequence[str]) -> None:
    """Raise :class:`RewardError` unless images are uint8 (B, 3, H, W) with B prompts."""
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4 \
            or images.shape[1] != 3:
        what = (f"{images.dtype} {tuple(images.shape)}" if isinstance(images, torch.Tensor)
                else type(images).__name__)
        raise RewardError(f"reward input: expected uint8 images (B, 3, H, W), got {what}")
    if len(prompts) != images.shape[0]:
        raise RewardError(
            f"reward input: {images.shape[0]} images but {len(prompts)} prompts")


def call_reward(name: str, fn: RewardFn, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """``fn(images, prompts)`` checked: a float32 tensor (B,) of finite values, else RewardError."""
    try:
        out = fn(images, prompts)
    except RewardError:
        raise
    except Exception as e:  # a plug-in's bug must surface with the term's name, not be lost
        raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e}") from e
    b = images.shape[0]
    if not isinstance(out, torch.Tensor):
        raise RewardError(f"reward {name!r}: returned {type(out).__name__}, expected a tensor of shape ({b},)")
    if tuple(out.shape) != (b,):
        raise RewardError(f"reward {name!r}: returned shape {tuple(out.shape)}, expected ({b},)")
    if not out.is_floating_point():
        raise RewardError(f"reward {name!r}: returned dtype {out.dtype}, expected a floating dtype")
    out = out.detach().to(device="cpu", dtype=torch.float32)
    bad = ~torch.isfinite(out)
    if bad.any():
        idx = int(bad.nonzero()[0])
        raise RewardError(f"reward {name!r}: value {out[idx].item()} at index {idx} is not finite")
    return out


class Reward:
    """A weighted sum of reward terms; ``reward(images, prompts) -> (total[B], {name: [B]})``."""

    def __init__(self, terms: Sequence[tuple[str, float, RewardFn]]) -> None:
        self.terms = list(terms)

    @property
    def names(self) -> list[str]:
        """The terms' names, in config order."""
        return [name for name, _, _ in self.terms]

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        check_images(images, prompts)
        images = images.cpu()
        parts = {name: call_reward(name, fn, images, prompts) for name, _, fn in self.terms}
        total = torch.zeros(images.shape[0], dtype=torch.float32)
        for name, weight, _ in self.terms:
            total += weight * parts[name]
        return total, parts


def build_reward(terms: Sequence[RewardTerm]) -> Reward:
    """Resolve each term now (so a typo fails at start-up, not after the first rollout)."""
    if not terms:
        raise RewardError("reward terms: expected at least one term")
    resolved: list[tuple[str, float, RewardFn]] = []
    for term in terms:
        if term.name in {n for n, _, _ in resolved}:
            raise RewardError(f"reward {term.name!r}: listed twice; give it one weight")
        if not math.isfinite(term.weight):
            raise RewardError(f"reward {term.name!r}: weight {term.weight} is not finite")
        resolved.append((term.name, float(term.weight), resolve_reward(term.name)))
    return Reward(resolved)

