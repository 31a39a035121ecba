"""Prompt sets: a text file with one prompt per line, or the built-in shapes set.

Blank lines and lines starting with ``#`` are ignored; surrounding whitespace is stripped.
The built-in set (``digenrl/data/prompts.txt``) holds prompts of the shapes grammar that the
shipped base model was trained on (see :mod:`digenrl.data.shapes`).
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path


class PromptError(ValueError):
    """A prompt file is missing, unreadable or holds no prompts; the message names the file."""


def parse_prompts(text: str, origin: str = "<text>") -> list[str]:
    """The prompts in ``text`` (one per line, blank and ``#`` lines skipped)."""
    prompts = [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]
    if not prompts:
        raise PromptError(f"prompt file {origin}: holds no prompts (only blank or # lines)")
    return prompts


def builtin_prompts() -> list[str]:
    """The built-in shapes prompt set shipped as package data."""
    text = importlib.resources.files("digenrl.data").joinpath("prompts.txt").read_text()
    return parse_prompts(text, "<built-in prompts.txt>")


def load_prompts(path: str) -> list[str]:
    """Prompts from the text file at ``path``; an empty ``path`` gives the built-in set."""
    if not path:
        return builtin_prompts()
    p = Path(path)
    if not p.is_file():
        raise PromptError(f"prompt file {path!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"prompt file {path!r} cannot be read: {e}") from None
    return parse_prompts(text, repr(path))
