"""Credit ledger: admission, byte window, attempts and exactly-once accounting (sans-I/O).

The ledger is the single authority on *which* fragment may be generated next and on what
happened to every admitted trajectory. It knows nothing about nodes, sockets or clocks
beyond the ``now`` values it is handed; :mod:`digenrl.core.scheduler` decides *who* generates.

Vocabulary (DESIGN.md, "Credits and staleness")::

    B  = prompts_per_step * group_size         trajectories per optimizer step
    F  = fragments_per_step                    a fragment = (prompts_per_step / F) whole groups
    slot (s, f)                                fragment f of step s; its content is fixed
    n  = s*B + f*(B/F) + i                     trajectory sequence number
    v  = latest published version              optimizer steps done (starts at 0)
    K  = staleness                             rollouts may be at most K versions behind

Admission (QUIC-style absolute limit, so a duplicate or reordered publish is harmless):
a fragment of step ``s`` may be admitted only if every ``n`` in it is ``< (v + K + 1) * B``,
which for whole fragments is ``s <= v + K``. Slots are admitted lowest first, so if the
lowest pending slot is blocked, so is every other.

Byte window (the trainer's staging memory): ``bytes_in_flight + fragment_bytes <= window``,
*except* that a fragment is always admitted when nothing is in flight, so a window
smaller than one fragment cannot deadlock the run; hence ``bytes_in_flight <=
max(window, fragment_bytes)`` always. (Re-queues cannot deadlock either: every fragment
is the same size and slots are admitted lowest first, so a later-step fragment admitted
while slot p was live left room for p, and that room is still free when p is re-queued.)
Bytes come back when the trainer has *consumed* the fragment or when its attempt is
discarded, never when it is merely sent.

Attempts: each admission of a slot is an attempt with a fresh, monotone ``task_id``.
Discarding an attempt (lost node, expired lease, stale commit, restart) returns its
bytes and re-queues the *slot*, so the next attempt regenerates the same prompts and
seeds. Events for a task id that is not live are ignored and counted (fencing).

Exactly-once accounting, in trajectories, over all attempts, at every moment::

    admitted == trained + sum(discarded.values()) + in_flight
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

Slot = tuple[int, int]
"""(step, fragment)."""

CommitOutcome = Literal["ok", "duplicate", "zombie", "stale"]
ConsumeOutcome = Literal["ok", "zombie"]

SNAPSHOT_FORMAT = 1


class CreditError(ValueError):
    """A value a user or peer supplied to the ledger is invalid; the message names it."""


@dataclass
class Attempt:
    """One assignment of a slot. Returned to callers for reading; only the ledger mutates it."""

    task_id: int
    step: int
    fragment: int
    node_id: str
    assigned_at: float
    trajectories: int
    nbytes: int
    gen_version: int | None = None
    """Policy version the rollout used; known once committed."""
    committed_at: float | None = None

    @property
    def slot(self) -> Slot:
        return (self.step, self.fragment)

    @property
    def committed(self) -> bool:
        return self.committed_at is not None


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CreditError(f"{name} = {value!r}: expected an integer >= {minimum}")
    return value


class CreditLedger:
    """Version-keyed admission plus a byte window over fragment slots; see the module doc."""

    def __init__(self, *, steps: int, prompts_per_step: int, group_size: int,
                 fragments_per_step: int, staleness: int, byte_window: int,
                 bytes_per_trajectory: int) -> None:
        self.steps = _positive_int("steps", steps)
        self.prompts_per_step = _positive_int("prompts_per_step", prompts_per_step)
        self.group_size = _positive_int("group_size", group_size)
        self.fragments_per_step = _positive_int("fragments_per_step", fragments_per_step)
        self.staleness = _positive_int("staleness", staleness, 0)
        self.byte_window = _positive_int("byte_window", byte_window)
        self.bytes_per_trajectory = _positive_int("bytes_per_trajectory", bytes_per_trajectory, 0)
        if prompts_per_step % fragments_per_step:
            raise CreditError(
                f"fragments_per_step = {fragments_per_step}: expected a divisor of "
                f"prompts_per_step = {prompts_per_step} (fragments hold whole groups)")
        self._version = 0
        self._next_fresh = 0  # s * F + f of the lowest slot never admitted
        self._requeued: list[Slot] = []  # heap of slots whose attempt was discarded
        self._live: dict[int, Attempt] = {}
        self._slot_task: dict[Slot, int] = {}
        self._consumed: set[Slot] = set()
        self._consumed_per_step: Counter[int] = Counter()
        self._next_task_id = 1
        self._bytes = 0
        self._admitted = 0
        self._trained = 0
        self._discarded: Counter[str] = Counter()
        self._attempts = 0
        self._zombie_commits = 0
        self._zombie_consumes = 0
        self._duplicate_commits = 0
        self._stale_commits = 0
        self._max_trained_staleness = -1
        self._peak_bytes = 0

    # ------------------------------------------------------------------ derived sizes

    @property
    def batch_size(self) -> int:
        """B = prompts_per_step * group_size."""
        return self.prompts_per_step * self.group_size

    @property
    def fragment_size(self) -> int:
        """Trajectories per fragment = B / F."""
        return self.batch_size // self.fragments_per_step

    @property
    def fragment_bytes(self) -> int:
        """Bytes a fragment holds at the trainer = fragment_size * bytes_per_trajectory."""
        return self.fragment_size * self.bytes_per_trajectory

    @property
    def version(self) -> int:
        """Latest published policy version (optimizer steps done)."""
        return self._version

    @property
    def done(self) -> bool:
        """True once every step has been trained (version == steps)."""
        return self._version >= self.steps

    @property
    def bytes_in_flight(self) -> int:
        return self._bytes

    def sequence_number(self, step: int, fragment: int, i: int = 0) -> int:
        """n = s*B + f*(B/F) + i."""
        return step * self.batch_size + fragment * self.fragment_size + i

    # ------------------------------------------------------------------ versions

    def publish(self, version: int) -> bool:
        """Record a published version; returns True if it advanced. Older/duplicate: no-op."""
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= self.steps:
            raise CreditError(f"version = {version!r}: expected an integer in [0, {self.steps}]")
        if version <= self._version:
            return False
        self._version = version
        return True

    # ------------------------------------------------------------------ admission

    def _lowest_pending(self) -> Slot | None:
        fresh = None
        if self._next_fresh < self.steps * self.fragments_per_step:
            fresh = divmod(self._next_fresh, self.fragments_per_step)
        if self._requeued and (fresh is None or self._requeued[0] < fresh):
            return self._requeued[0]
        return fresh

    def blocked_by(self) -> Literal["done", "empty", "staleness", "bytes"] | None:
        """Why nothing can be admitted now, or None if :meth:`peek` has a slot."""
        if self.done:
            return "done"
        slot = self._lowest_pending()
        if slot is None:
            return "empty"
        if slot[0] > self._version + self.staleness:
            return "staleness"
        if self._bytes > 0 and self._bytes + self.fragment_bytes > self.byte_window:
            return "bytes"
        return None

    def peek(self) -> Slot | None:
        """The slot :meth:`admit` would hand out now, or None if admission is blocked."""
        return None if self.blocked_by() else self._lowest_pending()

    def pending_slots(self) -> list[Slot]:
        """Every slot not yet admitted or re-queued, ascending (cheap: lists only re-queued + a range)."""
        total = self.steps * self.fragments_per_step
        fresh = [divmod(i, self.fragments_per_step) for i in range(self._next_fresh, total)]
        return sorted(self._requeued) + fresh if self._requeued else fresh

    def pending_count(self, max_step: int) -> int:
        """How many pending (not live, not consumed) slots have ``step <= max_step``."""
        total = min(self.steps, max_step + 1) * self.fragments_per_step
        fresh = max(0, total - self._next_fresh)
        return fresh + sum(1 for s in self._requeued if s[0] <= max_step)

    def admit(self, node_id: str, now: float) -> Attempt:
        """Admit the lowest pending slot as a new attempt held by ``node_id``."""
        slot = self.peek()
        if slot is None:
            raise CreditError(f"admit for node {node_id!r}: nothing admissible ({self.blocked_by()})")
        if self._requeued and self._requeued[0] == slot:
            heapq.heappop(self._requeued)
        else:
            self._next_fresh += 1
        assert slot not in self._slot_task and slot not in self._consumed, slot
        attempt = Attempt(task_id=self._next_task_id, step=slot[0], fragment=slot[1],
                          node_id=node_id, assigned_at=now, trajectories=self.fragment_size,
                          nbytes=self.fragment_bytes)
        self._next_task_id += 1
        self._live[attempt.task_id] = attempt
        self._slot_task[slot] = attempt.task_id
        self._bytes += attempt.nbytes
        self._peak_bytes = max(self._peak_bytes, self._bytes)
        self._admitted += attempt.trajectories
        self._attempts += 1
        return attempt

    # ------------------------------------------------------------------ attempt events

    def attempt(self, task_id: int) -> Attempt | None:
        """The live attempt with this task id, or None."""
        return self._live.get(task_id)

    def live_attempts(self) -> list[Attempt]:
        """Live attempts (assigned or committed, not yet consumed), by task id."""
        return [self._live[t] for t in sorted(self._live)]

    def commit(self, task_id: int, gen_version: int, now: float) -> CommitOutcome:
        """A rollout finished a fragment with policy ``gen_version``.

        Returns "zombie" (task not live: ignored, counted), "duplicate" (already committed:
        ignored, counted), "stale" (``step - gen_version`` outside ``[0, K]``: the attempt is
        discarded as "stale" and its slot re-queued; correct admission never lets this
        happen) or "ok".
        """
        attempt = self._live.get(task_id)
        if attempt is None:
            self._zombie_commits += 1
            return "zombie"
        if attempt.committed:
            self._duplicate_commits += 1
            return "duplicate"
        if isinstance(gen_version, bool) or not isinstance(gen_version, int):
            raise CreditError(f"gen_version = {gen_version!r} for task {task_id}: expected an integer")
        if not 0 <= attempt.step - gen_version <= self.staleness:
            self._stale_commits += 1
            self.discard(task_id, "stale")
            return "stale"
        attempt.gen_version = gen_version
        attempt.committed_at = now
        return "ok"

    def consume(self, task_id: int, trained: int, discarded: dict[str, int] | None = None) -> ConsumeOutcome:
        """The trainer consumed the fragment: ``trained`` trajectories plus per-reason discards.

        ``trained + sum(discarded.values())`` must equal the fragment size. A consume for an
        attempt whose commit has not reached the ledger yet is accepted: the trainer only
        trains committed fragments, so the consume proves the commit (the commit arrives by
        another path and is then counted as a zombie). Returns "zombie" for a task that is
        not live (ignored, counted), else "ok".
        """
        attempt = self._live.get(task_id)
        if attempt is None:
            self._zombie_consumes += 1
            return "zombie"
        discarded = dict(discarded or {})
        counts = [trained, *discarded.values()]
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise CreditError(f"consume of task {task_id}: trained = {trained!r}, discarded = "
                              f"{discarded!r}: expected non-negative integers")
        if not all(isinstance(r, str) and r for r in discarded):
            raise CreditError(f"consume of task {task_id}: discarded = {discarded!r}: "
                              "expected non-empty reason strings")
        if sum(counts) != attempt.trajectories:
            raise CreditError(
                f"consume of task {task_id}: trained {trained} + discarded {sum(counts) - trained}"
                f" = {sum(counts)}: expected the fragment size {attempt.trajectories}")
        self._end(attempt)
        assert attempt.slot not in self._consumed, attempt.slot  # no slot trained twice
        self._consumed.add(attempt.slot)
        self._consumed_per_step[attempt.step] += 1
        self._trained += trained
        self._discarded.update({r: n for r, n in discarded.items() if n})
        if attempt.gen_version is not None and trained:
            self._max_trained_staleness = max(self._max_trained_staleness,
                                              attempt.step - attempt.gen_version)
        return "ok"

    def discard(self, task_id: int, reason: str) -> Attempt | None:
        """End a live attempt without training it; its bytes return and its slot is re-queued.

        Returns the discarded attempt, or None (and does nothing) if it was not live.
        """
        attempt = self._live.get(task_id)
        if attempt is None:
            return None
        self._end(attempt)
        self._discarded[reason] += attempt.trajectories
        heapq.heappush(self._requeued, attempt.slot)
        return attempt

    def _end(self, attempt: Attempt) -> None:
        del self._live[attempt.task_id]
        del self._slot_task[attempt.slot]
        self._bytes -= attempt.nbytes
        assert self._bytes >= 0, self._bytes

    # ------------------------------------------------------------------ queries

    def step_consumed(self, step: int) -> int:
        """How many of step ``step``'s fragments the trainer has consumed."""
        return self._consumed_per_step[step]

    def is_consumed(self, step: int, fragment: int) -> bool:
        return (step, fragment) in self._consumed

    def statistics(self) -> dict[str, Any]:
        """Counts (in trajectories unless named otherwise); admitted = trained + discarded + in_flight."""
        in_flight = sum(a.trajectories for a in self._live.values())
        return {
            "version": self._version,
            "steps": self.steps,
            "done": self.done,
            "admitted": self._admitted,
            "trained": self._trained,
            "discarded": dict(self._discarded),
            "in_flight": in_flight,
            "fragments_in_flight": len(self._live),
            "committed_in_flight": sum(a.committed for a in self._live.values()),
            "bytes_in_flight": self._bytes,
            "peak_bytes_in_flight": self._peak_bytes,
            "byte_window": self.byte_window,
            "attempts": self._attempts,
            "zombie_commits": self._zombie_commits,
            "zombie_consumes": self._zombie_consumes,
            "duplicate_commits": self._duplicate_commits,
            "stale_commits": self._stale_commits,
            "max_trained_staleness": self._max_trained_staleness,
            "blocked_by": self.blocked_by(),
        }

    # ------------------------------------------------------------------ checkpoints

    def snapshot(self) -> dict[str, Any]:
        """Plain msgpack-able state. Live attempts are recorded as discarded ("restart"):
        a restored ledger re-queues their slots (slots of already-trained steps are dropped)."""
        restart = sum(a.trajectories for a in self._live.values())
        discarded = Counter(self._discarded)
        if restart:
            discarded["restart"] += restart
        keep = self._version  # steps below the version are trained and in the trainer checkpoint
        pending = sorted({s for s in self._requeued if s[0] >= keep}
                         | {a.slot for a in self._live.values() if a.step >= keep})
        return {
            "format": SNAPSHOT_FORMAT,
            "shape": [self.steps, self.prompts_per_step, self.group_size, self.fragments_per_step],
            "version": self._version,
            "next_task_id": self._next_task_id,
            "next_fresh": self._next_fresh,
            "requeued": [list(s) for s in pending],
            "consumed": [list(s) for s in sorted(self._consumed) if s[0] >= keep],
            "counters": {
                "admitted": self._admitted, "trained": self._trained,
                "discarded": dict(discarded), "attempts": self._attempts,
                "zombie_commits": self._zombie_commits, "zombie_consumes": self._zombie_consumes,
                "duplicate_commits": self._duplicate_commits, "stale_commits": self._stale_commits,
                "max_trained_staleness": self._max_trained_staleness,
            },
        }

    def restore(self, snap: dict[str, Any]) -> None:
        """Load :meth:`snapshot` output into a ledger built with the same shape and no attempts."""
        if self._live:
            raise CreditError(f"restore: the ledger has {len(self._live)} live attempts; "
                              "restore into a fresh ledger")
        if snap.get("format") != SNAPSHOT_FORMAT:
            raise CreditError(f"snapshot format = {snap.get('format')!r}: expected {SNAPSHOT_FORMAT}")
        shape = [self.steps, self.prompts_per_step, self.group_size, self.fragments_per_step]
        if list(snap["shape"]) != shape:
            raise CreditError(f"snapshot shape (steps, prompts, group, fragments) = "
                              f"{snap['shape']!r}: expected {shape} (the run's config changed)")
        c = snap["counters"]
        self._version = int(snap["version"])
        self._next_task_id = int(snap["next_task_id"])
        self._next_fresh = int(snap["next_fresh"])
        self._requeued = [(int(s), int(f)) for s, f in snap["requeued"]]
        heapq.heapify(self._requeued)
        self._consumed = {(int(s), int(f)) for s, f in snap["consumed"]}
        self._consumed_per_step = Counter(s for s, _ in self._consumed)
        self._slot_task = {}
        self._bytes = 0
        self._admitted, self._trained = int(c["admitted"]), int(c["trained"])
        self._discarded = Counter({str(k): int(v) for k, v in c["discarded"].items()})
        self._attempts = int(c["attempts"])
        self._zombie_commits, self._zombie_consumes = int(c["zombie_commits"]), int(c["zombie_consumes"])
        self._duplicate_commits, self._stale_commits = int(c["duplicate_commits"]), int(c["stale_commits"])
        self._max_trained_staleness = int(c["max_trained_staleness"])
