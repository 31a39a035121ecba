"""Cluster description for the planner: GPU types, counts, roles and links, from a small TOML.

Kept out of :mod:`digenrl.config` on purpose (the run config stays small)::

    name = "mixed-h100-h20-32"
    [network]                 # optional; defaults in costmodel.Network
    link_gbs = 45.0
    weight_gbs = 8.25
    [[gpus]]
    type = "H100"             # a costmodel.GPUS name
    count = 16
    role = "trainer"          # trainer | rollout | any (any: the planner splits them)
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from digenrl.core.costmodel import GPUS, Network

ROLES = ("trainer", "rollout", "any")


class ClusterError(ValueError):
    """A cluster TOML value is wrong; the message names the key, the value and the expectation."""


@dataclass(frozen=True, kw_only=True)
class GpuGroup:
    type: str
    count: int
    role: str = "any"


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """GPU groups and links. :meth:`split` turns it into (rollout GPUs, trainer GPUs)."""

    name: str
    gpus: tuple[GpuGroup, ...]
    network: Network = field(default_factory=Network)

    @property
    def size(self) -> int:
        return sum(g.count for g in self.gpus)

    def all_gpus(self) -> list[str]:
        """Every GPU's type, fastest training GPUs first (they become trainers first)."""
        out = [g.type for g in self.gpus for _ in range(g.count)]
        return sorted(out, key=lambda t: -GPUS[t].train_tflops)

    def split(self, trainers: int | None = None) -> tuple[list[str], list[str]]:
        """(rollout GPU types, trainer GPU types).

        Fixed roles are honoured; ``any`` GPUs fill the trainer side up to ``trainers`` (default:
        half the cluster) taking the fastest trainers first, the rest generate.
        """
        fixed_t = [g.type for g in self.gpus if g.role == "trainer" for _ in range(g.count)]
        fixed_r = [g.type for g in self.gpus if g.role == "rollout" for _ in range(g.count)]
        free = sorted((g.type for g in self.gpus if g.role == "any" for _ in range(g.count)),
                      key=lambda t: -GPUS[t].train_tflops)
        want = self.size // 2 if trainers is None else trainers
        if not 1 <= want <= self.size - 1:
            raise ClusterError(f"trainers = {want}: expected 1..{self.size - 1} for cluster {self.name}")
        if trainers is not None and not free:
            return self._resplit(want)
        take = max(0, min(len(free), want - len(fixed_t)))
        return fixed_r + free[take:], fixed_t + free[:take]

    def _resplit(self, trainers: int) -> tuple[list[str], list[str]]:
        """A search ignores fixed roles: fastest trainers first, the rest generate."""
        gpus = self.all_gpus()
        return gpus[trainers:], gpus[:trainers]


def _check(key: str, value: Any, kind: type, ok: bool = True, want: str = "") -> Any:
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind) or not ok:
        raise ClusterError(f"{key} = {value!r}: expected {want or getattr(kind, '__name__', kind)}")
    return value


def cluster_from_dict(table: dict[str, Any], origin: str = "<cluster>") -> Cluster:
    """Build a :class:`Cluster`; unknown keys and bad values raise :class:`ClusterError`."""
    for k in table:
        if k not in ("name", "gpus", "network"):
            raise ClusterError(f"{origin}: unknown key {k}: expected name, gpus, network")
    name = _check("name", table.get("name", Path(origin).stem), str)
    rows = table.get("gpus")
    if not isinstance(rows, list) or not rows:
        raise ClusterError(f"{origin}: gpus = {rows!r}: expected at least one [[gpus]] table")
    groups = []
    for i, row in enumerate(rows):
        key = f"gpus[{i}]"
        if not isinstance(row, dict):
            raise ClusterError(f"{key} = {row!r}: expected a table")
        for k in row:
            if k not in ("type", "count", "role"):
                raise ClusterError(f"unknown key {key}.{k}: expected type, count, role")
        t = row.get("type")
        t = _check(f"{key}.type", t, str, t in GPUS, f"one of {', '.join(GPUS)}")
        n = row.get("count", 1)
        _check(f"{key}.count", n, int, isinstance(n, int) and n >= 1, "an integer >= 1")
        role = row.get("role", "any")
        _check(f"{key}.role", role, str, role in ROLES, f"one of {', '.join(ROLES)}")
        groups.append(GpuGroup(type=t, count=n, role=role))
    net_t = table.get("network", {})
    if not isinstance(net_t, dict):
        raise ClusterError(f"network = {net_t!r}: expected a table")
    fields = {f.name for f in dataclasses.fields(Network)}
    for k, v in net_t.items():
        if k not in fields:
            raise ClusterError(f"unknown key network.{k}: expected one of {', '.join(sorted(fields))}")
        _check(f"network.{k}", v, int | float, not isinstance(v, bool) and v > 0, "a number > 0")  # type: ignore[arg-type]
    net = Network(**{k: float(v) for k, v in net_t.items()})
    return Cluster(name=name, gpus=tuple(groups), network=net)


def load_cluster(path: str | Path | None) -> Cluster:
    """Read a cluster TOML; ``None`` is one CPU trainer and one CPU rollout (the tiny config)."""
    if path is None:
        return Cluster(name="cpu-2", gpus=(GpuGroup(type="cpu", count=1, role="trainer"),
                                           GpuGroup(type="cpu", count=1, role="rollout")))
    p = Path(path)
    if not p.is_file():
        raise ClusterError(f"--cluster {str(path)!r}: file does not exist")
    try:
        table = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ClusterError(f"{p}: not valid TOML: {e}") from None
    return cluster_from_dict(table, str(p))
