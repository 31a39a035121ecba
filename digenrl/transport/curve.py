"""CurveZMQ: key files, socket security settings and a ZAP allow-list authenticator.

Key files are the ``zmq.auth`` format (``NAME.key`` public, ``NAME.key_secret`` both),
written by :func:`generate_keys` (``digenrl keys generate``). A server socket takes
:class:`CurveServer`, a client :class:`CurveClient`; both are passed to a
:class:`~digenrl.transport.socketio.Socket` as ``security=``.

Which clients may talk is decided by :class:`Authenticator`, a ZAP handler (ZeroMQ RFC
27) on the context's inproc ZAP endpoint: pyzmq's asyncio authenticator with an allow-list of
client keys and the counters a node reports. Server sockets set ``ZAP_ENFORCE_DOMAIN``, so
without a running handler no client gets in at all (the libzmq default would accept any
client that knows the server's public key).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from digenrl.transport.errors import TransportError

log = structlog.get_logger("digenrl.transport.curve")
DEFAULT_DOMAIN = "digenrl"


class CurveKeyError(ValueError):
    """A key file is missing or unreadable; the message names the path."""


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, both halves Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes


def generate_keys(directory: str | os.PathLike[str],
                  names: Iterable[str] = ("server", "client")) -> dict[str, tuple[Path, Path]]:
    """Write a key pair per name into ``directory``; returns name -> (public, secret) paths.

    The folder is created private (0700) and secret files are made 0600.
    """
    folder = Path(directory)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = {}
    for name in names:
        public, secret = zmq.auth.create_certificates(str(folder), name)
        os.chmod(secret, 0o600)
        out[name] = (Path(public), Path(secret))
    return out


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveKeyError(f"cannot read CURVE key file {path}: {e}") from e


def load_keypair(directory: str | os.PathLike[str], name: str) -> KeyPair:
    """The key pair written by :func:`generate_keys` under ``name``."""
    path = Path(directory) / f"{name}.key_secret"
    public, secret = _load(path)
    if not secret:
        raise CurveKeyError(f"{path} holds no secret key")
    return KeyPair(public=public, secret=secret)


def load_public_key(directory: str | os.PathLike[str], name: str) -> bytes:
    """The public half of ``name``'s key (what a client needs about the server)."""
    return _load(Path(directory) / f"{name}.key")[0]


@dataclass(frozen=True, kw_only=True)
class CurveServer:
    """Security for a socket that accepts CURVE clients (who may talk: the Authenticator)."""

    keypair: KeyPair
    domain: str = DEFAULT_DOMAIN

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Set the options; must run before bind."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keypair.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keypair.public)
        sock.setsockopt(zmq.ZAP_DOMAIN, self.domain.encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


@dataclass(frozen=True, kw_only=True)
class CurveClient:
    """Security for a socket that connects to a CURVE server."""

    keypair: KeyPair
    server_public: bytes

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Set the options; must run before connect."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keypair.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keypair.secret)


class Authenticator(AsyncioAuthenticator):
    """ZAP handler admitting CURVE clients whose public key is on an allow-list.

    pyzmq's own asyncio authenticator (``zmq.auth.asyncio``) does the ZAP protocol; this
    subclass adds what a node reports and logs: ``accepted`` / ``rejected`` counters and one
    warning per refused client (its address and key). It admits the CURVE mechanism only,
    for one ZAP domain (the base class would also admit NULL clients of a domain).

    Construct it inside the event loop that serves it: it binds the context's ZAP endpoint
    and answers at once (a handshake that found no handler would be refused for good).
    :meth:`serve` keeps a task alive until cancelled, then unbinds; :meth:`close` unbinds.
    """

    def __init__(self, ctx: zmq.asyncio.Context, *,
                 allowed: Iterable[bytes] | Mapping[str, bytes] = (),
                 domain: str = DEFAULT_DOMAIN) -> None:
        super().__init__(ctx)
        self.domain = domain
        self.certs[domain] = {}  # z85 public key -> allowed
        self.names: dict[bytes, str] = {}  # z85 public key -> its key file's name (the User-Id)
        if isinstance(allowed, Mapping):
            for name, key in allowed.items():
                self.allow_key(key, name=name)
        else:
            for key in allowed:
                self.allow_key(key)
        self.accepted = 0
        self.rejected = 0
        self._peer = ("", b"")  # (address, z85 key) of the request being answered
        try:
            self.start()
        except zmq.ZMQError as e:
            self.stop()
            raise TransportError(f"a ZAP handler already runs in this context: {e}") from e

    def allow_key(self, public_key: bytes, *, name: str | None = None) -> None:
        """Admit the client with this Z85 public key from its next handshake on; its messages
        carry ``name`` (default: the Z85 key itself) as their ZeroMQ ``User-Id``."""
        key = bytes(public_key)
        self.certs[self.domain][key] = True
        if name is not None:
            self.names[key] = name

    def revoke_key(self, public_key: bytes) -> None:
        """Refuse this key from its next handshake on (open connections stay)."""
        self.certs[self.domain].pop(bytes(public_key), None)
        self.names.pop(bytes(public_key), None)

    def curve_user_id(self, client_public_key: bytes) -> str:
        """The ``User-Id`` every message of an admitted connection carries: the name of the
        client's key file (``rollout-3`` for ``rollout-3.key``), else its Z85 key."""
        key = z85.encode(client_public_key)
        return self.names.get(key, key.decode("ascii"))

    async def serve(self) -> None:
        """Keep answering until cancelled; then unbind the ZAP endpoint."""
        try:
            await asyncio.Event().wait()
        finally:
            self.stop()

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # [version, request id, domain, address, identity, mechanism, credentials...]
        address = msg[3].decode(errors="replace") if len(msg) > 3 else ""
        key = z85.encode(msg[6]) if len(msg) == 7 and msg[5] == b"CURVE" and len(msg[6]) == 32 else b""
        self._peer = (address, key)
        if len(msg) >= 6 and msg[5] != b"CURVE":
            self._send_zap_reply(msg[1], b"400", b"CURVE only")
            return
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes,
                        user_id: str = "anonymous") -> None:
        # every answer goes out here (pyzmq's one exit), so the counters see each decision
        if status_code == b"200":
            self.accepted += 1
        else:
            self.rejected += 1
            address, key = self._peer
            log.warning("curve_client_refused", address=address, key=key.decode(errors="replace"),
                        why=status_text.decode(errors="replace"))
        super()._send_zap_reply(request_id, status_code, status_text, user_id)

    def close(self) -> None:
        """Unbind the ZAP endpoint."""
        self.stop()
