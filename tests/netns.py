"""Hosts on one machine: Linux network namespaces on one bridge (tests/test_netns.py, bench/weight_dist.py).

Each host is a namespace with one veth (``eth0``, one address of a /24 made for the fabric)
whose other end is on a bridge in a namespace of its own, so the host's own network is never
touched. Needs root and iproute2: :func:`netns_unavailable` says why not, else "".
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def netns_unavailable(*tools: str) -> str:
    """Why namespaces (and iproute2's ``ip`` plus ``tools``, e.g. "tc") cannot be used here,
    or "" when they can (a probe namespace is made and deleted)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    needed = ("ip", *tools)
    if any(shutil.which(t) is None for t in needed):
        return f"iproute2 ({', '.join(needed)}) is not installed"
    probe = f"dgprobe{os.getpid()}"
    try:
        ip("netns", "add", probe)
        ip("netns", "del", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return f"`ip netns add` failed here: {getattr(e, 'stderr', b'') or e}"
    return ""


@dataclass(frozen=True)
class Host:
    ns: str
    addr: str
    port: str  # the bridge-side veth: its rx_bytes are this host's egress


class Fabric:
    """``count`` hosts named ``<name><pid>n<i>`` with addresses ``10.<net>.<pid % 250>.<first + i>``
    on a bridge in namespace ``<name>b<pid>``; ``link_mbit`` limits both directions of each
    host's link (tc tbf: upload and download). :meth:`close` deletes every namespace made, as
    does a failure half way through the building."""

    def __init__(self, count: int, *, name: str, net: int, first: int = 1,
                 link_mbit: float | None = None) -> None:
        tag = os.getpid() % 100000
        self.bridge = f"{name}b{tag}"
        self.made: list[str] = []
        self.hosts: list[Host] = []
        subnet = f"10.{net}.{tag % 250}"
        try:
            ip("netns", "add", self.bridge)
            self.made.append(self.bridge)
            ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            ip("-n", self.bridge, "link", "set", "br0", "up")
            for i in range(count):
                ns, port, addr = f"{name}{tag}n{i}", f"p{i}x{tag}", f"{subnet}.{first + i}"
                ip("netns", "add", ns)
                self.made.append(ns)
                ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.bridge)
                ip("-n", self.bridge, "link", "set", port, "master", "br0")
                ip("-n", self.bridge, "link", "set", port, "up")
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", ns, "link", "set", "lo", "up")
                if link_mbit:
                    for where, dev in ((ns, "eth0"), (self.bridge, port)):  # upload and download
                        subprocess.run(["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root",
                                        "tbf", "rate", f"{link_mbit}mbit", "burst", "256kb", "latency", "200ms"],
                                       check=True, capture_output=True, timeout=30)
                self.hosts.append(Host(ns=ns, addr=addr, port=port))
        except BaseException:
            self.close()
            raise

    def egress(self, port: str) -> int:
        """Bytes the host behind ``port`` (:attr:`Host.port`) has sent so far."""
        out = subprocess.run(["ip", "netns", "exec", self.bridge, "cat", f"/sys/class/net/{port}/statistics/rx_bytes"],
                             check=True, capture_output=True, text=True, timeout=30)
        return int(out.stdout)

    def close(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()
