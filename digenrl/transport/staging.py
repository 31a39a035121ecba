"""Chunks between a device and the wire: pooled host buffers, copies on side streams.

    rollout:  sampler stream --(wait_stream)--> copy stream: device-to-host into a pooled
              pinned buffer, event recorded --> event loop: ``await staged.wait_ready()``,
              ``Push.send(..., track=True)`` zero-copy --> ``staged.release(tracker)``: the
              buffer is reused only once ZeroMQ has let go of it (``tracker.done``; at
              once for frames under ``options.COPY_BELOW``, which ZeroMQ copies).
    trainer:  received frames --memcpy--> pooled pinned buffer --copy stream: one
              host-to-device copy of the whole buffer, event recorded--> ``landed.wait()``
              on the training thread: its stream waits on the event (a GPU-side wait; the
              host never blocks); the pinned buffer is reused once the event has passed.

The sampler's stream is never made to wait for a send: its only dependency is the copy
stream's wait on *it*, and its host thread returns from :meth:`DeviceToHost.stage` as soon
as the copies are queued. The pool grows when every buffer is still in flight (the run's
credit byte window bounds how many chunks are), so a held-up send never holds the sampler.

CPU nodes run the same code with the CUDA parts off: a device-to-host "copy" is a host copy
into a pooled buffer, done at once, and still reused only after its send completed (what
``tests/test_staging.py`` checks with real sockets); :class:`HostToDevice` has nothing to
copy on a CPU node.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 64  # bytes: each tensor's slice of a pooled buffer starts on a cache line

Fence = Callable[[], bool]
"""True once whatever used a buffer has let go of it: ``lambda: tracker.done`` for a ZeroMQ
send, ``event.query`` for a CUDA copy."""


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Aligned byte offsets of each tensor in one buffer, and the buffer's size."""
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return offsets, max(size, ALIGN)


def _views(buf: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    """Tensors shaped like ``tensors`` over slices of the uint8 buffer ``buf``."""
    out = []
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        out.append(buf[off:off + n].view(t.dtype).view(t.shape))
    return out


class HostPool:
    """Host buffers reused by size, each handed out again only when its fences have passed.

    Thread-safe: a compute thread acquires, the event loop releases. ``pin`` allocates
    page-locked memory (CUDA nodes: asynchronous copies need it).
    """

    def __init__(self, *, pin: bool = False) -> None:
        self.pin = pin
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._fenced: list[tuple[torch.Tensor, list[Fence]]] = []
        self._stats = {"allocated": 0, "reused": 0, "in_flight": 0, "peak_in_flight": 0,
                       "bytes_allocated": 0}

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes``: a free one whose fences passed, else a new one."""
        with self._lock:
            free = self._free.get(nbytes)
            if not free and self._fenced:  # look at the fences only when it may pay
                self._reap()
                free = self._free.get(nbytes)
            stats = self._stats
            if free:
                buf = free.pop()
                stats["reused"] += 1
            else:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
                stats["allocated"] += 1
                stats["bytes_allocated"] += nbytes
            stats["in_flight"] += 1
            stats["peak_in_flight"] = max(stats["peak_in_flight"], stats["in_flight"])
            return buf

    def release(self, buf: torch.Tensor, *fences: Fence) -> None:
        """``buf`` may be reused once every fence says so (at once with no fences)."""
        with self._lock:
            self._stats["in_flight"] -= 1
            if fences:  # looked at when a buffer of its size is next wanted (acquire)
                self._fenced.append((buf, list(fences)))
            else:
                self._free.setdefault(buf.numel(), []).append(buf)

    def _reap(self) -> None:
        """Move buffers whose fences all passed to the free lists (lock held), the most
        recently released last: ``acquire`` takes it first (warmest in the caches)."""
        keep = []
        for buf, fences in self._fenced:
            if all(f() for f in fences):
                self._free.setdefault(buf.numel(), []).append(buf)
            else:
                keep.append((buf, fences))
        self._fenced = keep

    def statistics(self) -> dict[str, int]:
        """allocated, reused, in_flight (acquired, not released), peak_in_flight, waiting
        (released, fences pending), bytes_allocated."""
        with self._lock:
            self._reap()
            return {**self._stats, "waiting": len(self._fenced)}


@dataclass
class Staged:
    """A chunk's tensors in a pooled host buffer, on their way to the wire."""

    tensors: list[torch.Tensor]  # host views over the pooled buffer, shaped like the sources
    event: Any  # torch.cuda.Event recorded after the copies, or None (CPU: already there)
    _pool: HostPool = field(repr=False)
    _buf: torch.Tensor = field(repr=False)
    _released: bool = field(default=False, repr=False)

    def ready(self) -> bool:
        """Whether the copies have landed in host memory."""
        return self.event is None or bool(self.event.query())

    async def wait_ready(self) -> None:
        """Wait (off the event loop) until the copies have landed in host memory."""
        if not self.ready():
            await asyncio.to_thread(self.event.synchronize)

    def release(self, tracker: Any = None) -> None:
        """Give the buffer back; it is reused once ``tracker`` (a ``zmq.MessageTracker``
        from ``send(..., track=True)``, or None when nothing was sent) is done. Idempotent."""
        if self._released:
            return
        self._released = True
        fences: list[Fence] = [] if tracker is None else [lambda: bool(tracker.done)]
        if self.event is not None:  # never reuse a buffer a copy may still be writing
            fences.append(self.event.query)
        self._pool.release(self._buf, *fences)


class DeviceToHost:
    """Stages tensors from ``device`` into pooled host buffers, off the producer's stream."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pool = HostPool(pin=self.cuda)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def stage(self, tensors: Sequence[torch.Tensor]) -> Staged:
        """Queue copies of ``tensors`` into one pooled buffer; returns at once on CUDA.

        Call it on the thread (and stream) that produced the tensors: the copy stream waits
        for that stream's work so far, and the tensors' memory is kept from the allocator
        until the copies ran.
        """
        offsets, size = _layout(tensors)
        buf = self.pool.acquire(size)
        views = _views(buf, tensors, offsets)
        if self.stream is None:
            for v, t in zip(views, tensors):
                v.copy_(t)
            return Staged(views, None, self.pool, buf)
        producer = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(producer)
        with torch.cuda.stream(self.stream):
            for v, t in zip(views, tensors):
                v.copy_(t, non_blocking=True)
                if t.is_cuda:
                    t.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return Staged(views, event, self.pool, buf)


@dataclass
class Landed:
    """Tensors on their way to (or already on) the device."""

    tensors: list[torch.Tensor]
    event: Any  # torch.cuda.Event after the host-to-device copies, or None

    def wait(self) -> list[torch.Tensor]:
        """The tensors, safe to use on the calling thread's current stream.

        On CUDA that stream waits for the copies (on the device; the host does not block),
        and the tensors are marked used by it, so the allocator keeps them until it is done.
        """
        if self.event is not None:
            stream = torch.cuda.current_stream(self.tensors[0].device)
            stream.wait_event(self.event)
            for t in self.tensors:
                t.record_stream(stream)
        return self.tensors


class HostToDevice:
    """Lands received host tensors on ``device``: pinned bounce, copy on a side stream."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pool = HostPool(pin=True) if self.cuda else None
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def stage(self, tensors: Sequence[torch.Tensor]) -> Landed:
        """Start copying ``tensors`` (host, e.g. decoded frames) to the device.

        The frames are copied once into a pooled pinned buffer (ZeroMQ's pageable memory
        cannot feed an asynchronous copy), then to the device on the side stream. On a CPU
        node the tensors are already where they are used: returned as they are.
        """
        if self.stream is None or self.pool is None:
            return Landed(list(tensors), None)
        offsets, size = _layout(tensors)
        buf = self.pool.acquire(size)
        views = _views(buf, tensors, offsets)
        for v, t in zip(views, tensors):
            v.copy_(t)
        with torch.cuda.stream(self.stream):
            # one host-to-device copy of the whole buffer (not one per tensor: each copy is a
            # launch and a DMA set-up); the tensors are views of one device buffer laid out
            # like the pinned one, so the allocator frees it when the last of them goes
            dev = torch.empty(size, dtype=torch.uint8, device=self.device)
            dev.copy_(buf, non_blocking=True)
            out = _views(dev, tensors, offsets)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pool.release(buf, event.query)
        return Landed(out, event)


__all__ = ["DeviceToHost", "Fence", "HostPool", "HostToDevice", "Landed", "Staged"]
