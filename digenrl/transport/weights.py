"""Weight sets by version: split into parts for the wire, reassembled and verified on arrival.

A version is published as parts of about ``PART_BYTES`` each, with one checksum per part
(CRC-32 over names, dtypes, shapes and bytes) and a set checksum over the part checksums
in order. A receiver verifies each part as it lands and the set from the part checksums, so
every byte is hashed once on each side.
"""

from __future__ import annotations

import hashlib

import torch

from digenrl.transport.protocol import tensor_checksum

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


class WeightAssembly:
    """Collects the parts of one version; ``state_dict()`` once all arrived and the set checks."""

    def __init__(self, version: int, nparts: int, checksum: str) -> None:
        self.version, self.nparts, self.checksum = version, nparts, checksum
        self.parts: dict[int, dict[str, torch.Tensor]] = {}
        self.sums: dict[int, str] = {}

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

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.missing():
            raise ValueError(f"weights v{self.version}: parts {self.missing()} missing")
        if set_checksum([self.sums[p] for p in range(self.nparts)]) != self.checksum:
            raise ValueError(f"weights v{self.version}: whole-set checksum mismatch")
        return {k: v for p in range(self.nparts) for k, v in self.parts[p].items()}
