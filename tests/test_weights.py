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


def test_a_version_takes_the_unchanged_segment_from_a_held_one_and_only_one_carried_alike() -> None:
    """Rank 0's version 2 changes ``a`` only: it shares ``b``'s parts with version 1 (same
    tensors, ``since`` 1). A node holding version 1 whole takes ``b`` from it and must fetch
    ``a``; a node holding a version whose ``b`` differs (another checksum) takes nothing."""
    from digenrl.transport.weights import build_version

    one = build_version(1, {"a": _sd(0), "b": _sd(1)}, None, part_bytes=40_000)
    two = build_version(2, {"a": _sd(2)}, one, part_bytes=40_000)
    assert [(g.name, g.since, g.nparts) for g in two.segments] == [("a", 2, 3), ("b", 1, 3)]
    assert all(two.parts[3 + i] is one.parts[3 + i] for i in range(3))  # shared, not copied
    assert two.new_bytes() == sum(t.numel() * t.element_size() for t in _sd(2).values())
    ann = two.announce(step=2)
    assert ann.segments == ["a", "b"] and ann.segment_since == [2, 1] and ann.segment_parts == [3, 3]

    held = WeightAssembly.announced(one.announce(step=1))
    for i in range(one.nparts):
        held.add(i, one.parts[i], one.sums[i])
    fetching = WeightAssembly.announced(ann)
    assert fetching.prefill(held) == 3 and fetching.missing() == [0, 1, 2]
    for i in fetching.missing():
        fetching.add(i, two.parts[i], two.sums[i])
    assert fetching.state_dict().keys() == two.state_dict().keys()
    assert set(fetching.state_dict(newer_than=1)) == set(_sd(2))  # what a holder of v1 lacks

    other = build_version(1, {"a": _sd(0), "b": _sd(3)}, None, part_bytes=40_000)  # another b at "v1"
    assert WeightAssembly.announced(ann).prefill(other) == 0


def test_an_announce_whose_segments_do_not_add_up_is_refused() -> None:
    from digenrl.transport.errors import ProtocolError
    from digenrl.transport.protocol import VersionAnnounce
    from digenrl.transport.schema import check

    def ann(**over: object) -> VersionAnnounce:
        fields: dict[str, object] = dict(version=3, step=3, nparts=2, nbytes=8, checksum="c",
                                         segments=["transformer", "transformer_2"], segment_since=[3, 1],
                                         segment_parts=[1, 1], segment_sums=["x", "y"])
        return VersionAnnounce(**{**fields, **over})  # type: ignore[arg-type]

    check(ann())
    check(ann(nparts=0, segments=[], segment_since=[], segment_parts=[], segment_sums=[]))
    for bad, why in (({"segment_parts": [1, 2]}, "adding up to nparts"), ({"segment_since": [4, 1]}, "<= version 3"),
                     ({"segment_sums": ["x"]}, "of one length")):
        with pytest.raises(ProtocolError, match=why):
            check(ann(**bad))
