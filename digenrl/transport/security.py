"""Node hardening: which sockets speak CurveZMQ, the ZAP allow-list, and the node's counters.

One :class:`NodeSecurity` per ZeroMQ context (= per node process) decides, from the node's
own ``transport`` config, what security each socket gets (``transport/factory.py`` asks it on
every bind and connect, so callers need not know):

| transport.curve | loopback address (127/8, ::1, ipc) | any other address (``*``, ``0.0.0.0``, 10.x)     |
|-----------------|------------------------------------|---------------------------------------------------|
| ``on``          | CURVE                              | CURVE                                             |
| ``auto``        | plain text                         | CURVE; without ``keys_dir``: refused, or plain    |
|                 |                                    | text with a loud warning when allow_plaintext     |
| ``off``         | plain text                         | refused unless allow_plaintext (then warns)       |

Servers (coordinator ROUTER + PUB, trainer PULL + weights ROUTER) use the ``server`` key
pair of ``keys_dir``; clients the ``transport.client_key`` pair (default ``client``) and the
server's public key. Which clients may connect is decided by a ZAP handler
(:class:`~digenrl.transport.curve.Authenticator`) admitting every ``*.key`` of ``keys_dir``
except ``server.key``. A client with any other key never completes its handshake: no byte
of it reaches the node's code. Every message of an admitted connection carries its key's
name as ZeroMQ's ``User-Id``; the coordinator binds a node id to it at ``Hello`` (a key named
after a node id may speak only as that node, and that node only with it; the shared
``client`` key as any node id that has no key of its own).

The ZAP handler runs on its own thread with its own small event loop. Why not a task in
the actor's TaskGroup: the coordinator's sockets are bound before any actor exists
(``serve_coordinator``), and a handshake that arrives while no handler serves is refused
for good. The thread is started by the first CURVE bind and stopped (joined, its socket
closed) when the last socket this object tracks is closed, so ``ctx.term()`` never waits
on it. That last close also logs the node's final counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio

from digenrl.config import TransportConfig
from digenrl.transport.curve import (
    Authenticator,
    CurveClient,
    CurveKeyError,
    CurveServer,
    load_keypair,
    load_public_key,
)
from digenrl.transport.endpoints import is_loopback

log = structlog.get_logger("digenrl.security")

SERVER_KEY = "server"
CLIENT_KEY = "client"


class PlaintextRefused(ValueError):
    """A plain-text socket on a non-loopback address without ``allow_plaintext``."""


def _keys_hint(keys_dir: str) -> str:
    folder = keys_dir or "/etc/digenrl/keys"
    return (f"create them with `digenrl keys generate {folder}` and set "
            f"transport.keys_dir = \"{folder}\" on every machine")


def allowed_client_keys(keys_dir: str | Path) -> dict[str, bytes]:
    """Name -> public key of every ``*.key`` in ``keys_dir`` except the server's (the ZAP
    allow-list; the name is what the connection's messages carry as ``User-Id``)."""
    folder = Path(keys_dir)
    return {p.stem: load_public_key(folder, p.stem) for p in sorted(folder.glob("*.key"))
            if p.stem != SERVER_KEY}


class _ZapThread:
    """An :class:`Authenticator` serving on a thread; ``start`` returns once it is bound."""

    def __init__(self, ctx: zmq.Context[Any], allowed: dict[str, bytes]) -> None:
        self._address = ctx.underlying
        self._allowed = allowed
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.auth: Authenticator | None = None
        self._thread = threading.Thread(target=self._run, name="digenrl-zap", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # stop() cancels serve(): the way out
            asyncio.run(self._main())

    async def _main(self) -> None:
        actx = zmq.asyncio.Context.shadow(self._address)  # same context, asyncio view
        try:
            self.auth = Authenticator(actx, allowed=self._allowed)
        except BaseException as e:  # handed to start()'s caller, who raises it
            self._error = e
            self._ready.set()
            return
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._ready.set()
        try:
            await self.auth.serve()
        finally:
            self.auth.close()

    def stop(self) -> None:
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join()


class NodeSecurity:
    """Security decisions and counters for every socket of one zmq context (see module doc)."""

    def __init__(self, ctx: zmq.Context[Any], transport: TransportConfig) -> None:
        self.transport = transport
        self._ctx = ctx
        self._zap: _ZapThread | None = None
        self._open: dict[int, Any] = {}
        self._closed_bad_frames = 0
        self._closed_bad_by_socket: dict[str, int] = {}
        self.warnings = 0

    # ------------------------------------------------------------------ decisions
    def _wants_curve(self, endpoint: str, *, what: str) -> bool:
        t = self.transport
        local = is_loopback(endpoint)
        if t.curve == "on":
            return True
        if local:
            return False
        if t.curve == "auto" and t.keys_dir:
            return True
        if not t.allow_plaintext:
            why = ("transport.curve = \"off\"" if t.curve == "off"
                   else "transport.keys_dir is empty, so CurveZMQ has no keys")
            raise PlaintextRefused(
                f"refusing to {what} {endpoint} in plain text ({why}): it is not a loopback "
                f"address. Use CurveZMQ ({_keys_hint(t.keys_dir)}), or pass --allow-plaintext "
                "(transport.allow_plaintext = true) on a network you trust")
        self.warnings += 1
        log.warning("PLAINTEXT_ON_NETWORK", endpoint=endpoint, action=what,
                    detail="traffic (weights, latents, control) is unencrypted and "
                           "unauthenticated; anyone who can reach this address can join the run")
        return False

    def _keypair(self, name: str) -> Any:
        folder = self.transport.keys_dir
        if not folder:
            raise CurveKeyError(f"transport.curve = {self.transport.curve!r} needs keys but "
                                f"transport.keys_dir is empty: {_keys_hint(folder)}")
        try:
            return load_keypair(folder, name)
        except CurveKeyError as e:
            raise CurveKeyError(f"{e}; {_keys_hint(folder)}") from e

    def for_bind(self, endpoint: str) -> CurveServer | None:
        """Security for a server socket bound at ``endpoint`` (starts the ZAP handler)."""
        if not self._wants_curve(endpoint, what="bind"):
            return None
        server = CurveServer(keypair=self._keypair(SERVER_KEY))
        if self._zap is None:
            allowed = allowed_client_keys(self.transport.keys_dir)
            if not allowed:
                raise CurveKeyError(f"no client keys (*.key besides server.key) in "
                                    f"{self.transport.keys_dir}: {_keys_hint(self.transport.keys_dir)}")
            zap = _ZapThread(self._ctx, allowed)
            zap.start()
            self._zap = zap
        return server

    def for_connect(self, endpoint: str) -> CurveClient | None:
        """Security for a client socket connecting to ``endpoint``."""
        if not self._wants_curve(endpoint, what="connect to"):
            return None
        folder = self.transport.keys_dir
        try:
            server_public = load_public_key(folder, SERVER_KEY)
        except CurveKeyError as e:
            raise CurveKeyError(f"{e}; {_keys_hint(folder)}") from e
        return CurveClient(keypair=self._keypair(self.transport.client_key or CLIENT_KEY),
                           server_public=server_public)

    def key_names(self) -> frozenset[str]:
        """Names of the client keys this node's ZAP handler admits (empty without CURVE)."""
        auth = self._zap.auth if self._zap is not None else None
        return frozenset(auth.names.values()) if auth is not None else frozenset()

    # ------------------------------------------------------------------ lifetime, counters
    def track(self, sock: Any) -> None:
        """Count ``sock``'s bad frames; its close is reported with :meth:`closed`."""
        self._open[id(sock)] = sock

    def closed(self, sock: Any) -> None:
        """``sock`` was closed; the last close stops the ZAP handler and logs the counters."""
        if self._open.pop(id(sock), None) is None:
            return
        bad = sock.statistics().bad_frames
        self._closed_bad_frames += bad
        self._closed_bad_by_socket[sock.name] = self._closed_bad_by_socket.get(sock.name, 0) + bad
        if not self._open:
            if self._zap is not None:
                self._zap.stop()
            log.info("transport_security_final", **self.counters(),
                     bad_frames_by_socket=dict(self._closed_bad_by_socket))

    def counters(self) -> dict[str, int]:
        """``bad_frames`` (dropped undecodable messages, all sockets), ``zap_rejected`` /
        ``zap_accepted`` (CURVE handshakes refused / admitted), ``plaintext_warnings``."""
        auth = self._zap.auth if self._zap is not None else None
        return {
            "bad_frames": self._closed_bad_frames
            + sum(s.statistics().bad_frames for s in self._open.values()),
            "zap_rejected": auth.rejected if auth else 0,
            "zap_accepted": auth.accepted if auth else 0,
            "plaintext_warnings": self.warnings,
        }


_BY_CONTEXT: weakref.WeakKeyDictionary[zmq.Context[Any], NodeSecurity] = weakref.WeakKeyDictionary()


def node_security(ctx: zmq.Context[Any], transport: TransportConfig | None = None) -> NodeSecurity:
    """The context's :class:`NodeSecurity`, made from ``transport`` on first use.

    A node's security is fixed by the first config it opens a socket with (its local, boot
    config): the run's config that arrives in Welcome names the *coordinator's* key folder,
    which means nothing on this machine.
    """
    sec = _BY_CONTEXT.get(ctx)
    if sec is None:
        if transport is None:
            raise KeyError("this zmq context has opened no socket through digenrl.transport.factory")
        sec = _BY_CONTEXT[ctx] = NodeSecurity(ctx, transport)
    return sec


def process_counters() -> dict[str, int]:
    """:meth:`NodeSecurity.counters` summed over this process's live contexts (for Prometheus)."""
    total: dict[str, int] = {}
    for sec in list(_BY_CONTEXT.values()):
        for k, v in sec.counters().items():
            total[k] = total.get(k, 0) + v
    return total
