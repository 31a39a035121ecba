"""Open the project's sockets by kind name, with the run's limits and security (one place).

Every socket opened here is registered with its context's
:class:`~digenrl.transport.security.NodeSecurity`, which picks CurveZMQ or plain text from the
node's ``transport`` config and the address (see that module's table), refuses plain text
on a non-loopback address unless allowed, and counts bad frames over all of them. Passing
``security=`` explicitly overrides the decision (tests, tools).
"""

from __future__ import annotations

from typing import Any

import zmq
import zmq.asyncio

from digenrl.config import Config
from digenrl.transport.options import Lane, SocketOptions
from digenrl.transport.security import NodeSecurity, node_security
from digenrl.transport.socketio import Socket
from digenrl.transport.sockets import Dealer, Pub, Pull, Push, Router, Sub


class _Tracked:
    """Mixin: tell the context's NodeSecurity when the socket closes."""

    node_security: NodeSecurity

    def close(self) -> None:
        super().close()  # type: ignore[misc]
        self.node_security.closed(self)


KINDS: dict[str, type[Socket]] = {"router": Router, "dealer": Dealer, "pub": Pub, "sub": Sub,
                                  "push": Push, "pull": Pull}
_TRACKED: dict[str, type[Socket]] = {
    k: type(cls.__name__, (_Tracked, cls), {"__doc__": cls.__doc__}) for k, cls in KINDS.items()}


def _make(ctx: zmq.asyncio.Context, kind: str, cfg: Config, *, identity: bytes | None,
          security: Any, name: str, sec: NodeSecurity, lane: Lane) -> Socket:
    sock = _TRACKED[kind](ctx, options=SocketOptions.from_config(cfg), identity=identity,
                          security=security, name=name or kind, lane=lane)
    sock.node_security = sec  # type: ignore[attr-defined]
    sec.track(sock)
    return sock


def bind(ctx: zmq.asyncio.Context, kind: str, endpoint: str, cfg: Config, *,
         identity: bytes | None = None, security: Any = None, handover: bool = False,
         name: str = "", lane: Lane = "control") -> Socket:
    """A bound socket; ``sock.endpoint`` is the resolved address (a ``*`` port filled in).
    ``lane``: "bulk" for sockets that carry chunks, weights or images (see ``node_context``).

    Raises :class:`~digenrl.transport.security.PlaintextRefused` or
    :class:`~digenrl.transport.curve.CurveKeyError` (both ValueError) when the address needs
    CurveZMQ and it cannot be had.
    """
    sec = node_security(ctx, cfg.transport)
    if security is None:
        security = sec.for_bind(endpoint)
    sock = _make(ctx, kind, cfg, identity=identity, security=security, name=name, sec=sec, lane=lane)
    try:
        if handover:  # a restarted node reusing its identity takes over the old connection
            sock.zmq_socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.bind(endpoint)
    except BaseException:
        sock.close()
        raise
    return sock


def connect(ctx: zmq.asyncio.Context, kind: str, endpoint: str, cfg: Config, *,
            identity: bytes | None = None, security: Any = None, name: str = "",
            lane: Lane = "control") -> Socket:
    """A connected socket (ZeroMQ connects in the background and retries); ``lane`` as for
    :func:`bind`."""
    sec = node_security(ctx, cfg.transport)
    if security is None:
        security = sec.for_connect(endpoint)
    sock = _make(ctx, kind, cfg, identity=identity, security=security, name=name, sec=sec, lane=lane)
    try:
        sock.connect(endpoint)
    except BaseException:
        sock.close()
        raise
    return sock
