"""Shapes judges: tiny learned classifiers of the shapes world, a reward and an eval metric.

The shapes world (:mod:`digenrl.data.shapes`) has a GenEval of its own: a prompt names a shape,
the shape's colour and the background colour, and a classifier can check all three. Two such
classifiers ship as package data, trained by ``scripts/train_judge.py`` on the world's renders
with augmentations that look like generated samples (pixel noise, blur, token-sized blockiness,
slight colour jitter), *independently* (different seeds, architectures and augmentations) so
that a policy trained against one is measured by the other:

==========  ======================================  =====================================
judge       file                                     used by
==========  ======================================  =====================================
``reward``  ``digenrl/data/judge-reward.safetensors``  the ``shapes_judge`` reward term
``eval``    ``digenrl/data/judge-eval.safetensors``    :func:`attribute_correct` (evaluation)
==========  ======================================  =====================================

Each judge maps a uint8 image ``(3, 32, 32)`` to three distributions: shape (5 classes,
:data:`~digenrl.data.shapes.SHAPES`), shape colour and background colour (8 classes each,
:data:`~digenrl.data.shapes.COLOURS`). Images of another size are resized to 32x32 (bilinear,
antialiased) first. The file records its architecture, training recipe and held-out accuracy
in the safetensors metadata (``digenrl.rl.judge.judge_info``).

The reward (:func:`judge_log_prob`, built-in term ``shapes_judge``) is the reward judge's
log-probability of the prompt's three attributes, ``log p(shape) + log p(colour) +
log p(background)`` (the attributes treated as independent given the image), so it is <= 0 and
0 only for an image the judge is certain shows exactly what the prompt asks. The prompt is
parsed with :func:`~digenrl.data.shapes.parse_prompt`; a prompt outside the grammar
``a <colour> <shape> on a <colour>ish background`` raises :class:`RewardError` naming it.

The evaluation (:func:`attribute_correct`, built-in term ``shapes_attributes``) is the eval
judge's arg-max against the prompt, per image: ``{"shape", "colour", "background", "all"}``,
each a float32 ``(B,)`` of 0/1 (``all`` = all three right), so a batch's means are the
accuracies and the all-correct rate::

    [reward]
    terms = [{ name = "shapes_judge" }]          # args = { judge = "reward" } by default
    [eval]
    terms = [{ name = "shapes_attributes" }]     # args = { judge = "eval" } by default

Both terms take ``args.judge``: ``"reward"``, ``"eval"`` or the path of a judge file written by
``scripts/train_judge.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from digenrl.data.shapes import COLOURS, IMAGE_SIZE, SHAPES, PromptParseError, parse_prompt
from digenrl.rl.rewards.base import RewardError, check_images

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
JUDGES: dict[str, Path] = {
    "reward": DATA_DIR / "judge-reward.safetensors",
    "eval": DATA_DIR / "judge-eval.safetensors",
}
#: The three attributes a prompt names, and the classes of each (the heads' order).
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "shape": SHAPES, "colour": tuple(COLOURS), "background": tuple(COLOURS),
}
_BATCH = 256  # images per forward: bounds memory on a large reward batch


class ShapesJudge(nn.Module):
    """A small CNN: conv stages (BatchNorm, ReLU), global pooling, one linear layer to 21 logits.

    ``arch`` (a JSON-able dict, stored with the weights) sets ``widths`` (channels per conv),
    ``strides`` and ``kernels`` (one per conv), ``pool`` (``"avg"`` or ``"avgmax"``: the
    average and the maximum over positions, concatenated) and ``hidden`` (0 or the width of a
    ReLU layer before the heads).
    """

    def __init__(self, arch: dict[str, Any]) -> None:
        super().__init__()
        self.arch = dict(arch)
        layers: list[nn.Module] = []
        c_in = 3
        for c, s, k in zip(arch["widths"], arch["strides"], arch["kernels"], strict=True):
            layers += [nn.Conv2d(c_in, c, k, stride=s, padding=k // 2, bias=False),
                       nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            c_in = c
        self.features = nn.Sequential(*layers)
        feat = c_in * (2 if arch["pool"] == "avgmax" else 1)
        n_out = sum(len(v) for v in ATTRIBUTES.values())
        hidden = int(arch.get("hidden", 0))
        self.head: nn.Module = (nn.Sequential(nn.Linear(feat, hidden), nn.ReLU(inplace=True),
                                              nn.Linear(hidden, n_out))
                                if hidden else nn.Linear(feat, n_out))

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] (B, 3, 32, 32) float -> logits (B, 21): shape, colour, background."""
        h = self.features(x_BCHW)
        pooled = h.mean(dim=(2, 3))
        if self.arch["pool"] == "avgmax":
            pooled = torch.cat([pooled, h.amax(dim=(2, 3))], dim=1)
        return self.head(pooled)

    def split(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """Logits (B, 21) -> {attribute: log-softmax (B, n_classes)}."""
        out, i = {}, 0
        for name, classes in ATTRIBUTES.items():
            out[name] = torch.log_softmax(logits[:, i:i + len(classes)].float(), dim=1)
            i += len(classes)
        return out

    @torch.no_grad()
    def log_probs(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """uint8 images (B, 3, H, W) -> {attribute: log-probabilities (B, n_classes)}, eval mode."""
        self.eval()
        parts = [self.split(self(to_input(images[i:i + _BATCH])))
                 for i in range(0, images.shape[0], _BATCH)]
        return {k: torch.cat([p[k] for p in parts]) for k in ATTRIBUTES}


def to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> float32 in [-1, 1] at 32x32 (resized, antialiased, if H, W differ)."""
    x = images.float() / 127.5 - 1.0
    if x.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
        x = nn.functional.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear",
                                      antialias=True, align_corners=False)
    return x


def save_judge(judge: ShapesJudge, path: str | Path, info: dict[str, Any]) -> None:
    """Weights as float16 safetensors (half the bytes; logits move by ~1e-3), arch + ``info`` as metadata."""
    from safetensors.torch import save_file

    state = {k: (v.half() if v.is_floating_point() else v).contiguous()
             for k, v in judge.state_dict().items()}
    save_file(state, str(path), metadata={"arch": json.dumps(judge.arch), "info": json.dumps(info)})


def judge_info(path: str | Path) -> dict[str, Any]:
    """The metadata a judge file was saved with: ``{"arch": {...}, "info": {...}}``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return {k: json.loads(v) for k, v in meta.items()}


def load_judge_file(path: str | Path) -> ShapesJudge:
    """A judge from a file written by :func:`save_judge`, float32, eval mode, no grad."""
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise RewardError(f"shapes judge {str(p)!r} does not exist (scripts/train_judge.py writes it)")
    judge = ShapesJudge(judge_info(p)["arch"])
    judge.load_state_dict({k: v.float() if v.is_floating_point() else v
                           for k, v in load_file(str(p)).items()})
    return judge.eval().requires_grad_(False)


@cache
def load_judge(which: str) -> ShapesJudge:
    """The shipped ``"reward"`` or ``"eval"`` judge, or the judge file at the path ``which``
    (loaded once per process)."""
    if which in JUDGES:
        return load_judge_file(JUDGES[which])
    if not which.endswith(".safetensors"):
        raise RewardError(f"shapes judge {which!r}: expected {' or '.join(map(repr, JUDGES))} "
                          "or the path of a judge .safetensors file")
    return load_judge_file(which)


def prompt_labels(prompts: Sequence[str]) -> torch.Tensor:
    """(B, 3) int64 class indices (shape, colour, background) of grammar prompts; RewardError otherwise."""
    rows = []
    for prompt in prompts:
        try:
            shape, colour, background = parse_prompt(prompt)
        except PromptParseError as e:
            raise RewardError(f"shapes_judge: {e}") from None
        rows.append([SHAPES.index(shape), ATTRIBUTES["colour"].index(colour),
                     ATTRIBUTES["background"].index(background)])
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), 3)


def judge_log_prob(images: torch.Tensor, prompts: Sequence[str], *, which: str = "reward") -> torch.Tensor:
    """Per image, the judge's ``log p(shape) + log p(colour) + log p(background)`` of the prompt (<= 0)."""
    check_images(images, prompts)
    labels = prompt_labels(prompts)
    logp = load_judge(which).log_probs(images.cpu())
    total = torch.zeros(images.shape[0], dtype=torch.float32)
    for j, name in enumerate(ATTRIBUTES):
        total += logp[name].gather(1, labels[:, j:j + 1]).squeeze(1)
    return total


def attribute_correct(images: torch.Tensor, prompts: Sequence[str], *,
                      which: str = "eval") -> dict[str, torch.Tensor]:
    """Per image, whether the (eval) judge sees each attribute the prompt names.

    Returns ``{"shape", "colour", "background", "all"}``, each float32 ``(B,)`` of 0.0 / 1.0.
    """
    check_images(images, prompts)
    labels = prompt_labels(prompts)
    logp = load_judge(which).log_probs(images.cpu())
    out = {name: (logp[name].argmax(1) == labels[:, j]).float() for j, name in enumerate(ATTRIBUTES)}
    out["all"] = out["shape"] * out["colour"] * out["background"]
    return out


class ShapesJudgeReward:
    """Built-in term ``shapes_judge``: :func:`judge_log_prob` of one judge (``args.judge``:
    ``"reward"`` by default, ``"eval"`` or a judge file's path; loaded when the term is built)."""

    def __init__(self, *, judge: str = "reward") -> None:
        self.judge = judge
        load_judge(judge)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return judge_log_prob(images, prompts, which=self.judge)


class ShapesAttributes:
    """Built-in term ``shapes_attributes``: :func:`attribute_correct` of one judge (``args.judge``,
    ``"eval"`` by default). A mapping term: as an ``[eval] terms`` entry it reports
    ``shapes_attributes/{shape,colour,background,all}``; as a reward it needs a ``key``."""

    def __init__(self, *, judge: str = "eval") -> None:
        self.judge = judge
        load_judge(judge)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        return attribute_correct(images, prompts, which=self.judge)


def spread_per_sample(features_NF: torch.Tensor, groups: Sequence[object]) -> torch.Tensor:
    """Per row, the mean Euclidean distance between its L2-normalised features and those of the
    other rows of its group (float64 (N,)); 0 for a row alone in its group."""
    f = nn.functional.normalize(features_NF.double(), dim=1)
    keys = list(groups)
    out = torch.zeros(f.shape[0], dtype=torch.float64)
    for g in dict.fromkeys(keys):
        idx = torch.tensor([i for i, k in enumerate(keys) if k == g])
        if len(idx) > 1:
            d = torch.cdist(f[idx], f[idx])
            out[idx] = d.sum(1) / (len(idx) - 1)  # the zero diagonal left out of the mean
    return out


@torch.no_grad()
def conv_features(images: torch.Tensor, *, which: str) -> torch.Tensor:
    """A judge's last convolution map of uint8 images, flattened: float32 (B, C * h * w). It
    keeps where the shape is and how large, which the judge's pooled heads discard."""
    judge = load_judge(which).eval()
    parts = [judge.features(to_input(images[i:i + _BATCH].cpu())).flatten(1)
             for i in range(0, images.shape[0], _BATCH)]
    return torch.cat(parts).float()


class ShapesSpread:
    """Built-in term ``shapes_spread``: how different each sample is from the other samples of
    its prompt in the same scoring call (a rollout scores whole groups together): the mean
    distance of its features to theirs in a judge's last convolution map (``args.judge``,
    ``"reward"`` by default, so that the evaluation's judge stays independent). In [0, 2]; 0
    for a sample alone with its prompt. Added to the reward with a small weight it pays a group
    for spreading its samples' placement and size instead of collapsing on one."""

    def __init__(self, *, judge: str = "reward") -> None:
        self.judge = judge
        load_judge(judge)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_images(images, prompts)
        return spread_per_sample(conv_features(images, which=self.judge), prompts).float()
