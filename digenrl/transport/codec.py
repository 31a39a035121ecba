"""The codec: message classes registered by tag <-> lists of ZeroMQ frames.

A message is a multipart ZeroMQ message. Frame 0 is a msgpack map::

    {"t": tag, "v": PROTOCOL_VERSION, <non-tensor fields>...,
     "_tensors": [[field, key, dtype, shape, nbytes], ...]}

and every tensor follows as one raw frame, in the order of ``_tensors``. ``key`` is
``None`` for a ``Tensor`` field and the dict key for a ``dict[str, Tensor]`` field (a
slot of its own rather than ``"field/key"``, because parameter names contain ``/``).

:func:`decode` treats its input as hostile: whatever the bytes, it raises only
:class:`ProtocolError`; it checks frame counts, frame sizes and declared shapes before
it builds anything, and gives msgpack explicit container limits. The message set itself
lives in :mod:`digenrl.transport.protocol`.

Two decoders, one contract. The typed path (:func:`_decode_typed`) reads a header as this
codec writes it in one msgspec call that also checks the field types and the schema bounds
msgspec can express (each class's header struct, a tagged union on ``"t"``), then runs the
remaining checks in Python; anything it does not accept goes to the checked path
(:func:`_decode` + :func:`schema.check`), which names what is wrong. The typed path accepts
only what the checked path accepts, as the same message (tests/test_codec_typed.py). A
field's kind and the checks of its values are :mod:`digenrl.transport.kinds`'; each class's
encoder and the typed path's finish are generated code (:mod:`digenrl.transport.compiled`),
fast paths of :func:`_encode_checked` and the checked path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar, dataclass_transform

import msgpack
import msgspec
import torch
import zmq

from digenrl.transport import schema
from digenrl.transport.compiled import compile_encoder, compile_finish, compile_init
from digenrl.transport.errors import ProtocolError, VersionMismatch
from digenrl.transport.frames import (
    DTYPES,
    MAX_NDIM,
    as_buffer,
    frame_to_tensor,
    received_frame_to_tensor,
    tensor_to_frame,
    tensors_equal,
)
from digenrl.transport.kinds import (
    FLOATS_EXACT,
    WIRE_TYPE,
    check_value,
    decoded_check,
    encode_check,
    kind_of,
    plain_types_ok,
    typed_kind,
)

# 1: first release. 2: weight part checksums are CRC-32 (were blake2b): a node of the
# other version would fail every weight fetch, so it is refused at the handshake instead.
# 3: Hello carries data_endpoint / weights_endpoint (host was "data|weights" on trainers);
# roles and heartbeat states are Literals checked on decode; WeightsApplied is gone.
# 4: weights relay: WeightsRoute, WeightsMissing, WeightsHeld; rollouts serve weights too.
# 5: reward workers (role "reward", Score/Scored); Assign carries each prompt's metadata;
# Commit.discard names a fragment discarded untrained (a reward worker's failure).
# 6: CleanSample (forward-process fragments: final latents instead of per-step chunks) and
# Consumed.policy_version (the trained trajectories' generating version, for the ledger).
# 7: WeightsPending (a relay tells a requester the part is still on its way: hop-by-hop
# liveness, so a deep chain is not mistaken for a silent upstream).
PROTOCOL_VERSION = 7

FROZEN_TAGS = frozenset({"shutdown"})
"""Messages whose layout never changes (``{"t": "shutdown", "v": N, "reason": str,
"_tensors": []}`` in every version): a node of any version reads them, so a refusal for a
version mismatch reaches the peer instead of being dropped as undecodable."""

DEFAULT_MAX_FRAMES = 1 + 8192  # header + tensors; bigger weight sets go in more parts
DEFAULT_MAX_HEADER_BYTES = 1 << 20
# Bounds how many Python objects a header may expand into (msgpack's own default is the
# buffer length, i.e. up to a million one-byte nils per MiB).
_MAX_CONTAINER_LEN = 1 << 16

JSONDict = dict[str, Any]
"""A msgpack-able mapping: str keys; None/bool/int/float/str/bytes, lists and dicts as values."""


class Message:
    """Base of all wire messages; subclasses are made by :func:`message`."""

    TAG: ClassVar[str]
    KINDS: ClassVar[dict[str, str]]  # field name -> "int" | "list:str" | "literal:a|b" | "tensor" | ...


_REGISTRY: dict[str, type[Message]] = {}
M = TypeVar("M", bound=Message)


@dataclass_transform(frozen_default=True, kw_only_default=True)
def message(tag: str) -> Callable[[type[M]], type[M]]:
    """Class decorator: make a frozen keyword-only dataclass and register it under ``tag``."""

    def register(cls: type[M]) -> type[M]:
        if tag in _REGISTRY or tag.startswith("_") or tag in ("t", "v"):
            raise TypeError(f"message tag {tag!r} is reserved or registered twice")
        cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        if not hasattr(cls, "__post_init__") and all(
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                for f in fields):
            cls.__init__ = compile_init(cls, [f.name for f in fields])  # type: ignore[method-assign]
        hints = typing.get_type_hints(cls)
        cls.KINDS = {f.name: kind_of(hints[f.name]) for f in fields}
        cls.TAG = tag
        _REGISTRY[tag] = cls
        _PLANS[cls] = _Plan(cls)
        _TYPED.clear()  # the typed decoder's union gains this class on its next use
        return cls

    return register


def message_types() -> dict[str, type[Message]]:
    """Every registered message class by tag (a copy)."""
    return dict(_REGISTRY)


# ---------------------------------------------------------------- encoding


def encode(msg: Message, *, version: int = PROTOCOL_VERSION) -> list[bytes | memoryview]:
    """Frames for ``msg``: the msgpack header, then one zero-copy memoryview per tensor.

    Do not modify the tensors in place until the frames are sent. Raises ValueError
    naming the field if a value cannot travel (wrong type, int outside 64 bits,
    unsupported dtype). ``version`` other than this node's is for :data:`FROZEN_TAGS` only
    (a refusal written in the peer's version).
    """
    cls = type(msg)
    plan = _PLANS.get(cls)
    if plan is not None and version == PROTOCOL_VERSION:  # first, the generated fast path
        frames = plan.encode(msg.__dict__, version)  # (compiled.py)
        if frames is not None:
            return frames
    if plan is None or _REGISTRY.get(cls.TAG) is not cls:
        raise ValueError(f"{cls.__name__} is not a registered message class")
    if version != PROTOCOL_VERSION and plan.tag not in FROZEN_TAGS:
        raise ValueError(f"{cls.__name__} in protocol version {version}: only "
                         f"{', '.join(sorted(FROZEN_TAGS))} can be written in another version")
    values = msg.__dict__
    if version != PROTOCOL_VERSION:  # a frozen message in the peer's version (else it just ran)
        frames = plan.encode(values, version)
        if frames is not None:
            return frames
    return _encode_checked(plan, values, version)


def _encode_checked(plan: _Plan, values: dict[str, Any], version: int) -> list[bytes | memoryview]:
    """:func:`encode` the long way: each field checked and converted, or named in a ValueError."""
    header: dict[str, Any] = {"t": plan.tag, "v": version}
    entries: list[list[Any]] = []
    frames: list[bytes | memoryview] = [b""]
    for name, kind, ok in plan.encoders:
        value = values[name]
        if ok is not None:  # a plain field: the exact-type check, else the naming one
            header[name] = value if ok(value) else check_value(f"{plan.name}.{name}", kind, value)
        elif kind == "tensor":
            dtype, shape, raw = tensor_to_frame(f"{plan.name}.{name}", value)
            entries.append([name, None, dtype, shape, raw.nbytes])
            frames.append(raw)
        else:
            _tensor_dict(f"{plan.name}.{name}", name, value, entries, frames)
    header["_tensors"] = entries
    frames[0] = _ENCODER.encode(header)
    return frames


def _tensor_dict(where: str, name: str, value: Any, entries: list[list[Any]],
                 frames: list[bytes | memoryview]) -> None:
    """Add a ``dict[str, Tensor]`` field's entries and frames (``where`` names it in errors)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a dict of tensors")
    for key, t in value.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: key {key!r} is not a str")
        dtype, shape, raw = tensor_to_frame(f"{where}[{key!r}]", t)
        entries.append([name, key, dtype, shape, raw.nbytes])
        frames.append(raw)


_ENCODER = msgspec.msgpack.Encoder()
"""msgspec's msgpack writer, made once (``msgpack.packb`` builds a Packer per call: ~3 us of
a heartbeat's ~9). The same bytes: floats as float64, bytes as bin, str as str."""


# ---------------------------------------------------------------- decoding


class _Plan:
    """What encode and decode need of one message class, worked out once at registration."""

    def __init__(self, cls: type[Message]) -> None:
        self.cls = cls
        self.tag = cls.TAG
        self.name = cls.__name__
        # (field, kind, exact-type check or None for tensor kinds), in declaration order
        self.encoders = [(n, k, encode_check(k) if k not in ("tensor", "tensors") else None)
                         for n, k in cls.KINDS.items()]
        self.decoders = {n: decoded_check(k) for n, k in cls.KINDS.items()
                         if k not in ("tensor", "tensors")}
        self.dict_tensors = [n for n, k in cls.KINDS.items() if k == "tensors"]
        self.tensor_names = frozenset(n for n, k in cls.KINDS.items() if k == "tensor")
        # the decoder's fast path: header keys and value types exactly as encode() makes them
        self.names = tuple(self.decoders)
        self.types = tuple(WIRE_TYPE[k.partition(":")[0]] for n, k in cls.KINDS.items()
                           if n in self.decoders)
        # fields whose exact type is not enough: their elements, or a literal's value
        # (a list of floats holding an int goes the long way, which makes it a float)
        self.nested = [(n, FLOATS_EXACT if cls.KINDS[n] == "list:float" else ok)
                       for n, ok in self.decoders.items()
                       if cls.KINDS[n] == "dict" or cls.KINDS[n].startswith(("list:", "literal:"))]
        self.nfields = len(cls.KINDS)
        # Without a __post_init__ the decoder fills the instance's __dict__ directly: the
        # frozen dataclass __init__ costs an object.__setattr__ per field (~5 us a Chunk).
        self.direct = not hasattr(cls, "__post_init__")
        # The typed decoder (see _decode_typed): the header as a msgspec struct whose field
        # types are the kinds, narrowed by the schema's rules that msgspec can say; what it
        # cannot say (dict contents, the other rules, the whole-message rule) runs after it.
        rules = schema.RULES.get(self.tag, {})
        typed: list[tuple[str, Any]] = [("v", int)]
        self.typed_checks: list[tuple[str, Callable[[Any], bool]]] = []
        for n, k in cls.KINDS.items():
            if n not in self.decoders:
                continue
            ok = rules[n][0] if n in rules else None
            if isinstance(ok, (schema.IntRange, schema.FloatRange, schema.MaxLen, schema.Typed)):
                typed.append((n, ok.msgspec_type(typed_kind(k))))  # the rule, in C
                continue
            typed.append((n, typed_kind(k)))
            if k == "dict":  # (a decoded int is always in range: msgpack holds no other)
                self.typed_checks.append((n, plain_types_ok))
            if ok is not None:
                self.typed_checks.append((n, ok))
        typed.append(("_tensors", _TENSOR_ENTRIES))
        self.header_type = msgspec.defstruct(f"{self.name}Header", typed, tag=self.tag,
                                             tag_field="t", forbid_unknown_fields=True)
        self.whole = schema.WHOLE.get(self.tag)
        # the same, as code written for this class's fields (compiled.py)
        self.encode = compile_encoder(cls, cls.KINDS, self.tag, to_frame=tensor_to_frame,
                                      tensor_dict=_tensor_dict, write=_ENCODER.encode)
        self.finish = compile_finish(cls, cls.KINDS, self.typed_checks, version=PROTOCOL_VERSION,
                                     direct=self.direct, whole=self.whole,
                                     tensors=_typed_tensors, lean=received_frame_to_tensor,
                                     plan=self)

    def build(self, fields: dict[str, Any]) -> Message:
        if not self.direct:
            return self.cls(**fields)
        msg = object.__new__(self.cls)
        msg.__dict__.update(fields)
        return msg


_PLANS: dict[type[Message], _Plan] = {}


_TYPED: dict[str, Any] = {}
"""The typed decoder, built on first use from every registered class: ``decoder`` (a tagged
union of the header structs on "t"), ``plans`` (header struct -> plan) and ``fast`` (the
union's decode method and header struct -> the plan's finish, what :func:`_decode_typed`
reads)."""


def _typed_decoder() -> tuple[Any, dict[type, _Plan]]:
    if not _TYPED:
        plans = {plan.header_type: plan for plan in _PLANS.values()}
        decoder = msgspec.msgpack.Decoder(functools.reduce(operator.or_, plans))
        _TYPED["decoder"] = decoder
        _TYPED["plans"] = plans
        _TYPED["fast"] = (decoder.decode, {t: plan.finish for t, plan in plans.items()})
    return _TYPED["decoder"], _TYPED["plans"]


def decode(frames: Sequence[Any], *, max_frame_bytes: int,
           max_frames: int = DEFAULT_MAX_FRAMES,
           max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> Message:
    """Rebuild a message from frames (bytes, memoryview or zmq.Frame) without copying tensors.

    Raises only :class:`ProtocolError` (:class:`VersionMismatch` for another protocol
    version; reason ``invalid`` for a well-typed message out of bounds, see
    :mod:`digenrl.transport.schema`). Decoded tensors share memory with the frames.
    """
    msg = _decode_typed(frames, max_frame_bytes, max_frames, max_header_bytes)
    if msg is not None:
        return msg
    try:
        msg = _decode(frames, max_frame_bytes, max_frames, max_header_bytes)
        schema.check(msg)  # ranges, sizes, shapes: before any handler sees it
        return msg
    except ProtocolError:
        raise
    except Exception as e:  # the contract is one exception type, whatever hostile bytes trip
        raise ProtocolError(f"undecodable message: {type(e).__name__}: {e}") from e


def _decode_typed(frames: Sequence[Any], max_frame_bytes: int, max_frames: int,
                  max_header_bytes: int) -> Message | None:
    """The fast path: a message as this codec writes it, decoded and checked in one msgspec
    call plus the checks msgspec cannot say; None for anything else, which the checked path
    (:func:`_decode` + :func:`schema.check`) then refuses with its reason or accepts.

    It accepts only what the checked path accepts, and builds the same message
    (tests/test_codec_typed.py holds it to that on random and mutated messages): the header
    types are the checked path's, its rules are the schema's, and a header over 64 KiB (where
    the checked path bounds containers itself) is left to the checked path. Never raises.
    """
    fast = _TYPED.get("fast")
    if fast is None:
        _typed_decoder()
        fast = _TYPED["fast"]
    try:
        head = frames[0]  # (no frames: IndexError, None)
        # msgspec reads bytes and a zmq.Frame as they are, their len their size in bytes (a
        # received frame's view costs ~0.4 us more)
        if type(head) is not bytes and type(head) is not zmq.Frame:
            head = as_buffer(head)
        n = len(frames)
        if n > max_frames or len(head) > min(_MAX_CONTAINER_LEN, max_frame_bytes, max_header_bytes):
            return None
        decode_header, finishes = fast
        header = decode_header(head)
        # the version, tensors, checks, message and whole-message rule (compiled.py)
        msg: Message | None = finishes[type(header)](header, frames, n, max_frame_bytes)
        return msg
    except Exception:  # whatever it is, the checked path names it
        return None


_TENSOR_ENTRIES: Any = list[tuple[  # type: ignore[misc]
    str, str | None, Literal[tuple(DTYPES)], Annotated[list[Annotated[int, msgspec.Meta(ge=0)]],
                                                     msgspec.Meta(max_length=MAX_NDIM)],
    Annotated[int, msgspec.Meta(ge=0)]]]
"""The ``_tensors`` entries of a typed header: (field, key, dtype, shape, nbytes), each element
already of the kind :func:`frame_to_tensor` checks for (what it does not accept the checked
path refuses anyway)."""

def _typed_tensors(plan: _Plan, entries: list[Any], frames: Sequence[Any],
                   fields: dict[str, Any], max_frame_bytes: int) -> bool:
    """Add the tensor fields of a typed header's ``entries`` (one per frame after the
    header) to ``fields``; False for an entry the typed path does not accept (a field the
    class does not have as that kind, or twice); raises for a description that does not match
    its frame. A received frame whose description adds up is read by
    :func:`~digenrl.transport.frames.received_frame_to_tensor`, anything else (bytes from a
    test or a file, sizes that do not add up) by :func:`frame_to_tensor`, which names it."""
    singles = plan.tensor_names
    for name in plan.dict_tensors:
        fields[name] = {}
    for i, entry in enumerate(entries, 1):
        name, key, dtype, shape, nbytes = entry
        t = received_frame_to_tensor(entry, frames[i], max_frame_bytes)
        if t is None:
            t = frame_to_tensor(plan.name, dtype, shape, nbytes, as_buffer(frames[i]),
                                max_frame_bytes=max_frame_bytes)
        if key is None:
            if name not in singles or name in fields:
                return False
            fields[name] = t
        else:
            held = fields.get(name) if name in plan.dict_tensors else None
            if held is None or key in held:
                return False
            held[key] = t
    return True


def _tensor_fields(plan: _Plan, entries: Any, views: list[memoryview],
                   max_frame_bytes: int) -> dict[str, Any]:
    """The tensor fields of a message from its header's ``_tensors`` and the views of its
    frames 1..n (each entry checked against its frame before a tensor is built)."""
    name_of = plan.name
    if type(entries) is not list or len(entries) != len(views):
        have = len(entries) if type(entries) is list else "no list of"
        raise ProtocolError(f"{name_of}: header lists {have} tensors, message has "
                            f"{len(views)} tensor frames", reason="frames")
    kinds = plan.cls.KINDS
    fields: dict[str, Any] = {n: {} for n in plan.dict_tensors}
    for entry, view in zip(entries, views):
        well_formed = type(entry) is list and len(entry) == 5
        name, key = (entry[0], entry[1]) if well_formed else ("", None)
        kind = kinds.get(name) if type(name) is str else None
        if kind == "tensor" and key is None and name not in fields:
            fields[name] = frame_to_tensor(f"{name_of}.{name}", entry[2], entry[3], entry[4],
                                           view, max_frame_bytes=max_frame_bytes)
        elif kind == "tensors" and type(key) is str and key not in fields[name]:
            fields[name][key] = frame_to_tensor(f"{name_of}.{name}[{key!r}]", entry[2],
                                                entry[3], entry[4], view,
                                                max_frame_bytes=max_frame_bytes)
        else:
            raise ProtocolError(f"{name_of}: bad or repeated tensor entry {entry!r:.200}",
                                reason="tensor")
    return fields


def _decode(frames: Sequence[Any], max_frame_bytes: int, max_frames: int,
            max_header_bytes: int) -> Message:
    n = len(frames)
    if not 1 <= n <= max_frames:
        raise ProtocolError(f"{n} frames; expected 1 to {max_frames}", reason="frames")
    head = frames[0]
    head_view = head if type(head) is bytes else as_buffer(head)
    views = [as_buffer(f) for f in frames[1:]] if n > 1 else []
    limit = len(head_view)
    for i, size in enumerate([limit, *map(len, views)]):
        if size > max_frame_bytes:
            raise ProtocolError(f"frame {i} has {size} bytes, over the {max_frame_bytes}-byte "
                                "limit", reason="too_large")
    if limit > max_header_bytes:
        raise ProtocolError(f"header has {limit} bytes, over {max_header_bytes}",
                            reason="too_large")
    # The header is small: msgpack reads bytes faster than a buffer view, and a zmq.Frame
    # keeps its bytes copy. Tensor frames stay views (zero-copy).
    raw = head_view if isinstance(head_view, bytes) else getattr(head, "bytes", None)
    if type(raw) is not bytes:
        raw = bytes(head_view)
    # msgpack's default limits (strings, containers) are already the buffer's length.
    try:
        if limit <= _MAX_CONTAINER_LEN:
            header = msgpack.unpackb(raw, max_ext_len=0)
        else:
            header = msgpack.unpackb(
                raw, raw=False, strict_map_key=True, use_list=True,
                max_str_len=limit, max_bin_len=limit, max_ext_len=0,
                max_array_len=_MAX_CONTAINER_LEN, max_map_len=_MAX_CONTAINER_LEN)
    except Exception as e:
        raise ProtocolError(f"header is not msgpack: {type(e).__name__}: {e}",
                            reason="header") from e
    if type(header) is not dict:
        raise ProtocolError(f"header is a {type(header).__name__}, not a map", reason="header")
    version = header.pop("v", None)
    tag = header.pop("t", None)
    frozen = type(tag) is str and tag in FROZEN_TAGS
    if type(version) is not int or (version != PROTOCOL_VERSION and not frozen):
        raise VersionMismatch(version, PROTOCOL_VERSION)
    cls = _REGISTRY.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message tag {tag!r:.80}", reason="tag")
    kinds = cls.KINDS
    plan = _PLANS[cls]
    fields = _tensor_fields(plan, header.pop("_tensors", None), views, max_frame_bytes)
    # What this codec sends: every field present, in order, of its exact type; only lists
    # and dicts still need their elements looked at (else the long way names what is wrong).
    if (tuple(header) == plan.names and tuple(map(type, header.values())) == plan.types
            and all(nested_ok(header[name]) for name, nested_ok in plan.nested)):
        fields.update(header)
        return plan.build(fields)
    decoders = plan.decoders
    for name, value in header.items():
        field_ok = decoders.get(name)
        if field_ok is None:
            raise ProtocolError(f"{cls.__name__}: unexpected field {name!r:.80}", reason="field")
        if not field_ok(value):
            raise ProtocolError(f"{cls.__name__}.{name} = {value!r:.200}: expected {kinds[name]}",
                                reason="field")
        kind = kinds[name]
        if kind == "float":
            value = float(value)
        elif kind == "list:float":
            value = [float(v) for v in value]
        fields[name] = value
    if len(fields) != plan.nfields:
        missing = [n for n in kinds if n not in fields]
        raise ProtocolError(f"{cls.__name__}: missing fields {', '.join(missing)}", reason="field")
    return plan.build(fields)


# ---------------------------------------------------------------- equality for tests and checks


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tensors_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def messages_equal(a: Message, b: Message) -> bool:
    """Field-wise equality, tensors compared bit for bit (dataclass ``==`` is ambiguous on them)."""
    if type(a) is not type(b):
        return False
    return all(_values_equal(getattr(a, f), getattr(b, f)) for f in type(a).KINDS)
