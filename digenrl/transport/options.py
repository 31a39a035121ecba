"""How every socket of a node is set up before bind/connect: lanes, limits, heartbeats.

:class:`SocketOptions` holds the limits and ZMTP heartbeat settings shared by a node's
sockets and applies them (with the socket's lane) to a new ZeroMQ socket;
:class:`SocketSecurity` is what sets a socket's security options (``transport/curve.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import zmq
import zmq.asyncio

from digenrl.transport.protocol import DEFAULT_MAX_FRAMES

if TYPE_CHECKING:
    from digenrl.config import Config


Lane = Literal["control", "bulk"]
LANES: tuple[Lane, ...] = ("control", "bulk")
"""A socket's lane picks its libzmq I/O thread in a :func:`node_context`: control messages
(heartbeats, assignments, commits) never wait behind a bulk transfer (chunks, weights, images)
in the I/O thread that reads and writes the TCP streams. Measured (docs/benchmarks.md,
Transport): a heartbeat's round trip under a 16 MiB chunk stream was 7.6-11x its idle time
with one I/O thread for both, 1.03-1.39x with one per lane."""


COPY_BELOW = 256 << 10
"""Frames smaller than this are copied into libzmq at send, larger ones go zero-copy (pyzmq's
``copy_threshold``, 64 KiB by default). A zero-copy send costs pyzmq a ``Frame``, a tracking
entry and, when libzmq lets go, a release message to its garbage-collector thread; below
this size a memcpy is cheaper. CPU per 2-frame chunk, both processes, raw pyzmq with every
frame copied over zero-copy (``bench/transport.py --sweep``, two runs, docs/benchmarks.md,
Transport): 64 KiB 0.77-0.92, 128 KiB 0.89-0.99, 256 KiB 1.07-1.08, 512 KiB 1.46-1.54,
1-2 MiB 1.48-1.8: copying pays below 256 KiB and costs above it."""


def node_context() -> zmq.asyncio.Context:
    """The ZeroMQ context of a node: one libzmq I/O thread per lane (see ``LANES``)."""
    return zmq.asyncio.Context(io_threads=len(LANES))


class SocketSecurity(Protocol):
    """Anything that sets a socket's security options before bind/connect (see curve.py)."""

    def apply(self, sock: zmq.Socket[Any]) -> None: ...


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

    def apply(self, sock: zmq.Socket[Any], ctx: zmq.Context[Any], *, identity: bytes | None,
              lane: Lane) -> None:
        """Set these options, the routing ``identity`` and the ``lane``'s I/O thread on a
        new socket of ``ctx`` (before bind/connect)."""
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        if int(ctx.get(zmq.IO_THREADS)) >= len(LANES):  # see node_context
            sock.setsockopt(zmq.AFFINITY, 1 << LANES.index(lane))
        # ZMTP heartbeats on control sockets only. libzmq 4.3.5 aborts a process (assertion
        # !_io_error, stream_engine_base.cpp:310) when a socket whose pipe is full (input
        # stopped) loses its peer and a heartbeat timer then writes a PING: a rollout dying, or
        # a hostile peer flooding and leaving, while a trainer's data PULL is at its high-water
        # mark would kill the trainer. Bulk peers' liveness is the coordinator's (application
        # heartbeats) and the weights fetch's own silence timeout.
        if self.heartbeat_s is not None and lane == "control":
            ivl_ms = max(1, round(self.heartbeat_s * 1000))
            sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ivl_ms * self.heartbeat_misses)
            sock.setsockopt(zmq.HEARTBEAT_TTL, ivl_ms * self.heartbeat_misses)
