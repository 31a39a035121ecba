"""What every actor shares: one TaskGroup, heartbeats, structured shutdown, a bound logger.

An actor is a coroutine ``main()`` plus background loops. ``run()`` runs them in one
``asyncio.TaskGroup``; when ``main()`` returns, the background loops are cancelled and the
sockets closed. An exception in any of them propagates (never swallowed) and ends the actor.
After a stop request ``main()`` has ``stop_grace_s`` to notice it; then it is cancelled (a
torch call that never returns cannot be, which :meth:`Actor.compute_stuck` reports).

Where this sits (README, "Files"; ``tests/test_layout.py`` enforces it): the package is
layered, lowest first, ``config, fileio, faults, data -> core, transport, models, telemetry ->
rl -> actors, sim -> launch -> cli``, and a module imports only its own layer or lower ones.
The actors are the I/O shell around the sans-I/O ``core`` (the scheduler and the credit
ledger): they turn socket messages into core events and core commands into messages, and
they run the RL code (``rl/``) on a compute thread.

How an actor is wired: everything comes in through the constructor, nothing is patched on
afterwards. The node process (``actors/node.py``) hands each actor its sockets (inside
:class:`~digenrl.actors.peers.NodePeers`), a :class:`NodeHooks` (extra heartbeat stats, where
those stats go, extra background loops) and, in tests only, a
:class:`~digenrl.faults.Slowdown`. Shared behaviour is a held component built from explicit
inputs: :class:`~digenrl.actors.streamer.FragmentStreamer` (generation and streaming) and
:class:`~digenrl.actors.following.WeightFollower` (a rollout's weights).

| blocking call             | waits for                         | unblocked by                    |
|---------------------------|-----------------------------------|---------------------------------|
| ``wait_stopped()``        | shutdown requested                | ``request_stop()``, Shutdown msg |
| socket ``recv()``         | a peer's message                  | peer send, or cancellation       |
| ``unless_stopped(op)``    | ``op`` (a recv, a queue get)      | ``op`` finishing, or a stop      |
| ``in_thread(...)``        | torch work on the compute thread  | the work finishing              |
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol, Required, TypedDict, TypeVar

from digenrl.faults import NO_SLOWDOWN, Slowdown
from digenrl.telemetry import sdnotify
from digenrl.telemetry.trace import BusyClock, SpanRecorder

T = TypeVar("T")

STOP_GRACE_S = 30.0
"""How long a stopping actor's main loop may stay in a torch call before it is called wedged
(a node shortens it to ``runtime.stall_timeout_s`` when that is shorter)."""


class RunFailed(RuntimeError):
    """The run ended without finishing (no recovery left, a disk full, ...); the message says why."""


class Log(Protocol):
    """The logger an actor is given (structlog's bound loggers are such)."""

    def bind(self, **context: Any) -> Log: ...
    def info(self, event: str, **kw: Any) -> Any: ...
    def warning(self, event: str, **kw: Any) -> Any: ...
    def error(self, event: str, **kw: Any) -> Any: ...


def _no_stats() -> Mapping[str, float]:
    return {}


def _drop_stats(stats: Mapping[str, float]) -> None:
    """Stats seen by nobody (an actor outside a node process: tests, the coordinator)."""


Loop = Callable[[], Coroutine[Any, Any, None]]
"""A background loop: called once by :meth:`Actor.run`, runs until cancelled."""

DRAINED = ("done", "SIGTERM", "SIGINT")
"""Stop reasons of a node that ended as asked (exit 0): the run's end, or a drain on a signal."""

COORDINATOR_STOPPED = "coordinator stopped"
"""The Shutdown reason a ``digenrl-node`` coordinator stopped by a signal sends its nodes (with
the signal's name: ``coordinator stopped (SIGTERM)``): not one of :data:`DRAINED`, so each
exits 1 and its supervisor restarts it (actors/node.py)."""


def stopped_by_signal(reason: str) -> bool:
    """Whether a stop reason is a drain someone asked for (a signal here or at the coordinator),
    after which the run is meant to be resumed: a trainer then writes a drain checkpoint."""
    return reason in ("SIGTERM", "SIGINT") or reason.startswith(COORDINATOR_STOPPED + " (")


def stop_on_signals(stop: Callable[[str], None], again: Callable[[], None] | None = None) -> Callable[[], None]:
    """SIGTERM, or a first SIGINT (Ctrl-C), sends ``STOPPING=1`` and calls ``stop`` with the
    signal's name: the caller's drain. A second SIGINT calls ``again`` (someone insists;
    without it the drain goes on). Installed on the running loop; returns what removes them
    (SIGINT is then Python's KeyboardInterrupt again)."""
    loop = asyncio.get_running_loop()
    interrupts = [0]

    def handle(sig: signal.Signals) -> None:
        if sig == signal.SIGINT:
            interrupts[0] += 1
            if interrupts[0] > 1:
                if again is not None:
                    again()
                return
        sdnotify.stopping()
        stop(sig.name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle, sig)

    def remove() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    return remove


@dataclass(frozen=True)
class NodeHooks:
    """What the node process adds to its actor, given to the constructor (``actors/node.py``):
    the actor knows nothing of transport security, process memory or systemd."""

    extra_stats: Callable[[], Mapping[str, float]] = _no_stats
    """More heartbeat stats: the node's transport-security counters, its memory."""
    stats_sink: Callable[[Mapping[str, float]], None] = _drop_stats
    """Sees every heartbeat's stats (the node's Prometheus endpoint serves the latest)."""
    loops: tuple[Loop, ...] = ()
    """More background loops (the systemd watchdog)."""
    compute_init: Callable[[], object] | None = None
    """Run once on the compute thread when it starts (the node sets its CUDA device there:
    a thread's current device is its own)."""


NO_HOOKS = NodeHooks()


class ActorArgs(TypedDict, total=False):
    """The keyword arguments of :class:`Actor`, which every actor passes through
    (``def __init__(self, *, ..., **kw: Unpack[ActorArgs])``)."""

    node_id: Required[str]
    recorder: Required[SpanRecorder]
    log: Required[Log]
    hooks: NodeHooks
    slowdown: Slowdown
    stop_grace_s: float
    trace_path: Path | None
    trace_flush_s: float


class Actor:
    """Base of coordinator, rollout and trainer actors."""

    role = "actor"

    def __init__(self, *, node_id: str, recorder: SpanRecorder, log: Log,
                 hooks: NodeHooks = NO_HOOKS, slowdown: Slowdown = NO_SLOWDOWN,
                 stop_grace_s: float = STOP_GRACE_S, trace_path: Path | None = None,
                 trace_flush_s: float = 5.0) -> None:
        self.node_id = node_id
        self.recorder = recorder
        self.log = log
        self.hooks = hooks
        self.slowdown = slowdown  # TEST-ONLY (failpoints, digenrl/faults.py): compute spans stretched
        self.busy = BusyClock(recorder)
        self._stop = asyncio.Event()
        self.stop_reason = ""
        self._compute: ThreadPoolExecutor | None = None
        self._computing: tuple[str, Future[Any]] | None = None  # the last torch call submitted
        self.stop_grace_s = stop_grace_s  # after a stop request, how long main may take to notice it
        self.trace_path = trace_path  # where the node's trace goes (None: kept in memory)
        self.trace_flush_s = trace_flush_s
        self.unexpected_messages: Counter[str] = Counter()  # "socket:Type" -> count
        self.refused: Counter[str] = Counter()  # messages dropped by :meth:`refuse`, by reason

    # -- lifecycle ------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self.log.info("stopping", reason=reason)
            self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def wait_stopped(self) -> None:
        await self._stop.wait()

    async def unless_stopped(self, op: Coroutine[Any, Any, T]) -> T | None:
        """``op``'s result, or None once a stop is requested (whichever comes first): a main
        loop parked on a queue or a socket wakes for a stop without waiting for an item or a
        message. The loser is cancelled, and ``op`` has finished its cancellation when this
        returns: a queue's ``get`` or a socket's ``recv`` so cancelled loses nothing (the next
        one returns it; ``transport/socketio.py``)."""
        get = asyncio.ensure_future(op)
        stop = asyncio.ensure_future(self.wait_stopped())
        try:
            await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the caller itself is cancelled: nothing is left waiting
            stop.cancel()
            get.cancel()  # a no-op once it finished
        if not get.done():
            await asyncio.wait({get})  # its cleanup has run before the caller reads again
        return None if get.cancelled() else get.result()

    async def next_unless_stopped(self, queue: asyncio.Queue[T]) -> T | None:
        """The queue's next item, or None once a stop is requested (:meth:`unless_stopped`)."""
        with self.recorder.span("wait"):
            return await self.unless_stopped(queue.get())

    async def main(self) -> None:
        raise NotImplementedError

    def background(self) -> list[Loop]:
        """The actor's own background loops (:meth:`run` adds the node's ``hooks.loops``)."""
        return []

    async def close(self) -> None:
        """Release sockets; called once after the task group ends."""

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                main = tg.create_task(self.main(), name=f"{self.node_id}:main")
                flush = [self._flush_trace] if self.trace_path is not None else []
                loops = [tg.create_task(fn(), name=f"{self.node_id}:{fn.__name__}")
                         for fn in [*self.background(), *self.hooks.loops, *flush]]
                stop = tg.create_task(self._stop.wait(), name=f"{self.node_id}:stop")
                await asyncio.wait({main, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not main.done():
                    # main sees the stop at its next check; one blocked in a torch call that
                    # never returns (a wedged GPU or collective) is cancelled after the grace
                    await asyncio.wait({main}, timeout=self.stop_grace_s)
                    if not main.done():
                        self.log.error("main loop still busy after stop; cancelling it",
                                       grace_s=self.stop_grace_s,
                                       call=self._computing[0] if self._computing else None)
                        main.cancel()
                for t in (*loops, stop):
                    t.cancel()
        finally:
            await self.close()
            if self._compute is not None:
                self._compute.shutdown(wait=False, cancel_futures=True)

    async def _flush_trace(self) -> None:
        """Append the trace's new events to ``trace_path`` every ``trace_flush_s``: a long
        run's events do not pile up in memory, and a node that is killed loses only the last
        few seconds of its trace (the node writes the rest when it stops)."""
        assert self.trace_path is not None
        while True:
            await asyncio.sleep(self.trace_flush_s)
            self.recorder.dump(self.trace_path)

    # -- receive loops --------------------------------------------------------------------
    def unexpected(self, socket: str, msg: object, why: str = "no handler") -> None:
        """A receive loop got ``msg`` and has no use for it: count it (``socket:Type``) and
        log it, the first ten and then every power of two (a peer cannot flood the log; the
        counts stay exact and go out in the heartbeat stats)."""
        kind = type(msg).__name__
        self.unexpected_messages[f"{socket}:{kind}"] += 1
        n = self.unexpected_messages.total()
        if n <= 10 or (n & (n - 1)) == 0:
            self.log.warning("unexpected_message", socket=socket, msg=kind, why=why,
                             total_unexpected=n)

    def refuse(self, reason: str, msg: object, **fields: Any) -> None:
        """Drop ``msg`` a peer should not have sent (an id it does not hold, a step outside the
        run, a slot that cannot exist): count it by reason in ``refused`` and log it, rate-
        limited like :meth:`unexpected` (the counts stay exact)."""
        self.refused[reason] += 1
        n = self.refused.total()
        if n <= 10 or (n & (n - 1)) == 0:
            self.log.warning("message_refused", reason=reason, msg=type(msg).__name__,
                             total_refused=n, **fields)

    def heartbeat_stats(self) -> dict[str, float]:
        """What the next heartbeat reports: busy/wall seconds, the unexpected and the refused
        messages (``refused_<reason>``) and the node's ``hooks.extra_stats``;
        ``hooks.stats_sink`` sees it too."""
        out = {**self.busy.stats(), "unexpected_messages": float(self.unexpected_messages.total()),
               **{f"refused_{k}": float(v) for k, v in self.refused.items()},
               **self.hooks.extra_stats()}
        self.hooks.stats_sink(out)
        return out

    # -- work accounting ------------------------------------------------------------------
    @contextmanager
    def working(self, name: str, **args: Any) -> Iterator[None]:
        """A work span in the trace; it counts as busy if its name is in trace.BUSY_SPANS
        (``send_chunk`` and ``weight_fetch`` are I/O and do not)."""
        with self.recorder.span(name, **args):
            yield

    async def in_thread(self, name: str, fn: Callable[..., Any], *a: Any, **args: Any) -> Any:
        """Run torch work off the event loop, as a busy span, on the actor's compute thread.

        One thread for all of an actor's torch work (its calls are sequential anyway): the
        work stays on one OS thread instead of hopping between the default pool's threads.
        """
        t0 = time.perf_counter()
        with self.working(name, **args):
            out = await self.submit(name, fn, *a)
        extra = self.slowdown.extra_s(name, time.perf_counter() - t0)
        if extra > 0:  # TEST-ONLY (failpoints): an emulated slower GPU, idle after the span
            await asyncio.sleep(extra)
        return out

    def submit(self, name: str, fn: Callable[..., Any], *a: Any) -> asyncio.Future[Any]:
        """Queue ``fn(*a)`` on the compute thread, without a span (the caller records the
        work's spans itself); awaiting the result is the caller's business."""
        if self._compute is None:
            self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.role}-compute",
                                               initializer=self.hooks.compute_init)
        job = self._compute.submit(contextvars.copy_context().run, partial(fn, *a))
        self._computing = (name, job)
        return asyncio.wrap_future(job)

    def compute_stuck(self) -> str | None:
        """After :meth:`run`: the name of a torch call still running (it outlived the stop
        grace: a wedged GPU or collective; the thread cannot be interrupted), else None."""
        if self._computing is None or self._computing[1].done():
            return None
        return self._computing[0]


def default_node_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def incarnation() -> int:
    """A per-process number that grows across restarts (fencing of zombie messages)."""
    return time.time_ns() // 1000


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """The event loop every process runs: uvloop where it is installed (made once, at the entry)."""
    try:
        import uvloop
        return uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.new_event_loop
