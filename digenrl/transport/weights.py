"""Weight sets by version: split into parts for the wire, reassembled, verified, served, relayed.

A version is published as parts of about ``PART_BYTES`` each, with one checksum per part
(CRC-32 over names, dtypes, shapes and bytes) and a set checksum over the part checksums
in order. A receiver verifies each part as it lands and the set from the part checksums, so
every byte is hashed once on each side.

A version is also cut into *segments* that change as one (each expert of a two-expert model;
"" the whole set otherwise), each naming the version whose bytes it carries (``since``).
Trainer rank 0 builds a version from the segments its step changed and the unchanged ones of
the version before, shared, not copied (:func:`build_version`). A receiver takes every
segment that a version it already holds whole carries with the same ``since`` and checksum
from that version (:meth:`WeightAssembly.prefill`) and fetches only the others, so a version
whose step left an expert untouched costs the network only the experts it changed; one that
holds nothing fetches every part. Version 0 carries no segment: every node loads its
weights itself, and a segment no step changed is never sent.

Serving (:func:`serve_weights`, a ROUTER answering ``WeightsRequest``) works from a
:class:`WeightStore`: trainer rank 0 publishes complete versions into it, and a rollout
puts in the version it is fetching, so it can serve each part to the rollouts downstream of
it the moment that part has landed and been verified (the pipelined relay; who serves whom
is :mod:`digenrl.core.relay`). A request for a part that has not landed yet waits for it
(while this node is receiving that version, the requester hears ``WeightsPending`` every
keep-alive interval meanwhile); a request for a version the server will never hold
(superseded: it moved to a newer one, or dropped) is answered with ``WeightsMissing``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from digenrl.transport.errors import Closed, PeerLost
from digenrl.transport.protocol import (
    VersionAnnounce,
    WeightsMissing,
    WeightsPart,
    WeightsPending,
    WeightsRequest,
    tensor_checksum,
)

PART_BYTES = 4 << 20


def split_parts(sd: dict[str, torch.Tensor], part_bytes: int = PART_BYTES) -> list[dict[str, torch.Tensor]]:
    """Group tensors (in name order) into parts of about ``part_bytes``; a big tensor is its own part."""
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(sd):
        t = sd[name]
        nbytes = t.numel() * t.element_size()
        if parts[-1] and size + nbytes > part_bytes:
            parts.append({})
            size = 0
        parts[-1][name] = t
        size += nbytes
    return parts


def set_checksum(part_checksums: list[str]) -> str:
    """The checksum of a whole weight set: over its parts' checksums, in part order."""
    h = hashlib.blake2b(digest_size=16)
    for c in part_checksums:
        h.update(c.encode())
        h.update(b"|")
    return h.hexdigest()


def publish_parts(sd: dict[str, torch.Tensor],
                  part_bytes: int = PART_BYTES) -> tuple[list[tuple[dict[str, torch.Tensor], str]], str]:
    """([(part tensors, part checksum)], set checksum) of a weight set, ready to serve."""
    parts = split_parts(sd, part_bytes)
    sums = [tensor_checksum(p) for p in parts]
    return list(zip(parts, sums, strict=True)), set_checksum(sums)


@dataclass(frozen=True)
class Segment:
    """Parts of a version that change as one: ``name`` ("" or an expert), ``since`` (the
    version whose bytes they carry), their count and :func:`set_checksum` over their sums."""

    name: str
    since: int
    nparts: int
    checksum: str


class WeightAssembly:
    """Collects the parts of one version; ``state_dict()`` once all arrived and the set checks.

    ``segments`` (in part order; default: one segment "" of every part, new at ``version``).
    """

    def __init__(self, version: int, nparts: int, checksum: str,
                 segments: Sequence[Segment] | None = None) -> None:
        self.version, self.nparts, self.checksum = version, nparts, checksum
        self.segments = tuple(segments) if segments is not None else (
            (Segment("", version, nparts, checksum),) if nparts else ())
        if sum(seg.nparts for seg in self.segments) != nparts:
            raise ValueError(f"weights v{version}: segments of {sum(g.nparts for g in self.segments)} "
                             f"parts, expected {nparts}")
        self.parts: dict[int, dict[str, torch.Tensor]] = {}
        self.sums: dict[int, str] = {}
        self.reused = 0  # parts taken from a version held before (prefill), not received

    @classmethod
    def announced(cls, ann: VersionAnnounce) -> WeightAssembly:
        """An empty assembly of the version ``ann`` announces, with its segments."""
        segments = None
        if ann.segments:
            segments = [Segment(n, v, p, c) for n, v, p, c in zip(
                ann.segments, ann.segment_since, ann.segment_parts, ann.segment_sums, strict=True)]
        return cls(ann.version, ann.nparts, ann.checksum, segments)

    def spans(self) -> list[tuple[Segment, range]]:
        """Each segment with the indices of its parts."""
        out, start = [], 0
        for seg in self.segments:
            out.append((seg, range(start, start + seg.nparts)))
            start += seg.nparts
        return out

    def prefill(self, held: WeightAssembly) -> int:
        """Take from ``held`` (a whole version this node holds) every segment it carries with
        the same name, ``since`` and checksum: those bytes need not travel. Returns the parts
        taken; the set checksum still checks them with the rest."""
        theirs = {seg: span for seg, span in held.spans()}
        taken = 0
        for seg, span in self.spans():
            other = theirs.get(seg)
            if other is None or seg.since > held.version or any(i not in held.parts for i in other):
                continue
            for i, j in zip(span, other, strict=True):
                self.parts[i], self.sums[i] = held.parts[j], held.sums[j]
            taken += seg.nparts
        self.reused += taken
        return taken

    def verify(self) -> None:
        """Raise ValueError unless every part is here and the set checksum holds."""
        if self.missing():
            raise ValueError(f"weights v{self.version}: parts {self.missing()} missing")
        if set_checksum([self.sums[p] for p in range(self.nparts)]) != self.checksum:
            raise ValueError(f"weights v{self.version}: whole-set checksum mismatch")

    def state_dict(self, newer_than: int = -1) -> dict[str, torch.Tensor]:
        """The whole set's tensors, verified; with ``newer_than``, only those of the segments
        carried since a later version (what a node holding that version lacks)."""
        self.verify()
        return {k: v for seg, span in self.spans() if seg.since > newer_than
                for p in span for k, v in self.parts[p].items()}

    def new_bytes(self) -> int:
        """Bytes of the segments new at this version (what a node holding the one before fetches)."""
        return sum(t.numel() * t.element_size() for seg, span in self.spans() if seg.since == self.version
                   for p in span for t in self.parts.get(p, {}).values())

    def announce(self, step: int) -> VersionAnnounce:
        """This (whole) version's announcement."""
        return VersionAnnounce(
            version=self.version, step=step, nparts=self.nparts,
            nbytes=sum(t.numel() * t.element_size() for p in self.parts.values() for t in p.values()),
            checksum=self.checksum, segments=[g.name for g in self.segments],
            segment_since=[g.since for g in self.segments], segment_parts=[g.nparts for g in self.segments],
            segment_sums=[g.checksum for g in self.segments])

    def add(self, part: int, tensors: dict[str, torch.Tensor], part_checksum: str) -> None:
        if not 0 <= part < self.nparts:
            raise ValueError(f"weights v{self.version}: part {part} outside 0..{self.nparts - 1}")
        if tensor_checksum(tensors) != part_checksum:
            raise ValueError(f"weights v{self.version} part {part}: checksum mismatch")
        # No copy: decoded tensors view their received frames, which ZeroMQ never reuses (the
        # tensor keeps the frame alive). The apply's copy into the model is the only one.
        self.parts[part] = dict(tensors)
        self.sums[part] = part_checksum

    def missing(self) -> list[int]:
        return [p for p in range(self.nparts) if p not in self.parts]



def build_version(version: int, fresh: Mapping[str, dict[str, torch.Tensor]], before: WeightAssembly | None,
                  part_bytes: int = PART_BYTES) -> WeightAssembly:
    """Trainer rank 0's whole ``version``: each segment of ``fresh`` (name -> tensors) split,
    checksummed and carried since ``version``; every other segment of ``before`` (the version
    published last) kept as it is, its tensors shared. Segments in name order."""
    old = {seg.name: (seg, span) for seg, span in before.spans()} if before is not None else {}
    segments: list[Segment] = []
    parts: list[dict[str, torch.Tensor]] = []
    sums: list[str] = []
    for name in sorted({n for n, sd in fresh.items() if sd} | set(old)):
        if fresh.get(name):
            mine = split_parts(fresh[name], part_bytes)
            mine_sums = [tensor_checksum(p) for p in mine]
            since = version
        else:
            assert before is not None
            seg, span = old[name]
            mine, mine_sums, since = [before.parts[i] for i in span], [before.sums[i] for i in span], seg.since
        segments.append(Segment(name, since, len(mine), set_checksum(mine_sums)))
        parts += mine
        sums += mine_sums
    asm = WeightAssembly(version, len(parts), set_checksum(sums), segments)
    asm.parts, asm.sums = dict(enumerate(parts)), dict(enumerate(sums))
    return asm


class WeightStore:
    """The weight sets a node can serve: the newest ``keep`` versions, complete or landing.

    Versions enter in increasing order (a node only ever moves to a newer version), so a
    version below the newest that is not held will never be: requests for it are answered
    as missing. Single event loop; callers announce each landed part with :meth:`landed`.
    """

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self._sets: dict[int, WeightAssembly] = {}
        self._gone = -1  # versions <= this are not held and never will be
        self._changed = asyncio.Event()

    @property
    def newest(self) -> int:
        return max(self._sets, default=self._gone)

    def get(self, version: int) -> WeightAssembly | None:
        return self._sets.get(version)

    def whole_below(self, version: int) -> WeightAssembly | None:
        """The newest version below ``version`` held whole (every part landed), if any."""
        whole = [v for v, asm in self._sets.items() if v < version and not asm.missing()]
        return self._sets[max(whole)] if whole else None

    def publish(self, version: int, parts: list[tuple[dict[str, torch.Tensor], str]], whole: str) -> None:
        """A complete version (trainer rank 0's own, already checksummed by publish_parts)."""
        asm = WeightAssembly(version, len(parts), whole)
        for i, (tensors, checksum) in enumerate(parts):
            asm.parts[i], asm.sums[i] = tensors, checksum
        self.begin(asm)

    def begin(self, asm: WeightAssembly) -> None:
        """A version being fetched: its parts are served as they land."""
        self._sets[asm.version] = asm
        for old in sorted(self._sets)[:-self.keep]:
            del self._sets[old]
            self._gone = max(self._gone, old)
        self.landed()

    def abandon(self, version: int) -> None:
        """A fetch that will not finish: requests waiting for its parts get WeightsMissing."""
        asm = self._sets.get(version)
        if asm is not None and asm.missing():
            del self._sets[version]
            self._gone = max(self._gone, version)
            self.landed()

    def landed(self) -> None:
        """Wake the requests waiting on this store (a part landed, a version began or went)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def part(self, version: int, part: int) -> WeightAssembly | None:
        """The version's assembly once ``part`` has landed in it; None if it never will."""
        while True:
            asm = self._sets.get(version)
            if asm is not None:
                if not 0 <= part < asm.nparts:
                    return None
                if part in asm.parts:
                    return asm
            elif version <= self._gone or version < self.newest:
                return None
            await self._changed.wait()


MAX_WAITING_REQUESTS = 1024
"""Requests a server holds at once; beyond it they are answered as missing (a peer cannot
make it hold unbounded state)."""


async def serve_weights(router: Any, store: WeightStore,
                        unexpected: Callable[[str, object], None] | None = None,
                        keepalive_s: float | None = None) -> None:
    """Answer ``WeightsRequest`` on ``router`` from ``store`` until cancelled; each request
    waits for its part on its own, so one not yet landed never holds the others up. While a
    request waits for a version this node is receiving, a ``WeightsPending`` goes to its peer
    every ``keepalive_s`` (None: never), so a requester deep in a relay chain hears that this
    hop is alive and still receiving; a request for a version not begun here hears nothing
    until it is answered (its requester's silence timeout applies)."""
    waiting: set[asyncio.Task[None]] = set()

    async def send(peer: bytes, reply: Any) -> None:
        with contextlib.suppress(PeerLost, Closed):  # it left (or we are closing): nobody to tell
            await router.send(reply, to=peer)

    async def answer(peer: bytes, req: WeightsRequest) -> None:
        asm = None
        if len(waiting) <= MAX_WAITING_REQUESTS:
            landing = asyncio.ensure_future(store.part(req.version, req.part))
            try:
                while not (await asyncio.wait({landing}, timeout=keepalive_s))[0]:
                    held = store.get(req.version)
                    if held is not None:  # only a version this node is receiving is "on its way"
                        await send(peer, WeightsPending(version=req.version, part=req.part,
                                                        landed=len(held.parts)))
            finally:
                landing.cancel()
            asm = landing.result()
        if asm is None:
            reply: Any = WeightsMissing(version=req.version, part=req.part, newest=store.newest)
        else:
            reply = WeightsPart(version=req.version, part=req.part, nparts=asm.nparts,
                                checksum=asm.sums[req.part], tensors=asm.parts[req.part])
        await send(peer, reply)

    try:
        while True:
            peer, msg = await router.recv()
            if not isinstance(msg, WeightsRequest):
                if unexpected is not None:
                    unexpected("weights", msg)
                continue
            task = asyncio.ensure_future(answer(peer, msg))
            waiting.add(task)
            task.add_done_callback(waiting.discard)
    finally:
        for task in list(waiting):
            task.cancel()
