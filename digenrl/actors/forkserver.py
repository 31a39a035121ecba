"""Start a local cluster's node processes by forking one pre-imported process.

A node started as ``python -m digenrl.cli node ...`` spends most of its first seconds
importing torch, diffusers, transformers and peft (4-6 s of CPU on a small machine, more than
a small run's whole training). ``digenrl launch`` starts every node, and restarts them after a
fault or a rewind: with ``cluster.spawn = "fork"`` (the default) it asks one server process,
which imported those modules once, to fork each of them instead (Python's
``multiprocessing`` forkserver). A forked node runs exactly the code an exec'd one runs,
:func:`digenrl.cli.main` with the same arguments, with its own environment, its output in its
``logs/<node>.stderr`` and its real exit status (a configuration refusal still exits
:data:`digenrl.config.CONFIG_ERROR_EXIT`, so the launcher does not restart it).

What a fresh interpreter would do differently, and why it does not matter here: the server
was started with the launcher's environment, so a variable read at import time by a preloaded
library (``OMP_NUM_THREADS`` by the OpenMP runtime) has the launcher's value; a node sets its
thread counts from the config (``run.threads``) and reads its own environment for everything
else at run time (devices, failpoints). The server touches no CUDA device, starts no thread and
opens no socket before it forks. ``cluster.spawn = "exec"`` starts every node as a fresh
interpreter instead; it is also the fallback where fork servers do not exist (not Linux).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import io
import multiprocessing
import multiprocessing.context
import os
import sys
import threading
import types
from collections.abc import Mapping, Sequence
from pathlib import Path

#: What the server imports before it forks: everything a node imports before its first step
#: (the model families import diffusers' classes, peft and transformers come with them).
PRELOAD = (
    "digenrl.cli",
    "digenrl.actors.node",
    "digenrl.actors.trainer",
    "digenrl.actors.rollout",
    "digenrl.actors.reward",
    "digenrl.models.families",
    "digenrl.rl.learner",
    "peft",
    "digenrl.actors.preloaded",  # last: freezes what the imports left alive
)


def available() -> bool:
    """Whether this platform has fork servers (Linux, macOS; not Windows)."""
    return "forkserver" in multiprocessing.get_all_start_methods()


def _context() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    assert isinstance(ctx, multiprocessing.context.ForkServerContext)
    return ctx


def start_server(log_path: Path, env: Mapping[str, str] | None = None) -> None:
    """Start this process's fork server if it is not running, with :data:`PRELOAD` and, for
    its import-time reads, ``env`` on top of this process's environment. Idempotent; the
    server lives until this process exits. Returns once the server is started, not once its
    imports are done (the first fork waits for those).

    The server's stdout and stderr (and those of multiprocessing's resource tracker, started
    with it) go to ``log_path``: a process that reads this one's output to its end (a shell
    pipe, a test's ``communicate``) then does not also wait for the server's exit."""
    from multiprocessing import forkserver

    ctx = _context()
    ctx.set_forkserver_preload(list(PRELOAD))
    saved_env = dict(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.environ.update(env or {})
        os.dup2(log, 1)
        os.dup2(log, 2)
        forkserver.ensure_running()
    finally:
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in (log, *saved_fds):
            os.close(fd)
        os.environ.clear()
        os.environ.update(saved_env)


def _node_entry(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """The forked node: its own stdio, environment and argv, then the CLI's ``main``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # unbuffered, as PYTHONUNBUFFERED=1 makes an exec'd node: its last words reach the file
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["digenrl", *argv]
    from digenrl import faults
    faults.set_failpoints(None)  # read again from this node's environment
    # by name, as `python -m digenrl.cli` finds it: the CLI sits above this layer
    main = importlib.import_module("digenrl.cli").main
    try:
        code = main(argv)
    except Exception as e:  # what an exec'd node's interpreter prints, without multiprocessing's header
        _report(e)
        code = 1
    finally:
        atexit._run_exitfuncs()  # what interpreter exit runs (log handlers' flush); forked
        # children end in os._exit, which would skip it
    if code:
        raise SystemExit(code)


def _report(e: Exception) -> None:
    """The traceback of the error that ended the node, with its one-line summary both first
    and last: the launcher names a dead node by the last line of its stderr that is not a log
    record (cluster.Children.last_error), and on a full disk only the first short write may fit."""
    import traceback

    leaf: BaseException = e
    while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:  # a TaskGroup's: what failed in it
        leaf = leaf.exceptions[0]
    summary = "".join(traceback.format_exception_only(leaf)).strip().splitlines()[-1]
    for text in (summary + "\n", "".join(traceback.format_exception(e)), summary + "\n"):
        with contextlib.suppress(OSError):  # ENOSPC and the like: what was written stays
            sys.stderr.write(text)


class ForkedNode:
    """A forked node, with the part of :class:`asyncio.subprocess.Process` the launcher uses."""

    def __init__(self, proc: multiprocessing.process.BaseProcess) -> None:
        self._proc = proc

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it has exited (negative: the signal that ended it), else None."""
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()

    def terminate(self) -> None:
        self._proc.terminate()

    async def wait(self) -> int:
        # the process is the fork server's child: its end is read from the server's pipe,
        # which asyncio cannot await, so poll (the launcher's supervision already polls at 0.2 s)
        while (code := self._proc.exitcode) is None:
            await asyncio.sleep(0.02)
        return code


async def fork_node(argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> ForkedNode:
    """Fork a node running ``digenrl <argv>`` with ``env`` as its whole environment and its
    stdout and stderr appended to ``log_path``. The first fork of a launch waits for the
    server's imports, off the event loop."""
    proc = _context().Process(target=_node_entry, args=(list(argv), dict(env), str(log_path)),
                              name=f"digenrl-{log_path.stem}")
    await asyncio.to_thread(_start, proc)
    return ForkedNode(proc)


def _start(proc: multiprocessing.process.BaseProcess) -> None:
    """``proc.start()`` without multiprocessing's main-module fix-up: by default a forked child
    first re-runs this process's ``__main__`` (the script or ``-m`` module that started it, as
    ``__mp_main__``), which a node does not need and a script that launches at import time
    must not see. The fix-up is derived from ``sys.modules["__main__"]``'s spec and file, so a
    bare stand-in takes its place while the request is made."""
    main = sys.modules["__main__"]
    bare = types.ModuleType("__main__")
    bare.__spec__ = None
    with _START_LOCK:
        sys.modules["__main__"] = bare
        try:
            proc.start()
        finally:
            sys.modules["__main__"] = main


_START_LOCK = threading.Lock()
