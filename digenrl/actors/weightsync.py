"""The coordinator's side of weight distribution: the relay's membership and who holds what.

Rollouts join the relay (:class:`~digenrl.core.relay.RelayTree`) when they join the schedule
and leave it when they are lost, exit or restart; every change sends ``WeightsRoute`` to the
rollouts whose upstream moved (their new upstream's weights ROUTER, or "" for trainer
rank 0). ``WeightsHeld`` reports are kept per version, with the time rank 0's announcement
of that version reached the coordinator, which gives the weight-sync time of a version (from
its publication to the last live rollout holding it) and tells the end of a run when every
live rollout holds the final version.
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable
from typing import Any

from digenrl.core.relay import RelayTree
from digenrl.transport.protocol import WeightsRoute


class WeightSync:
    """Relay membership and per-version holders; ``send(node_id, msg)`` reaches a node."""

    def __init__(self, fanout: int, send: Callable[[str, Any], Awaitable[None]]) -> None:
        self.tree = RelayTree(fanout)
        self.send = send
        self.endpoints: dict[str, str] = {}  # rollout -> its weights ROUTER (the relay)
        self.published_at: dict[int, float] = {}
        self.held_at: dict[int, dict[str, float]] = {}
        self.routes_sent = 0

    def reset(self) -> None:
        """Every node restarts (a trainer was lost): membership starts over, history stays."""
        self.tree = RelayTree(self.tree.fanout)
        self.endpoints.clear()

    async def join(self, node_id: str, endpoint: str) -> None:
        self.endpoints[node_id] = endpoint
        await self._route(self.tree.join(node_id))

    async def leave(self, node_id: str) -> None:
        if node_id in self.tree:
            await self._route(self.tree.leave(node_id))
        self.endpoints.pop(node_id, None)

    async def _route(self, changed: dict[str, str | None]) -> None:
        for node, up in changed.items():
            self.routes_sent += 1
            await self.send(node, WeightsRoute(upstream=self.endpoints.get(up, "") if up else "",
                                               upstream_node=up or ""))

    @property
    def members(self) -> list[str]:
        return self.tree.members

    def published(self, version: int, now: float) -> None:
        self.published_at.setdefault(version, now)

    def held(self, node_id: str, version: int, now: float) -> None:
        self.held_at.setdefault(version, {}).setdefault(node_id, now)

    def holders(self, version: int) -> set[str]:
        return set(self.held_at.get(version, {}))

    def all_hold(self, version: int) -> bool:
        """Every rollout in the relay holds ``version`` (vacuously true with none)."""
        return set(self.members) <= self.holders(version)

    def sync_seconds(self) -> dict[int, float]:
        """Per version >= 1: publication to the last holder (of those that reported it)."""
        return {v: max(self.held_at[v].values()) - t for v, t in sorted(self.published_at.items())
                if v >= 1 and self.held_at.get(v)}

    def summary(self, final_version: int) -> dict[str, Any]:
        sync = self.sync_seconds()
        return {"fanout": self.tree.fanout, "routes_sent": self.routes_sent,
                "final_version": final_version, "live_rollouts": sorted(self.members),
                "held_final": sorted(self.holders(final_version) & set(self.members)),
                "sync_s_median": statistics.median(sync.values()) if sync else None,
                "sync_s": {str(v): s for v, s in sync.items()}}
