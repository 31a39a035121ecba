"""Transport benchmark: the project's codec + sockets against raw pyzmq, side by side in one run.

    .venv/bin/python bench/transport.py [--repeats 5] [--quick] [--json]
    .venv/bin/python bench/transport.py --sweep [--repeats 5] [--json]
    .venv/bin/python bench/transport.py --split [--repeats 5] [--json]

Every figure is the median of interleaved repeats (codec and raw measured back to back,
alternating which goes first); a ratio is the median of the per-repeat ratios.

1. Goodput of per-timestep ``Chunk`` messages (x_t and x_next of 64 KiB, 1 MiB, 16 MiB
   each, float32) over PUSH/PULL on tcp loopback, sender in another process:
   *codec* = ``Push.send(Chunk)`` (encode) -> ``Pull.recv()`` (decode to tensors) under uvloop;
   *raw* = the same frames through blocking pyzmq ``send_multipart(copy=False)`` /
   ``recv_multipart(copy=False)``; *raw_copy* = raw with the codec's copy threshold
   (frames under 256 KiB copied into libzmq, ``transport/options.py: COPY_BELOW``), so the
   codec's own tuning is not what beats raw (``goodput_ratio_best_raw_*``: codec over the
   better raw). Goodput counts tensor bytes, first message to last.
   At 1 MiB and 16 MiB raw and raw_copy are the *same* configuration (every tensor frame
   over both thresholds goes zero-copy, the two small frames are copied by both), so
   ``goodput_null_ratio_{1m,16m}`` (raw_copy over raw, median of the per-repeat ratios) is
   how far apart two identical sides land in this run: the noise a codec/raw ratio carries.
   ``goodput_ratio_reps_*`` lists the per-repeat codec/raw ratios the medians are taken of.
   Before the repeats every mode streams a quarter of its messages at every size, untimed:
   the first stream of a fresh pair of processes ran slower (in a one-off run its cores sat
   a third idle, against an eighth to a fifth for the streams after it), and it used to be
   the codec's (it goes first in the even repeats).
2. Round trip of a ``Heartbeat``: ``Dealer`` -> ``Router`` echo (another process) -> back,
   against raw msgpack over blocking DEALER/ROUTER; and *floor*: the same msgpack dicts over
   the same pyzmq sockets driven by uvloop at both ends, written as cheaply as an asyncio
   receive can be (:class:`_FloorReader`: one reader callback, one future per wait, no
   classes, no checks). ``heartbeat_rtt_floor_ratio`` (floor over raw) is what the asyncio
   actor model costs by itself; ``heartbeat_rtt_codec_over_floor`` what the project's
   sockets and codec add to it.
3. The same Heartbeat round trip while the same two processes stream 16 MiB chunks
   (PUSH/PULL, codec) in the background, against the idle round trip (both codec): control
   must not queue behind bulk data. The codec side opens its sockets as nodes do: on
   ``node_context()`` with the chunk sockets in the bulk lane (their own libzmq I/O thread).
4. The codec alone: encode + decode, CPU microseconds per message.
5. ``staged_chunk_goodput``: chunks device -> pinned host -> wire -> pinned host -> device
   through :mod:`digenrl.transport.staging`, against the bare copies and raw pyzmq (on a
   CPU-only machine "device" is the host; bench/gpu_check.py calls it on a GPU).

Next to every wall-clock ratio the bench reports CPU time per message (both processes,
libzmq's I/O threads included, ``time.process_time``): on a host shared with other jobs the
wall clock mostly measures the scheduler, while the CPU a message costs is what decides the
wall-clock ratios once the machine is quiet (``cpu_ratio_*``: raw over codec CPU per chunk;
``heartbeat_cpu_ratio``: codec over raw CPU per round trip).

``thread_cpu_us_*``: the same CPU per message split by thread (Linux ``schedstat``), per mode
and end: ``recv_main``/``send_main`` the Python thread that receives or sends, ``*_io``
libzmq's I/O threads, ``send_gc`` pyzmq's zero-copy garbage-collector thread.

``codec_recv_waits_per_msg_*`` / ``codec_send_waits_per_msg_*``: how often the codec's
receiver found no message and its sender a full pipe, each a park on the event loop
(``Socket.statistics().waits``) where raw pyzmq blocks inside libzmq.

``--sweep`` measures only raw pyzmq with every frame copied against zero-copy at chunk sizes
64 KiB to 2 MiB (key ``copy_sweep``): where copying stops paying, i.e. the codec's copy
threshold.

``--split`` measures only goodput of a raw or codec sender into a raw or codec receiver
(all four pairings, every size, key ``split``): which end the codec's cost sits on.

``--json`` prints one JSON object instead of tables (keys: ``goodput_ratio_64k``,
``goodput_ratio_1m``, ``goodput_ratio_16m``, ``heartbeat_rtt_ratio``,
``heartbeat_rtt_bulk_ratio`` and the figures behind them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import timeit
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import torch
import uvloop
import zmq
import zmq.asyncio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from digenrl.transport import allocator
from digenrl.transport.options import COPY_BELOW, SocketOptions, node_context
from digenrl.transport.protocol import Chunk, Heartbeat, decode, encode
from digenrl.transport.socketio import recv_multipart, send_multipart
from digenrl.transport.sockets import Dealer, Pull, Push, Router
from digenrl.transport.staging import DeviceToHost, HostToDevice

OPTS = SocketOptions(max_frame_bytes=64 << 20, hwm=8)  # hwm 8: at most ~256 MiB queued at 16 MiB
WARMUP = 3
SIZES = {"64k": (64 << 10, 3000), "1m": (1 << 20, 400), "16m": (16 << 20, 30)}
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def _chunk(nbytes: int, i: int = 0) -> Chunk:
    n = nbytes // 4
    return Chunk(task_id=i, step=0, fragment=0, t_index=i % 10, sigma=0.9, sigma_next=0.8,
                 policy_version=1, x_t=torch.ones(1, n), x_next=torch.full((1, n), 2.0),
                 log_prob=torch.zeros(1))


def _heartbeat(seq: int, state: str = "running") -> Heartbeat:
    return Heartbeat(node_id="rollout-0", incarnation=1, policy_version=3, state=state,
                     seq=seq, gpu={"free_mb": 40000.0, "util": 0.93},
                     stats={"chunks": 120, "bytes": 1 << 30})


def _run(coro: Any) -> Any:
    """The loop the actors use (STYLE.md: uvloop, made once at the entry point)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


# ------------------------------------------------------------------ the peer process


def _peer(conn: Connection, default_malloc: bool = False) -> None:
    """Serves the measurements' other end, one command at a time, until ``None``."""
    torch.set_num_threads(1)
    if not default_malloc:
        allocator.tune()  # as a node does at start (raw and codec alike: same processes)
    while (cmd := conn.recv()) is not None:
        kind, mode, *args = cmd
        if kind == "send":
            _send(conn, mode, *args)
        elif kind == "echo":
            _echo(conn, mode, *args)
        elif kind == "bulk_echo":
            _run(_bulk_echo(conn, *args))
        conn.send("finished")


RAW_THRESHOLDS = {"raw": None, "raw_copy": COPY_BELOW, "raw_copy_all": (1 << 31) - 1}
"""Raw pyzmq's modes by copy threshold: pyzmq's default (frames under 64 KiB copied), the
codec's (options.COPY_BELOW), and every frame copied (``--sweep``'s other side)."""


def _send(conn: Connection, mode: str, endpoint: str, nbytes: int, count: int) -> None:
    if mode in RAW_THRESHOLDS:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        if RAW_THRESHOLDS[mode] is not None:
            sock.copy_threshold = RAW_THRESHOLDS[mode]
        sock.setsockopt(zmq.SNDHWM, OPTS.hwm)
        sock.connect(endpoint)
        frames = encode(_chunk(nbytes))
        c0, th0 = time.process_time(), _threads()
        for _ in range(count):
            sock.send_multipart(frames, copy=False)
        conn.recv()  # the receiver has everything: close
        # this process's CPU (its I/O threads included), waits, CPU by thread kind
        conn.send((time.process_time() - c0, 0, _thread_us(th0, _threads(), count)))
        sock.close(linger=0)
        ctx.term()
        return

    async def run() -> None:
        ctx = node_context()
        with Push(ctx, options=OPTS, lane="bulk") as push:
            push.connect(endpoint)
            base = _chunk(nbytes).__dict__
            c0, th0 = time.process_time(), _threads()
            for i in range(count):
                await push.send(Chunk(**{**base, "task_id": i}))
            conn.recv()
            conn.send((time.process_time() - c0, push.statistics().waits,
                       _thread_us(th0, _threads(), count)))
        ctx.term()

    _run(run())


def _echo(conn: Connection, mode: str, endpoint: str) -> None:
    if mode == "raw":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(endpoint)
        conn.send("ready")
        c0 = time.process_time()
        while True:
            peer, body = sock.recv_multipart()
            msg = msgpack.unpackb(body)
            if msg.get("state") == "stopping":
                break
            sock.send_multipart([peer, msgpack.packb(msg)])
        conn.send(time.process_time() - c0)
        sock.close(linger=0)
        ctx.term()
        return
    if mode == "floor":
        _run(_floor_echo(conn, endpoint))
        return

    async def run() -> None:
        ctx = node_context()
        with Router(ctx, options=OPTS) as router:
            router.bind(endpoint)
            conn.send("ready")
            c0 = time.process_time()
            await _echo_loop(router)
            conn.send(time.process_time() - c0)
        ctx.term()

    _run(run())


class _FloorReader:
    """The cheapest receive on an asyncio loop: the floor under the project's sockets.

    One reader callback on ZeroMQ's descriptor and one future per wait; plain ints for the
    flags, no statistics, no checks, no fairness (nothing else runs on the loop). Like the
    project's sockets it asks ``EVENTS`` before parking (the descriptor signals edges) and
    reads at once when woken. Its ends send through the project's ``send_multipart`` (int
    flags, pyzmq's send under its Python wrapper), the cheapest send found.
    """

    def __init__(self, sock: zmq.Socket[Any], loop: asyncio.AbstractEventLoop) -> None:
        self.sock, self.loop = sock, loop
        self.waiter: asyncio.Future[list[zmq.Frame]] | None = None
        loop.add_reader(sock.FD, self._wake)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is None:
            return
        try:
            frames = recv_multipart(self.sock)
        except zmq.Again:
            return
        self.waiter = None
        waiter.set_result(frames)

    async def recv(self) -> list[zmq.Frame]:
        if int(self.sock.getsockopt(_EVENTS)) & _POLLIN:
            return recv_multipart(self.sock)
        self.waiter = self.loop.create_future()
        return await self.waiter

    def close(self) -> None:
        self.loop.remove_reader(self.sock.FD)
        self.sock.close(linger=0)


def _floor_socket(kind: int) -> tuple[zmq.Context[Any], zmq.Socket[Any]]:
    ctx = zmq.Context()
    return ctx, ctx.socket(kind)


async def _floor_echo(conn: Connection, endpoint: str) -> None:
    ctx, sock = _floor_socket(zmq.ROUTER)
    sock.bind(endpoint)
    reader = _FloorReader(sock, asyncio.get_running_loop())
    conn.send("ready")
    c0 = time.process_time()
    while True:
        peer, body = await reader.recv()
        msg = msgpack.unpackb(body)
        if msg.get("state") == "stopping":
            break
        send_multipart(sock, [peer, msgpack.packb(msg)], False)
    conn.send(time.process_time() - c0)
    reader.close()
    ctx.term()


async def _floor_pings(pings: int, endpoint: str) -> tuple[list[float], float]:
    ctx, sock = _floor_socket(zmq.DEALER)
    sock.connect(endpoint)
    reader = _FloorReader(sock, asyncio.get_running_loop())
    body = dict(_heartbeat(0).__dict__)
    rtts = []
    c0 = time.process_time()
    for i in range(pings + 50):
        t = time.perf_counter()
        send_multipart(sock, [msgpack.packb({**body, "seq": i})], False)
        (reply,) = await reader.recv()
        msgpack.unpackb(reply)
        if i >= 50:
            rtts.append((time.perf_counter() - t) * 1e6)
    cpu = time.process_time() - c0
    sock.send(msgpack.packb({**body, "state": "stopping"}))
    await asyncio.sleep(0.1)  # let the stop leave before the linger-0 close
    reader.close()
    ctx.term()
    return rtts, cpu


async def _echo_loop(router: Router) -> None:
    while True:
        peer, msg = await router.recv()
        if isinstance(msg, Heartbeat) and msg.state == "stopping":
            return
        await router.send(msg, to=peer)


async def _bulk_echo(conn: Connection, router_ep: str, pull_ep: str) -> None:
    """A node with a control ROUTER (echo) and a data PULL (decodes every chunk) in one loop."""
    ctx = node_context()
    with Router(ctx, options=OPTS) as router, Pull(ctx, options=OPTS, lane="bulk") as pull:
        router.bind(router_ep)
        pull.bind(pull_ep)
        conn.send("ready")

        async def drain() -> None:
            while True:
                await pull.recv()

        drainer = asyncio.ensure_future(drain())
        try:
            await _echo_loop(router)
        finally:
            drainer.cancel()
            await asyncio.gather(drainer, return_exceptions=True)
    ctx.term()


# ------------------------------------------------------------------ measurements


def _free_tcp() -> str:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.bind("tcp://127.0.0.1:*")
    ep = s.getsockopt_string(zmq.LAST_ENDPOINT)
    s.close(linger=0)
    ctx.term()
    return ep


def goodput(peer: Connection, mode: str, nbytes: int, count: int,
            receiver: str | None = None) -> tuple[float, float]:
    """Payload bytes per second received (x_t + x_next + log_prob), and the CPU time both
    processes spent per message (microseconds, libzmq's I/O threads included). ``mode`` is
    the sender's; the receiver is the same kind (raw or codec) unless ``receiver`` says."""
    total = count + WARMUP
    endpoint = _free_tcp()
    if (receiver or mode) in RAW_THRESHOLDS:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, OPTS.hwm)
        sock.bind(endpoint)
        c0, th0 = time.process_time(), _threads()
        peer.send(("send", mode, endpoint, nbytes, total))
        t0 = time.perf_counter()
        for i in range(total):
            sock.recv_multipart(copy=False)
            if i == WARMUP - 1:
                t0 = time.perf_counter()
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0
        THREADS["recv"] = _thread_us(th0, _threads(), total)
        sock.close(linger=0)
        ctx.term()
    else:
        async def run() -> tuple[float, float]:
            ctx = node_context()
            with Pull(ctx, options=OPTS, lane="bulk") as pull:
                pull.bind(endpoint)
                c0, th0 = time.process_time(), _threads()
                peer.send(("send", mode, endpoint, nbytes, total))
                t0 = time.perf_counter()
                for i in range(total):
                    _, msg = await pull.recv()
                    assert isinstance(msg, Chunk) and msg.x_next.numel() == nbytes // 4
                    del msg  # as raw's loop drops its frames: no message held over the next wait
                    if i == WARMUP - 1:
                        t0 = time.perf_counter()
                elapsed = time.perf_counter() - t0
                cpu = time.process_time() - c0
                THREADS["recv"] = _thread_us(th0, _threads(), total)
                WAITS["recv"] = pull.statistics().waits / total
            ctx.term()
            return elapsed, cpu

        elapsed, cpu = _run(run())
    peer.send("close")
    sender_cpu, sender_waits, THREADS["send"] = peer.recv()
    cpu += sender_cpu
    if mode not in RAW_THRESHOLDS:
        WAITS["send"] = sender_waits / total
    assert peer.recv() == "finished"
    return count * (2 * nbytes + 4) / elapsed, cpu / total * 1e6


WAITS: dict[str, float] = {}
"""Waits per message of the last codec goodput run's receiver (``recv``) and sender (``send``):
receives that found no message, sends that found the pipe full, each a park on the event loop
(``Socket.statistics().waits``) where raw pyzmq blocks in libzmq."""
THREADS: dict[str, dict[str, float]] = {}
"""CPU microseconds per message of the last goodput run's receiver (``recv``) and sender
(``send``) by thread kind (:func:`_threads`)."""


def _threads() -> dict[int, tuple[str, int]]:
    """This process's threads: id -> (kind, CPU nanoseconds so far). Kinds: ``main`` (the
    Python thread that sends or receives), ``io`` (libzmq's I/O threads), ``gc`` (other
    threads named like the main one: pyzmq's zero-copy garbage collector), ``other``. Empty
    where /proc has no per-thread ``schedstat`` (off Linux)."""
    out: dict[int, tuple[str, int]] = {}
    me = os.getpid()
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        with open("/proc/self/comm") as f:
            main_comm = f.read().strip()
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended, or no schedstat
            continue
        kind = ("main" if tid == me else "io" if comm.startswith("ZMQbg/IO")
                else "gc" if comm == main_comm else "other")
        out[tid] = (kind, ns)
    return out


def _thread_us(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]],
               n: int) -> dict[str, float]:
    """CPU microseconds per message by thread kind between two :func:`_threads` snapshots."""
    us: dict[str, float] = {}
    for tid, (kind, ns) in after.items():
        us[kind] = us.get(kind, 0.0) + (ns - before.get(tid, (kind, 0))[1]) / n / 1e3
    return {kind: v for kind, v in us.items() if v >= 0.05}  # idle kinds left out


def latency(peer: Connection, mode: str, pings: int) -> tuple[list[float], float]:
    """Heartbeat round-trip times in microseconds (50 warm-up pings not counted), and the
    CPU time both processes spent per round trip (microseconds, I/O threads included)."""
    endpoint = _free_tcp()
    peer.send(("echo", mode, endpoint))
    assert peer.recv() == "ready"
    rtts: list[float] = []
    if mode == "raw":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        body = dict(_heartbeat(0).__dict__)
        c0 = time.process_time()
        for i in range(pings + 50):
            t = time.perf_counter()
            sock.send(msgpack.packb({**body, "seq": i}))
            msgpack.unpackb(sock.recv())
            if i >= 50:
                rtts.append((time.perf_counter() - t) * 1e6)
        cpu = time.process_time() - c0
        sock.send(msgpack.packb({**body, "state": "stopping"}))
        sock.close(linger=1000)
        ctx.term()
    elif mode == "floor":
        got, cpu = _run(_floor_pings(pings, endpoint))
        rtts.extend(got)
    else:
        async def run() -> float:
            ctx = node_context()
            with Dealer(ctx, options=OPTS) as dealer:
                dealer.connect(endpoint)
                c0 = time.process_time()
                rtts.extend(await _pings(dealer, pings))
                spent = time.process_time() - c0
                await dealer.send(_heartbeat(0, state="stopping"))
                await asyncio.sleep(0.1)  # let the stop leave before the linger-0 close
            ctx.term()
            return spent

        cpu = _run(run())
    cpu += peer.recv()
    assert peer.recv() == "finished"
    return rtts, cpu / (pings + 50) * 1e6


async def _pings(dealer: Dealer, pings: int, warmup: int = 50) -> list[float]:
    rtts = []
    for i in range(pings + warmup):
        t = time.perf_counter()
        await dealer.send(_heartbeat(i))
        await dealer.recv()
        if i >= warmup:
            rtts.append((time.perf_counter() - t) * 1e6)
    return rtts


def latency_under_bulk(peer: Connection, pings: int, repeats: int,
                       nbytes: int = 16 << 20) -> dict[str, Any]:
    """Heartbeat round trips (codec) with and without a 16 MiB chunk stream between the same
    two processes; idle and bulk blocks interleaved, ``repeats`` of each."""
    router_ep, pull_ep = _free_tcp(), _free_tcp()
    peer.send(("bulk_echo", "codec", router_ep, pull_ep))
    assert peer.recv() == "ready"

    async def run() -> dict[str, Any]:
        ctx = node_context()
        idle: list[float] = []
        bulk: list[float] = []
        ratios = []
        with Dealer(ctx, options=OPTS) as dealer, Push(ctx, options=OPTS, lane="bulk") as push:
            dealer.connect(router_ep)
            push.connect(pull_ep)
            base = _chunk(nbytes).__dict__
            sent = 0

            async def stream() -> None:
                nonlocal sent
                while True:
                    await push.send(Chunk(**{**base, "task_id": sent}))
                    sent += 1

            await _pings(dealer, 0)  # connect and warm up
            for _ in range(repeats):
                quiet = await _pings(dealer, pings, warmup=10)
                streamer = asyncio.ensure_future(stream())
                before = sent
                while sent < before + 2 * OPTS.hwm:  # the pipes are full: bulk is flowing
                    await asyncio.sleep(0.001)
                busy = await _pings(dealer, pings, warmup=10)
                streamer.cancel()
                await asyncio.gather(streamer, return_exceptions=True)
                idle += quiet
                bulk += busy
                ratios.append(statistics.median(busy) / statistics.median(quiet))
            await dealer.send(_heartbeat(0, state="stopping"))
            await asyncio.sleep(0.1)
        ctx.term()
        return {"idle_us": statistics.median(idle), "bulk_us": statistics.median(bulk),
                "bulk_p99_us": _p99(bulk), "ratio": statistics.median(ratios),
                "chunks_streamed": sent}

    out = _run(run())
    assert peer.recv() == "finished"
    return out


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else xs[0]


def codec_us(msg: Any, number: int) -> float:
    """encode + decode, CPU microseconds per message (best of 7)."""
    limit = 64 << 20
    timer = timeit.Timer(lambda: decode(encode(msg), max_frame_bytes=limit), timer=time.thread_time)
    return min(timer.repeat(number=number, repeat=7)) / number * 1e6


# ------------------------------------------------------------------ GPU staging path


def staged_chunk_goodput(device: str = "cpu", nbytes: int = 1 << 20, count: int = 200,
                         repeats: int = 3) -> dict[str, float]:
    """Chunk goodput device -> host -> wire -> host -> device against raw pinned copies.

    *staged*: the sampler side stages each chunk's two tensors with
    :class:`~digenrl.transport.staging.DeviceToHost` (side-stream copy into a pooled pinned
    buffer), sends it with ``Push.send(track=True)`` and returns the buffer on the send's
    completion; the trainer side receives with ``Pull.recv()`` and lands the tensors with
    :class:`~digenrl.transport.staging.HostToDevice` (pinned bounce, side-stream copy), then
    waits for them on its stream. *raw*: ``tensor.to("cpu")`` into a pinned buffer
    (blocking), raw pyzmq send/recv, ``copy_`` back to the device (blocking). Both over
    inproc between two threads of this process (so only the staging and transport layers
    differ, not the kernel's TCP). Returns MB/s medians and their ratio (staged / raw).
    ``device="cpu"`` runs the same code with the CUDA parts off.
    """
    dev = torch.device(device)
    n = nbytes // 4
    src = [torch.randn(1, n, device=dev), torch.randn(1, n, device=dev)]
    rates: dict[str, list[float]] = {"staged": [], "raw": []}
    ratios = []
    for rep in range(repeats):
        order = ("staged", "raw") if rep % 2 == 0 else ("raw", "staged")
        got = {m: _staged_once(m, dev, src, count) for m in order}
        for m, secs in got.items():
            rates[m].append(count * 2 * nbytes / secs / 1e6)
        ratios.append(got["raw"] / got["staged"])
    return {"staged_MBps": statistics.median(rates["staged"]),
            "raw_MBps": statistics.median(rates["raw"]), "ratio": statistics.median(ratios),
            "nbytes": float(nbytes), "device": device}  # type: ignore[dict-item]


def _staged_once(mode: str, dev: torch.device, src: list[torch.Tensor], count: int) -> float:
    """Seconds to move ``count`` chunks; sender and receiver share one thread (and, staged,
    one event loop), so the figure is the per-chunk cost of each path, GIL hand-offs aside."""
    endpoint = f"inproc://staged-{mode}-{time.monotonic_ns()}"
    ctx = node_context()
    cuda = dev.type == "cuda"
    try:
        if mode == "raw":
            plain = zmq.Context.shadow(ctx.underlying)
            pull, push = plain.socket(zmq.PULL), plain.socket(zmq.PUSH)
            pull.bind(endpoint)
            push.connect(endpoint)
            pinned = [torch.empty_like(t, device="cpu", pin_memory=cuda) for t in src]
            landed = [torch.empty_like(t) for t in src]
            t0 = time.perf_counter()
            for _ in range(count):
                # a blocking device-to-host copy into fresh pinned memory (torch caches it)
                out = [torch.empty_like(t, device="cpu", pin_memory=cuda).copy_(t) for t in src]
                push.send_multipart([o.numpy() for o in out], copy=False)
                frames = pull.recv_multipart(copy=False)
                if cuda:  # what HostToDevice does, blocking: pinned bounce, then the copy
                    for f, p, d in zip(frames, pinned, landed):
                        p.view(-1).view(torch.uint8).numpy()[:] = memoryview(f.buffer)
                        d.copy_(p)
            if cuda:
                torch.cuda.synchronize(dev)
            elapsed = time.perf_counter() - t0
            push.close(linger=0)
            pull.close(linger=0)
            return elapsed

        async def run() -> float:
            d2h, h2d = DeviceToHost(dev), HostToDevice(dev)
            with Pull(ctx, options=OPTS, lane="bulk") as pull, Push(ctx, options=OPTS, lane="bulk") as push:
                pull.bind(endpoint)
                push.connect(endpoint)

                async def produce() -> None:
                    for i in range(count):
                        staged = d2h.stage(src)
                        await staged.wait_ready()
                        x_t, x_next = staged.tensors
                        tracker = await push.send(Chunk(
                            task_id=i, step=0, fragment=0, t_index=0, sigma=0.5, sigma_next=0.4,
                            policy_version=0, x_t=x_t, x_next=x_next, log_prob=torch.zeros(1)),
                            track=True)
                        staged.release(tracker)

                t0 = time.perf_counter()
                producer = asyncio.ensure_future(produce())
                for _ in range(count):
                    _, msg = await pull.recv()
                    assert isinstance(msg, Chunk)
                    h2d.stage([msg.x_t, msg.x_next]).wait()
                if cuda:
                    torch.cuda.synchronize(dev)
                elapsed = time.perf_counter() - t0
                await producer
            return elapsed

        return float(_run(run()))
    finally:
        ctx.term()


# ------------------------------------------------------------------ the copy threshold


SWEEP = {"64k": (64 << 10, 3000), "128k": (128 << 10, 2000), "256k": (256 << 10, 1200),
         "512k": (512 << 10, 800), "1m": (1 << 20, 400), "2m": (2 << 20, 200)}


def copy_sweep(peer: Connection, repeats: int, scale: float) -> dict[str, Any]:
    """Raw pyzmq with every frame copied into libzmq against zero-copy, per chunk size,
    interleaved: the evidence for ``transport/options.py: COPY_BELOW``. Both send the same
    frames (a 2-tensor Chunk's) over PUSH/PULL tcp loopback; zero-copy here is pyzmq's
    default (frames under its own 64 KiB threshold are still copied)."""
    cells: dict[str, dict[str, list[float]]] = {}
    for rep in range(repeats):
        order = ("raw", "raw_copy_all") if rep % 2 == 0 else ("raw_copy_all", "raw")
        for key, (nbytes, count) in SWEEP.items():
            cell = cells.setdefault(key, {})
            for m in order:
                rate, cpu = goodput(peer, m, nbytes, max(8, int(count * scale)))
                cell.setdefault(f"{m}_MBps", []).append(rate / 1e6)
                cell.setdefault(f"{m}_cpu_us", []).append(cpu)
    out = {}
    for key, cell in cells.items():
        med = {k: statistics.median(v) for k, v in cell.items()}
        out[key] = {"zero_copy_MBps": med["raw_MBps"], "copy_MBps": med["raw_copy_all_MBps"],
                    "cpu_us_per_msg_zero_copy": med["raw_cpu_us"],
                    "cpu_us_per_msg_copy": med["raw_copy_all_cpu_us"],
                    "copy_over_zero_copy_cpu": med["raw_copy_all_cpu_us"] / med["raw_cpu_us"]}
    return out


def split_ends(peer: Connection, repeats: int, scale: float) -> dict[str, Any]:
    """Which end the codec's cost sits on: goodput of every pairing of a raw and a codec
    sender with a raw and a codec receiver, per size, interleaved (``--split``)."""
    pairs = {"raw_to_raw": ("raw", "raw"), "codec_to_raw": ("codec", "raw"),
             "raw_to_codec": ("raw", "codec"), "codec_to_codec": ("codec", "codec")}
    sizes = SIZES
    rates: dict[tuple[str, str], list[float]] = {}
    for rep in range(repeats):
        names = list(pairs) if rep % 2 == 0 else list(pairs)[::-1]
        for key, (nbytes, count) in sizes.items():
            for name in names:
                sender, receiver = pairs[name]
                rate, _ = goodput(peer, sender, nbytes, max(8, int(count * scale)), receiver=receiver)
                rates.setdefault((key, name), []).append(rate / 1e6)
    out: dict[str, Any] = {}
    for key in sizes:
        med = {name: statistics.median(rates[key, name]) for name in pairs}
        out[key] = {**{f"{n}_MBps": v for n, v in med.items()},
                    **{f"{n}_over_raw": v / med["raw_to_raw"] for n, v in med.items() if n != "raw_to_raw"}}
    return out


# ------------------------------------------------------------------ main


def _print_study(out: dict[str, Any], key: str, repeats: int) -> None:
    """The table of ``--split`` or ``--sweep``."""
    load = f"load {out['load_avg_1m'][0]:.1f} -> {out['load_avg_1m'][1]:.1f}"
    if key == "split":
        print(f"# sender/receiver split, medians of {repeats} interleaved repeats, {load}")
        print("\n| size | raw -> raw MB/s | codec -> raw | raw -> codec | codec -> codec |")
        print("|---|---|---|---|---|")
        for size, c in out[key].items():
            print(f"| {size} | {c['raw_to_raw_MBps']:,.0f} | {c['codec_to_raw_over_raw']:.2f} | "
                  f"{c['raw_to_codec_over_raw']:.2f} | {c['codec_to_codec_over_raw']:.2f} |")
        return
    print(f"# copy threshold sweep, raw pyzmq, medians of {repeats} interleaved repeats, {load}; "
          f"COPY_BELOW = {COPY_BELOW >> 10} KiB")
    print("\n| tensor size | zero-copy MB/s | copy MB/s | CPU us/msg zero-copy | copy | copy/zero-copy CPU |")
    print("|---|---|---|---|---|---|")
    for size, c in out[key].items():
        print(f"| {size} | {c['zero_copy_MBps']:,.0f} | {c['copy_MBps']:,.0f} | "
              f"{c['cpu_us_per_msg_zero_copy']:.0f} | {c['cpu_us_per_msg_copy']:.0f} | "
              f"{c['copy_over_zero_copy_cpu']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per cell (median)")
    ap.add_argument("--quick", action="store_true", help="fewer messages (smoke test)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    ap.add_argument("--sweep", action="store_true",
                    help="only raw copy against raw zero-copy per chunk size, 64 KiB-2 MiB "
                         "(the copy threshold's evidence)")
    ap.add_argument("--split", action="store_true",
                    help="only goodput of raw/codec senders against raw/codec receivers, every "
                         "size (which end the codec's cost sits on)")
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave glibc's allocator thresholds at their defaults in both processes "
                         "(nodes set them at start: digenrl/transport/allocator.py)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    malloc_tuned = False if args.default_malloc else allocator.tune()
    scale = 0.1 if args.quick else 1.0
    load_before = os.getloadavg()
    out: dict[str, Any] = {"python": sys.version.split()[0], "pyzmq": zmq.__version__,
                           "libzmq": zmq.zmq_version(), "cpus": os.cpu_count(),
                           "repeats": args.repeats, "malloc_tuned": malloc_tuned}
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_peer, args=(child, args.default_malloc),
                                           daemon=True)
    proc.start()
    if args.split or args.sweep:  # one study alone, then the peer is done
        key, study = ("split", split_ends) if args.split else ("copy_sweep", copy_sweep)
        try:
            out[key] = study(parent, args.repeats, scale)
        finally:
            parent.send(None)
            proc.join(timeout=30)
        out["load_avg_1m"] = [load_before[0], os.getloadavg()[0]]
        if args.json:
            print(json.dumps(out, indent=1, sort_keys=True))
        else:
            _print_study(out, key, args.repeats)
        return
    try:
        rates: dict[tuple[str, str], list[float]] = {}
        cpus: dict[tuple[str, str], list[float]] = {}
        ratios: dict[str, list[float]] = {k: [] for k in SIZES}
        cpu_ratios: dict[str, list[float]] = {k: [] for k in SIZES}
        best_ratios: dict[str, list[float]] = {k: [] for k in SIZES}
        null_ratios: dict[str, list[float]] = {k: [] for k in SIZES}
        waits: dict[tuple[str, str], list[float]] = {}
        threads: dict[tuple[str, str, str], list[float]] = {}  # (size, mode, end_kind)
        for nbytes, count in SIZES.values():  # untimed warm-up (module docstring)
            for m in ("codec", "raw", "raw_copy"):
                goodput(parent, m, nbytes, max(8, int(count * scale) // 4))
        for rep in range(args.repeats):
            order = ("codec", "raw", "raw_copy") if rep % 2 == 0 else ("raw_copy", "raw", "codec")
            for key, (nbytes, count) in SIZES.items():
                count = max(8, int(count * scale))
                got = {}
                for m in order:
                    got[m] = goodput(parent, m, nbytes, count)
                    for end, by_kind in THREADS.items():
                        for kind, us in by_kind.items():
                            threads.setdefault((key, m, f"{end}_{kind}"), []).append(us)
                    if m == "codec":
                        for end, w in WAITS.items():
                            waits.setdefault((key, end), []).append(w)
                for m, (rate, cpu) in got.items():
                    rates.setdefault((key, m), []).append(rate / 1e6)
                    cpus.setdefault((key, m), []).append(cpu)
                ratios[key].append(got["codec"][0] / got["raw"][0])
                best_ratios[key].append(got["codec"][0] / max(got["raw"][0], got["raw_copy"][0]))
                cpu_ratios[key].append(got["raw"][1] / got["codec"][1])
                null_ratios[key].append(got["raw_copy"][0] / got["raw"][0])
        for key in SIZES:
            out[f"goodput_ratio_{key}"] = statistics.median(ratios[key])
            out[f"goodput_ratio_reps_{key}"] = [round(r, 3) for r in ratios[key]]
            if SIZES[key][0] >= COPY_BELOW:  # raw and raw_copy the same configuration here
                out[f"goodput_null_ratio_{key}"] = statistics.median(null_ratios[key])
            # against the better of raw zero-copy and raw with the codec's copy threshold
            out[f"goodput_ratio_best_raw_{key}"] = statistics.median(best_ratios[key])
            out[f"goodput_codec_MBps_{key}"] = statistics.median(rates[key, "codec"])
            out[f"goodput_raw_MBps_{key}"] = statistics.median(rates[key, "raw"])
            # raw CPU per message over codec CPU per message: what the goodput ratio tends
            # to when CPU is the bottleneck and not the host's other tenants
            out[f"cpu_ratio_{key}"] = statistics.median(cpu_ratios[key])
            out[f"goodput_raw_copy_MBps_{key}"] = statistics.median(rates[key, "raw_copy"])
            for m in ("codec", "raw", "raw_copy"):
                out[f"cpu_us_per_msg_{m}_{key}"] = statistics.median(cpus[key, m])
            for end in ("recv", "send"):
                out[f"codec_{end}_waits_per_msg_{key}"] = statistics.median(waits[key, end])
            out[f"thread_cpu_us_{key}"] = {
                m: {ek: round(statistics.median(v), 1) for (k, mm, ek), v in sorted(threads.items())
                    if k == key and mm == m} for m in ("codec", "raw")}

        pings = max(200, int(2000 * scale))
        modes = ("codec", "floor", "raw")
        lat: dict[str, list[float]] = {m: [] for m in modes}
        rtt_cpu: dict[str, list[float]] = {m: [] for m in modes}
        rtt_ratios, rtt_cpu_ratios, floor_ratios, over_floor = [], [], [], []
        for rep in range(args.repeats):
            got_rtt = {m: latency(parent, m, pings) for m in (modes if rep % 2 == 0 else modes[::-1])}
            for m, (v, cpu) in got_rtt.items():
                lat[m] += v
                rtt_cpu[m].append(cpu)
            med = {m: statistics.median(v) for m, (v, _) in got_rtt.items()}
            rtt_ratios.append(med["codec"] / med["raw"])
            floor_ratios.append(med["floor"] / med["raw"])
            over_floor.append(med["codec"] / med["floor"])
            rtt_cpu_ratios.append(got_rtt["codec"][1] / got_rtt["raw"][1])
        out["heartbeat_rtt_ratio"] = statistics.median(rtt_ratios)
        out["heartbeat_rtt_floor_ratio"] = statistics.median(floor_ratios)  # floor over raw
        out["heartbeat_rtt_codec_over_floor"] = statistics.median(over_floor)
        out["heartbeat_cpu_ratio"] = statistics.median(rtt_cpu_ratios)  # codec over raw
        for m in modes:
            out[f"heartbeat_cpu_us_{m}"] = statistics.median(rtt_cpu[m])
        for m in modes:
            out[f"heartbeat_rtt_{m}_us"] = statistics.median(lat[m])
            out[f"heartbeat_rtt_{m}_p99_us"] = _p99(lat[m])

        bulk = latency_under_bulk(parent, max(100, int(500 * scale)), args.repeats)
        out["heartbeat_rtt_bulk_ratio"] = bulk["ratio"]
        out["heartbeat_rtt_idle_us"] = bulk["idle_us"]
        out["heartbeat_rtt_bulk_us"] = bulk["bulk_us"]
        out["heartbeat_rtt_bulk_p99_us"] = bulk["bulk_p99_us"]
    finally:
        parent.send(None)
        proc.join(timeout=30)

    out["codec_us_heartbeat"] = codec_us(_heartbeat(1), 2000)
    out["codec_us_chunk_64k"] = codec_us(_chunk(64 << 10), 2000)
    out["codec_us_chunk_16m"] = codec_us(_chunk(16 << 20), 200)
    staged = staged_chunk_goodput("cpu", 1 << 20, max(20, int(200 * scale)), args.repeats)
    out["staged_goodput_ratio_1m_cpu"] = staged["ratio"]
    out["staged_MBps_1m_cpu"] = staged["staged_MBps"]
    out["raw_pinned_MBps_1m_cpu"] = staged["raw_MBps"]
    out["load_avg_1m"] = [load_before[0], os.getloadavg()[0]]

    if args.json:
        print(json.dumps(out, indent=1, sort_keys=True))
        return
    print(f"# transport bench  python {out['python']}  pyzmq {out['pyzmq']}  libzmq "
          f"{out['libzmq']}  cpus {out['cpus']}  load {out['load_avg_1m'][0]:.1f} -> "
          f"{out['load_avg_1m'][1]:.1f}  medians of {args.repeats} interleaved repeats")
    print("\n| tensor size | codec MB/s | raw MB/s | raw_copy MB/s | codec/raw | codec/best raw "
          "| CPU us/msg codec | raw | raw/codec |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in SIZES:
        print(f"| {key} | {out[f'goodput_codec_MBps_{key}']:,.0f} | "
              f"{out[f'goodput_raw_MBps_{key}']:,.0f} | {out[f'goodput_raw_copy_MBps_{key}']:,.0f} | "
              f"{out[f'goodput_ratio_{key}']:.2f} | {out[f'goodput_ratio_best_raw_{key}']:.2f} | "
              f"{out[f'cpu_us_per_msg_codec_{key}']:.0f} | {out[f'cpu_us_per_msg_raw_{key}']:.0f} | "
              f"{out[f'cpu_ratio_{key}']:.2f} |")
    for key in SIZES:
        if f"goodput_null_ratio_{key}" in out:
            print(f"{key}: raw_copy/raw {out[f'goodput_null_ratio_{key}']:.2f} (the same "
                  f"configuration: this run's noise); codec/raw per repeat "
                  f"{', '.join(f'{r:.2f}' for r in out[f'goodput_ratio_reps_{key}'])}")
    kinds = ("recv_main", "recv_io", "send_main", "send_io", "send_gc")
    print("\n| CPU us a message, by thread | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for key in SIZES:
        for m in ("codec", "raw"):
            row = out[f"thread_cpu_us_{key}"][m]
            print(f"| {key} {m} | " + " | ".join(f"{row.get(k, 0):.0f}" for k in kinds) + " |")
    print("\n| Heartbeat round trip | median us | p99 us |")
    print("|---|---|---|")
    for m in ("codec", "floor", "raw"):
        print(f"| {m} | {out[f'heartbeat_rtt_{m}_us']:.0f} | {out[f'heartbeat_rtt_{m}_p99_us']:.0f} |")
    print(f"| codec/raw | {out['heartbeat_rtt_ratio']:.2f} | |")
    print(f"| floor/raw (asyncio itself) | {out['heartbeat_rtt_floor_ratio']:.2f} | |")
    print(f"| codec/floor | {out['heartbeat_rtt_codec_over_floor']:.2f} | |")
    print(f"| CPU us per round trip, codec / raw | {out['heartbeat_cpu_us_codec']:.0f} / "
          f"{out['heartbeat_cpu_us_raw']:.0f} (ratio {out['heartbeat_cpu_ratio']:.2f}) | |")
    print(f"| codec, idle (bulk test) | {out['heartbeat_rtt_idle_us']:.0f} | |")
    print(f"| codec, under 16 MiB bulk | {out['heartbeat_rtt_bulk_us']:.0f} | "
          f"{out['heartbeat_rtt_bulk_p99_us']:.0f} |")
    print(f"| bulk/idle | {out['heartbeat_rtt_bulk_ratio']:.2f} | |")
    print("\n| codec only (encode+decode) | CPU us/message |")
    print("|---|---|")
    print(f"| Heartbeat | {out['codec_us_heartbeat']:.1f} |")
    print(f"| Chunk, 2 x 64 KiB | {out['codec_us_chunk_64k']:.1f} |")
    print(f"| Chunk, 2 x 16 MiB | {out['codec_us_chunk_16m']:.1f} |")
    print(f"\nstaged chunk path (cpu, 2 x 1 MiB): {out['staged_MBps_1m_cpu']:,.0f} MB/s, raw "
          f"{out['raw_pinned_MBps_1m_cpu']:,.0f} MB/s, ratio {out['staged_goodput_ratio_1m_cpu']:.2f}")


if __name__ == "__main__":
    main()
