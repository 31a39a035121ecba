"""Structured logs: one :func:`configure_logging` call per process, one bound logger per actor.

Every process (coordinator, rollout node, trainer rank, ``digenrl launch``) calls
:func:`configure_logging` once at its entry point. Records go through structlog into the
standard library's ``logging``, so warnings from torch, diffusers or zmq land in the same
stream with the same fields. On a terminal they are rendered for people (aligned, coloured);
otherwise -- under a supervisor, in CI, piped to a file -- as JSON lines, which contain no
control characters (``json.dumps`` escapes them). With ``log_file`` every record is also
appended as a JSON line to that file; a run keeps one per node in ``logs/<node_id>.log``
(:func:`node_log_path`).

An actor binds its logger once (:func:`get_logger`) and re-binds when its policy version
changes::

    log = get_logger("trainer", "trainer-0", policy_version=0)
    ...
    log = log.bind(policy_version=v)
    log.info("optimizer_step", step=s, loss=loss)
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

from digenrl.telemetry.progress import line_cleared

__all__ = ["LEVELS", "configure_logging", "get_logger", "node_log_path"]

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}

# Handlers this module installed on the root logger, so a second call replaces them
# (tests, and `digenrl launch` reconfiguring after parsing its flags).
_installed: list[logging.Handler] = []

_SHARED: list[Any] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.stdlib.ExtraAdder(),
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def node_log_path(run_dir: Path | str, node_id: str) -> Path:
    """Where a node's JSON-lines log lives: ``run_dir/logs/<node_id>.log``."""
    return Path(run_dir) / "logs" / f"{node_id}.log"


class _ConsoleHandler(logging.StreamHandler[TextIO]):
    """Writes records for people; steps around a live progress line on the same terminal
    (otherwise a record would be glued to the end of ``step 3/6 ... ETA 12s``)."""

    def emit(self, record: logging.LogRecord) -> None:
        with line_cleared():
            super().emit(record)


def _json_formatter() -> logging.Formatter:
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_SHARED,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(sort_keys=False)])


_LIBRARY_LOGGERS = ("diffusers", "transformers", "peft", "accelerate")


def configure_logging(*, json: bool | None = None, level: str = "info",
                      log_file: Path | str | None = None, stream: TextIO | None = None) -> None:
    """Configure structlog and stdlib logging for this process (call once, at the entry point).

    ``json``: JSON lines (True), human console (False), or console only when ``stream``
    (default stderr) is a terminal (None). ``level``: one of :data:`LEVELS`.
    ``log_file``: also append JSON lines there (parent folders are created).
    """
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LEVELS)}")
    stream = stream if stream is not None else sys.stderr
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    root = logging.getLogger()
    for handler in _installed:
        root.removeHandler(handler)
        handler.close()
    _installed.clear()

    console = logging.StreamHandler(stream) if json else _ConsoleHandler(stream)
    if json:
        console.setFormatter(_json_formatter())
    else:
        console.setFormatter(structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=_SHARED,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.dev.ConsoleRenderer(colors=True)]))
    _installed.append(console)
    if log_file is not None:
        path = Path(log_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(path, mode="a", encoding="utf-8")
        file_handler.setFormatter(_json_formatter())
        _installed.append(file_handler)
    for handler in _installed:
        root.addHandler(handler)
    root.setLevel(LEVELS[level])
    # libraries that install their own handler and stop propagation (diffusers and
    # transformers do, once their logging module is used) would bypass our format
    for name in _LIBRARY_LOGGERS:
        lib = logging.getLogger(name)
        for handler in list(lib.handlers):
            lib.removeHandler(handler)
        lib.propagate = True

    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *_SHARED,
                    structlog.stdlib.PositionalArgumentsFormatter(),
                    structlog.processors.StackInfoRenderer(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: a second configure_logging call (tests) must reach existing loggers.
        cache_logger_on_first_use=False,
    )


def get_logger(role: str, node_id: str, **context: Any) -> structlog.stdlib.BoundLogger:
    """A logger bound with ``role``, ``node_id`` and ``context`` (e.g. ``policy_version``).

    Bound loggers are immutable: ``log = log.bind(policy_version=v)`` when it changes.
    """
    log: structlog.stdlib.BoundLogger = structlog.get_logger(f"digenrl.{role}")
    return log.bind(role=role, node_id=node_id, **context)
