"""The codec: message classes registered by tag <-> lists of ZeroMQ frames.

A message is a multipart ZeroMQ message. Frame 0 is a msgpack map::

    {"t": tag, "v": PROTOCOL_VERSION, <non-tensor fields>...,
     "_tensors": [[field, key, dtype, shape, nbytes], ...]}

and every tensor follows as one raw frame, in the order of ``_tensors``. ``key`` is
``None`` for a ``Tensor`` field and the dict key for a ``dict[str, Tensor]`` field (a
slot of its own rather than ``"field/key"``, because parameter names contain ``/``).
A tensor travels as its bytes: a uint8 view of the tensor's own storage when sending
(bfloat16 has no buffer-protocol format), ``numpy``/``torch.from_numpy`` over the received
frame when receiving, so neither end copies it.

A field's annotation gives its *kind* (:func:`kind_of`): ``"int"``, ``"float"``, ``"str"``,
``"bool"``, ``"bytes"``, ``"list:<scalar>"``, ``"literal:a|b"``, ``"dict"`` (a msgpack-able
map), ``"tensor"`` or ``"tensors"`` (a dict of tensors). :func:`encode` and :func:`decode`
check every value against its kind with the same function (:func:`check_value`).

:func:`decode` treats its input as hostile: whatever the bytes, it raises only
:class:`ProtocolError`; it checks frame counts, frame sizes and declared shapes before
it builds anything, gives msgpack explicit container limits, and then checks the values'
bounds (:mod:`digenrl.transport.schema`). The message set itself lives in
:mod:`digenrl.transport.protocol`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar, dataclass_transform

import msgpack
import numpy as np
import torch

from digenrl.transport import schema
from digenrl.transport.errors import ProtocolError, VersionMismatch

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
# 8: Samples (trainer rank 0 shows the coordinator sample grids for the experiment trackers).
PROTOCOL_VERSION = 9

FROZEN_TAGS = frozenset({"shutdown"})
"""Messages whose layout never changes (``{"t": "shutdown", "v": N, "reason": str,
"_tensors": []}`` in every version): a node of any version reads them, so a refusal for a
version mismatch reaches the peer instead of being dropped as undecodable."""

DEFAULT_MAX_FRAMES = 1 + 8192  # header + tensors; bigger weight sets go in more parts
DEFAULT_MAX_HEADER_BYTES = 1 << 20
# Bounds how many Python objects a header may expand into (msgpack's own default is the
# buffer length, i.e. up to a million one-byte nils per MiB).
_MAX_CONTAINER_LEN = 1 << 16

INT_MIN = -(1 << 63)
INT_MAX = (1 << 64) - 1  # msgpack carries unsigned 64-bit too
MAX_DEPTH = 16  # nesting of a dict field's values
MAX_NDIM = 16

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""Wire name -> dtype for every dtype a tensor frame may carry."""

DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

_NUMPY: dict[str, Any] = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16,
                          "int64": np.int64, "int32": np.int32, "uint8": np.uint8, "bool": np.bool_}
"""Wire dtype -> the numpy dtype its bytes are read as (bfloat16 as int16, then viewed)."""

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
        hints = typing.get_type_hints(cls)
        cls.KINDS = {f.name: kind_of(hints[f.name])
                     for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        cls.TAG = tag
        _REGISTRY[tag] = cls
        return cls

    return register


def message_types() -> dict[str, type[Message]]:
    """Every registered message class by tag (a copy)."""
    return dict(_REGISTRY)


# ---------------------------------------------------------------- field kinds


_SCALARS: dict[Any, str] = {int: "int", float: "float", str: "str", bool: "bool", bytes: "bytes"}
_EXACT: dict[str, type] = {"str": str, "bool": bool, "bytes": bytes}
_LEAVES = (type(None), bool, float, str, bytes)


def kind_of(tp: Any) -> str:
    """The kind of a field annotated ``tp``; TypeError for a type no message field may have."""
    if tp in _SCALARS:
        return _SCALARS[tp]
    if typing.get_origin(tp) is typing.Literal:
        # a closed set of strings (a role, a state): "literal:a|b", checked both ways
        choices = typing.get_args(tp)
        if not choices or not all(type(c) is str and c and "|" not in c for c in choices):
            raise TypeError(f"unsupported message field type {tp!r}: Literal of strings only")
        return "literal:" + "|".join(choices)
    if tp is torch.Tensor:
        return "tensor"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and len(args) == 1 and args[0] in _SCALARS:
        return "list:" + _SCALARS[args[0]]
    if origin is dict and args and args[0] is str:
        return "tensors" if args[1] is torch.Tensor else "dict"
    raise TypeError(f"unsupported message field type {tp!r}")  # our bug, not a peer's


def check_value(where: str, kind: str, value: Any) -> Any:
    """One non-tensor field's value, checked against its kind: the msgpack-ready value (an
    int made a float for a float field, a tuple a list), or a ValueError naming ``where``."""
    if kind.startswith("list:"):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} = {value!r}: expected a list")
        inner, out = kind[5:], []
        for i, v in enumerate(value):
            why = _scalar_refusal(inner, v)
            if why is not None:
                raise ValueError(f"{where}[{i}] = {v!r}: {why}")
            out.append(float(v) if inner == "float" else v)
        return out
    if kind == "dict":
        _check_plain(where, value, 0)
        return value
    why = _scalar_refusal(kind, value)
    if why is not None:
        raise ValueError(f"{where} = {value!r}: {why}")
    return float(value) if kind == "float" else value


def _scalar_refusal(kind: str, value: Any) -> str | None:
    """Why ``value`` is not of the scalar or literal ``kind``; None when it is."""
    if kind == "int":
        if type(value) is not int:
            return "expected an int"
        return None if INT_MIN <= value <= INT_MAX else "outside the 64-bit range"
    if kind == "float":  # an int is a float's value too (another msgpack writer may shorten 1.0)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "expected a float"
    if kind.startswith("literal:"):
        if type(value) is str and value in kind[8:].split("|"):
            return None
        return f"expected one of {kind[8:]}"
    return None if type(value) is _EXACT[kind] else f"expected {kind}"


def _check_plain(where: str, value: Any, depth: int) -> None:
    """A msgpack-able map or list: str keys, ints in 64 bits, nesting at most MAX_DEPTH."""
    if isinstance(value, dict):
        for k in value:
            if type(k) is not str:
                raise ValueError(f"{where}: key {k!r} is not a str")
        items: Any = value.items()
    elif isinstance(value, (list, tuple)) and depth:
        items = enumerate(value)
    else:
        raise ValueError(f"{where} = {value!r:.200}: expected a dict")
    if value and depth >= MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_DEPTH}")
    for k, v in items:
        if isinstance(v, _LEAVES):
            continue
        if isinstance(v, int):
            if not INT_MIN <= v <= INT_MAX:
                raise ValueError(f"{where}[{k!r}] = {v!r}: outside the 64-bit range")
        elif isinstance(v, (dict, list, tuple)):
            _check_plain(f"{where}[{k!r}]", v, depth + 1)
        else:
            raise ValueError(f"{where}[{k!r}] = {v!r:.200}: {type(v).__name__} is not msgpack-able")


# ---------------------------------------------------------------- tensors <-> frames


def tensor_to_frame(where: str, t: Any) -> tuple[str, list[int], memoryview]:
    """(dtype name, shape, bytes view) of ``t``; ``where`` names the field in errors.

    The view shares the tensor's memory when it is a contiguous CPU tensor (the common
    case); otherwise a contiguous CPU copy is made first. A GPU tensor should be staged
    into pinned host memory first (:mod:`digenrl.transport.staging`): this copy blocks.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where} = {type(t).__name__}: expected a torch.Tensor")
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"{where}: dtype {t.dtype} is not one of {', '.join(DTYPES)}")
    if not (t.is_cpu and t.is_contiguous()) or t.requires_grad:
        t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return name, list(t.shape), memoryview(b"")
    arr = (t.view(torch.int16) if name == "bfloat16" else t).numpy()
    return name, list(t.shape), arr.data.cast("B")


def as_buffer(frame: Any) -> memoryview:
    """A flat byte view of bytes, bytearray, memoryview or zmq.Frame, without copying."""
    buf = getattr(frame, "buffer", None)  # zmq.Frame: already a memoryview
    view = memoryview(frame if buf is None else buf)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def frame_to_tensor(where: str, dtype_name: Any, shape: Any, nbytes: Any, frame: memoryview,
                    *, max_frame_bytes: int) -> torch.Tensor:
    """Rebuild a tensor over ``frame`` after checking the declared description against it.

    Every check runs on the header's numbers (in Python ints, so no overflow) before a
    tensor object exists; the result shares memory with ``frame``.
    """
    dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise ProtocolError(f"{where}: unknown dtype {dtype_name!r:.80}", reason="tensor")
    if not (type(shape) is list and len(shape) <= MAX_NDIM
            and all(type(d) is int and d >= 0 for d in shape)):
        raise ProtocolError(f"{where}: bad shape {shape!r:.200}", reason="tensor")
    if type(nbytes) is not int:
        raise ProtocolError(f"{where}: bad nbytes {nbytes!r:.80}", reason="tensor")
    expected = math.prod(shape) * dtype.itemsize
    if expected > max_frame_bytes:
        raise ProtocolError(f"{where}: shape {shape} {dtype_name} needs {expected} bytes, "
                            f"over the {max_frame_bytes}-byte frame limit", reason="too_large")
    if nbytes != expected or len(frame) != expected:
        raise ProtocolError(f"{where}: shape {shape} {dtype_name} needs {expected} bytes, header "
                            f"says {nbytes}, frame has {len(frame)}", reason="tensor")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses empty buffers
    if dtype is torch.bool and bool((np.frombuffer(frame, dtype=np.uint8) > 1).any()):
        # torch assumes bools are 0 or 1; other bytes give undefined results downstream.
        raise ProtocolError(f"{where}: bool tensor holds bytes other than 0 and 1", reason="tensor")
    arr = np.ndarray(shape, _NUMPY[dtype_name], frame)
    if frame.readonly:
        # bytes input (tests, files): torch warns that the tensor cannot be made read-only
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out = torch.from_numpy(arr)
    else:
        out = torch.from_numpy(arr)
    return out.view(torch.bfloat16) if dtype is torch.bfloat16 else out


# ---------------------------------------------------------------- encoding


def encode(msg: Message, *, version: int = PROTOCOL_VERSION) -> list[bytes | memoryview]:
    """Frames for ``msg``: the msgpack header, then one zero-copy memoryview per tensor.

    Do not modify the tensors in place until the frames are sent. Raises ValueError
    naming the field if a value cannot travel (wrong type, int outside 64 bits,
    unsupported dtype). ``version`` other than this node's is for :data:`FROZEN_TAGS` only
    (a refusal written in the peer's version).
    """
    cls = type(msg)
    tag = getattr(cls, "TAG", None)
    if tag is None or _REGISTRY.get(tag) is not cls:
        raise ValueError(f"{cls.__name__} is not a registered message class")
    if version != PROTOCOL_VERSION and tag not in FROZEN_TAGS:
        raise ValueError(f"{cls.__name__} in protocol version {version}: only "
                         f"{', '.join(sorted(FROZEN_TAGS))} can be written in another version")
    header: dict[str, Any] = {"t": tag, "v": version}
    entries: list[list[Any]] = []
    frames: list[bytes | memoryview] = [b""]
    for name, kind in cls.KINDS.items():
        where, value = f"{cls.__name__}.{name}", getattr(msg, name)
        if kind == "tensor":
            dtype, shape, raw = tensor_to_frame(where, value)
            entries.append([name, None, dtype, shape, raw.nbytes])
            frames.append(raw)
        elif kind == "tensors":
            if not isinstance(value, dict):
                raise ValueError(f"{where}: expected a dict of tensors")
            for key, t in value.items():
                if not isinstance(key, str):
                    raise ValueError(f"{where}: key {key!r} is not a str")
                dtype, shape, raw = tensor_to_frame(f"{where}[{key!r}]", t)
                entries.append([name, key, dtype, shape, raw.nbytes])
                frames.append(raw)
        else:
            header[name] = check_value(where, kind, value)
    header["_tensors"] = entries
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


# ---------------------------------------------------------------- decoding


def decode(frames: Sequence[Any], *, max_frame_bytes: int,
           max_frames: int = DEFAULT_MAX_FRAMES,
           max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> Message:
    """Rebuild a message from frames (bytes, memoryview or zmq.Frame) without copying tensors.

    Raises only :class:`ProtocolError` (:class:`VersionMismatch` for another protocol
    version; reason ``invalid`` for a well-typed message out of bounds, see
    :mod:`digenrl.transport.schema`). Decoded tensors share memory with the frames.
    """
    try:
        msg = _decode(frames, max_frame_bytes, max_frames, max_header_bytes)
        schema.check(msg)  # ranges, sizes, shapes: before any handler sees it
        return msg
    except ProtocolError:
        raise
    except Exception as e:  # the contract is one exception type, whatever hostile bytes trip
        raise ProtocolError(f"undecodable message: {type(e).__name__}: {e}") from e


def _decode(frames: Sequence[Any], max_frame_bytes: int, max_frames: int,
            max_header_bytes: int) -> Message:
    n = len(frames)
    if not 1 <= n <= max_frames:
        raise ProtocolError(f"{n} frames; expected 1 to {max_frames}", reason="frames")
    views = [as_buffer(f) for f in frames]
    for i, view in enumerate(views):
        if len(view) > max_frame_bytes:
            raise ProtocolError(f"frame {i} has {len(view)} bytes, over the {max_frame_bytes}-byte "
                                "limit", reason="too_large")
    limit = len(views[0])
    if limit > max_header_bytes:
        raise ProtocolError(f"header has {limit} bytes, over {max_header_bytes}",
                            reason="too_large")
    containers = min(limit, _MAX_CONTAINER_LEN)
    try:
        header = msgpack.unpackb(
            views[0], raw=False, strict_map_key=True, use_list=True, max_str_len=limit,
            max_bin_len=limit, max_ext_len=0, max_array_len=containers, max_map_len=containers)
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
    fields = _tensor_fields(cls, header.pop("_tensors", None), views[1:], max_frame_bytes)
    for name, value in header.items():
        kind = kinds.get(name) if type(name) is str else None
        if kind is None or kind in ("tensor", "tensors"):
            raise ProtocolError(f"{cls.__name__}: unexpected field {name!r:.80}", reason="field")
        try:
            fields[name] = check_value(name, kind, value)
        except ValueError:
            raise ProtocolError(f"{cls.__name__}.{name} = {value!r:.200}: expected {kind}",
                                reason="field") from None
    if len(fields) != len(kinds):
        missing = [n for n in kinds if n not in fields]
        raise ProtocolError(f"{cls.__name__}: missing fields {', '.join(missing)}", reason="field")
    return cls(**fields)


def _tensor_fields(cls: type[Message], entries: Any, views: list[memoryview],
                   max_frame_bytes: int) -> dict[str, Any]:
    """The tensor fields of a message from its header's ``_tensors`` and the views of its
    frames 1..n (each entry checked against its frame before a tensor is built)."""
    name_of = cls.__name__
    if type(entries) is not list or len(entries) != len(views):
        have = len(entries) if type(entries) is list else "no list of"
        raise ProtocolError(f"{name_of}: header lists {have} tensors, message has "
                            f"{len(views)} tensor frames", reason="frames")
    kinds = cls.KINDS
    fields: dict[str, Any] = {n: {} for n, k in kinds.items() if k == "tensors"}
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


# ---------------------------------------------------------------- equality and checksums


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so NaN payloads and -0.0 compare as the bits they are)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


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


def tensor_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 (hex) over names, dtypes, shapes and bytes, in sorted name order.

    An integrity check against damaged or mixed-up parts, not a signature (CURVE
    authenticates peers). CRC-32 runs at several GB/s and releases the GIL: a weight set is
    checksummed on every publish and every fetch, which blake2b made ~5x more expensive
    (bench/weights.py).
    """
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        meta = msgpack.packb([name, str(t.dtype), list(t.shape)])
        crc = zlib.crc32(len(meta).to_bytes(4, "little"), crc)  # length prefix: no ambiguity
        crc = zlib.crc32(meta, crc)
        crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().data, crc)
    return f"{crc:08x}"
