"""CurveZMQ: key files, socket security settings and a ZAP allow-list authenticator.

Key files are the ``zmq.auth`` format (``NAME.key`` public, ``NAME.key_secret`` both),
written by :func:`generate_keys` (``digenrl keys generate``). A server socket takes
:class:`CurveServer`, a client :class:`CurveClient`; both are passed to a
:class:`~digenrl.transport.sockets.Socket` as ``security=``.

Which clients may talk is decided by :class:`Authenticator`, a ZAP handler (ZeroMQ RFC
27) on an inproc ROUTER of the same context. Server sockets set
``ZAP_ENFORCE_DOMAIN``, so without a running handler no client gets in at all (the
libzmq default would accept any client that knows the server's public key).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog
import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils import z85

from digenrl.transport.errors import TransportError

log = structlog.get_logger("digenrl.transport.curve")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
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

    def apply(self, sock: zmq.Socket) -> None:
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

    def apply(self, sock: zmq.Socket) -> None:
        """Set the options; must run before connect."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keypair.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keypair.secret)


class Authenticator:
    """ZAP handler admitting CURVE clients whose public key is on an allow-list.

    Construct it (it binds the context's ZAP endpoint at once, so handshakes queue until
    it serves) and run :meth:`serve` in the actor's task group.
    """

    def __init__(self, ctx: zmq.asyncio.Context, *, allowed: Iterable[bytes] = (),
                 domain: str = DEFAULT_DOMAIN) -> None:
        self.domain = domain.encode()
        self._allowed = {bytes(k) for k in allowed}
        self.accepted = 0
        self.rejected = 0
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as e:
            self._sock.close()
            raise TransportError(f"a ZAP handler already runs in this context: {e}") from e

    def allow(self, public_key: bytes) -> None:
        """Admit the client with this Z85 public key from its next handshake on."""
        self._allowed.add(bytes(public_key))

    def revoke(self, public_key: bytes) -> None:
        """Refuse this key from its next handshake on (open connections stay)."""
        self._allowed.discard(bytes(public_key))

    async def serve(self) -> None:
        """Answer ZAP requests until cancelled."""
        while True:
            request = await self._sock.recv_multipart()
            await self._sock.send_multipart(self.reply(request))

    def reply(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply frames (routing envelope included) for one request."""
        # [routing id, b"", version, request id, domain, address, identity, mechanism, creds...]
        if len(request) < 8 or request[1] != b"":
            return [request[0], b"", b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        envelope, version, request_id, domain, address = request[:2], *request[2:6]
        mechanism, credentials = request[7], request[8:]
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and credentials else b""
        if version != b"1.0":
            status, text = b"500", b"unsupported ZAP version"
        elif domain != self.domain:
            status, text = b"400", b"wrong domain"
        elif key and key in self._allowed:
            status, text = b"200", b"OK"
        else:
            status, text = b"400", b"key not allowed"
        if status == b"200":
            self.accepted += 1
        else:
            self.rejected += 1
            log.warning("curve_client_refused", address=address.decode(errors="replace"),
                        key=key.decode(errors="replace"), why=text.decode())
        return [*envelope, b"1.0", request_id, status, text, key if status == b"200" else b"", b""]

    def close(self) -> None:
        """Unbind the ZAP endpoint (linger 0)."""
        self._sock.close(linger=0)
