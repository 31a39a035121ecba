"""The generated per-class encoders (transport/compiled.py) and tensor_to_frame's fast path are
the long way's fast paths: same frames for what they take, and nothing taken that the long way
would have converted or refused.

The typed decoder's generated finish is held to the checked decoder by tests/test_codec_typed.py
(every decode of a typed header goes through it); here, also on frames received from a real
ZeroMQ socket, where its inline tensor step (frames.received_frame_to_tensor) runs. The
generated ``__init__`` builds the instance the dataclass ``__init__`` builds."""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from digenrl.transport import codec, frames, kinds
from digenrl.transport.protocol import (
    PROTOCOL_VERSION,
    Message,
    encode,
    message_types,
    messages_equal,
)
from tests.test_codec_typed import HONEST, _agree, _checked
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
                  {}, {"a": 1}, {1: 1}, (1,), *choices,
                  # ints past 64 bits inside a dict: msgspec's OverflowError, caught (ranges)
                  {"a": kinds.INT_MAX}, {"a": kinds.INT_MAX + 1}, {"a": [{"b": kinds.INT_MIN - 1}]},
                  {"a": (1,)}, {"a": {1: 2}}, _nested(kinds.MAX_DEPTH), _nested(kinds.MAX_DEPTH + 1)]:
        took = encoder({"f": value}, PROTOCOL_VERSION) is not None
        assert took == kinds.encode_check(kind)(value), (kind, value)


def _nested(depth: int) -> dict[str, Any]:
    """A dict whose innermost list holds a value ``depth`` levels below the dict's own values."""
    inner: Any = [1]
    for _ in range(depth - 1):
        inner = [inner]
    return {"a": inner}


deep = st.recursive(plain | st.integers(-(1 << 70), 1 << 70) | st.tuples(st.integers(0, 3)),
                    lambda inner: st.lists(inner, max_size=2)
                    | st.dictionaries(st.text(max_size=2) | st.integers(0, 2), inner, max_size=2),
                    max_leaves=24)
"""Plain values, ints past 64 bits, tuples and int keys included, nested up to ~20 levels."""


@FAST
@given(value=deep | st.builds(_nested, st.integers(kinds.MAX_DEPTH - 2, kinds.MAX_DEPTH + 2)))
def test_plain_types_ok_is_plain_ok_less_the_int_ranges(value: Any) -> None:
    """The typed decoder and the generated encoder check dicts with plain_types_ok: it must
    answer as plain_ok does, except for an int outside 64 bits (which msgpack cannot decode and
    msgspec's encoder refuses with OverflowError)."""
    def in_range(v: Any) -> Any:  # the same value, every int outside 64 bits made 0
        if type(v) is int:
            return v if kinds.INT_MIN <= v <= kinds.INT_MAX else 0
        if type(v) is list:
            return [in_range(x) for x in v]
        if type(v) is dict:
            return {k: in_range(x) for k, x in v.items()}
        return v

    for top in (value, {"k": value}):
        assert kinds.plain_types_ok(top) == kinds.plain_ok(in_range(top)), top


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


# ---------------------------------------------------------------- received frames


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://test-codec-compiled")
    b.connect("inproc://test-codec-compiled")
    yield a, b
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


def _received(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]], fs: list[Any]) -> list[zmq.Frame]:
    """``fs`` as a node receives them: zmq.Frames over libzmq's own (writable) buffers."""
    pair[0].send_multipart(fs, copy=False)
    got = pair[1].recv_multipart(copy=False)
    assert all(type(f) is zmq.Frame for f in got)
    return got


TENSORED = [m for m in HONEST if encode(m)[1:]]
SINGLES = [m for m in TENSORED if "tensors" not in type(m).KINDS.values()]  # Chunk, CleanSample, Score
"""Messages with tensors; SINGLES: those whose finish reads them inline (the others: the
codec's _typed_tensors loop, which reads received frames with the same function)."""


def test_the_inline_tensor_step_is_generated_for_the_chunk() -> None:
    assert {type(m).__name__ for m in SINGLES} >= {"Chunk", "CleanSample"}


@pytest.mark.parametrize("msg", HONEST, ids=lambda m: type(m).__name__)
def test_honest_messages_received_from_a_socket_decode_as_sent(pair: Any, msg: Message) -> None:
    got = _agree(_received(pair, encode(msg)))
    assert got is not None and messages_equal(got, msg)


@pytest.mark.parametrize("msg", SINGLES, ids=lambda m: type(m).__name__)
def test_received_tensors_take_the_inline_step_alone(pair: Any, msg: Message,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With the generic tensor step broken, a received message laid out as encode() writes
    it still decodes: the inline step did all of it (so a step that always declined, which
    every equivalence test would pass, fails here). Its tensors are views of the frames."""
    finish = codec._PLANS[type(msg)].finish

    def broken(*args: Any) -> bool:
        raise AssertionError("the generic tensor step ran")

    monkeypatch.setitem(finish.__globals__, "tensors", broken)
    received = _received(pair, encode(msg))
    got = codec._decode_typed(received, 1 << 20, codec.DEFAULT_MAX_FRAMES,
                              codec.DEFAULT_MAX_HEADER_BYTES)
    assert got is not None and messages_equal(got, msg)
    names = [n for n, k in type(msg).KINDS.items() if k == "tensor"]
    for name, frame in zip(names, received[1:]):
        t = getattr(got, name)
        assert t.untyped_storage().data_ptr() == np.frombuffer(frame, np.uint8).ctypes.data


@pytest.mark.parametrize("msg", TENSORED, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("change", ["swap", "size", "shape", "shrink", "dtype", "drop",
                                    "over-bytes"])
def test_received_frames_the_inline_step_declines_go_the_generic_way(pair: Any, msg: Message,
                                                                    change: str) -> None:
    """Entries out of order (the generic step takes them; for a dict of tensors, in the other
    key order), sizes that do not match (both
    paths refuse; "shrink": frames longer than descriptions that agree with each other), a
    frame dropped. And a Frame made over a bytes object, as a caller may build
    one: pyzmq calls its buffer writable, so torch must not warn (warnings are errors here)."""
    fs = encode(msg)
    header = msgpack.unpackb(fs[0])
    entries, tensor_frames = header["_tensors"], list(fs[1:])
    if change == "swap" and len(entries) > 1:
        entries[0], entries[1] = entries[1], entries[0]
        tensor_frames[0], tensor_frames[1] = tensor_frames[1], tensor_frames[0]
    elif change == "size":
        entries[-1][4] += 1
    elif change == "shape":
        entries[0][3] = [*entries[0][3], 2]
    elif change == "shrink":  # every N to 1, sizes to match: the frames are longer than said
        for entry in entries:
            entry[3], entry[4] = [1, *entry[3][1:]], entry[4] // entry[3][0]
    elif change == "dtype":
        entries[0][2] = "int64" if entries[0][2] != "int64" else "int32"
    elif change == "drop":
        del tensor_frames[-1]
    mutated = [msgpack.packb(header, use_bin_type=True), *tensor_frames]
    if change == "over-bytes":
        received: list[Any] = [zmq.Frame(bytes(f)) for f in mutated]
    else:
        received = _received(pair, mutated)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _agree(received)
    if change == "over-bytes" or (change == "swap" and "tensors" not in type(msg).KINDS.values()):
        assert got is not None and messages_equal(got, msg)
    elif change == "swap":  # a dict of tensors in another key order: still accepted
        assert got is not None
    elif change != "dtype" or entries[0][2] != "int32":
        assert got is None and isinstance(_checked(received), Exception)


@FAST
@given(msg=any_message)
def test_random_messages_received_from_a_socket_decode_alike_both_ways(pair: Any, msg: Message) -> None:
    _agree(_received(pair, encode(msg)))


# ---------------------------------------------------------------- the generated __init__


@pytest.mark.parametrize("tag, cls", CLASSES)
def test_every_message_class_has_the_generated_init_with_the_dataclass_signature(
        tag: str, cls: type[Message]) -> None:
    assert cls.__init__.__code__.co_filename.startswith("<digenrl.transport.compiled")
    params = inspect.signature(cls).parameters
    assert list(params) == [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    assert all(p.kind is p.KEYWORD_ONLY and p.default is p.empty for p in params.values())


@pytest.mark.parametrize("msg", HONEST, ids=lambda m: type(m).__name__)
def test_the_generated_init_builds_what_the_dataclass_init_builds(msg: Message) -> None:
    cls = type(msg)
    values = dict(msg.__dict__)
    # the dataclass __init__ that message() replaced, made again for the same fields
    reference = dataclasses.dataclass(frozen=True, kw_only=True)(
        type(cls.__name__, (), {"__annotations__": dict(cls.__annotations__)}))
    want = reference(**values).__dict__
    got = cls(**values)  # type: ignore[call-arg]
    assert list(got.__dict__) == list(want) and all(got.__dict__[n] is want[n] for n in want)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(got, next(iter(values)), None)
    first = next(iter(values))
    for bad in ({k: v for k, v in values.items() if k != first}, {**values, "extra": 1}):
        with pytest.raises(TypeError) as generated:
            cls(**bad)
        with pytest.raises(TypeError) as dataclass_init:
            reference(**bad)
        assert str(generated.value).split("() ", 1)[1] == str(dataclass_init.value).split("() ", 1)[1]
    with pytest.raises(TypeError):
        cls(*values.values())


def test_a_message_with_a_default_or_a_post_init_keeps_the_dataclass_init() -> None:
    made: list[type[Message]] = []
    try:
        @codec.message("test_with_default")
        class WithDefault(Message):
            a: int
            b: str = "x"

        made.append(WithDefault)

        @codec.message("test_with_post_init")
        class WithPostInit(Message):
            a: int

            def __post_init__(self) -> None:
                object.__setattr__(self, "a", self.a + 1)

        made.append(WithPostInit)
        assert WithDefault(a=1).__dict__ == {"a": 1, "b": "x"}
        assert WithPostInit(a=1).a == 2
        assert not WithDefault.__init__.__code__.co_filename.startswith("<digenrl")
    finally:
        for cls in made:
            codec._REGISTRY.pop(cls.TAG, None)
            codec._PLANS.pop(cls, None)
        codec._TYPED.clear()
