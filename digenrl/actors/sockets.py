"""Open the project's sockets by kind name, with the run's limits (one place for all actors)."""

from __future__ import annotations

from typing import Any

import zmq
import zmq.asyncio

from digenrl.config import Config
from digenrl.transport.sockets import Dealer, Pub, Pull, Push, Router, Socket, SocketOptions, Sub

KINDS: dict[str, type[Socket]] = {"router": Router, "dealer": Dealer, "pub": Pub, "sub": Sub,
                                  "push": Push, "pull": Pull}


def _make(ctx: zmq.asyncio.Context, kind: str, cfg: Config, *, identity: bytes | None,
          security: Any, name: str) -> Socket:
    return KINDS[kind](ctx, options=SocketOptions.from_config(cfg), identity=identity,
                       security=security, name=name or kind)


def bind(ctx: zmq.asyncio.Context, kind: str, endpoint: str, cfg: Config, *,
         identity: bytes | None = None, security: Any = None, handover: bool = False,
         name: str = "") -> Socket:
    """A bound socket; ``sock.endpoint`` is the resolved address (a ``*`` port filled in)."""
    sock = _make(ctx, kind, cfg, identity=identity, security=security, name=name)
    if handover:  # a restarted node reusing its identity takes over the old connection
        sock.zmq_socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.endpoint = sock.bind(endpoint)  # type: ignore[attr-defined]
    return sock


def connect(ctx: zmq.asyncio.Context, kind: str, endpoint: str, cfg: Config, *,
            identity: bytes | None = None, security: Any = None, name: str = "") -> Socket:
    sock = _make(ctx, kind, cfg, identity=identity, security=security, name=name)
    sock.connect(endpoint)
    sock.endpoint = endpoint  # type: ignore[attr-defined]
    return sock
