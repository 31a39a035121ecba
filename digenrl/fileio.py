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
