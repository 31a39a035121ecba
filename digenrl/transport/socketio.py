"""The base class of every socket kind: lifecycle, statistics and the direct non-blocking I/O path.

:class:`Socket` sends and receives :mod:`digenrl.transport.protocol` messages over one
ZeroMQ socket; :mod:`digenrl.transport.sockets` has its subclass per ZeroMQ kind (and the
table of what each sends and receives). Only the blocking operations are ``async``; the
``zmq.asyncio.Context`` is always passed in, never created here.

A message that does not decode is counted in :meth:`Socket.statistics`, logged with
the peer, and dropped; ``recv`` keeps waiting for the next one, so a peer can never
crash a node with bytes.

A socket's limits, lane and ZMTP heartbeats are :mod:`digenrl.transport.options`'; every
bind and connect address is checked by :mod:`digenrl.transport.endpoints`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog
import zmq
import zmq.asyncio

from digenrl.transport.endpoints import Endpoint
from digenrl.transport.errors import Closed, PeerLost, ProtocolError
from digenrl.transport.options import COPY_BELOW, LANES, Lane, SocketOptions, SocketSecurity
from digenrl.transport.protocol import Message, decode, encode

log = structlog.get_logger("digenrl.transport")

# plain ints: pyzmq's enum flags cost ~1 us an operation on the per-message path
_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
_MORE = _NOBLOCK | _SNDMORE


@dataclass
class SocketStatistics:
    """Counters of one socket; ``bad_by_reason`` keys are ProtocolError reasons."""

    sent: int = 0
    received: int = 0
    bytes_sent: int = 0  # frame bytes of the messages sent (tensor payloads included)
    dropped: int = 0  # sends a ROUTER dropped because the peer's queue was full
    bad_frames: int = 0
    bad_by_reason: dict[str, int] = field(default_factory=dict)
    waits: int = 0  # operations that found nothing to do and waited on the event loop


class Socket:
    """A ZeroMQ socket that sends and receives protocol messages (see the module table).

    I/O path (docs/benchmarks.md, Transport): every operation first tries the socket
    directly, non-blocking, through pyzmq's blocking API; only when it would block does
    the caller park on a future. One reader callback per socket on ZeroMQ's descriptor
    (:meth:`_service`) completes parked operations. ``zmq.asyncio``'s own futures, pollers
    and per-operation event bookkeeping are not used: they cost ~50-100 us a message.

    ZeroMQ's descriptor signals edges, not levels: any operation on the socket processes
    its pending commands and can clear the signal of a message (or of room to send) that
    arrived meanwhile. So after every operation done while some other operation is
    parked, :meth:`_service` is scheduled to look at ``EVENTS`` and finish what it can;
    otherwise that parked ``recv`` could sleep on with a message queued (the regression
    test in tests/test_transport.py).
    """

    KIND: ClassVar[int]
    BATCH: ClassVar[int] = 64  # operations one _service call completes before it yields
    YIELD_EVERY: ClassVar[int] = 8  # operations that did not wait, between yields to the loop

    def __init__(self, ctx: zmq.asyncio.Context, *, options: SocketOptions | None = None,
                 identity: bytes | None = None, security: SocketSecurity | None = None,
                 name: str = "", lane: Lane = "control") -> None:
        if not isinstance(ctx, zmq.asyncio.Context):
            raise TypeError(f"expected a zmq.asyncio.Context, got {type(ctx).__name__}")
        if lane not in LANES:
            raise ValueError(f"lane = {lane!r}: expected one of {', '.join(LANES)}")
        self.options = options or SocketOptions()
        self.name = name or type(self).__name__.lower()
        self.endpoint = ""  # the address of the last bind (wildcards resolved) or connect
        self._stats = SocketStatistics()
        self.last_bad: ProtocolError | None = None  # why the last dropped frame was dropped
        self._closed = False
        sock = ctx.socket(self.KIND)
        self._sock: zmq.asyncio.Socket = sock  # for options and monitors only (zmq_socket)
        # every send and recv goes through this blocking-API view of the same socket
        self._sync: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)
        self._sync.copy_threshold = COPY_BELOW  # smaller frames are copied: see options.py
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recv_waiters: deque[asyncio.Future[list[zmq.Frame]]] = deque()
        self._send_waiters: deque[tuple[list[Any], bool, asyncio.Future[Any]]] = deque()
        self._held: deque[list[zmq.Frame]] = deque()  # read for a recv cancelled before it returned
        self._service_soon = False
        self._rx_hot = False  # the last read found a message: read again before asking EVENTS
        self._unyielded = 0  # operations since the last yield to the loop
        self.options.apply(sock, ctx, identity=identity, lane=lane)
        if security is not None:
            security.apply(sock)
        self._configure(sock)

    def _configure(self, sock: zmq.Socket[Any]) -> None:
        """Kind-specific options, set before bind/connect."""

    # ------------------------------------------------------------ lifecycle

    def bind(self, endpoint: str) -> str:
        """Bind and return the actual address (``tcp://127.0.0.1:*`` gets its real port)."""
        Endpoint.parse(endpoint)
        self._live().bind(endpoint)
        self.endpoint = self.last_endpoint
        return self.endpoint

    def connect(self, endpoint: str) -> None:
        """Connect (asynchronously: ZeroMQ reconnects until the peer is there)."""
        Endpoint.parse(endpoint)
        self._live().connect(endpoint)
        self.endpoint = endpoint

    @property
    def last_endpoint(self) -> str:
        """The address of the last bind, with wildcards resolved."""
        value = self._live().getsockopt(zmq.LAST_ENDPOINT)
        return value.decode() if isinstance(value, bytes) else str(value)

    @property
    def zmq_socket(self) -> zmq.asyncio.Socket:
        """The underlying socket, for monitors and options this class does not wrap.

        Do not send or receive through it: this class owns the socket's descriptor.
        """
        return self._live()

    def close(self) -> None:
        """Close with linger 0 (pending messages are dropped); idempotent.

        Operations still parked on the socket raise :class:`Closed`.
        """
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sync.FD)
        error = Closed(f"{self.name}: socket is closed")
        for fut in [*self._recv_waiters, *(f for _, _, f in self._send_waiters)]:
            if not fut.done():
                fut.set_exception(error)
        self._recv_waiters.clear()
        self._send_waiters.clear()
        self._held.clear()
        self._sock.close(linger=0)

    def __enter__(self) -> Socket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def statistics(self) -> SocketStatistics:
        """A snapshot of the counters."""
        return dataclasses.replace(self._stats, bad_by_reason=dict(self._stats.bad_by_reason))

    def _live(self) -> zmq.asyncio.Socket:
        if self._closed:
            raise Closed(f"{self.name}: socket is closed")
        return self._sock

    # ------------------------------------------------------------ the I/O path

    def _park(self) -> asyncio.Future[Any]:
        """A future for an operation that would block; the descriptor's reader finishes it."""
        self._stats.waits += 1
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._sync.FD, self._service)
        return self._loop.create_future()

    def _after_op(self, *, sends_only: bool = False) -> None:
        """An operation just ran on the socket: if another one is parked, look at EVENTS soon
        (the operation may have consumed the descriptor's edge that would have woken it).
        ``sends_only``: the operation was a receive that just found nothing, so parked
        receives have nothing to gain from a look."""
        if (self._send_waiters or (self._recv_waiters and not sends_only)) \
                and not self._service_soon:
            self._service_soon = True
            assert self._loop is not None  # something is parked, so the loop is known
            self._loop.call_soon(self._service)

    def _yield_due(self) -> bool:
        """True every ``YIELD_EVERY`` operations that did not wait: the caller then yields to
        the loop (``await asyncio.sleep(0)``), so a fast sender or a busy stream cannot starve
        other tasks (a yield per message costs a loop turn, ~5 us, on every message). A plain
        call, not a coroutine: awaiting one costs ~0.5 us on every message, yield or not."""
        self._unyielded += 1
        if self._unyielded >= self.YIELD_EVERY:
            self._unyielded = 0
            return True
        return False

    def _service(self) -> None:
        """Finish parked operations while ZeroMQ says they can go (the descriptor's reader).

        Reading ``EVENTS`` processes the socket's commands, which also resets the
        descriptor. Up to :attr:`BATCH` operations per call, so one busy socket cannot hold
        the loop; when it stops there with work left, it runs again on the loop's next turn.
        """
        self._service_soon = False
        if self._closed:
            return
        sync = self._sync
        if self._recv_waiters and not self._send_waiters and self._recv_direct():
            return
        for _ in range(self.BATCH):
            try:
                events = int(sync.getsockopt(_EVENTS))
            except zmq.ZMQError as e:
                self._fail_all(e)
                return
            if events & _POLLOUT and self._send_waiters:
                frames, track, fut = self._send_waiters[0]
                if fut.done():  # cancelled while parked: it never leaves
                    self._send_waiters.popleft()
                    continue
                try:
                    tracker = send_multipart(sync, frames, track)
                except zmq.Again:
                    pass
                except zmq.ZMQError as e:
                    self._send_waiters.popleft()
                    fut.set_exception(self._send_error(e, None))
                    continue
                else:
                    self._send_waiters.popleft()
                    fut.set_result(tracker)
                    continue
            if events & _POLLIN and self._recv_waiters:
                rfut = self._recv_waiters[0]
                if rfut.done():
                    self._recv_waiters.popleft()
                    continue
                try:
                    frames = recv_multipart(sync)
                except zmq.Again:
                    continue
                except zmq.ZMQError as e:
                    self._fail_all(e)
                    return
                self._recv_waiters.popleft()
                rfut.set_result(frames)
                if self._recv_waiters or self._send_waiters:
                    continue
            return  # nothing parked can go (or nothing is parked): the next edge brings us back
        self._after_op()  # the batch ran out with work possibly left

    def _recv_direct(self) -> bool:
        """Only receives are parked, so the wake was most likely a message: read it for the
        first live one without asking ``EVENTS`` first (~3 us a wake). True when that
        finished the service: a message was handed over and nobody else waits (the read
        processed the socket's commands as ``EVENTS`` would; every receive looks at the
        socket again before it parks). False: the loop of :meth:`_service` goes on."""
        waiters = self._recv_waiters
        while waiters and waiters[0].done():  # cancelled while parked
            waiters.popleft()
        if not waiters:
            return True
        try:
            frames = recv_multipart(self._sync)
        except zmq.Again:
            return False  # woken for something else: EVENTS tells
        except zmq.ZMQError as e:
            self._fail_all(e)
            return True
        waiters.popleft().set_result(frames)
        return not waiters

    def _fail_all(self, e: zmq.ZMQError) -> None:
        error: BaseException = Closed(f"{self.name}: socket is closed") \
            if e.errno in (zmq.ENOTSOCK, zmq.ETERM) else e
        for fut in [*self._recv_waiters, *(f for _, _, f in self._send_waiters)]:
            if not fut.done():
                fut.set_exception(error)
        self._recv_waiters.clear()
        self._send_waiters.clear()

    async def _send_frames(self, frames: list[Any], *, track: bool = False,
                           peer: bytes | None = None) -> zmq.MessageTracker | None:
        """Send now if ZeroMQ takes it; else wait in line (order kept) for room."""
        if self._closed:
            self._live()  # raises Closed
        if not self._send_waiters:
            try:
                tracker: zmq.MessageTracker | None = send_multipart(self._sync, frames, track)
            except zmq.Again:
                pass
            except zmq.ZMQError as e:
                raise self._send_error(e, peer) from e
            else:
                self._count_sent(frames)
                if self._recv_waiters:  # (no send waits: checked above)
                    self._after_op()
                if self._yield_due():
                    await asyncio.sleep(0)
                return tracker
        fut = self._park()
        self._send_waiters.append((frames, track, fut))
        self._after_op()  # the failed send may have processed commands: look at EVENTS
        tracker = await fut
        self._count_sent(frames)
        return tracker

    def _count_sent(self, frames: list[Any]) -> None:
        self._stats.sent += 1
        self._stats.bytes_sent += sum(map(len, frames))

    def _send_error(self, e: zmq.ZMQError, peer: bytes | None) -> BaseException:
        if e.errno == zmq.EHOSTUNREACH and peer is not None:
            return PeerLost(peer)
        if e.errno in (zmq.ENOTSOCK, zmq.ETERM):
            return Closed(f"{self.name}: socket is closed")
        return e

    async def _recv_frames(self) -> list[zmq.Frame]:
        """The next multipart message's frames (zero-copy), in arrival order.

        While messages keep coming the socket is read directly; once a read found nothing
        it asks ``EVENTS`` first, which costs the same system call as a read that fails but
        not its exception (~5 us): a receiver that usually waits pays the cheap way.

        Cancelling a receive loses no message: one read for it before the cancellation
        reached it (it came as the wait was cancelled, or during the yield after a direct
        read) is held, and the next receive returns it. A cancelled parked wait is skipped
        by :meth:`_service`, never handed a message.
        """
        if self._closed:
            self._live()  # raises Closed
        if self._held:
            return self._held.popleft()
        sync = self._sync
        if not self._recv_waiters:
            try:
                if self._rx_hot or int(sync.getsockopt(_EVENTS)) & _POLLIN:
                    frames = recv_multipart(sync)
                    self._rx_hot = True
                    if self._send_waiters:  # (no receive waits: checked above)
                        self._after_op()
                    try:
                        if self._yield_due():
                            await asyncio.sleep(0)
                    except asyncio.CancelledError:
                        self._held.append(frames)
                        raise
                    return frames
            except zmq.Again:
                pass
            except zmq.ZMQError as e:
                if e.errno in (zmq.ENOTSOCK, zmq.ETERM):
                    raise Closed(f"{self.name}: socket is closed") from e
                raise
        self._rx_hot = False
        fut: asyncio.Future[list[zmq.Frame]] = self._park()
        self._recv_waiters.append(fut)
        if self._send_waiters:
            self._after_op(sends_only=True)
        try:
            frames = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._held.append(fut.result())  # handed over just as the wait was cancelled
            raise
        self._unyielded = 0  # that wait was a yield
        return frames

    # ------------------------------------------------------------ messages

    async def send(self, msg: Message, *, to: bytes | None = None,
                   track: bool = False) -> zmq.MessageTracker | None:
        """Send ``msg``; tensor frames of ``COPY_BELOW`` bytes and more go zero-copy (smaller
        ones are copied now): do not modify the tensors in place until sent.

        With ``track=True`` the result is a ``zmq.MessageTracker`` whose ``done`` says when
        ZeroMQ has let go of the tensors' memory (a pooled buffer may be reused then; see
        :mod:`digenrl.transport.staging`); else None.
        """
        if to is not None:
            raise ValueError(f"{self.name}: only a Router sends to a peer identity")
        return await self._send_frames(encode(msg), track=track)

    async def recv(self) -> tuple[bytes | None, Message]:
        """The next valid message and its sender's identity (ROUTER only, else None)."""
        while True:  # _recv_valid's loop, one coroutine less on every message
            peer, msg = self._accept(await self._recv_frames())
            if msg is not None:
                return peer, msg

    async def _recv_valid(self) -> tuple[list[zmq.Frame], bytes | None, Message]:
        """The next message that decodes and validates, with its frames and sender."""
        while True:
            frames = await self._recv_frames()
            peer, msg = self._accept(frames)
            if msg is not None:
                return frames, peer, msg

    def _accept(self, frames: list[zmq.Frame]) -> tuple[bytes | None, Message | None]:
        """The one place where received frames become messages (or are counted and dropped).

        Checks that concern a message's meaning rather than its bytes hook in here.
        """
        peer, body = self._split(frames)
        try:
            msg = decode(body, max_frame_bytes=self.options.max_frame_bytes,
                         max_frames=self.options.max_frames)
        except ProtocolError as e:
            self._on_bad_frames(peer, frames, e)
            return peer, None
        self._stats.received += 1
        return peer, msg

    def _split(self, frames: list[zmq.Frame]) -> tuple[bytes | None, list[zmq.Frame]]:
        return None, frames

    def _on_bad_frames(self, peer: bytes | None, frames: list[zmq.Frame],
                       error: ProtocolError) -> None:
        stats = self._stats
        self.last_bad = error
        stats.bad_frames += 1
        stats.bad_by_reason[error.reason] = stats.bad_by_reason.get(error.reason, 0) + 1
        # rate-limited: a hostile peer must not be able to flood the logs (counters stay exact)
        n = stats.bad_frames
        if n <= 10 or (n & (n - 1)) == 0:
            log.warning("bad_frames_dropped", socket=self.name, peer=_peer_name(peer, frames),
                        reason=error.reason, error=str(error), total_bad_frames=n)


def send_multipart(sock: zmq.Socket[Any], frames: list[Any],
                    track: bool) -> zmq.MessageTracker | None:
    """Send ``frames`` without blocking (zmq.Again if ZeroMQ cannot take the first); frames
    of :data:`~digenrl.transport.options.COPY_BELOW` bytes and more go zero-copy, smaller
    ones are copied.

    Frame by frame with int flags: pyzmq's ``send_multipart`` ORs enum flags per frame
    (~3 us each). Once ZeroMQ took the first frame it takes the rest (a multipart message is
    atomic). With ``track``, one tracker over *every* zero-copy frame: pyzmq's
    ``send_multipart`` returns the last frame's only, which for a chunk is the 4-byte
    log-prob, copied and done at once.
    """
    if not track:  # the common case, without the trackers' bookkeeping
        for f in frames[:-1]:
            _send(sock, f, _MORE, len(f) < COPY_BELOW, False)
        f = frames[-1]
        _send(sock, f, _NOBLOCK, len(f) < COPY_BELOW, False)
        return None
    last = len(frames) - 1
    trackers = []
    for i, f in enumerate(frames):
        flags = _MORE if i < last else _NOBLOCK
        if len(f) < COPY_BELOW:
            _send(sock, f, flags, True, False)  # copied now: never tracked
        else:
            tracker = _send(sock, f, flags, False, track)
            if track and tracker is not None and not tracker.done:
                trackers.append(tracker)
    return zmq.MessageTracker(*trackers) if track else None


_send = zmq.backend.Socket.send
"""pyzmq's own send, under its Python wrapper (which only adds DRAFT routing ids and groups,
~1 us a frame); every frame's copy-or-not decided here by :data:`COPY_BELOW`, as pyzmq's
``copy_threshold`` would (a copying send is ~0.5 us against ~1.8 for the wrapped zero-copy
call that then copies)."""


def recv_multipart(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """The next multipart message's frames, zero-copy, without blocking (zmq.Again if none).

    Each frame's ``more`` says whether another follows: pyzmq's ``recv_multipart`` asks
    ``getsockopt(RCVMORE)`` per frame instead, which builds a ``SocketOption`` enum each time
    (~1-3 us a frame, on every chunk's four frames). Once the first frame is read the rest
    are there (a multipart message is atomic).
    """
    recv = sock.recv
    frame = recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


def _peer_name(peer: bytes | None, frames: list[zmq.Frame]) -> str:
    if peer is not None:
        return peer.hex()
    try:  # the TCP peer's address; ipc and inproc have none
        return str(frames[0].get("Peer-Address"))
    except (zmq.ZMQError, IndexError):
        return "unknown"
