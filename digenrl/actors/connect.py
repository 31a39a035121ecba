"""A node's wait for its coordinator's Welcome, and what it says when none comes.

A node needs only the coordinator's address; when that address is wrong, ZeroMQ retries
quietly forever. :func:`wait_welcome` bounds the silence: with no Welcome within
``--connect-timeout`` it looks at what answers there (:func:`probe`) and says so --
refused (nothing listens), not ZeroMQ (an HTTP server, other bytes), no Welcome (a ZeroMQ peer
that stays silent, or a socket of another type) -- then keeps waiting (ZeroMQ reconnects with
backoff) and says it again at growing intervals, or stops with :class:`ConnectFailed` when
``--exit-on-connect-failure`` asks it to. A frame of another protocol version stops the node at
once, naming both versions: waiting cannot fix it. The Hello is never re-sent (a coordinator
takes a second Hello for a restarted node).

:func:`probe` speaks just enough ZMTP 3 (the greeting and a NULL-mechanism READY, RFC 23) on a
separate plain connection to read the peer's socket type; a ZeroMQ peer greets first, so a
server that stays silent is not one.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass
from typing import Any

import zmq

from digenrl.transport.codec import PROTOCOL_VERSION, Message
from digenrl.transport.endpoints import Endpoint
from digenrl.transport.errors import VersionMismatch
from digenrl.transport.protocol import Shutdown, Welcome
from digenrl.transport.socketio import Socket

POLL_S = 0.1
"""How often the wait looks at frames the control socket dropped (another protocol version)."""

RECONNECT_IVL_MAX_MS = 5000
"""ZeroMQ's reconnect interval doubles from its default up to this while nothing answers."""

_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
_GREETING = _SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + bytes(31)


class ConnectFailed(RuntimeError):
    """The coordinator cannot be reached or spoken to; ``code`` is the node's exit code
    (1: nothing usable answers, a supervisor may retry; 3: refused, as a coordinator's refusal)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, kw_only=True)
class ConnectPolicy:
    """``--connect-timeout`` and ``--exit-on-connect-failure``."""

    timeout_s: float = 30.0  # no Welcome for this long: say what answers
    exit_on_failure: bool = False  # then stop (ConnectFailed) instead of waiting on
    repeat_max_s: float = 300.0  # the message repeats at doubling intervals up to this


def _ready(socket_type: bytes) -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return b"\x04" + bytes([len(body)]) + body


def _read(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes, fewer if the peer closes or goes quiet (the socket's timeout)."""
    data = b""
    with contextlib.suppress(TimeoutError, OSError):
        while len(data) < n:
            more = sock.recv(n - len(data))
            if not more:
                break
            data += more
    return data


def _socket_type(ready: bytes) -> str | None:
    """The Socket-Type property of a ZMTP READY command (flags, size, body), or None."""
    if len(ready) < 2 or ready[0] not in (0x04, 0x06):
        return None
    body = ready[2:] if ready[0] == 0x04 else ready[9:]
    if body[:6] != b"\x05READY":
        return None
    i = 6
    while i < len(body):
        name = body[i + 1:i + 1 + body[i]]
        i += 1 + body[i]
        (size,) = struct.unpack(">I", body[i:i + 4] or b"\0\0\0\0")
        value = body[i + 4:i + 4 + size]
        i += 4 + size
        if name.lower() == b"socket-type":
            return value.decode("ascii", "replace")
    return None


def _connect(ep: Endpoint, timeout_s: float) -> socket.socket | str:
    """A plain connection to ``ep``, or what went wrong, in words."""
    if ep.scheme == "ipc":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        where = ep.address
        target: Any = ep.address
    else:
        port = ep.address.rsplit(":", 1)[-1]
        where = f"{ep.host}:{port}"
        try:
            family, kind, proto, _, target = socket.getaddrinfo(ep.host, int(port), type=socket.SOCK_STREAM)[0]
        except (socket.gaierror, ValueError) as e:
            return f"refused: cannot resolve {ep.host!r} ({e})"
        s = socket.socket(family, kind, proto)
    s.settimeout(timeout_s)
    try:
        s.connect(target)
    except ConnectionRefusedError:
        s.close()
        return f"refused: nothing listens at {where} (connection refused)"
    except FileNotFoundError:
        s.close()
        return f"refused: no socket file at {where}"
    except TimeoutError:
        s.close()
        return f"no answer: connecting to {where} timed out (no such host, or a firewall drops it)"
    except OSError as e:
        s.close()
        return f"refused: {e.strerror or e}"
    return s


def probe(endpoint: str, timeout_s: float = 1.0) -> str:
    """What answers at ``endpoint``, in words (blocking, at most a few ``timeout_s``)."""
    ep = Endpoint.parse(endpoint)
    if ep.scheme == "inproc":
        return "no Welcome (an inproc endpoint: the coordinator runs in this process)"
    conn = _connect(ep, timeout_s)
    if isinstance(conn, str):
        return conn
    with conn:
        first = _read(conn, len(_SIGNATURE))
        if not first:  # a ZeroMQ peer greets at once; an HTTP server waits for a request
            with contextlib.suppress(OSError):
                conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
            reply = _read(conn, 64)
            if reply.startswith(b"HTTP/"):
                line = reply.split(b"\r\n", 1)[0].decode("ascii", "replace")
                return f"not ZeroMQ: an HTTP server answers ({line!r})"
            if reply:
                return f"not ZeroMQ: the peer answered {len(reply)} bytes that are no ZeroMQ greeting"
            return "not ZeroMQ: the peer accepts connections but sends nothing (a ZeroMQ peer greets first)"
        if first[:1] != b"\xff" or (len(first) == len(_SIGNATURE) and first[9:10] != b"\x7f"):
            if first.startswith(b"HTTP/"):
                return "not ZeroMQ: an HTTP server answers"
            return f"not ZeroMQ: the peer sent bytes that are no ZeroMQ greeting ({first[:8]!r}...)"
        with contextlib.suppress(OSError):
            conn.sendall(_GREETING)
        rest = _read(conn, 64 - len(first))
        greeting = first + rest
        if len(greeting) < 64:
            return "no Welcome: a ZeroMQ peer of an older protocol (ZMTP 1 or 2), or one that hung up"
        mechanism = greeting[12:32].rstrip(b"\0").decode("ascii", "replace")
        if mechanism != "NULL":
            return (f"no Welcome: a ZeroMQ peer using {mechanism} security answers (this node's keys "
                    "or transport.curve may not match it)")
        with contextlib.suppress(OSError):
            conn.sendall(_ready(b"DEALER"))
        head = _read(conn, 2)
        size = head[1] if len(head) == 2 and head[0] == 0x04 else 0
        kind = _socket_type(head + _read(conn, size)) if size else None
    if kind is None:
        return "no Welcome: a ZeroMQ peer answers, but its handshake names no socket type"
    if kind != "ROUTER":
        return (f"no Welcome: a ZeroMQ {kind} socket answers; the coordinator's control socket is "
                "a ROUTER (another port of the run, or another program?)")
    return ("no Welcome: a ZeroMQ ROUTER answers but sends no Welcome (a coordinator waiting for "
            "other trainer ranks, a stuck one, or another program's socket)")


def _seen_on(control: Socket) -> str:
    bad = control.statistics().bad_frames
    return f"; {bad} frame(s) from it were not DigenRL messages" if bad else ""


async def wait_welcome(control: Socket, endpoint: str, policy: ConnectPolicy, log: Any,
                       hello: Message) -> Welcome | Shutdown:
    """Send ``hello`` on ``control``, then the coordinator's first Welcome or Shutdown.

    The Hello itself is under the same watch: a DEALER holds a send until some peer completed
    its handshake, which a wrong peer (a PUB, an HTTP server) never does. Raises
    :class:`ConnectFailed` on a frame of another protocol version, and after
    ``policy.timeout_s`` without an answer when ``policy.exit_on_failure``."""
    control.zmq_socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline, interval = t0 + policy.timeout_s, policy.timeout_s
    unsent: Message | None = hello
    while True:
        msg: Message | None = None
        try:
            async with asyncio.timeout(POLL_S):
                if unsent is not None:
                    await control.send(unsent)  # a send cancelled while parked is never sent
                    unsent = None
                else:
                    _, msg = await control.recv()
        except TimeoutError:
            pass
        error = control.last_bad
        if isinstance(error, VersionMismatch) and type(error.peer_version) is int:
            raise ConnectFailed(f"the coordinator at {endpoint} speaks protocol version "
                                f"{error.peer_version}, this node speaks {PROTOCOL_VERSION}: run the "
                                "same DigenRL version on every node", code=3)
        if isinstance(msg, Welcome | Shutdown):
            return msg
        if msg is not None:
            # nothing else is sent before Welcome (a restarted node may get its old
            # incarnation's last messages): say so, then keep waiting for Welcome
            log.warning("unexpected_message", socket="control", msg=type(msg).__name__,
                        why="before Welcome")
        now = loop.time()
        if now < deadline:
            continue
        saw = await asyncio.to_thread(probe, endpoint, min(1.0, policy.timeout_s))
        saw += _seen_on(control)
        waited = now - t0
        if policy.exit_on_failure:
            raise ConnectFailed(f"no Welcome from the coordinator at {endpoint} within "
                                f"{waited:.3g} s: {saw}")
        interval = min(interval * 2, policy.repeat_max_s)
        log.warning("no_welcome", coordinator=endpoint, waited_s=round(waited, 1), saw=saw,
                    next_report_s=round(interval, 1),
                    hint="still waiting (digenrl-node --exit-on-connect-failure stops instead)")
        deadline = loop.time() + interval
