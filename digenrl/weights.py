"""Weight sets by version: split into parts for the wire, reassembled and verified on arrival."""

from __future__ import annotations

import torch

from digenrl.protocol import tensor_checksum

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


class WeightAssembly:
    """Collects the parts of one version; ``complete()`` once all arrived and the checksum matches."""

    def __init__(self, version: int, nparts: int, checksum: str) -> None:
        self.version, self.nparts, self.checksum = version, nparts, checksum
        self.parts: dict[int, dict[str, torch.Tensor]] = {}

    def add(self, part: int, tensors: dict[str, torch.Tensor], part_checksum: str) -> None:
        if tensor_checksum(tensors) != part_checksum:
            raise ValueError(f"weights v{self.version} part {part}: checksum mismatch")
        # the frames are owned by zmq; copy out before they are reused
        self.parts[part] = {k: v.clone() for k, v in tensors.items()}

    def missing(self) -> list[int]:
        return [p for p in range(self.nparts) if p not in self.parts]

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.missing():
            raise ValueError(f"weights v{self.version}: parts {self.missing()} missing")
        sd = {k: v for part in self.parts.values() for k, v in part.items()}
        if tensor_checksum(sd) != self.checksum:
            raise ValueError(f"weights v{self.version}: whole-set checksum mismatch")
        return sd
