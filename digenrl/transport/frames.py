"""Tensors <-> raw ZeroMQ frames, without copies, and checks that come before any allocation.

A tensor travels as its bytes; the header (see :mod:`digenrl.transport.codec`) carries
``[dtype, shape, nbytes]``. Sending uses a uint8 memoryview of the tensor's own storage
(bfloat16 has no buffer-protocol format, and bytes are what travel anyway); receiving
uses ``torch.frombuffer`` over the received frame, then ``.view(dtype)``.
"""

from __future__ import annotations

import math
import warnings
import zlib
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from digenrl.transport.errors import ProtocolError

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
MAX_NDIM = 16


def tensor_to_frame(where: str, t: Any) -> tuple[str, list[int], memoryview]:
    """(dtype name, shape, bytes view) of ``t``; ``where`` names the field in errors.

    The view shares the tensor's memory when it is a contiguous CPU tensor (the common
    case); otherwise a contiguous CPU copy is made first. A GPU tensor should be staged
    into pinned host memory first (:mod:`digenrl.transport.staging`): this copy blocks.
    """
    if type(t) is torch.Tensor:
        # The common case in one try: numpy() refuses a GPU, grad-requiring, conjugated or
        # bfloat16 tensor and cast() a non-contiguous or empty one; each then goes the long
        # way below, which makes it sendable or names what is wrong (~1.2 us a tensor less).
        try:
            arr = t.numpy()
            view = arr.data.cast("B")
        except (TypeError, RuntimeError, ValueError):
            return tensor_to_frame_checked(where, t)
        fast = _NUMPY_NAMES.get(arr.dtype)
        if fast is not None:
            return fast, list(arr.shape), view
    return tensor_to_frame_checked(where, t)


def tensor_to_frame_checked(where: str, t: Any) -> tuple[str, list[int], memoryview]:
    """:func:`tensor_to_frame` the long way: any tensor made sendable, or named in a ValueError."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where} = {type(t).__name__}: expected a torch.Tensor")
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"{where}: dtype {t.dtype} is not one of {', '.join(DTYPES)}")
    if not (t.is_cpu and t.is_contiguous()) or t.requires_grad:
        t = t.detach().cpu().contiguous()
    # Through numpy: ~1.5 us against ~4 us for reshape/view(uint8)/numpy (per tensor, per
    # message, on both the hot chunk path and every control message).
    if t.numel() == 0:
        return name, list(t.shape), memoryview(b"")
    arr = (t.view(torch.int16) if name == "bfloat16" else t).numpy()
    return name, list(t.shape), arr.data.cast("B")


def as_buffer(frame: Any) -> memoryview:
    """A flat byte view of bytes, bytearray, memoryview or zmq.Frame, without copying."""
    tp = type(frame)
    view: memoryview
    if tp is memoryview:
        view = frame
    elif tp is bytes or tp is bytearray:
        view = memoryview(frame)
    else:
        buf = getattr(frame, "buffer", None)  # zmq.Frame: already a memoryview
        view = buf if type(buf) is memoryview else memoryview(frame if buf is None else buf)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


_NUMPY: dict[str, Any] = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16,
                          "int64": np.int64, "int32": np.int32, "uint8": np.uint8, "bool": np.bool_}
"""Wire dtype -> the numpy dtype its bytes are read as (bfloat16 as int16, then viewed)."""

_NUMPY_NAMES: dict[Any, str] = {np.dtype(v): k for k, v in _NUMPY.items() if k != "bfloat16"}
"""numpy dtype -> wire dtype, for :func:`tensor_to_frame`'s fast path (int16 is not here: a
bfloat16 tensor has no numpy view, and an int16 one is not sendable)."""


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
    # An ndarray over the frame (its size checked above) + from_numpy: ~1.4 us, against ~2.1
    # through frombuffer/reshape and ~4-8 for torch.frombuffer/view.
    arr = np.ndarray(shape, _NUMPY[dtype_name], frame)
    if frame.readonly:
        # bytes input (tests, files): torch warns that the tensor cannot be made read-only.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out = torch.from_numpy(arr)
    else:
        out = torch.from_numpy(arr)
    return out.view(torch.bfloat16) if dtype is torch.bfloat16 else out


_LEAN: dict[str, tuple[Any, int, bool]] = {
    name: (_NUMPY[name], dt.itemsize, dt is torch.bfloat16)
    for name, dt in DTYPES.items() if dt is not torch.bool}
"""Wire dtype -> (numpy dtype, item size, is bfloat16), for :func:`received_frame_to_tensor`;
a bool tensor (whose bytes must be checked) is not in it."""


def received_frame_to_tensor(entry: list[Any], frame: Any, max_frame_bytes: int) -> torch.Tensor | None:
    """The tensor of a typed header's ``entry`` (``[field, key, dtype, shape, nbytes]``, its
    types checked) over a received ``zmq.Frame`` whose size matches; None for anything else
    (another buffer type, sizes that do not add up, an empty or a bool tensor), which
    :func:`frame_to_tensor` then handles or refuses, naming what is wrong. The typed decoder's
    per-tensor step: inline in the generated finish for a class of single tensors (compiled.py;
    a 1 MiB Chunk's decode 12.5 -> 10.0 us, hot), and in the codec's loop for the others."""
    lean = _LEAN.get(entry[2])
    if lean is None or type(frame) is not _FRAME:
        return None
    shape = entry[3]
    expected = math.prod(shape) * lean[1]
    if not 0 < expected == entry[4] == len(frame) <= max_frame_bytes:
        return None
    # pyzmq exposes every Frame's buffer as writable (even one made over a bytes object), so
    # torch has no read-only array to warn about (tests/test_codec_compiled.py checks that)
    out = torch.from_numpy(np.ndarray(shape, lean[0], frame))  # type: ignore[arg-type]
    return out.view(torch.bfloat16) if lean[2] else out


_FRAME = zmq.Frame


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so NaN payloads and -0.0 compare as the bits they are)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


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
