"""The codec: every message round-trips; hostile frames only ever raise ProtocolError."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import re
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

from digenrl.transport import codec, protocol, schema
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
from tests.factories import chunk

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
        "weights_route", "weights_held", "step_done", "samples",
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
        task_id=7, step=3, fragment=1, t_index=2, policy_version=4,
        x_t=torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
        x_next=torch.ones(2, 3, 4, dtype=torch.bfloat16), log_prob=torch.zeros(2))
    fields.update(over)
    return chunk(**fields)  # type: ignore[arg-type]


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
    assert protocol.PROTOCOL_VERSION == 9


# ---------------------------------------------------------------- one honest message of each type

X = torch.arange(24, dtype=torch.float32).reshape(4, 2, 3)
IMAGES = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
HONEST: list[Message] = [
    protocol.Hello(node_id="rollout-0", role="rollout", gpu="H100", incarnation=2, pid=4242, host="10.0.0.7",
                   data_endpoint="tcp://10.0.0.7:5601", weights_endpoint="tcp://10.0.0.7:5602"),
    protocol.Welcome(node_id="rollout-0", run_id="run-1", config_toml="[run]\nsteps = 3\n",
                     endpoints={"control": "tcp://10.0.0.1:5555", "trainer-0": "tcp://10.0.0.2:5600"},
                     rank=0, world_size=4),
    Heartbeat(node_id="rollout-0", incarnation=1, policy_version=3, state="running", seq=9,
              gpu={"available": True, "reason": "", "gpus": [
                  {"index": 0, "name": "H100", "mem_free_mb": 1.5, "power_w": None, "temp_c": 40.0}]},
              stats={"busy_s": 1.0, "chunks": 120, "bad_frames": 0}),
    protocol.Assign(task_id=5, step=1, fragment=0, prompt_ids=[3, 4], prompts=["a cat", "a dog"],
                    seeds=[1, 2, 3, 4], group_size=2, version_floor=0, lease_s=30.0, sde_steps=[0, 1, 2],
                    owners={"0": 0, "1": 1, "2": 0}, metadata=['{"tag": "x"}', "{}"]),
    Chunk(task_id=5, step=1, fragment=0, t_index=2, sigma=0.9, sigma_next=0.8, policy_version=3,
          x_t=X, x_next=X.to(torch.bfloat16), log_prob=torch.zeros(4)),
    protocol.CleanSample(task_id=5, step=1, fragment=0, policy_version=3, x0=X.to(torch.bfloat16)),
    protocol.Commit(task_id=5, step=1, fragment=0, node_id="rollout-0", policy_version=3, prompt_ids=[3, 4],
                    rewards=[0.5, 1.0, math.nan, 2.0], reward_terms={"jpeg": [1.0, 2.0, 3.0, 4]},
                    gen_seconds=0.1, cond={"pooled": torch.ones(2, 8)}, images=IMAGES, discard=""),
    protocol.Consumed(task_id=5, step=1, fragment=0, rank=1, policy_version=3, trained=3,
                      discarded={"zero_advantage": 1}, train_seconds=0.25),
    protocol.VersionAnnounce(version=4, step=1, nparts=2, nbytes=1 << 20, checksum="deadbeef",
                             segments=["transformer", "transformer_2"], segment_since=[4, 2], segment_parts=[1, 1],
                             segment_sums=["0badf00d", "deadbeef"]),
    protocol.WeightsRequest(version=4, part=1),
    WeightsPart(version=4, part=1, nparts=2, checksum="deadbeef",
                tensors={"blocks.0/attn.weight": torch.ones(3, 3), "norm.bias": torch.zeros(3)}),
    protocol.WeightsMissing(version=4, part=1, newest=-1),
    protocol.WeightsPending(version=4, part=1, landed=1),
    protocol.WeightsRoute(upstream="tcp://10.0.0.9:5602", upstream_node="rollout-3"),
    protocol.WeightsHeld(node_id="rollout-0", version=4),
    protocol.StepDone(step=1, version=4, metrics={"reward_mean": 0.5, "grad_norm": math.nan, "trained": 16}),
    protocol.Samples(step=1, kind="train", grid=torch.zeros(4, 6, 3, dtype=torch.uint8), prompt_ids=[3, 4],
                     caption=""),
    protocol.TagOffer(node_id="trainer-0", rank=0, free_mb=-1.0),
    protocol.Revoke(task_id=5, reason="lease expired"),
    Shutdown(reason="done"),
    protocol.Score(task_id=5, step=1, images=IMAGES, prompts=["a cat", "a dog"], metadata=["{}", "{}"]),
    protocol.Scored(task_id=5, rewards=[0.1, 0.2], reward_terms={"clip": [0.1, 0.2]}, error="", seconds=0.5),
]
TENSORED = [i for i, m in enumerate(HONEST) if encode(m)[1:]]


def test_every_message_type_has_an_honest_example_here() -> None:
    assert {m.TAG for m in HONEST} == set(message_types())


@pytest.mark.parametrize("msg", HONEST, ids=lambda m: type(m).__name__)
def test_honest_messages_round_trip_as_frames_and_as_bytes(msg: Message) -> None:
    frames = encode(msg)
    assert messages_equal(decode(frames, max_frame_bytes=LIMIT), msg)
    assert messages_equal(decode([bytes(f) for f in frames], max_frame_bytes=LIMIT), msg)


@pytest.mark.parametrize("tag", sorted(message_types()))
def test_message_classes_are_frozen_keyword_only_dataclasses_registered_once(tag: str) -> None:
    cls = message_types()[tag]
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    params = inspect.signature(cls).parameters.values()
    assert all(p.kind is p.KEYWORD_ONLY and p.default is p.empty for p in params)
    msg = next(m for m in HONEST if tag == m.TAG)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(msg, next(iter(cls.KINDS)), None)
    with pytest.raises(TypeError):
        cls(*msg.__dict__.values())
    with pytest.raises(TypeError, match="registered twice"):
        protocol.message(tag)(type("Again", (Message,), {"__annotations__": {"a": "int"}}))


def test_ints_in_a_list_of_floats_decode_as_floats() -> None:
    """Another msgpack writer may send 0 for 0.0."""
    commit = HONEST[6]
    header = _header(encode(commit))
    header["rewards"] = [0, 1, 2.5, 3]
    got = decode(_with_header(encode(commit), header), max_frame_bytes=LIMIT)
    assert isinstance(got, protocol.Commit) and got.rewards == [0.0, 1.0, 2.5, 3.0]
    assert all(type(r) is float for r in got.rewards)


def _nested(depth: int) -> dict[str, object]:
    """A dict holding ``depth`` nested lists, the innermost holding a value ``depth + 1`` levels
    below the dict."""
    inner: object = [1]
    for _ in range(depth - 1):
        inner = [inner]
    return {"a": inner}


def test_dicts_nested_past_the_depth_limit_are_refused_both_ways() -> None:
    def beat(gpu: dict[str, object]) -> Heartbeat:
        return Heartbeat(node_id="a", incarnation=0, policy_version=0, state="running", seq=0,
                         gpu=gpu, stats={})

    deepest = beat(_nested(codec.MAX_DEPTH - 1))  # its leaf MAX_DEPTH levels down
    assert _header(encode(deepest))["gpu"] == deepest.gpu
    with pytest.raises(ValueError, match=r"Heartbeat\.gpu.*nested deeper than 16"):
        encode(beat(_nested(codec.MAX_DEPTH)))
    header = _header(encode(deepest))
    header["gpu"] = _nested(codec.MAX_DEPTH)
    with pytest.raises(ProtocolError, match=r"Heartbeat\.gpu") as err:
        decode(_with_header(encode(deepest), header), max_frame_bytes=LIMIT)
    assert err.value.reason == "field"


@pytest.mark.parametrize("index", TENSORED, ids=lambda i: type(HONEST[i]).__name__)
@pytest.mark.parametrize("element, change", [(4, 1), (4, -1), (3, "reshape"), (3, "grow"), (3, "shrink"),
                                             (2, "dtype")])
def test_a_tensor_entry_that_does_not_match_its_frame_is_refused(
        index: int, element: int, change: object) -> None:
    """A size off by one, a shape of the same or another size, one element with its size (the
    frame longer than the header says), a dtype of another item size: only a same-size
    reshape decodes (the schema may still refuse the shape)."""
    frames = encode(HONEST[index])
    header = _header(frames)
    entry = header["_tensors"][0]
    if element == 4:
        entry[4] += change
    elif change == "reshape":
        entry[3] = [math.prod(entry[3])]
    elif change == "grow":
        entry[3] = [*entry[3], 2]
    elif change == "shrink":  # shape and size agree, the frame is bigger than both say
        entry[3], entry[4] = [1], entry[4] // math.prod(entry[3])
    else:
        entry[2] = "int64" if entry[2] != "int64" else "int32"
    mutated_frames = _with_header(frames, header)
    if change == "reshape":
        with contextlib.suppress(ProtocolError):
            decode(mutated_frames, max_frame_bytes=LIMIT)
    else:
        with pytest.raises(ProtocolError):
            decode(mutated_frames, max_frame_bytes=LIMIT)


def _accepted_is_a_valid_message(frames: list) -> None:
    """decode raises only ProtocolError, and what it accepts passes the schema and encodes."""
    try:
        got = decode(frames, max_frame_bytes=LIMIT)
    except ProtocolError:
        return
    schema.check(got)
    encode(got)


wire_values = st.one_of(
    plain, st.integers(INT_MIN, INT_MAX), st.floats(), st.text(min_size=100, max_size=5000),
    st.lists(st.integers(-3, 1 << 62), max_size=4), st.dictionaries(st.integers(-2, 2), st.integers(INT_MIN, INT_MAX)),
    st.sampled_from([msgpack.ExtType(1, b"x"), msgpack.Timestamp(0), "running", "", "\n"]))


@FAST
@given(index=st.integers(0, len(HONEST) - 1), data=st.data())
def test_mutated_headers_decode_to_valid_messages_or_protocol_errors(index: int, data: st.DataObject) -> None:
    frames = encode(HONEST[index])
    header = _header(frames)
    key = data.draw(st.sampled_from([*header, "extra", "_tensors"]))
    if data.draw(st.booleans()) and key in header:
        del header[key]
    else:
        header[key] = data.draw(wire_values)
    _accepted_is_a_valid_message([msgpack.packb(header, use_bin_type=True), *frames[1:]])


entry_values = st.one_of(wire_values, st.sampled_from(
    ["x_t", "x_next", "log_prob", "x0", "images", "cond", "tensors", "pooled", "float32", "bfloat16",
     "bool", "uint8", "int64", None, 0, 4, 96, 192, [4, 2, 3], [4, 6], [], [-1], [2] * 17]))


@FAST
@given(index=st.sampled_from(TENSORED), data=st.data())
def test_mutated_tensor_entries_decode_to_valid_messages_or_protocol_errors(index: int,
                                                                           data: st.DataObject) -> None:
    """An entry's field, key, dtype, shape or size changed, an entry dropped or doubled, frames
    dropped, doubled or reordered."""
    frames = encode(HONEST[index])
    header = _header(frames)
    entries, tensor_frames = header["_tensors"], list(frames[1:])
    action = data.draw(st.sampled_from(["element", "drop", "double", "frames"]))
    i = data.draw(st.integers(0, len(entries) - 1))
    if action == "element":
        entries[i][data.draw(st.integers(0, 4))] = data.draw(entry_values)
    elif action == "drop":  # with its frame or without
        del entries[i]
        if data.draw(st.booleans()):
            del tensor_frames[i]
    elif action == "double":
        entries.append(list(entries[i]))
        if data.draw(st.booleans()):
            tensor_frames.append(tensor_frames[i])
    else:
        order = data.draw(st.lists(st.integers(0, len(tensor_frames) - 1), max_size=len(tensor_frames) + 1))
        tensor_frames = [tensor_frames[j] for j in order]
    _accepted_is_a_valid_message([msgpack.packb(header, use_bin_type=True), *tensor_frames])


OFF_KIND = (st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats()
            | st.text(max_size=4) | st.binary(max_size=4) | st.lists(plain, max_size=3)
            | st.tuples(st.integers(0, 3)) | st.dictionaries(st.integers(0, 3), plain, max_size=2)
            | plain)
"""Values of every kind and of none, ints past 64 bits and tuples included: what a caller's
bug puts in a field."""


@FAST
@given(index=st.integers(0, len(HONEST) - 1), data=st.data())
def test_a_field_of_another_kind_is_refused_naming_it_or_travels_as_its_kind(index: int,
                                                                             data: st.DataObject) -> None:
    msg = HONEST[index]
    cls = type(msg)
    name = data.draw(st.sampled_from([n for n, k in cls.KINDS.items() if k not in ("tensor", "tensors")]))
    bad = dataclasses.replace(msg)
    bad.__dict__[name] = data.draw(OFF_KIND)  # around the frozen dataclass: its __init__ checks no types
    try:
        frames = encode(bad)
    except ValueError as e:
        assert str(e).startswith(f"{cls.__name__}.{name}"), e
        return
    try:  # it passed the kind's check, so it decodes unless the schema refuses its value
        decode(frames, max_frame_bytes=LIMIT)
    except ProtocolError as e:
        assert e.reason == "invalid", e


def _tensor_cases() -> list[torch.Tensor]:
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    return [x, x[:, :, 1], x.transpose(0, 1), x.expand(2, 2, 3, 4)[0], x[0, 0, 0], torch.empty(0, 3),
            x.to(torch.bfloat16), x.to(torch.float16), x.to(torch.int64), x.to(torch.int32),
            x.to(torch.uint8), x > 3, x.clone().requires_grad_(True), torch.nn.Parameter(x.clone()),
            x[1:], torch.ones(1, 5).t()]


@pytest.mark.parametrize("t", _tensor_cases(), ids=lambda t: f"{t.dtype}{tuple(t.shape)}")
def test_tensors_of_any_layout_travel_as_their_values(t: torch.Tensor) -> None:
    """Views, strided, expanded, 0-d, empty, grad-requiring tensors and Parameters: each arrives
    as a plain tensor of the same dtype, shape and values."""
    part = WeightsPart(version=1, part=0, nparts=1, checksum="x", tensors={"t": t})
    got = decode(encode(part), max_frame_bytes=LIMIT)
    assert isinstance(got, WeightsPart)
    assert type(got.tensors["t"]) is torch.Tensor and not got.tensors["t"].requires_grad
    assert messages_equal(got, WeightsPart(version=1, part=0, nparts=1, checksum="x",
                                           tensors={"t": t.detach().clone()}))


@pytest.mark.parametrize("dtype", [torch.int16, torch.float64, torch.complex64])
def test_a_tensor_of_another_dtype_is_refused_naming_it(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=rf"Chunk\.x_t: dtype {dtype}"):
        encode(_chunk(x_t=torch.zeros(2, 3, 4, dtype=dtype)))


# ---------------------------------------------------------------- frames received from a socket


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://test-protocol")
    b.connect("inproc://test-protocol")
    yield a, b
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


def _received(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]], fs: list[Any]) -> list[zmq.Frame]:
    """``fs`` as a node receives them: zmq.Frames over libzmq's own buffers."""
    pair[0].send_multipart(fs, copy=False)
    got = pair[1].recv_multipart(copy=False)
    assert all(type(f) is zmq.Frame for f in got)
    return got


@pytest.mark.parametrize("msg", HONEST, ids=lambda m: type(m).__name__)
def test_messages_received_from_a_socket_decode_as_sent_over_the_frames_memory(pair: Any,
                                                                               msg: Message) -> None:
    received = _received(pair, encode(msg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # over writable frames torch has nothing to warn about
        got = decode(received, max_frame_bytes=LIMIT)
    assert messages_equal(got, msg)
    singles = [n for n, k in type(msg).KINDS.items() if k == "tensor"]
    if "tensors" not in type(msg).KINDS.values():  # one frame per field, in field order
        for name, frame in zip(singles, received[1:]):
            t = getattr(got, name)
            if t.numel():
                assert t.untyped_storage().data_ptr() == np.frombuffer(frame, np.uint8).ctypes.data


@pytest.mark.parametrize("index", TENSORED, ids=lambda i: type(HONEST[i]).__name__)
def test_frames_made_over_bytes_decode_without_a_warning(index: int) -> None:
    """A zmq.Frame a caller builds over a bytes object: pyzmq calls its buffer writable."""
    frames = [zmq.Frame(bytes(f)) for f in encode(HONEST[index])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert messages_equal(decode(frames, max_frame_bytes=LIMIT), HONEST[index])


@FAST
@given(msg=any_message)
def test_random_messages_received_from_a_socket_decode_as_sent_or_are_refused(pair: Any,
                                                                              msg: Message) -> None:
    try:
        got = decode(_received(pair, encode(msg)), max_frame_bytes=LIMIT)
    except ProtocolError as e:  # random values of the right types: the schema may refuse them
        assert e.reason == "invalid", e
        return
    assert messages_equal(got, msg)
