"""Prompt sets with metadata, and their train/test split.

Two file formats, told apart by the name:

* ``*.jsonl``: one JSON object a line with a string ``prompt`` field; every other field is the
  prompt's metadata and reaches the reward functions unchanged (flow_grpo's GenEval
  ``metadata.jsonl``, with ``tag``, ``include``, ``exclude``, loads as it is). An edit prompt
  has an ``image`` field: the path of its input image, or a list of paths (several reference
  images, as Qwen-Image-Edit-Plus takes), relative to the jsonl file; ``images`` is the same
  field by another name (one of the two per line). Each image is opened and
  checked when the file is loaded (before any process starts): a missing, unreadable or
  non-image file is one :class:`PromptError` naming it and the prompt's line. The record's
  ``image`` is rewritten to the resolved absolute path(s), so every node reads the same file.
* anything else: one prompt a line. Blank lines and lines starting with ``#`` are ignored;
  surrounding whitespace is stripped. A text file whose lines are all JSON objects is refused
  (name it ``.jsonl``): used as text, each JSON line would become a prompt.

A prompt's metadata record is its whole jsonl object (``prompt`` included), or
``{"prompt": text}`` for a text line. The built-in set (``digenrl/data/prompts.txt``) holds
prompts of the shapes grammar that the shipped base model was trained on (see
:mod:`digenrl.data.shapes`); ``digenrl/data/prompts-test.txt`` holds 40 others (8 per shape),
the default config's held-out set. A path ``builtin:<name>`` names such a shipped file.

The test split (:func:`load_splits`) is ``prompts.test_file`` or, without one, a
``prompts.test_fraction`` of the prompt file held out by a permutation seeded with
``prompts.split_seed`` -- not the run seed, so runs with different seeds share a test set.
Held-out prompts are never trained on.
"""

from __future__ import annotations

import importlib.resources
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from digenrl.config import (
    EDIT_FAMILIES,
    Config,
    PromptConfig,
    edit_image_limit,
    nesting_depth,
    show,
)

MAX_PROMPT_CHARS = 8192
"""Longest prompt accepted (text encoders keep a few hundred tokens; a longer line is a mistake)."""

MAX_LINE_BYTES = 256 << 10
"""Longest line of a prompt file (a .jsonl line carries the prompt's metadata too)."""

MAX_METADATA_DEPTH = 16
"""Deepest nesting of lists and objects in a .jsonl line."""

MAX_IMAGES_PER_PROMPT = 8
"""Most input images one edit prompt may name (Qwen-Image-Edit-Plus takes up to three)."""

MAX_IMAGE_PIXELS = 1 << 26
"""Largest input image accepted, in pixels (64 Mpx; a larger file is a mistake, not an input)."""


class PromptError(ValueError):
    """A prompt file is missing, unreadable, malformed or holds no prompts; names the file."""


@dataclass(frozen=True)
class PromptSet:
    """Prompts and their metadata records, index for index."""

    prompts: list[str]
    metadata: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.metadata:
            self.metadata.extend({"prompt": p} for p in self.prompts)
        if len(self.metadata) != len(self.prompts):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.metadata)} metadata records")

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, indices: list[int]) -> PromptSet:
        return PromptSet([self.prompts[i] for i in indices], [self.metadata[i] for i in indices])

    @property
    def images(self) -> list[list[str]]:
        """Each prompt's input image paths (absolute; empty for a text-to-image prompt)."""
        return [prompt_images(m) for m in self.metadata]

    @property
    def is_edit(self) -> bool:
        """Whether the prompts carry input images (every one does; a mix is refused at load)."""
        return bool(self.metadata) and any(k in self.metadata[0] for k in IMAGE_FIELDS)


#: The fields of an edit prompt's record that name its input image(s): one of them per line.
IMAGE_FIELDS = ("image", "images")


def prompt_images(record: Mapping[str, Any]) -> list[str]:
    """The input image paths of a loaded prompt's metadata record (empty without ``image`` or
    ``images``)."""
    image = record.get("image", record.get("images"))
    if image is None:
        return []
    return [image] if isinstance(image, str) else list(image)


def check_image(path: Path, where: str) -> None:
    """Raise PromptError unless ``path`` is a readable image file; ``where`` names the prompt."""
    if not path.is_file():
        raise PromptError(f"{where}: input image {str(path)!r} does not exist")
    try:
        with Image.open(path) as im:
            w, h = im.size
            if w * h > MAX_IMAGE_PIXELS:
                raise PromptError(f"{where}: input image {str(path)!r} is {w}x{h}, more than "
                                  f"{MAX_IMAGE_PIXELS} pixels")
            im.verify()
    except PromptError:
        raise
    except UnidentifiedImageError:
        raise PromptError(f"{where}: input image {str(path)!r} is not an image "
                          "(PIL cannot identify it)") from None
    except OSError as e:
        raise PromptError(f"{where}: input image {str(path)!r} cannot be read: "
                          f"{e.strerror or e}") from None
    except (SyntaxError, ValueError, Image.DecompressionBombError) as e:  # PIL's verify() failures
        raise PromptError(f"{where}: input image {str(path)!r} is not a valid image: {e}") from None


def load_image(path: str) -> Image.Image:
    """An input image as RGB (checked at load by :func:`check_image`)."""
    with Image.open(path) as im:
        return im.convert("RGB")


def _resolve_images(value: Any, base: Path | None, where: str, key: str = "image") -> str | list[str]:
    """The ``image`` (or ``images``: ``key``) field of a jsonl record, checked and resolved
    against ``base``."""
    many = isinstance(value, list)
    items = value if many else [value]
    if not items or len(items) > MAX_IMAGES_PER_PROMPT or not all(
            isinstance(x, str) and x.strip() for x in items):
        raise PromptError(f"{where}: expected '{key}' to be a path or a list of 1 to "
                          f"{MAX_IMAGES_PER_PROMPT} paths, got {show(value)}")
    if base is None:
        raise PromptError(f"{where}: '{key}' needs a prompt file on disk to resolve its path against")
    paths = []
    for x in items:
        path = (base / x).resolve()
        check_image(path, where)
        paths.append(str(path))
    return paths if many else paths[0]


def parse_prompts(text: str, origin: str = "<text>") -> list[str]:
    """The prompts in ``text`` (one per line, blank and ``#`` lines skipped)."""
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s and not s.startswith("#"):
            if len(s) > MAX_PROMPT_CHARS:
                raise PromptError(f"prompt file {origin} line {n}: a prompt of {len(s)} characters, "
                                  f"longer than the limit of {MAX_PROMPT_CHARS}")
            prompts.append(s)
    if not prompts:
        raise PromptError(f"prompt file {origin}: holds no prompts (only blank or # lines)")
    if all(p.startswith("{") and p.endswith("}") for p in prompts):
        try:
            [json.loads(p) for p in prompts]
        except json.JSONDecodeError:
            pass  # braces in plain prompts: text after all
        else:
            raise PromptError(f"prompt file {origin}: every line is a JSON object; name the file "
                              "*.jsonl to read its 'prompt' fields and metadata")
    return prompts


def parse_jsonl(text: str, origin: str = "<jsonl>", base: Path | None = None) -> PromptSet:
    """Prompts and metadata of JSON lines (blank lines skipped); each needs a string ``prompt``.
    ``image`` fields are resolved against the folder ``base`` and checked (module docstring)."""
    prompts: list[str] = []
    with_image: list[int] = []
    metadata: list[dict[str, Any]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_BYTES:
            raise PromptError(f"prompt file {origin} line {n}: {len(line)} characters, longer than "
                              f"the limit of {MAX_LINE_BYTES} for a line")
        try:
            record = json.loads(line)
            too_deep = nesting_depth(record) > MAX_METADATA_DEPTH
        except json.JSONDecodeError as e:
            raise PromptError(f"prompt file {origin} line {n}: not JSON ({e.msg})") from None
        except RecursionError:  # json's parser recurses once per level
            too_deep = True
        if too_deep:
            raise PromptError(f"prompt file {origin} line {n}: nested deeper than "
                              f"{MAX_METADATA_DEPTH} levels of lists and objects")
        if not isinstance(record, dict):
            raise PromptError(f"prompt file {origin} line {n}: expected a JSON object, got "
                              f"{type(record).__name__}")
        prompt = record.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError(f"prompt file {origin} line {n}: expected a non-empty string field "
                              f"'prompt', got {show(prompt)}")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise PromptError(f"prompt file {origin} line {n}: a prompt of {len(prompt)} characters, "
                              f"longer than the limit of {MAX_PROMPT_CHARS}")
        keys = [k for k in IMAGE_FIELDS if k in record]
        if len(keys) > 1:
            raise PromptError(f"prompt file {origin} line {n}: both 'image' and 'images'; give the "
                              "input image(s) in one of them")
        if keys:
            record[keys[0]] = _resolve_images(record[keys[0]], base, f"prompt file {origin} line {n}", keys[0])
            with_image.append(n)
        prompts.append(prompt.strip())
        metadata.append(record)
    if not prompts:
        raise PromptError(f"prompt file {origin}: holds no prompts (no JSON lines)")
    if with_image and len(with_image) != len(prompts):
        lines = set(with_image)
        first = next(n for n, line in enumerate(text.splitlines(), 1) if line.strip() and n not in lines)
        raise PromptError(f"prompt file {origin} line {first}: no 'image' field, but line "
                          f"{with_image[0]} has one; an edit prompt file needs an image on every line")
    return PromptSet(prompts, metadata)


def builtin_prompts() -> list[str]:
    """The built-in shapes prompt set shipped as package data."""
    text = importlib.resources.files("digenrl.data").joinpath("prompts.txt").read_text()
    return parse_prompts(text, "<built-in prompts.txt>")


BUILTIN_PREFIX = "builtin:"
"""``builtin:<name>`` names a prompt file shipped in ``digenrl/data/`` (``builtin:prompts-test.txt``)."""


def load_prompt_set(path: str) -> PromptSet:
    """The prompt set in the file at ``path`` (format by name); empty ``path``: the built-in set;
    ``builtin:<name>``: the package data file ``digenrl/data/<name>``."""
    if not path:
        return PromptSet(builtin_prompts())
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX):]
        shipped = importlib.resources.files("digenrl.data").joinpath(name)
        if "/" in name or not name.endswith((".txt", ".jsonl")) or not shipped.is_file():
            raise PromptError(f"prompt file {path!r}: no such prompt file in the package data")
        text = shipped.read_text(encoding="utf-8")
        if name.endswith(".jsonl"):
            with importlib.resources.as_file(shipped) as real:
                return parse_jsonl(text, repr(path), real.parent)
        return PromptSet(parse_prompts(text, repr(path)))
    p = Path(path)
    if not p.is_file():
        raise PromptError(f"prompt file {path!r} does not exist")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise PromptError(f"prompt file {path!r} cannot be read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise PromptError(f"prompt file {path!r} cannot be read: not UTF-8 at byte {e.start} "
                          f"(line {line})") from None
    if p.suffix.lower() == ".jsonl":
        return parse_jsonl(text, repr(path), p.resolve().parent)
    return PromptSet(parse_prompts(text, repr(path)))


def load_prompts(path: str) -> list[str]:
    """The prompt texts of :func:`load_prompt_set` (no split, no metadata)."""
    return load_prompt_set(path).prompts


def split_off(prompts: PromptSet, fraction: float, seed: int) -> tuple[PromptSet, PromptSet]:
    """(train, test): ``round(fraction * n)`` prompts (at least one) held out, chosen by a
    permutation seeded with ``seed``; both keep the file's order."""
    n = len(prompts)
    k = max(1, round(fraction * n))
    if k >= n:
        raise PromptError(f"prompts.test_fraction = {fraction}: holds out {k} of {n} prompts, "
                          "leaving none to train on")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    test = sorted(order[:k])
    held = set(test)
    return prompts.subset([i for i in range(n) if i not in held]), prompts.subset(test)


def check_edit_prompts(cfg: Config, train: PromptSet, test: PromptSet | None) -> None:
    """An image-editing family needs edit prompts (an input image on each line, no more than it
    takes), and a text-to-image family text prompts: a PromptError naming the file otherwise."""
    family = cfg.model.family
    if cfg.model.path == "emulated" or not family:
        return
    most = edit_image_limit(cfg.model)
    for name, ps in (("prompts.file", train), ("prompts.test_file", test)):
        if ps is None:
            continue
        path = (cfg.prompts.test_file if name == "prompts.test_file" and cfg.prompts.test_file
                else cfg.prompts.file) or "(built-in prompts)"
        if most and not ps.is_edit:
            raise PromptError(f"{name} = {path!r}: model.family = {family!r} edits images; expected a "
                              ".jsonl file with an 'image' (input image path) on every line")
        if not most and ps.is_edit:
            raise PromptError(f"{name} = {path!r} holds edit prompts (input images), but model.family = "
                              f"{family!r} is text-to-image; use an image-editing family "
                              f"({', '.join(EDIT_FAMILIES)})")
        for i, images in enumerate(ps.images):
            if len(images) > most > 0:
                fewer = (f" (the {cfg.model.path!r} folder's pipeline)"
                         if most < EDIT_FAMILIES.get(family, 0) else "")
                raise PromptError(f"{name} = {path!r}: prompt {ps.prompts[i]!r} gives {len(images)} input "
                                  f"images; model.family = {family!r}{fewer} takes at most {most}")


def load_splits(cfg: PromptConfig) -> tuple[PromptSet, PromptSet | None]:
    """(train, test) prompt sets of a run; test is None without a test split."""
    full = load_prompt_set(cfg.file)
    if cfg.test_file:
        return full, load_prompt_set(cfg.test_file)
    if cfg.test_fraction > 0:
        return split_off(full, cfg.test_fraction, cfg.split_seed)
    return full, None
