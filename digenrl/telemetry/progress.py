"""Live progress of a launch: one refreshed line on a terminal, one plain line per step elsewhere.

``digenrl launch`` feeds each ``metrics.jsonl`` record to :meth:`Progress.update`::

    step 12/30  v13  reward 0.512±0.081  3.21 samples/s  busiest trainer-0 93%
    idlest rollout-1 41%  stale≤1  ETA 1m23s

On a terminal the line is redrawn in place (carriage return + erase line) and cut to the
terminal's width; the last step's line is ended with a newline, so whatever the launcher
prints next starts on a line of its own. Log records rendered for a terminal (see
:mod:`digenrl.telemetry.logging`) step around the line with :func:`line_cleared`: it is
erased, the record written, and the line drawn again below it. Otherwise (CI, a log file,
a supervisor) each step is its own line with no control characters at all.
"""

from __future__ import annotations

import math
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["Progress", "format_duration", "format_step", "line_cleared"]

# C0 controls, DEL and C1 controls: never written to a non-terminal stream.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CLEAR_LINE = "\r\x1b[2K"
# The Progress whose line is on the terminal without its newline (one per process at most),
# so that log handlers writing to the same terminal can step around it.
_on_screen: list[Progress] = []


@contextmanager
def line_cleared() -> Iterator[None]:
    """Erase the live progress line (if one is on screen) for the block, then redraw it."""
    live = _on_screen[-1] if _on_screen else None
    if live is None:
        yield
        return
    live.stream.write(_CLEAR_LINE)
    live.stream.flush()
    try:
        yield
    finally:
        live.stream.write(live.shown)
        live.stream.flush()


def format_duration(seconds: float) -> str:
    """``83.4 -> "1m23s"``, ``7300 -> "2h01m"``; "?" when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _num(record: Mapping[str, Any], key: str, fmt: str) -> str:
    value = record.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "–"
    return format(value, fmt)


def format_step(record: Mapping[str, Any], total_steps: int, eta_s: float | None) -> str:
    """The one-line summary of a metrics record (see the module docstring)."""
    step = record.get("step")
    done = f"{step + 1}" if isinstance(step, int) else "?"
    parts = [f"step {done}/{total_steps}", f"v{_num(record, 'policy_version', 'd')}",
             f"reward {_num(record, 'reward_mean', '.3f')}±{_num(record, 'reward_std', '.3f')}",
             f"{_num(record, 'samples_per_s', '.2f')} samples/s"]
    busy = {k.partition("/")[2]: v for k, v in record.items()
            if k.startswith("busy/") and isinstance(v, int | float)}
    if busy:
        busiest = max(busy, key=lambda n: (busy[n], n))
        idlest = min(busy, key=lambda n: (busy[n], n))
        parts.append(f"busiest {busiest} {busy[busiest]:.0%}")
        if idlest != busiest:
            parts.append(f"idlest {idlest} {busy[idlest]:.0%}")
    parts.append(f"stale≤{_num(record, 'max_staleness', 'd')}")
    parts.append(f"ETA {format_duration(eta_s) if eta_s is not None else '?'}")
    return "  ".join(parts)


class Progress:
    """Shows a run's progress on ``stream``, one :meth:`update` per finished step.

    ``tty`` forces terminal (True) or plain (False) output; by default it follows
    ``stream.isatty()``. ``clock`` (seconds, monotonic) is injectable for tests.
    """

    def __init__(self, total_steps: int, stream: TextIO | None = None, *,
                 tty: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps = {total_steps}: expected at least 1")
        self.total_steps = total_steps
        self.stream = stream if stream is not None else sys.stdout
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", bool)())
        self._clock = clock
        self._start = clock()
        self._dirty = False  # a TTY line is on screen without its newline
        self.shown = ""  # the TTY line as drawn (cut to the terminal's width)

    def eta_s(self, steps_done: int) -> float | None:
        """Remaining time, assuming the remaining steps take as long as the ones so far."""
        if steps_done <= 0:
            return None
        elapsed = self._clock() - self._start
        return elapsed / steps_done * max(self.total_steps - steps_done, 0)

    def update(self, metrics: Mapping[str, Any]) -> str:
        """Show one step's record; returns the line shown (without control characters)."""
        step = metrics.get("step")
        line = format_step(metrics, self.total_steps,
                           self.eta_s(step + 1) if isinstance(step, int) else None)
        line = _CONTROL.sub("", line)
        if self.tty:
            width = shutil.get_terminal_size((120, 24)).columns
            self.shown = line[: max(width - 1, 20)]
            self.stream.write(_CLEAR_LINE + self.shown)
            self._set_dirty(True)
            if isinstance(step, int) and step + 1 >= self.total_steps:
                self.close()  # the last step: nothing will redraw it, keep it
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        return line

    def message(self, text: str) -> None:
        """A line that stays (an event worth keeping on screen), above the progress line."""
        text = _CONTROL.sub("", text)
        if self.tty and self._dirty:
            self.stream.write(_CLEAR_LINE)
        self.stream.write(text + "\n")
        self._set_dirty(False)
        self.stream.flush()

    def close(self) -> None:
        """End the refreshed line so the shell prompt starts on a fresh one."""
        if self.tty and self._dirty:
            self.stream.write("\n")
            self.stream.flush()
        self._set_dirty(False)
        self.shown = ""

    def _set_dirty(self, dirty: bool) -> None:
        self._dirty = dirty
        if dirty and self not in _on_screen:
            _on_screen.append(self)
        elif not dirty and self in _on_screen:
            _on_screen.remove(self)
