"""The transport's error vocabulary, in one place.

``ProtocolError`` (and ``VersionMismatch``) are what a peer's bad bytes cause, so they are
``ValueError`` subclasses. ``Closed`` and ``PeerLost`` describe the state of a socket or
a peer, not a bad value.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base of the errors raised by :mod:`digenrl.transport`."""


class Closed(TransportError):
    """The socket was used after ``close()``."""


class PeerLost(TransportError):
    """A ROUTER was asked to send to an identity that is not connected (any more)."""

    def __init__(self, peer: bytes) -> None:
        super().__init__(f"peer {peer!r} is not connected")
        self.peer = peer


class EndpointError(ValueError):
    """An endpoint string is not a ZeroMQ address this project can use."""


class ProtocolError(ValueError):
    """Bytes from a peer do not form a valid message. ``reason`` is a short counter key."""

    def __init__(self, message: str, *, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version; ``peer_version`` is what it sent."""

    def __init__(self, peer_version: object, local_version: int) -> None:
        super().__init__(
            f"peer speaks protocol version {peer_version!r}, this node speaks {local_version}",
            reason="version")
        self.peer_version = peer_version
