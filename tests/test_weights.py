"""Weight sets on the wire: parts, per-part and set checksums, reassembly."""

from __future__ import annotations

import pytest
import torch

from digenrl.transport.weights import WeightAssembly, publish_parts


def _sd(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"block{i}.weight": torch.randn(64, 64, generator=g) for i in range(6)}


def test_a_weight_set_round_trips_through_parts_in_any_arrival_order() -> None:
    sd = _sd()
    parts, whole = publish_parts(sd, part_bytes=40_000)  # 16 kB tensors: 2 per part
    assert len(parts) == 3
    asm = WeightAssembly(7, len(parts), whole)
    for i in (2, 0, 1):
        asm.add(i, parts[i][0], parts[i][1])
    out = asm.state_dict()
    assert out.keys() == sd.keys() and all(torch.equal(out[k], sd[k]) for k in sd)


def test_a_corrupted_part_is_refused_and_a_missing_one_named() -> None:
    parts, whole = publish_parts(_sd(), part_bytes=40_000)
    asm = WeightAssembly(7, len(parts), whole)
    bad = {k: v.clone() for k, v in parts[0][0].items()}
    next(iter(bad.values()))[0, 0] += 1.0
    with pytest.raises(ValueError, match="part 0: checksum mismatch"):
        asm.add(0, bad, parts[0][1])
    asm.add(1, *parts[1])
    with pytest.raises(ValueError, match=r"parts \[0, 2\] missing"):
        asm.state_dict()
    with pytest.raises(ValueError, match="outside"):
        asm.add(3, *parts[1])


def test_parts_of_another_version_fail_the_set_checksum() -> None:
    a, whole_a = publish_parts(_sd(0), part_bytes=40_000)
    b, _ = publish_parts(_sd(1), part_bytes=40_000)
    asm = WeightAssembly(7, len(a), whole_a)
    asm.add(0, *a[0])
    asm.add(1, *b[1])  # a valid part, of the wrong set
    asm.add(2, *a[2])
    with pytest.raises(ValueError, match="whole-set checksum"):
        asm.state_dict()
