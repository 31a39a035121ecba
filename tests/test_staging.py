"""Chunk staging (transport/staging.py): pooled host buffers live exactly as long as ZeroMQ
needs them. Real sockets over inproc: there libzmq hands the message itself to the peer, so
a send completes only when the receiver lets go of it, a point the test controls."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch
import zmq
import zmq.asyncio

from digenrl.transport.options import COPY_BELOW, SocketOptions
from digenrl.transport.protocol import Chunk, WeightsPart
from digenrl.transport.sockets import Pull, Push
from digenrl.transport.staging import DeviceToHost, HostPool, HostToDevice
from digenrl.transport.weights import WeightAssembly, publish_parts
from tests.factories import chunk

WAIT = 10.0
OPTS = SocketOptions(max_frame_bytes=8 << 20, hwm=16)
N = COPY_BELOW // 4  # float32 elements: the smallest frame that goes zero-copy


@pytest.fixture
async def link() -> AsyncIterator[tuple[Push, Pull]]:
    ctx = zmq.asyncio.Context()
    push, pull = Push(ctx, options=OPTS), Pull(ctx, options=OPTS)
    pull.bind("inproc://staging")
    push.connect("inproc://staging")
    yield push, pull
    push.close()
    pull.close()
    ctx.destroy(linger=0)


def _chunk(x_t: torch.Tensor, x_next: torch.Tensor) -> Chunk:
    return chunk(x_t=x_t, x_next=x_next, sigma=0.5, sigma_next=0.4)


async def test_a_staged_buffer_is_not_reused_before_its_send_completes(link) -> None:
    push, pull = link
    d2h = DeviceToHost("cpu")
    x = torch.arange(2 * N, dtype=torch.float32).reshape(2, N)
    first = d2h.stage([x, x + 1])
    tracker = await push.send(_chunk(*first.tensors), track=True)
    first.release(tracker)
    assert tracker is not None and not tracker.done  # the peer holds the message

    second = d2h.stage([x, x + 1])  # the first buffer is still in flight: a new one
    assert second._buf.data_ptr() != first._buf.data_ptr()
    assert d2h.pool.statistics()["allocated"] == 2
    second.release()  # never sent: free at once

    _, got = await asyncio.wait_for(pull.recv(), WAIT)
    assert isinstance(got, Chunk) and torch.equal(got.x_t, x) and torch.equal(got.x_next, x + 1)
    # the received tensors are the staged buffer itself (zero-copy all the way)
    assert got.x_t.data_ptr() == first._buf.data_ptr()
    del got  # the receiver lets go: ZeroMQ frees the message, the tracker fires
    assert await asyncio.to_thread(tracker.wait, WAIT) is None and tracker.done

    third = d2h.stage([x, x + 1])
    fourth = d2h.stage([x, x + 1])
    assert {third._buf.data_ptr(), fourth._buf.data_ptr()} == \
        {first._buf.data_ptr(), second._buf.data_ptr()}
    stats = d2h.pool.statistics()
    assert (stats["allocated"], stats["reused"], stats["in_flight"]) == (2, 2, 2)


async def test_a_chunk_staged_from_a_device_arrives_bit_identical(link) -> None:
    push, pull = link
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(3, N // 3, generator=g)
    x_next = x_t.to(torch.bfloat16)  # sizes that are not multiples of the alignment
    staged = DeviceToHost("cpu").stage([x_t, x_next])
    await staged.wait_ready()
    staged.release(await push.send(_chunk(*staged.tensors), track=True))
    _, got = await asyncio.wait_for(pull.recv(), WAIT)
    assert isinstance(got, Chunk)
    landed = HostToDevice("cpu").stage([got.x_t, got.x_next]).wait()
    # exact: bytes copied, never computed on
    assert torch.equal(landed[0], x_t) and torch.equal(landed[1].view(torch.int16),
                                                       x_next.view(torch.int16))


async def test_frames_below_the_copy_threshold_are_copied_and_larger_ones_are_not(link) -> None:
    """Small frames are cheaper copied (options.COPY_BELOW): their send is done at once and
    the receiver gets its own bytes; from the threshold up the receiver reads the sender's
    memory (inproc hands over the message itself) until it lets go."""
    push, pull = link
    for n, zero_copy in ((N - 1, False), (N, True)):
        x = torch.arange(n, dtype=torch.float32).reshape(1, n)  # one frame of 4n bytes
        tracker = await push.send(_chunk(x, x + 1), track=True)
        assert tracker is not None and tracker.done is not zero_copy
        _, got = await asyncio.wait_for(pull.recv(), WAIT)
        # exact: the same process's bytes, moved (copied or not), never computed on
        assert isinstance(got, Chunk) and torch.equal(got.x_t, x)
        assert (got.x_t.data_ptr() == x.data_ptr()) is zero_copy
        del got
        assert await asyncio.to_thread(tracker.wait, WAIT) is None and tracker.done


def test_a_pool_buffer_waits_for_every_fence() -> None:
    pool = HostPool()
    buf = pool.acquire(1024)
    copy_done, send_done = [False], [False]
    pool.release(buf, lambda: copy_done[0], lambda: send_done[0])
    assert pool.acquire(1024).data_ptr() != buf.data_ptr()
    copy_done[0] = True
    assert pool.statistics()["waiting"] == 1
    send_done[0] = True
    assert pool.acquire(1024).data_ptr() == buf.data_ptr()
    assert pool.acquire(2048).numel() == 2048  # sizes are pooled apart


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_staging_never_blocks_the_producers_stream() -> None:
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    x = torch.randn(2, N, device=dev)
    d2h, h2d = DeviceToHost(dev), HostToDevice(dev)
    torch.cuda.synchronize()
    for _ in range(8):
        a = a @ a / 64  # queue seconds of work on the producer's stream
    staged = d2h.stage([x, x * 2])
    # stage() returned while the producer's stream still runs: nothing waited for it
    assert not torch.cuda.current_stream().query()
    assert staged.tensors[0].is_pinned()
    torch.cuda.current_stream().synchronize()
    staged.event.synchronize()
    odd = torch.arange(3, dtype=torch.float64)  # a size off the 64-byte grid, another dtype
    landed = h2d.stage([*staged.tensors, odd]).wait()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(landed[0], x) and torch.equal(landed[1], x * 2)
    assert torch.equal(landed[2].cpu(), odd)  # exact: bytes copied, nothing computed
    # one host-to-device copy: the landed tensors are views of one device buffer
    assert len({t.untyped_storage().data_ptr() for t in landed}) == 1
    staged.release()


async def test_received_weights_are_assembled_without_a_copy(link) -> None:
    push, pull = link
    sd = {"a.weight": torch.randn(256, 256), "b.bias": torch.randn(256).to(torch.bfloat16)}
    (part, checksum), = publish_parts(sd)[0]
    await push.send(WeightsPart(version=1, part=0, nparts=1, checksum=checksum, tensors=part))
    _, got = await asyncio.wait_for(pull.recv(), WAIT)
    assert isinstance(got, WeightsPart)
    asm = WeightAssembly(1, 1, publish_parts(sd)[1])
    asm.add(0, dict(got.tensors), got.checksum)
    out = asm.state_dict()
    for k, t in sd.items():  # the received frames themselves: the apply's copy is the only one
        assert out[k].data_ptr() == got.tensors[k].data_ptr()
        assert torch.equal(out[k].view(torch.uint8), t.view(torch.uint8))
