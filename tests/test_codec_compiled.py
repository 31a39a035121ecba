"""The generated per-class encoders (transport/compiled.py) and tensor_to_frame's fast path are
the long way's fast paths: same frames for what they take, and nothing taken that the long way
would have converted or refused.

The typed decoder's generated finish is held to the checked decoder by tests/test_codec_typed.py
(every decode of a typed header goes through it)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from digenrl.transport import codec, frames, kinds
from digenrl.transport.protocol import PROTOCOL_VERSION, Message, encode, message_types
from tests.test_codec_typed import HONEST
from tests.test_protocol import any_message, plain, tensors

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CLASSES = sorted(message_types().items())


def _bytes(fs: list[Any]) -> list[bytes]:
    return [bytes(f) for f in fs]


def _exact(cls: type[Message], values: dict[str, Any]) -> bool:
    """What the generated encoder must take: every plain field passes its exact-type check."""
    return all(kinds.encode_check(k)(values[n]) for n, k in cls.KINDS.items()
               if k not in ("tensor", "tensors"))


def _same_as_the_long_way(msg: Message) -> None:
    plan = codec._PLANS[type(msg)]
    values = msg.__dict__
    try:
        long_way: list[bytes] | Exception = _bytes(codec._encode_checked(plan, values, PROTOCOL_VERSION))
    except ValueError as e:
        long_way = e
    try:
        fast = plan.encode(values, PROTOCOL_VERSION)
    except ValueError as e:  # only a tensor the long way refuses in the same words
        assert isinstance(long_way, ValueError) and str(e) == str(long_way)
        return
    if fast is None:
        assert not _exact(type(msg), values), "the generated encoder gave up on exact values"
    else:
        assert _exact(type(msg), values), "the generated encoder took a value the long way converts"
        assert _bytes(fast) == long_way


@pytest.mark.parametrize("msg", HONEST, ids=lambda m: type(m).__name__)
def test_honest_messages_encode_to_the_same_frames_both_ways(msg: Message) -> None:
    plan = codec._PLANS[type(msg)]
    fast = plan.encode(msg.__dict__, PROTOCOL_VERSION)
    assert fast is not None
    assert _bytes(fast) == _bytes(codec._encode_checked(plan, msg.__dict__, PROTOCOL_VERSION))
    assert _bytes(encode(msg)) == _bytes(fast)


@FAST
@given(msg=any_message)
def test_random_messages_encode_to_the_same_frames_both_ways(msg: Message) -> None:
    _same_as_the_long_way(msg)


OFF_KIND = (st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats()
            | st.text(max_size=4) | st.binary(max_size=4) | st.lists(plain, max_size=3)
            | st.tuples(st.integers(0, 3)) | st.dictionaries(st.integers(0, 3), plain, max_size=2)
            | plain)
"""Values of every kind and of none, ints past 64 bits and tuples included: what a caller's
bug puts in a field."""


@FAST
@given(index=st.integers(0, len(HONEST) - 1), data=st.data())
def test_a_field_of_another_kind_is_encoded_as_the_long_way_encodes_it(index: int,
                                                                       data: st.DataObject) -> None:
    msg = HONEST[index]
    plain_fields = [n for n, k in type(msg).KINDS.items() if k not in ("tensor", "tensors")]
    name = data.draw(st.sampled_from(plain_fields))
    value = data.draw(OFF_KIND)
    # around the dataclass: the constructor does not check types, and encode() must not trust it
    bad = dataclasses.replace(msg)
    bad.__dict__[name] = value
    _same_as_the_long_way(bad)


@pytest.mark.parametrize("name, kind", sorted({k: k for _, c in CLASSES for k in c.KINDS.values()
                                               if k not in ("tensor", "tensors")}.items()))
def test_every_plain_kind_is_checked_inline_as_the_generic_check_says(name: str, kind: str) -> None:
    """One class per kind, with the field on its own: the generated test accepts exactly the
    values the generic exact-type check accepts (an inline template that is too loose or too
    strict fails here, not only by chance in the property tests)."""
    from digenrl.transport.compiled import compile_encoder

    encoder = compile_encoder(type("K", (), {}), {"f": kind}, "k", to_frame=frames.tensor_to_frame,
                              tensor_dict=codec._tensor_dict, write=codec._ENCODER.encode)
    choices = kind[8:].split("|") if kind.startswith("literal:") else []
    for value in [0, 1, -1, kinds.INT_MIN, kinds.INT_MAX, kinds.INT_MIN - 1, kinds.INT_MAX + 1,
                  True, 0.5, math.nan, "", "x", b"", b"x", None, [], [1], [1.0], ["x"], [True],
                  {}, {"a": 1}, {1: 1}, (1,), *choices]:
        took = encoder({"f": value}, PROTOCOL_VERSION) is not None
        assert took == kinds.encode_check(kind)(value), (kind, value)


def _tensor_cases() -> list[torch.Tensor]:
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    return [x, x[:, :, 1], x.transpose(0, 1), x.expand(2, 2, 3, 4)[0], x[0, 0, 0], torch.empty(0, 3),
            x.to(torch.bfloat16), x.to(torch.float16), x.to(torch.int64), x.to(torch.int32),
            x.to(torch.uint8), x > 3, x.clone().requires_grad_(True), torch.nn.Parameter(x.clone()),
            x.to(torch.int16), x.to(torch.float64), x[1:], torch.ones(1, 5).t()]


@pytest.mark.parametrize("t", _tensor_cases(), ids=lambda t: f"{t.dtype}{tuple(t.shape)}")
def test_a_tensor_gives_the_same_frame_both_ways(t: torch.Tensor) -> None:
    try:
        slow: Any = frames.tensor_to_frame_checked("M.x", t)
    except ValueError as e:
        with pytest.raises(ValueError, match=str(e).replace("(", r"\(").replace(")", r"\)")):
            frames.tensor_to_frame("M.x", t)
        return
    fast = frames.tensor_to_frame("M.x", t)
    assert (fast[0], fast[1], bytes(fast[2])) == (slow[0], slow[1], bytes(slow[2]))


@FAST
@given(t=tensors())
def test_random_tensors_give_the_same_frame_both_ways(t: torch.Tensor) -> None:
    fast = frames.tensor_to_frame("M.x", t)
    slow = frames.tensor_to_frame_checked("M.x", t)
    assert (fast[0], fast[1], bytes(fast[2])) == (slow[0], slow[1], bytes(slow[2]))
