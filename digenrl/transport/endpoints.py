"""Addresses: ZeroMQ endpoints parsed and checked, free ports, the trainers' rendezvous.

:class:`Endpoint` is the one parser of ``tcp://host:port``, ``ipc://path`` and
``inproc://name`` (sockets check every bind and connect with it; the CLI checks
``--coordinator`` and ``--bind`` before anything is built). :func:`is_loopback` decides
whether traffic stays on this machine, which picks CurveZMQ or plain text
(``transport/security.py``).
"""

from __future__ import annotations

import socket as pysocket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from digenrl.transport.errors import EndpointError

if TYPE_CHECKING:
    from digenrl.config import Config


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (for rendezvous addresses)."""
    with pysocket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rendezvous_endpoint(cfg: Config, run_dir: Path) -> str:
    """The trainer ranks' torch.distributed ``init_method``, a fresh one for every (re)start of
    their group. ``cluster.rendezvous = "tcp"``: a free port on ``cluster.host`` (trainer rank
    0 serves the store there, so it must run on that host); ``"file"``: a new file under
    ``run_dir/dist/``, which every trainer rank must see at the same path (shared storage),
    wherever it runs."""
    if cfg.cluster.rendezvous == "file":
        folder = Path(run_dir).resolve() / "dist"
        folder.mkdir(parents=True, exist_ok=True)
        return f"file://{folder / f'store-{time.time_ns()}'}"
    return f"tcp://{cfg.cluster.host}:{free_port(cfg.cluster.host)}"
