"""Thin asyncio wrappers over zmq.asyncio sockets that speak :mod:`digenrl.transport.protocol`.

One subclass of :class:`~digenrl.transport.socketio.Socket` (the shared lifecycle and I/O
path) per ZeroMQ kind. Only the blocking operations are ``async`` (``send``, ``recv``,
``wait_subscribed``). The ``zmq.asyncio.Context`` is always passed in, never created here.

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
from typing import Any

import structlog
import zmq

from digenrl.transport.errors import PeerLost, ProtocolError, VersionMismatch
from digenrl.transport.protocol import (
    INT_MAX,
    INT_MIN,
    PROTOCOL_VERSION,
    Message,
    Shutdown,
    encode,
)
from digenrl.transport.socketio import Socket, send_multipart

log = structlog.get_logger("digenrl.transport")


def _user_id(frame: zmq.Frame) -> str | None:
    """The ZAP ``User-Id`` a received frame carries, or None (no ZAP on its connection)."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:  # EINVAL: the property is not set
        return None
    return user if isinstance(user, str) else None


class Router(Socket):
    """ROUTER: many peers, addressed by identity.

    A send to an identity that is not connected raises PeerLost. A send to a peer whose
    queue is at the high-water mark (it does not read) is dropped and counted in
    ``statistics().dropped``, as ZeroMQ's ROUTER semantics have it: one slow peer must not
    hold the sender's other peers up, and a ROUTER cannot wait for room per peer.
    """

    KIND = zmq.ROUTER

    def _configure(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)

    async def send(self, msg: Message, *, to: bytes | None = None,
                   track: bool = False) -> zmq.MessageTracker | None:
        """Send ``msg`` to the peer whose identity is ``to`` (dropped if its queue is full).

        ``track``: as :meth:`Socket.send`; a dropped message's tracker is done at once.
        """
        if to is None:
            raise ValueError(f"{self.name}: a Router needs to=<peer identity>")
        tracker = self.send_nowait([to, *encode(msg)], to, track=track)
        if self._yield_due():
            await asyncio.sleep(0)
        return tracker if track else None

    def send_nowait(self, frames: list[Any], peer: bytes, *,
                    track: bool = False) -> zmq.MessageTracker | None:
        """Send ``frames`` (identity first) now. Returns a tracker (``track``) or None, and a
        done tracker (or None) when the peer's queue was full and the message was dropped
        (counted in ``statistics().dropped``)."""
        if self._closed:
            self._live()  # raises Closed
        try:
            tracker = send_multipart(self._sync, frames, track)
        except zmq.Again:
            stats = self._stats
            stats.dropped += 1
            n = stats.dropped
            if n <= 10 or (n & (n - 1)) == 0:
                log.warning("send_dropped_at_hwm", socket=self.name, peer=peer.hex(),
                            total_dropped=n)
            return zmq.MessageTracker() if track else None
        except zmq.ZMQError as e:
            raise self._send_error(e, peer) from e
        finally:
            if self._send_waiters or self._recv_waiters:
                self._after_op()
        self._count_sent(frames)
        return tracker

    async def recv_authenticated(self) -> tuple[bytes, str | None, Message]:
        """The next valid message, its sender's identity and the ``User-Id`` its connection
        was admitted with (CurveZMQ: the client key's name, see ``transport/curve.py``; None
        on a connection without ZAP, e.g. loopback plain text)."""
        frames, peer, msg = await self._recv_valid()
        assert peer is not None  # a ROUTER's first frame is its sender
        return peer, _user_id(frames[0]), msg

    def _split(self, frames: list[zmq.Frame]) -> tuple[bytes | None, list[zmq.Frame]]:
        return frames[0].bytes, frames[1:]

    def _on_bad_frames(self, peer: bytes | None, frames: list[zmq.Frame],
                       error: ProtocolError) -> None:
        super()._on_bad_frames(peer, frames, error)
        if isinstance(error, VersionMismatch) and peer is not None:
            # Tell the peer why it hears nothing back, instead of letting it time out; in its
            # own version (Shutdown's layout is frozen), so that an older node can read it.
            refusal = Shutdown(reason=f"protocol version mismatch: {error}")
            theirs = error.peer_version
            version = theirs if type(theirs) is int and INT_MIN <= theirs <= INT_MAX else PROTOCOL_VERSION
            with contextlib.suppress(PeerLost):  # it already left; nothing to tell
                self.send_nowait([peer, *encode(refusal, version=version)], peer)


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

    async def send(self, msg: Message, *, to: bytes | None = None,
                   track: bool = False) -> zmq.MessageTracker | None:
        raise TypeError("a Pull socket cannot send")


class Pub(Socket):
    """Publisher (an XPUB, so it can see subscriptions arrive); drops at the high-water mark."""

    KIND = zmq.XPUB

    MAX_SUBSCRIPTION_BYTES = 4096
    """A subscription is a topic prefix (this project's are empty): a peer sending a larger
    message is disconnected by ZeroMQ before it is buffered (8 MiB ones were once kept)."""

    def _configure(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not only the first
        sock.setsockopt(zmq.MAXMSGSIZE, self.MAX_SUBSCRIPTION_BYTES)

    async def drain_subscriptions(self) -> None:
        """Read (un)subscription messages until cancelled, counting them in ``received``. An
        XPUB queues every one for the application; a publisher that never reads them would
        hold each forever."""
        while True:
            await self._recv_frames()
            self._stats.received += 1

    async def wait_subscribed(self) -> bytes:
        """Wait until a subscriber's subscription arrives; returns its topic prefix.

        Messages published after this returns reach that subscriber (no slow-joiner loss).
        """
        while True:
            frames = await self._recv_frames()
            first = frames[0].bytes if frames else b""
            if first[:1] == b"\x01":
                return first[1:]

    async def recv(self) -> tuple[bytes | None, Message]:
        raise TypeError("a Pub socket cannot receive messages; see wait_subscribed()")


class Sub(Socket):
    """Subscriber to everything a Pub publishes (the state it carries is small)."""

    KIND = zmq.SUB

    def _configure(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.SUBSCRIBE, b"")

    async def send(self, msg: Message, *, to: bytes | None = None,
                   track: bool = False) -> zmq.MessageTracker | None:
        raise TypeError("a Sub socket cannot send")

