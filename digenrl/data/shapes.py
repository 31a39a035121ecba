"""Procedural shapes world: one coloured shape on a plain background of another colour.

This is the tiny data set the shipped base model (``digenrl/data/base-sd3-tiny``) was trained
on, and the grammar of the built-in prompt set (``digenrl/data/prompts.txt``)::

    a {colour} {shape} on a {background}ish background   e.g. "a red triangle on a bluish background"

Why "bluish" and not "blue": the tiny models' prompt encoder (``HashPromptEncoder``) gives each
word a fixed vector and SD3 adds no position to text tokens, so the transformer sees a prompt as
a *bag* of words. "a red square on a blue background" and "a blue square on a red background"
would then be the same input. Naming the background colour with its own word keeps the shape
colour and the background colour apart for any order-blind encoder.

Scenes are drawn from an injected :class:`random.Random`, so a seed replays the same images.
Shapes are anti-aliased by supersampling (each output pixel averages ``supersample``^2 coverage
samples), which gives the model smooth edges to learn instead of aliasing noise.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Named colours (sRGB, 0-255). Chosen to be far apart so a colour is unambiguous to a reward.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (35, 70, 220),
    "yellow": (240, 215, 35),
    "purple": (140, 45, 180),
    "orange": (245, 135, 20),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}

#: The word that names each colour as a background (see the module docstring for why).
BACKGROUND_WORDS: dict[str, str] = {
    "red": "reddish", "green": "greenish", "blue": "bluish", "yellow": "yellowish",
    "purple": "purplish", "orange": "orangish", "white": "whitish", "black": "blackish",
}
_BACKGROUND_COLOUR = {w: c for c, w in BACKGROUND_WORDS.items()}

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross")

IMAGE_SIZE = 32


class PromptParseError(ValueError):
    """A prompt does not follow the shapes grammar ``a {colour} {shape} on a {colour}ish background``."""


@dataclass(frozen=True, kw_only=True)
class Scene:
    """One scene: what is drawn and where (coordinates in pixels of a ``size`` x ``size`` image)."""

    shape: str
    colour: str
    background: str
    cx: float
    cy: float
    radius: float  # half the shape's extent

    @property
    def prompt(self) -> str:
        """The scene's caption in the shapes grammar."""
        return f"a {self.colour} {self.shape} on a {BACKGROUND_WORDS[self.background]} background"


def all_prompts() -> list[str]:
    """Every prompt of the grammar (shapes x colours x different background colours)."""
    return [
        f"a {c} {s} on a {BACKGROUND_WORDS[b]} background"
        for s in SHAPES for c in COLOURS for b in COLOURS if b != c
    ]


def parse_prompt(prompt: str) -> tuple[str, str, str]:
    """(shape, colour, background colour name) of a grammar prompt; PromptParseError otherwise.

    The background may be named "bluish" (the generated form) or plainly "blue".
    """
    words = prompt.strip().lower().split()
    if (len(words) != 7 or words[0] != "a" or words[3:5] != ["on", "a"]
            or words[6] != "background"):
        raise PromptParseError(
            f"prompt {prompt!r}: expected 'a <colour> <shape> on a <colour>ish background'")
    colour, shape, background = words[1], words[2], _BACKGROUND_COLOUR.get(words[5], words[5])
    for word, known, what in ((colour, COLOURS, "colour"), (shape, SHAPES, "shape"),
                              (background, COLOURS, "background colour")):
        if word not in known:
            raise PromptParseError(
                f"prompt {prompt!r}: unknown {what} {word!r}; expected one of {', '.join(known)}")
    return shape, colour, background


def sample_scene(rng: random.Random, prompt: str | None = None, size: int = IMAGE_SIZE) -> Scene:
    """A random scene; with ``prompt``, its shape and colours are fixed and only placement varies.

    The radius is 18-36% of the image size; the shape stays inside, off the outermost pixels.
    """
    if prompt is None:
        shape = rng.choice(SHAPES)
        colour = rng.choice(list(COLOURS))
        background = rng.choice([c for c in COLOURS if c != colour])
    else:
        shape, colour, background = parse_prompt(prompt)
    radius = rng.uniform(0.18, 0.36) * size
    # The diamond reaches 1.15 r from the centre; keep a one-pixel border of pure background.
    lo, hi = 1.15 * radius + 1.0, size - 1.15 * radius - 1.0
    return Scene(shape=shape, colour=colour, background=background,
                 cx=rng.uniform(lo, hi), cy=rng.uniform(lo, hi), radius=radius)


def _coverage(scene: Scene, size: int, supersample: int) -> torch.Tensor:
    """Fraction of each pixel covered by the shape, (size, size) float32 in [0, 1]."""
    n = size * supersample
    # Sample points at the centres of the sub-pixels, in output-pixel units.
    coords = (torch.arange(n, dtype=torch.float32) + 0.5) / supersample
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    dx, dy, r = x - scene.cx, y - scene.cy, scene.radius
    if scene.shape == "circle":
        inside = dx * dx + dy * dy <= r * r
    elif scene.shape == "square":
        inside = (dx.abs() <= r * 0.85) & (dy.abs() <= r * 0.85)  # same visual area as the circle
    elif scene.shape == "diamond":
        inside = dx.abs() + dy.abs() <= r * 1.15
    elif scene.shape == "cross":
        arm = r * 0.38
        inside = ((dx.abs() <= arm) & (dy.abs() <= r)) | ((dy.abs() <= arm) & (dx.abs() <= r))
    elif scene.shape == "triangle":
        # Upright isosceles triangle: apex at (cx, cy - r), base on y = cy + r, half-width r.
        t = (dy + r) / (2 * r)  # 0 at the apex, 1 at the base
        inside = (t >= 0) & (t <= 1) & (dx.abs() <= t * r)
    else:
        raise PromptParseError(f"shape {scene.shape!r}: expected one of {', '.join(SHAPES)}")
    cov = inside.float().reshape(size, supersample, size, supersample)
    return cov.mean(dim=(1, 3))


def render(scene: Scene, size: int = IMAGE_SIZE, supersample: int = 4) -> torch.Tensor:
    """The scene as a uint8 image (3, size, size)."""
    alpha = _coverage(scene, size, supersample)
    fg = torch.tensor(COLOURS[scene.colour], dtype=torch.float32).view(3, 1, 1)
    bg = torch.tensor(COLOURS[scene.background], dtype=torch.float32).view(3, 1, 1)
    img = bg * (1 - alpha) + fg * alpha
    return img.round().clamp(0, 255).to(torch.uint8)


def make_example(rng: random.Random, prompt: str | None = None,
                 size: int = IMAGE_SIZE) -> tuple[torch.Tensor, str]:
    """One (uint8 image (3, size, size), prompt) pair."""
    scene = sample_scene(rng, prompt, size)
    return render(scene, size), scene.prompt


def make_batch(rng: random.Random, n: int, prompts: Sequence[str] | None = None,
               size: int = IMAGE_SIZE) -> tuple[torch.Tensor, list[str]]:
    """``n`` examples, (uint8 (n, 3, size, size), prompts); prompts drawn from ``prompts`` if given."""
    pairs = [make_example(rng, rng.choice(prompts) if prompts else None, size) for _ in range(n)]
    return torch.stack([img for img, _ in pairs]), [p for _, p in pairs]
