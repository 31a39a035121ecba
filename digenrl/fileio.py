"""Atomic file writes: a reader sees the old file or the new one, never a torn one.

Write to a temporary name in the same folder, fsync it, rename over the target. On any
failure (a full disk, a read-only folder) the temporary file is removed and the target is
left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def temp_path(path: Path) -> Path:
    """The temporary name a write of ``path`` goes through (same folder, so the rename is atomic)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def replace_synced(tmp: Path, path: Path) -> None:
    """fsync ``tmp`` and rename it over ``path``."""
    with tmp.open("rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Call ``write(tmp)`` to fill a temporary file, then fsync it and rename it over ``path``."""
    tmp = temp_path(Path(path))
    try:
        write(tmp)
        replace_synced(tmp, Path(path))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    """``data`` as JSON (sorted keys), written atomically."""
    text = json.dumps(data, indent=1, sort_keys=True)
    write_atomic(path, lambda tmp: tmp.write_text(text))


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))


def remove_temp_files(folder: Path) -> list[Path]:
    """Remove every temporary file of :func:`write_atomic` under ``folder`` (left by a writer
    that was killed mid-write); call it only when no writer is alive. Returns what it removed."""
    removed = []
    for p in Path(folder).rglob(".*.tmp-*"):
        if p.is_file():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
    return removed


class DamagedFile(ValueError):
    """A file a run left is damaged (not what its writer writes); the message names the file,
    where, and what to do."""


def read_jsonl(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """The (line, row) pairs of a JSON-lines file its owner appends to, and what was dropped.

    A last line that is not a JSON object is what a crash mid-write leaves (a torn line, or the
    zeros some file systems show after a power loss): it is dropped, and the second value says
    so (None when nothing was). A bad line with good lines after it is damage no crash of the
    writer explains: :class:`DamagedFile` naming the line.
    """
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    rows: list[tuple[str, dict[str, Any]]] = []
    bad: tuple[int, str] | None = None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if bad is not None:
            raise DamagedFile(f"{path} line {bad[0]}: not a JSON row ({bad[1]}), with rows after it: "
                              f"damaged, not torn by a crash; move the file aside (or delete that "
                              "line) to go on")
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            bad = (n, e.msg if isinstance(e, json.JSONDecodeError) else "nested too deep")
            continue
        if not isinstance(row, dict):
            bad = (n, f"a JSON {type(row).__name__}")
            continue
        rows.append((line, row))
    dropped = None
    if bad is not None:
        dropped = (f"{path}: dropped a torn last line (line {bad[0]}, {len(lines[bad[0] - 1])} "
                   f"characters: {bad[1]}), as a crash mid-write leaves")
    return rows, dropped
