"""The codec: every message round-trips; hostile frames only ever raise ProtocolError."""

from __future__ import annotations

import contextlib
import math
import re

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from digenrl.transport import protocol, schema
from digenrl.transport.protocol import (
    DTYPES,
    INT_MAX,
    INT_MIN,
    PROTOCOL_VERSION,
    Chunk,
    Heartbeat,
    Message,
    ProtocolError,
    Shutdown,
    VersionMismatch,
    WeightsPart,
    decode,
    encode,
    message_types,
    messages_equal,
    tensor_checksum,
)

LIMIT = 1 << 20
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ints = st.integers(INT_MIN, INT_MAX)
floats = st.floats(allow_nan=True, allow_infinity=True)
scalars = st.none() | st.booleans() | ints | floats | st.text(max_size=8) | st.binary(max_size=8)
plain = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
plain_dicts = st.dictionaries(st.text(max_size=6), plain, max_size=4)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Any supported dtype, 0-3 dims (some empty), arbitrary bit patterns (NaNs included)."""
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = math.prod(shape) * dtype.itemsize
    raw = bytearray(draw(st.binary(min_size=n, max_size=n)))
    if dtype is torch.bool:
        raw = bytearray(b & 1 for b in raw)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


KIND_STRATEGIES = {
    "int": ints, "float": floats, "str": st.text(max_size=12), "bool": st.booleans(),
    "bytes": st.binary(max_size=12), "dict": plain_dicts, "tensor": tensors(),
    "tensors": st.dictionaries(st.text(max_size=8), tensors(), max_size=3),
}


def messages_of(cls: type[Message]) -> st.SearchStrategy[Message]:
    fields = {}
    for name, kind in cls.KINDS.items():
        if kind.startswith("list:"):
            fields[name] = st.lists(KIND_STRATEGIES[kind[5:]], max_size=5)
        elif kind.startswith("literal:"):
            fields[name] = st.sampled_from(kind[8:].split("|"))
        else:
            fields[name] = KIND_STRATEGIES[kind]
    return st.builds(cls, **fields)


any_message = st.sampled_from(sorted(message_types().items())).flatmap(lambda kv: messages_of(kv[1]))


def test_the_message_set_is_registered() -> None:
    assert set(message_types()) == {
        "hello", "welcome", "heartbeat", "assign", "chunk", "clean_sample", "commit", "consumed",
        "version_announce", "weights_request", "weights_part", "weights_missing", "weights_pending",
        "weights_route", "weights_held", "step_done",
        "tag_offer", "revoke", "shutdown", "score", "scored"}


@pytest.mark.parametrize("tag", sorted(message_types()))
@FAST
@given(data=st.data())
def test_every_message_type_round_trips_bit_identical(tag: str, data: st.DataObject) -> None:
    msg = data.draw(messages_of(message_types()[tag]))
    frames = encode(msg)
    try:  # random values of the right types: the schema (ranges, sizes) may refuse them
        schema.check(msg)
    except ProtocolError as refused:
        with pytest.raises(ProtocolError, match=re.escape(str(refused))):
            decode(frames, max_frame_bytes=LIMIT)
        return
    for as_bytes in (False, True):
        got = decode([bytes(f) for f in frames] if as_bytes else frames, max_frame_bytes=LIMIT)
        assert messages_equal(got, msg), (got, msg)


def _chunk(**over: object) -> Chunk:
    fields: dict[str, object] = dict(
        task_id=7, step=3, fragment=1, t_index=2, sigma=0.9, sigma_next=0.8, policy_version=4,
        x_t=torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
        x_next=torch.ones(2, 3, 4, dtype=torch.bfloat16), log_prob=torch.zeros(2))
    fields.update(over)
    return Chunk(**fields)  # type: ignore[arg-type]


def test_decoded_tensor_shares_the_received_frame_memory() -> None:
    frames = [bytearray(f) for f in encode(_chunk())]
    got = decode(frames, max_frame_bytes=LIMIT)
    assert isinstance(got, Chunk)
    frames[1][0:4] = torch.tensor([42.0]).numpy().tobytes()
    assert got.x_t.flatten()[0].item() == 42.0


def test_encode_rejects_ints_outside_64_bits_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"Chunk.task_id = 18446744073709551616"):
        encode(_chunk(task_id=INT_MAX + 1))
    with pytest.raises(ValueError, match=r"Heartbeat.stats\['n'\]"):
        encode(Heartbeat(node_id="a", incarnation=0, policy_version=0, state="running", seq=0, gpu={},
                         stats={"n": INT_MIN - 1}))


def test_encode_rejects_unsupported_dtypes_and_wrong_types() -> None:
    with pytest.raises(ValueError, match="float64"):
        encode(_chunk(x_t=torch.zeros(2, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"Chunk\.step = True: expected an int"):
        encode(_chunk(step=True))


def test_a_different_protocol_version_is_refused_with_a_clear_message() -> None:
    header = msgpack.packb({"t": "revoke", "v": 99, "task_id": 1, "reason": "x", "_tensors": []})
    with pytest.raises(VersionMismatch) as err:
        decode([header], max_frame_bytes=LIMIT)
    assert str(err.value) == f"peer speaks protocol version 99, this node speaks {PROTOCOL_VERSION}"
    assert err.value.peer_version == 99 and isinstance(err.value, ProtocolError)


def test_a_shutdown_reads_in_any_protocol_version_and_nothing_else_does() -> None:
    """Shutdown's layout is frozen, so a refusal reaches a node of another version."""
    old = msgpack.packb({"t": "shutdown", "v": 2, "reason": "refused", "_tensors": []})
    assert decode([old], max_frame_bytes=LIMIT) == Shutdown(reason="refused")
    assert _header(encode(Shutdown(reason="refused"), version=2)) == msgpack.unpackb(old)
    hello_v2 = msgpack.packb({"t": "hello", "v": 2, "node_id": "n", "role": "rollout", "gpu": "cpu",
                              "incarnation": 1, "pid": 1, "host": "", "_tensors": []})
    with pytest.raises(VersionMismatch):
        decode([hello_v2], max_frame_bytes=LIMIT)
    with pytest.raises(ValueError, match="only shutdown can be written in another version"):
        encode(Heartbeat(node_id="a", incarnation=0, policy_version=0, state="running", seq=0,
                         gpu={}, stats={}), version=2)


def test_roles_and_states_outside_their_sets_are_refused_both_ways() -> None:
    hello = protocol.Hello(node_id="n", role="rollout", gpu="cpu", incarnation=1, pid=1, host="h",
                           data_endpoint="", weights_endpoint="")
    assert protocol.Hello.KINDS["role"] == "literal:rollout|trainer|reward"
    with pytest.raises(ValueError, match=r"Hello\.role = 'admin': expected one of rollout\|trainer\|reward"):
        encode(protocol.Hello(**{**hello.__dict__, "role": "admin"}))
    header = _header(encode(hello))
    header["role"] = "coordinator"
    with pytest.raises(ProtocolError, match=r"Hello\.role = 'coordinator'") as err:
        decode([msgpack.packb(header)], max_frame_bytes=LIMIT)
    assert err.value.reason == "field"
    header = _header(encode(Heartbeat(node_id="a", incarnation=0, policy_version=0,
                                      state="stopping", seq=0, gpu={}, stats={})))
    header["state"] = "idle"
    with pytest.raises(ProtocolError, match=r"Heartbeat\.state = 'idle'"):
        decode([msgpack.packb(header)], max_frame_bytes=LIMIT)


def _header(frames: list) -> dict:
    return msgpack.unpackb(frames[0])


def _with_header(frames: list, header: dict) -> list:
    return [msgpack.packb(header), *frames[1:]]


def test_a_declared_shape_past_the_limit_is_refused_before_any_tensor_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_allocation(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor was built for a refused frame")

    frames = encode(_chunk())
    for shape in ([1 << 40, 1 << 40], [257], [16, 17]):  # 257 float32 > the 1 KiB limit
        header = _header(frames)
        header["_tensors"][0][3] = shape
        header["_tensors"][0][4] = min(math.prod(shape) * 4, INT_MAX)
        monkeypatch.setattr(torch, "frombuffer", no_allocation)
        monkeypatch.setattr(torch, "empty", no_allocation)
        with pytest.raises(ProtocolError, match="over the 1024-byte frame limit") as err:
            decode(_with_header(frames, header), max_frame_bytes=1024)
        monkeypatch.undo()
        assert err.value.reason == "too_large"


@pytest.mark.parametrize(("field", "value", "match"), [
    (3, [-1, 2], "bad shape"),
    (3, [2.0, 3], "bad shape"),
    (3, [1] * 17, "bad shape"),
    (3, [3, 4], "needs 48 bytes"),  # lies about the shape: frame has 2*3*4*4 bytes
    (4, 95, "header says 95"),  # lies about nbytes
    (4, "96", "bad nbytes"),
    (2, "float64", "unknown dtype"),
])
def test_lies_about_a_tensor_are_protocol_errors(field: int, value: object, match: str) -> None:
    frames = encode(_chunk())
    header = _header(frames)
    header["_tensors"][0][field] = value
    with pytest.raises(ProtocolError, match=match):
        decode(_with_header(frames, header), max_frame_bytes=LIMIT)


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda h: h.update(t="nope"), "unknown message tag 'nope'"),
    (lambda h: h.pop("step"), "missing fields step"),
    (lambda h: h.update(extra=1), "unexpected field 'extra'"),
    (lambda h: h.update(step="3"), "Chunk.step = '3': expected int"),
    (lambda h: h.update(x_t=1), "unexpected field 'x_t'"),
    (lambda h: h.update(_tensors=h["_tensors"][:2]), "header lists 2 tensors"),
    (lambda h: h["_tensors"][1].__setitem__(0, "x_t"), "repeated tensor entry"),
    (lambda h: h["_tensors"][1].__setitem__(1, "k"), "bad or repeated tensor entry"),
])
def test_malformed_headers_are_protocol_errors(mutate, match: str) -> None:
    frames = encode(_chunk())
    header = _header(frames)
    mutate(header)
    with pytest.raises(ProtocolError, match=match):
        decode(_with_header(frames, header), max_frame_bytes=LIMIT)


def test_bool_tensors_holding_other_bytes_and_bytes_dict_keys_are_refused() -> None:
    frames = [bytearray(f) for f in encode(_chunk(log_prob=torch.zeros(2, dtype=torch.bool)))]
    frames[3][0] = 2
    with pytest.raises(ProtocolError, match="bool tensor"):
        decode(frames, max_frame_bytes=LIMIT)
    hb = encode(Heartbeat(node_id="a", incarnation=0, policy_version=0, state="running", seq=0, gpu={},
                          stats={}))
    header = _header(hb)
    header["gpu"] = {b"raw": 1}
    with pytest.raises(ProtocolError, match=r"Heartbeat\.gpu"):
        decode([msgpack.packb(header, use_bin_type=True)], max_frame_bytes=LIMIT)


def test_frame_count_and_sizes_are_bounded() -> None:
    frames = encode(_chunk())
    with pytest.raises(ProtocolError, match="4 frames; expected 1 to 3"):
        decode(frames, max_frame_bytes=LIMIT, max_frames=3)
    big = encode(_chunk(x_t=torch.zeros(64)))
    with pytest.raises(ProtocolError, match="frame 1 has 256 bytes, over the 200-byte"):
        decode(big, max_frame_bytes=200)
    with pytest.raises(ProtocolError, match="header has"):
        decode(frames, max_frame_bytes=LIMIT, max_header_bytes=16)
    with pytest.raises(ProtocolError, match="0 frames"):
        decode([], max_frame_bytes=LIMIT)


@FAST
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_frames_raise_only_protocol_errors(frames: list[bytes]) -> None:
    with contextlib.suppress(ProtocolError):  # any other exception fails the test
        assert isinstance(decode(frames, max_frame_bytes=1024, max_frames=4), Message)


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    frames = [bytes(f) for f in encode(draw(any_message))]
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(frames) - 1))
        op = draw(st.sampled_from(["flip", "truncate", "add", "drop", "extend"]))
        f = bytearray(frames[i])
        if op == "flip" and f:
            j = draw(st.integers(0, len(f) - 1))
            f[j] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del f[draw(st.integers(0, len(f))):]
        elif op == "extend":
            f += draw(st.binary(min_size=1, max_size=8))
        elif op == "add":
            frames.insert(i, draw(st.binary(max_size=16)))
            continue
        elif op == "drop" and len(frames) > 1:
            frames.pop(i)
            continue
        frames[i] = bytes(f)
    return frames


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_valid_frames_raise_only_protocol_errors(frames: list[bytes]) -> None:
    with contextlib.suppress(ProtocolError):  # any other exception fails the test
        assert isinstance(decode(frames, max_frame_bytes=4096, max_frames=64), Message)


def test_tensor_checksum_ignores_order_and_sees_names_dtypes_shapes_and_bytes() -> None:
    a, b = torch.arange(6, dtype=torch.float32), torch.ones(2, 3, dtype=torch.bfloat16)
    base = tensor_checksum({"a": a, "b": b})
    assert base == tensor_checksum({"b": b, "a": a.clone()})
    variants = [{"a": a, "c": b}, {"a": a.to(torch.int32), "b": b}, {"a": a.reshape(2, 3), "b": b},
                {"a": a + 1, "b": b}]
    assert len({base, *(tensor_checksum(v) for v in variants)}) == 5


def test_weights_part_with_slashes_in_names_and_messages_equal_is_strict() -> None:
    tensors = {"blocks.0/attn.to_q.lora_A": torch.randn(4, 2), "x/y": torch.zeros(0)}
    part = WeightsPart(version=1, part=0, nparts=1, checksum=tensor_checksum(tensors),
                       tensors=tensors)
    got = decode(encode(part), max_frame_bytes=LIMIT)
    assert messages_equal(got, part)
    assert isinstance(got, WeightsPart) and tensor_checksum(got.tensors) == part.checksum
    assert not messages_equal(Shutdown(reason="a"), Shutdown(reason="b"))
    assert not messages_equal(_chunk(), _chunk(x_t=torch.zeros(2, 3, 4)))
    assert protocol.PROTOCOL_VERSION == 7
