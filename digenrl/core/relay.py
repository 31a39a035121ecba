"""Who fetches weights from whom: the relay tree over the live rollouts (sans-I/O).

Trainer rank 0 serves each new version once, to the first rollout; every rollout serves what
it has verified to at most ``fanout`` others, part by part as the parts land (the pipelined
relay of :mod:`digenrl.transport.weights`). Rank 0's egress per version is then one weight
set whatever the number of rollouts, and the time until the last rollout holds a version is
one set's transfer plus (depth - 1) parts'. ``fanout = 1`` is a chain; ``fanout = 0`` turns
the relay off (every rollout fetches from rank 0, whose egress is then N sets).

Positions are 1-based in join order; rank 0 is position 0 and has one child::

    parent(1) = 0        parent(j) = (j - 2) // fanout + 1   for j >= 2

A node that leaves is replaced by the last one (as in a heap), so a membership change
re-links only the moved node and the leaver's children. Every call returns the nodes whose
upstream changed, mapped to their new upstream (None: rank 0); the coordinator tells exactly
those (``WeightsRoute``).
"""

from __future__ import annotations


class RelayTree:
    def __init__(self, fanout: int) -> None:
        if fanout < 0:
            raise ValueError(f"runtime.weights_fanout = {fanout}: expected >= 0")
        self.fanout = fanout
        self._slots: list[str] = []  # position j holds _slots[j - 1]

    @property
    def members(self) -> list[str]:
        return list(self._slots)

    def __contains__(self, node: str) -> bool:
        return node in self._slots

    def _parent(self, j: int) -> int:
        return 0 if j == 1 else (j - 2) // self.fanout + 1

    def _node(self, j: int) -> str | None:
        return None if j == 0 else self._slots[j - 1]

    def upstream(self, node: str) -> str | None:
        """The node ``node`` fetches from (None: trainer rank 0)."""
        if self.fanout == 0 or node not in self._slots:
            return None
        return self._node(self._parent(self._slots.index(node) + 1))

    def downstream(self, node: str) -> list[str]:
        """The nodes that fetch from ``node``: positions (j - 1) * fanout + 2 .. j * fanout + 1."""
        if self.fanout == 0 or node not in self._slots:
            return []
        j = self._slots.index(node) + 1
        lo, hi = (j - 1) * self.fanout + 2, min(j * self.fanout + 1, len(self._slots))
        return [self._slots[c - 1] for c in range(lo, hi + 1)]

    def join(self, node: str) -> dict[str, str | None]:
        """Add ``node`` at the next position (a node already in the tree leaves first)."""
        changed = self.leave(node) if node in self._slots else {}
        self._slots.append(node)
        if self.fanout == 0:
            return changed
        changed[node] = self.upstream(node)
        return changed

    def leave(self, node: str) -> dict[str, str | None]:
        """Remove ``node``; the last node takes its position."""
        if node not in self._slots:
            return {}
        j = self._slots.index(node) + 1
        orphans = self.downstream(node)
        last = self._slots.pop()
        if last == node:
            return {}
        self._slots[j - 1] = last
        if self.fanout == 0:
            return {}
        moved = [last, *(c for c in orphans if c != last)]
        return {n: self.upstream(n) for n in moved}
