"""The codec's typed decoder (msgspec, codec._decode_typed) against the checked path
(codec._decode + schema.check): it takes every honest message, accepts nothing the checked
path refuses, and builds the same message; each schema rule it enforces in C says exactly
what the rule's predicate says."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from digenrl.transport import codec, kinds, schema
from digenrl.transport.protocol import (
    DEFAULT_MAX_FRAMES,
    INT_MAX,
    INT_MIN,
    Assign,
    Chunk,
    CleanSample,
    Commit,
    Consumed,
    Heartbeat,
    Hello,
    Message,
    Revoke,
    Score,
    Scored,
    Shutdown,
    StepDone,
    TagOffer,
    VersionAnnounce,
    WeightsHeld,
    WeightsMissing,
    WeightsPart,
    WeightsPending,
    WeightsRequest,
    WeightsRoute,
    Welcome,
    encode,
    message_types,
    messages_equal,
)
from tests.test_protocol import any_message, plain

LIMIT = 1 << 20
HEADER_LIMIT = codec.DEFAULT_MAX_HEADER_BYTES
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

X = torch.arange(24, dtype=torch.float32).reshape(4, 2, 3)
IMAGES = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
HONEST: list[Message] = [
    Hello(node_id="rollout-0", role="rollout", gpu="H100", incarnation=2, pid=4242, host="10.0.0.7",
          data_endpoint="tcp://10.0.0.7:5601", weights_endpoint="tcp://10.0.0.7:5602"),
    Welcome(node_id="rollout-0", run_id="run-1", config_toml="[run]\nsteps = 3\n",
            endpoints={"control": "tcp://10.0.0.1:5555", "trainer-0": "tcp://10.0.0.2:5600"},
            rank=0, world_size=4),
    Heartbeat(node_id="rollout-0", incarnation=1, policy_version=3, state="running", seq=9,
              gpu={"available": True, "reason": "", "gpus": [
                  {"index": 0, "name": "H100", "mem_free_mb": 1.5, "power_w": None, "temp_c": 40.0}]},
              stats={"busy_s": 1.0, "chunks": 120, "bad_frames": 0}),
    Assign(task_id=5, step=1, fragment=0, prompt_ids=[3, 4], prompts=["a cat", "a dog"],
           seeds=[1, 2, 3, 4], group_size=2, version_floor=0, lease_s=30.0, sde_steps=[0, 1, 2],
           owners={"0": 0, "1": 1, "2": 0}, metadata=['{"tag": "x"}', "{}"]),
    Chunk(task_id=5, step=1, fragment=0, t_index=2, sigma=0.9, sigma_next=0.8, policy_version=3,
          x_t=X, x_next=X.to(torch.bfloat16), log_prob=torch.zeros(4)),
    CleanSample(task_id=5, step=1, fragment=0, policy_version=3, x0=X.to(torch.bfloat16)),
    Commit(task_id=5, step=1, fragment=0, node_id="rollout-0", policy_version=3, prompt_ids=[3, 4],
           rewards=[0.5, 1.0, math.nan, 2.0], reward_terms={"jpeg": [1.0, 2.0, 3.0, 4]}, gen_seconds=0.1,
           cond={"pooled": torch.ones(2, 8)}, images=IMAGES, discard=""),
    Consumed(task_id=5, step=1, fragment=0, rank=1, policy_version=3, trained=3,
             discarded={"zero_advantage": 1}, train_seconds=0.25),
    VersionAnnounce(version=4, step=1, nparts=2, nbytes=1 << 20, checksum="deadbeef"),
    WeightsRequest(version=4, part=1),
    WeightsPart(version=4, part=1, nparts=2, checksum="deadbeef",
                tensors={"blocks.0/attn.weight": torch.ones(3, 3), "norm.bias": torch.zeros(3)}),
    WeightsMissing(version=4, part=1, newest=-1),
    WeightsPending(version=4, part=1, landed=1),
    WeightsRoute(upstream="tcp://10.0.0.9:5602", upstream_node="rollout-3"),
    WeightsHeld(node_id="rollout-0", version=4),
    StepDone(step=1, version=4, metrics={"reward_mean": 0.5, "grad_norm": math.nan, "trained": 16}),
    TagOffer(node_id="trainer-0", rank=0, free_mb=-1.0),
    Revoke(task_id=5, reason="lease expired"),
    Shutdown(reason="done"),
    Score(task_id=5, step=1, images=IMAGES, prompts=["a cat", "a dog"], metadata=["{}", "{}"]),
    Scored(task_id=5, rewards=[0.1, 0.2], reward_terms={"clip": [0.1, 0.2]}, error="", seconds=0.5),
]


def _typed(frames: list[Any]) -> Message | None:
    return codec._decode_typed(frames, LIMIT, DEFAULT_MAX_FRAMES, HEADER_LIMIT)


def _checked(frames: list[Any]) -> Message | Exception:
    """What the checked path makes of the frames: the message, or what it raised."""
    try:
        msg = codec._decode(frames, LIMIT, DEFAULT_MAX_FRAMES, HEADER_LIMIT)
        schema.check(msg)
        return msg
    except Exception as e:  # decode() turns any of these into a ProtocolError
        return e


def _agree(frames: list[Any]) -> Message | None:
    """The property: the typed path accepts only what the checked path accepts, as the same message."""
    typed = _typed(frames)
    if typed is not None:
        checked = _checked(frames)
        assert isinstance(checked, Message), f"typed path accepted what the checked path refuses: {checked}"
        assert messages_equal(typed, checked), (typed, checked)
    return typed


def test_every_message_type_has_an_honest_example_here() -> None:
    assert {m.TAG for m in HONEST} == set(message_types())


@pytest.mark.parametrize("msg", HONEST, ids=lambda m: type(m).__name__)
def test_honest_messages_take_the_typed_path_as_the_same_message(msg: Message) -> None:
    frames = encode(msg)
    got = _agree(frames)
    assert got is not None, "an honest message fell back to the checked path (slow)"
    assert messages_equal(got, msg)
    assert _agree([bytes(f) for f in frames]) is not None  # bytes frames (files, tests) as well


@FAST
@given(msg=any_message)
def test_random_messages_the_typed_path_accepts_the_checked_path_accepts_alike(msg: Message) -> None:
    _agree(encode(msg))


wire_values = st.one_of(
    plain, st.integers(INT_MIN, INT_MAX), st.floats(), st.text(min_size=100, max_size=5000),
    st.lists(st.integers(-3, 1 << 62), max_size=4), st.dictionaries(st.integers(-2, 2), st.integers(INT_MIN, INT_MAX)),
    st.sampled_from([msgpack.ExtType(1, b"x"), msgpack.Timestamp(0), "running", "", "\n"]))


@FAST
@given(index=st.integers(0, len(HONEST) - 1), data=st.data())
def test_mutated_headers_the_typed_path_accepts_the_checked_path_accepts_alike(index: int,
                                                                               data: st.DataObject) -> None:
    frames = encode(HONEST[index])
    header = msgpack.unpackb(frames[0])
    key = data.draw(st.sampled_from([*header, "extra", "_tensors"]))
    if data.draw(st.booleans()) and key in header:
        del header[key]
    else:
        header[key] = data.draw(wire_values)
    _agree([msgpack.packb(header, use_bin_type=True), *frames[1:]])


def test_ints_in_a_list_of_floats_decode_as_floats_on_both_paths() -> None:
    # Another msgpack writer may send 0 for 0.0; the checked path kept such ints when the
    # header was otherwise in this codec's layout (found by the mutation test above).
    header = msgpack.unpackb(encode(HONEST[6])[0])
    header["rewards"] = [0, 1, 2.5, 3]
    frames = [msgpack.packb(header, use_bin_type=True), *encode(HONEST[6])[1:]]
    checked = _checked(frames)
    assert isinstance(checked, Commit) and checked.rewards == [0.0, 1.0, 2.5, 3.0]
    assert all(type(r) is float for r in checked.rewards)
    assert _agree(frames) is not None


TENSORED = [i for i, m in enumerate(HONEST) if encode(m)[1:]]
entry_values = st.one_of(wire_values, st.sampled_from(
    ["x_t", "x_next", "log_prob", "x0", "images", "cond", "tensors", "pooled", "float32", "bfloat16",
     "bool", "uint8", "int64", None, 0, 4, 96, 192, [4, 2, 3], [4, 6], [], [-1], [2] * 17]))


@FAST
@given(index=st.sampled_from(TENSORED), data=st.data())
def test_mutated_tensor_entries_the_typed_path_accepts_the_checked_path_accepts_alike(
        index: int, data: st.DataObject) -> None:
    """The typed path builds tensors itself (codec._typed_tensors): an entry's field, key, dtype,
    shape or size changed, an entry dropped or doubled, frames dropped, doubled or swapped."""
    frames = encode(HONEST[index])
    header = msgpack.unpackb(frames[0])
    entries, tensors = header["_tensors"], list(frames[1:])
    action = data.draw(st.sampled_from(["element", "drop", "double", "frames"]))
    i = data.draw(st.integers(0, len(entries) - 1))
    if action == "element":
        entries[i][data.draw(st.integers(0, 4))] = data.draw(entry_values)
    elif action == "drop":  # with its frame or without
        del entries[i]
        if data.draw(st.booleans()):
            del tensors[i]
    elif action == "double":
        entries.append(list(entries[i]))
        if data.draw(st.booleans()):
            tensors.append(tensors[i])
    else:
        order = data.draw(st.lists(st.integers(0, len(tensors) - 1), max_size=len(tensors) + 1))
        tensors = [tensors[j] for j in order]
    _agree([msgpack.packb(header, use_bin_type=True), *tensors])


@pytest.mark.parametrize("index", TENSORED, ids=lambda i: type(HONEST[i]).__name__)
@pytest.mark.parametrize("element, change", [(4, 1), (4, -1), (3, "reshape"), (3, "grow"), (3, "shrink"),
                                             (2, "dtype")])
def test_a_tensor_entry_that_does_not_match_its_frame_is_refused_by_both(
        index: int, element: int, change: Any) -> None:
    """The size checks, each case made every run: a size off by one, a shape of the same or
    another size, one element with its size (the frame longer than the header says), a dtype
    of another item size. Only a same-size reshape may pass, and then on both paths alike.
    These frames are bytes; tests/test_codec_compiled.py makes the same kinds of change on
    received zmq.Frames, where the typed path's own size checks
    (frames.received_frame_to_tensor) run."""
    frames = encode(HONEST[index])
    header = msgpack.unpackb(frames[0])
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
    mutated = [msgpack.packb(header, use_bin_type=True), *frames[1:]]
    typed = _agree(mutated)
    if change != "reshape":
        assert typed is None and isinstance(_checked(mutated), Exception)


def _typed_rules() -> list[tuple[str, str, Any, str]]:
    out = []
    for tag, rules in schema.RULES.items():
        kinds = message_types()[tag].KINDS
        for name, (ok, _) in rules.items():
            if hasattr(ok, "msgspec_type"):
                out.append((tag, name, ok, kinds[name]))
    return out


TYPED_RULES = _typed_rules()


def _values_near(kind: str, ok: Any) -> st.SearchStrategy[Any]:
    """Values of a field's wire kind, concentrated at the rule's bounds."""
    if isinstance(ok, schema.IntRange):
        edges = [ok.lo - 1, ok.lo, ok.hi - 1, ok.hi]
        return st.sampled_from(edges) | st.integers(ok.lo - 4, ok.hi + 4) | wire_values
    if isinstance(ok, schema.FloatRange):
        return st.sampled_from([ok.lo, ok.hi, math.nextafter(ok.lo, -math.inf), math.nan, math.inf]) \
            | st.floats() | st.integers(-5, 5) | wire_values
    if isinstance(ok, schema.MaxLen):  # lengths around the limit, in characters of 1-4 UTF-8 bytes
        lengths = st.integers(max(0, ok.limit - 2), ok.limit + 2)
        if kind == "str":
            return st.builds(lambda n, c: c * n, lengths, st.sampled_from(["a", "\xe9", "\u20ac", "\U0001f600"])) \
                | wire_values
        return lengths.map(lambda n: [0] * n) | wire_values
    # free-form maps: flat or nested, of scalars, lists and maps, keys around the name limit
    keys = st.sampled_from(["", "k" * 128, "k" * 129]) | st.text(max_size=3)
    numbers = st.integers(-(1 << 62) - 2, (1 << 62) + 1) | st.floats()
    return wire_values | st.dictionaries(keys, numbers, max_size=3) \
        | st.dictionaries(keys, st.lists(numbers, max_size=3), max_size=3) \
        | st.dictionaries(keys, plain | st.lists(st.dictionaries(keys, plain, max_size=3), max_size=3),
                          max_size=4)


def test_typed_rules_cover_the_usual_bounds() -> None:
    typed = {(tag, name) for tag, name, _, _ in TYPED_RULES}
    assert {("heartbeat", "stats"), ("heartbeat", "gpu"), ("chunk", "task_id"),
            ("commit", "reward_terms"), ("consumed", "discarded")} <= typed


@pytest.mark.parametrize(("tag", "name", "ok", "kind"), TYPED_RULES,
                         ids=[f"{t}.{n}" for t, n, _, _ in TYPED_RULES])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_typed_rule_says_exactly_what_its_predicate_says(tag: str, name: str, ok: Any, kind: str,
                                                           data: st.DataObject) -> None:
    value = data.draw(_values_near(kind, ok))
    wire = msgpack.packb(value, use_bin_type=True)
    typed = ok.msgspec_type(kinds.typed_kind(kind))
    try:
        got = msgspec.msgpack.decode(wire, type=typed)
        typed_ok = True
    except msgspec.MsgspecError:
        typed_ok = False
    try:  # the checked path: msgpack without ext types, the kind's type check, then the rule
        decoded = msgpack.unpackb(wire, max_ext_len=0)
        checked_ok = kinds.decoded_ok(kind, decoded) and ok(float(decoded) if kind == "float"
                                                             and type(decoded) is int else decoded)
    except Exception:  # an ext type, or a predicate given the wrong type: refused
        checked_ok = False
    assert typed_ok == checked_ok, (value, typed_ok, checked_ok)
    if typed_ok and kind == "float":
        assert type(got) is float  # an int on the wire becomes a float, as on the checked path
