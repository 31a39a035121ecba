"""Thin asyncio wrappers over zmq.asyncio sockets that speak :mod:`digenrl.transport.protocol`.

One class, :class:`Socket`, with a subclass per ZeroMQ kind. Only the blocking
operations are ``async`` (``send``, ``recv``, ``wait_subscribed``). The
``zmq.asyncio.Context`` is always passed in, never created here.

| class  | ZeroMQ kind | send                    | recv returns            |
|--------|-------------|-------------------------|-------------------------|
| Router | ROUTER      | ``send(msg, to=peer)``  | ``(peer identity, msg)`` |
| Dealer | DEALER      | ``send(msg)``           | ``(None, msg)``          |
| Push   | PUSH        | ``send(msg)``           | (none)                   |
| Pull   | PULL        | (none)                  | ``(None, msg)``          |
| Pub    | XPUB        | ``send(msg)``           | ``wait_subscribed()``    |
| Sub    | SUB         | (none)                  | ``(None, msg)``          |

A message that does not decode is counted in :meth:`Socket.statistics`, logged with
the peer, and dropped; ``recv`` keeps waiting for the next one, so a peer can never
crash a node with bytes. A ROUTER also answers a peer speaking another protocol
version with a ``Shutdown`` that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket as pysocket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import structlog
import zmq
import zmq.asyncio

from digenrl.transport.errors import (
    Closed,
    EndpointError,
    PeerLost,
    ProtocolError,
    VersionMismatch,
)
from digenrl.transport.protocol import (
    DEFAULT_MAX_FRAMES,
    INT_MAX,
    INT_MIN,
    PROTOCOL_VERSION,
    Message,
    Shutdown,
    decode,
    encode,
)

if TYPE_CHECKING:
    from digenrl.config import Config

log = structlog.get_logger("digenrl.transport")


class SocketSecurity(Protocol):
    """Anything that sets a socket's security options before bind/connect (see curve.py)."""

    def apply(self, sock: zmq.Socket) -> None: ...


@dataclass(frozen=True, kw_only=True)
class SocketOptions:
    """Limits and keepalive settings shared by every socket of a node."""

    max_frame_bytes: int = 256 << 20  # ZMQ_MAXMSGSIZE: a peer sending a larger frame is cut off
    hwm: int = 64  # send and receive high-water marks, messages
    max_frames: int = DEFAULT_MAX_FRAMES  # frames per message the decoder accepts
    heartbeat_s: float | None = None  # ZMTP PING interval; None leaves ZMTP heartbeats off
    heartbeat_misses: int = 10  # the connection is dropped after this many silent intervals

    @classmethod
    def from_config(cls, cfg: Config) -> SocketOptions:
        """Options from ``cfg.transport`` (limits) and ``cfg.runtime`` (heartbeat interval)."""
        return cls(max_frame_bytes=cfg.transport.max_frame_bytes, hwm=cfg.transport.hwm,
                   heartbeat_s=cfg.runtime.heartbeat_s,
                   heartbeat_misses=cfg.runtime.heartbeat_misses)


@dataclass(frozen=True)
class Endpoint:
    """A parsed ZeroMQ address: ``scheme`` (tcp, ipc, inproc) and ``address`` after ``://``."""

    scheme: str
    address: str

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Split ``text``; raises EndpointError naming it if it is not tcp/ipc/inproc."""
        scheme, sep, address = text.partition("://")
        if not sep or scheme not in ("tcp", "ipc", "inproc") or not address:
            raise EndpointError(f"endpoint {text!r}: expected tcp://host:port, ipc://path or "
                                "inproc://name")
        if scheme == "tcp" and ":" not in address:
            raise EndpointError(f"endpoint {text!r}: tcp needs host:port")
        return cls(scheme, address)

    @property
    def host(self) -> str:
        """The tcp host (brackets of an IPv6 literal removed); '' for ipc and inproc."""
        if self.scheme != "tcp":
            return ""
        dest = self.address.rsplit(";", 1)[-1]  # "source;destination" form of connect
        return dest.rsplit(":", 1)[0].strip("[]")

    @property
    def is_loopback(self) -> bool:
        """True when traffic cannot leave the machine (ipc, inproc, tcp to 127/8, ::1, localhost)."""
        if self.scheme != "tcp":
            return True
        host = self.host
        return host.startswith("127.") or host in ("::1", "localhost")

    def __str__(self) -> str:
        return f"{self.scheme}://{self.address}"


def is_loopback(endpoint: str) -> bool:
    """Whether ``endpoint`` stays on this machine; binding ``tcp://*`` is not loopback."""
    return Endpoint.parse(endpoint).is_loopback


@dataclass
class SocketStatistics:
    """Counters of one socket; ``bad_by_reason`` keys are ProtocolError reasons."""

    sent: int = 0
    received: int = 0
    bytes_sent: int = 0  # frame bytes of the messages sent (tensor payloads included)
    bad_frames: int = 0
    bad_by_reason: dict[str, int] = field(default_factory=dict)


class Socket:
    """A ZeroMQ socket that sends and receives protocol messages (see the module table)."""

    KIND: ClassVar[int]

    def __init__(self, ctx: zmq.asyncio.Context, *, options: SocketOptions | None = None,
                 identity: bytes | None = None, security: SocketSecurity | None = None,
                 name: str = "") -> None:
        if not isinstance(ctx, zmq.asyncio.Context):
            raise TypeError(f"expected a zmq.asyncio.Context, got {type(ctx).__name__}")
        self.options = options or SocketOptions()
        self.name = name or type(self).__name__.lower()
        self._stats = SocketStatistics()
        self._closed = False
        sock = ctx.socket(self.KIND)
        self._sock: zmq.asyncio.Socket = sock
        # A blocking-API view of the same socket for the non-blocking fast path: a ready
        # message is taken without creating a future and polling (~2x faster per message).
        self._sync = zmq.Socket.shadow(sock.underlying)
        self._pending_sends = 0
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.options.max_frame_bytes)
        sock.setsockopt(zmq.SNDHWM, self.options.hwm)
        sock.setsockopt(zmq.RCVHWM, self.options.hwm)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        if self.options.heartbeat_s is not None:
            ivl_ms = max(1, round(self.options.heartbeat_s * 1000))
            sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ivl_ms * self.options.heartbeat_misses)
            sock.setsockopt(zmq.HEARTBEAT_TTL, ivl_ms * self.options.heartbeat_misses)
        if security is not None:
            security.apply(sock)
        self._configure(sock)

    def _configure(self, sock: zmq.Socket) -> None:
        """Kind-specific options, set before bind/connect."""

    # ------------------------------------------------------------ lifecycle

    def bind(self, endpoint: str) -> str:
        """Bind and return the actual address (``tcp://127.0.0.1:*`` gets its real port)."""
        Endpoint.parse(endpoint)
        self._live().bind(endpoint)
        return self.last_endpoint

    def connect(self, endpoint: str) -> None:
        """Connect (asynchronously: ZeroMQ reconnects until the peer is there)."""
        Endpoint.parse(endpoint)
        self._live().connect(endpoint)

    @property
    def last_endpoint(self) -> str:
        """The address of the last bind, with wildcards resolved."""
        value = self._live().getsockopt(zmq.LAST_ENDPOINT)
        return value.decode() if isinstance(value, bytes) else str(value)

    @property
    def zmq_socket(self) -> zmq.asyncio.Socket:
        """The underlying socket, for monitors and options this class does not wrap."""
        return self._live()

    def close(self) -> None:
        """Close with linger 0 (pending messages are dropped); idempotent."""
        if not self._closed:
            self._closed = True
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

    # ------------------------------------------------------------ messages

    async def send(self, msg: Message, *, to: bytes | None = None) -> None:
        """Send ``msg`` (tensor frames zero-copy: do not modify them in place afterwards)."""
        if to is not None:
            raise ValueError(f"{self.name}: only a Router sends to a peer identity")
        await self._send_frames(encode(msg))

    async def _send_frames(self, frames: list[Any], peer: bytes | None = None) -> None:
        sock = self._live()
        try:
            if self._pending_sends:  # keep order behind sends already waiting
                raise zmq.Again()
            self._sync.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            self._rearm(sock)
            await asyncio.sleep(0)  # a yield, so a fast sender cannot starve other tasks
        except zmq.Again:
            self._pending_sends += 1
            try:
                await self._send_slow(sock, frames, peer)
            finally:
                self._pending_sends -= 1
        except zmq.ZMQError as e:
            self._raise_send_error(e, peer)
        self._stats.sent += 1
        self._stats.bytes_sent += sum(len(f) for f in frames)

    @staticmethod
    def _rearm(sock: zmq.asyncio.Socket) -> None:
        """Wake whoever waits on ``sock`` if the fast path just cleared its readiness signal.

        ZeroMQ's socket descriptor signals edges, not levels: a send or receive on the
        blocking view processes the socket's pending commands, which clears the signal of a
        message (or of room to send) that arrived meanwhile. A ``recv`` (or slow ``send``)
        parked on the asyncio socket then sleeps on with the message queued, forever if
        nothing else arrives. Reading ``EVENTS`` through the asyncio socket makes pyzmq
        schedule its waiters for whatever is ready (pyzmq does the same after its own sends).
        """
        sock.get(zmq.EVENTS)

    async def _send_slow(self, sock: zmq.asyncio.Socket, frames: list[Any],
                         peer: bytes | None) -> None:
        try:
            await sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as e:
            self._raise_send_error(e, peer)

    def _raise_send_error(self, e: zmq.ZMQError, peer: bytes | None) -> None:
        if e.errno == zmq.EHOSTUNREACH and peer is not None:
            raise PeerLost(peer) from e
        if e.errno in (zmq.ENOTSOCK, zmq.ETERM):
            raise Closed(f"{self.name}: socket is closed") from e
        raise e

    async def recv(self) -> tuple[bytes | None, Message]:
        """The next valid message and its sender's identity (ROUTER only, else None)."""
        while True:
            sock = self._live()
            try:
                try:
                    frames = self._sync.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    self._rearm(sock)
                    await asyncio.sleep(0)  # a yield, so a busy stream cannot starve other tasks
                except zmq.Again:
                    frames = await sock.recv_multipart(copy=False)
            except zmq.ZMQError as e:
                if e.errno in (zmq.ENOTSOCK, zmq.ETERM):
                    raise Closed(f"{self.name}: socket is closed") from e
                raise
            peer, body = self._split(frames)
            try:
                msg = decode(body, max_frame_bytes=self.options.max_frame_bytes,
                             max_frames=self.options.max_frames)
            except ProtocolError as e:
                await self._on_bad_frames(peer, frames, e)
                continue
            self._stats.received += 1
            return peer, msg

    def _split(self, frames: list[zmq.Frame]) -> tuple[bytes | None, list[zmq.Frame]]:
        return None, frames

    async def _on_bad_frames(self, peer: bytes | None, frames: list[zmq.Frame],
                             error: ProtocolError) -> None:
        stats = self._stats
        stats.bad_frames += 1
        stats.bad_by_reason[error.reason] = stats.bad_by_reason.get(error.reason, 0) + 1
        # rate-limited: a hostile peer must not be able to flood the logs (counters stay exact)
        n = stats.bad_frames
        if n <= 10 or (n & (n - 1)) == 0:
            log.warning("bad_frames_dropped", socket=self.name, peer=_peer_name(peer, frames),
                        reason=error.reason, error=str(error), total_bad_frames=n)


def _peer_name(peer: bytes | None, frames: list[zmq.Frame]) -> str:
    if peer is not None:
        return peer.hex()
    try:  # the TCP peer's address; ipc and inproc have none
        return str(frames[0].get("Peer-Address"))
    except (zmq.ZMQError, IndexError):
        return "unknown"


class Router(Socket):
    """ROUTER: many peers, addressed by identity; unroutable sends raise PeerLost."""

    KIND = zmq.ROUTER

    def _configure(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)

    async def send(self, msg: Message, *, to: bytes | None = None) -> None:
        """Send ``msg`` to the peer whose identity is ``to``."""
        if to is None:
            raise ValueError(f"{self.name}: a Router needs to=<peer identity>")
        await self._send_frames([to, *encode(msg)], peer=to)

    def _split(self, frames: list[zmq.Frame]) -> tuple[bytes | None, list[zmq.Frame]]:
        return frames[0].bytes, frames[1:]

    async def _on_bad_frames(self, peer: bytes | None, frames: list[zmq.Frame],
                             error: ProtocolError) -> None:
        await super()._on_bad_frames(peer, frames, error)
        if isinstance(error, VersionMismatch) and peer is not None:
            # Tell the peer why it hears nothing back, instead of letting it time out; in its
            # own version (Shutdown's layout is frozen), so that an older node can read it.
            refusal = Shutdown(reason=f"protocol version mismatch: {error}")
            theirs = error.peer_version
            version = theirs if type(theirs) is int and INT_MIN <= theirs <= INT_MAX else PROTOCOL_VERSION
            with contextlib.suppress(PeerLost):  # it already left; nothing to tell
                await self._send_frames([peer, *encode(refusal, version=version)], peer=peer)


class Dealer(Socket):
    """DEALER: one logical peer (the coordinator); sends block at the high-water mark."""

    KIND = zmq.DEALER


class Push(Socket):
    """PUSH: streams messages (chunks) to PULL peers; blocks at the high-water mark."""

    KIND = zmq.PUSH

    async def recv(self) -> tuple[bytes | None, Message]:
        raise TypeError("a Push socket cannot receive")


class Pull(Socket):
    """PULL: receives what PUSH peers stream."""

    KIND = zmq.PULL

    async def send(self, msg: Message, *, to: bytes | None = None) -> None:
        raise TypeError("a Pull socket cannot send")


class Pub(Socket):
    """Publisher (an XPUB, so it can see subscriptions arrive); drops at the high-water mark."""

    KIND = zmq.XPUB

    def _configure(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not only the first

    async def wait_subscribed(self) -> bytes:
        """Wait until a subscriber's subscription arrives; returns its topic prefix.

        Messages published after this returns reach that subscriber (no slow-joiner loss).
        """
        while True:
            frames = await self._live().recv_multipart()
            if frames and frames[0][:1] == b"\x01":
                return frames[0][1:]

    async def recv(self) -> tuple[bytes | None, Message]:
        raise TypeError("a Pub socket cannot receive messages; see wait_subscribed()")


class Sub(Socket):
    """Subscriber to everything a Pub publishes (the state it carries is small)."""

    KIND = zmq.SUB

    def _configure(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.SUBSCRIBE, b"")

    async def send(self, msg: Message, *, to: bytes | None = None) -> None:
        raise TypeError("a Sub socket cannot send")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (for rendezvous addresses)."""
    with pysocket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
