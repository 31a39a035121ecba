"""Transport benchmark: the project's codec + sockets against raw pyzmq, in one run.

    .venv/bin/python bench/transport.py [--repeats 2] [--quick]

1. Goodput of per-timestep ``Chunk`` messages (x_t and x_next of 64 KiB, 1 MiB, 16 MiB
   each, float32) over PUSH/PULL on tcp loopback, sender in a spawned process:
   *codec* = ``Push.send`` (encode) -> ``Pull.recv`` (decode to tensors) under asyncio;
   *raw* = the same frames sent with ``send_multipart(copy=False)`` and received with
   ``recv_multipart(copy=False)`` by plain blocking pyzmq.
2. Round-trip latency of a ``Heartbeat`` through ``Dealer``/``Router`` (echo server in a
   spawned process) against a raw msgpack DEALER/ROUTER ping-pong.
3. The codec's own encode+decode time per message, no socket.

Goodput counts tensor payload bytes only, from the first message received to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
import timeit

import msgpack
import torch
import uvloop
import zmq
import zmq.asyncio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from digenrl.transport.protocol import Chunk, Heartbeat, decode, encode
from digenrl.transport.sockets import Dealer, Pull, Push, Router, SocketOptions

OPTS = SocketOptions(max_frame_bytes=64 << 20, hwm=8)  # hwm 8: at most ~256 MiB queued at 16 MiB
WARMUP = 3


def _chunk(nbytes: int, i: int = 0) -> Chunk:
    n = nbytes // 4
    return Chunk(task_id=i, step=0, fragment=0, t_index=i % 10, sigma=0.9, sigma_next=0.8,
                 policy_version=1, x_t=torch.ones(1, n), x_next=torch.full((1, n), 2.0),
                 log_prob=torch.zeros(1))


def _heartbeat(seq: int) -> Heartbeat:
    return Heartbeat(node_id="rollout-0", incarnation=1, policy_version=3, state="running",
                     seq=seq, gpu={"free_mb": 40000.0, "util": 0.93},
                     stats={"chunks": 120, "bytes": 1 << 30})


def _run(coro):  # type: ignore[no-untyped-def]
    """The loop the actors use (STYLE.md: uvloop, made once at the entry point)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


# ------------------------------------------------------------------ processes (spawned)


def _sender(mode: str, endpoint: str, nbytes: int, count: int, done: mp.Event) -> None:
    torch.set_num_threads(1)
    if mode == "raw":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, OPTS.hwm)
        sock.connect(endpoint)
        frames = encode(_chunk(nbytes))
        for _ in range(count):
            sock.send_multipart(frames, copy=False)
        done.wait()
        sock.close(linger=0)
        ctx.term()
        return

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        with Push(ctx, options=OPTS) as push:
            push.connect(endpoint)
            base = _chunk(nbytes)
            for i in range(count):
                await push.send(Chunk(**{**base.__dict__, "task_id": i}))
            while not done.is_set():  # keep the socket open until everything is received
                await asyncio.sleep(0.01)
        ctx.term()

    _run(run())


def _echo(mode: str, endpoint: str, ready: mp.Event) -> None:
    if mode == "raw":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(endpoint)
        ready.set()
        while True:
            peer, body = sock.recv_multipart()
            msg = msgpack.unpackb(body)
            if msg.get("stop"):
                break
            sock.send_multipart([peer, msgpack.packb(msg)])
        sock.close(linger=0)
        ctx.term()
        return

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        with Router(ctx, options=OPTS) as router:
            router.bind(endpoint)
            ready.set()
            while True:
                peer, msg = await router.recv()
                if isinstance(msg, Heartbeat) and msg.state == "stopping":
                    break
                await router.send(msg, to=peer)
        ctx.term()

    _run(run())


# ------------------------------------------------------------------ measurements


def _free_tcp() -> str:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.bind("tcp://127.0.0.1:*")
    ep = s.getsockopt_string(zmq.LAST_ENDPOINT)
    s.close(linger=0)
    ctx.term()
    return ep


def goodput(mode: str, nbytes: int, count: int) -> float:
    """Payload bytes per second received (x_t + x_next + log_prob)."""
    spawn = mp.get_context("spawn")
    done = spawn.Event()
    total = count + WARMUP

    def start(endpoint: str) -> mp.Process:
        proc = spawn.Process(target=_sender, args=(mode, endpoint, nbytes, total, done))
        proc.start()
        return proc

    if mode == "raw":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, OPTS.hwm)
        sock.bind("tcp://127.0.0.1:*")
        proc = start(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        for i in range(total):
            sock.recv_multipart(copy=False)
            if i == WARMUP - 1:
                t0 = time.perf_counter()
        elapsed = time.perf_counter() - t0
        sock.close(linger=0)
        ctx.term()
    else:
        async def run() -> tuple[float, mp.Process]:
            ctx = zmq.asyncio.Context()
            with Pull(ctx, options=OPTS) as pull:
                proc = start(pull.bind("tcp://127.0.0.1:*"))
                for i in range(total):
                    _, msg = await pull.recv()
                    assert isinstance(msg, Chunk) and msg.x_next.numel() == nbytes // 4
                    if i == WARMUP - 1:
                        t0 = time.perf_counter()
                elapsed = time.perf_counter() - t0
            ctx.term()
            return elapsed, proc

        elapsed, proc = _run(run())
    done.set()
    proc.join(timeout=30)
    return count * (2 * nbytes + 4) / elapsed


def latency(mode: str, pings: int) -> list[float]:
    """Round-trip times in microseconds."""
    spawn = mp.get_context("spawn")
    ready = spawn.Event()
    endpoint = _free_tcp()
    proc = spawn.Process(target=_echo, args=(mode, endpoint, ready))
    proc.start()
    ready.wait(60)
    rtts: list[float] = []
    if mode == "raw":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        body = {k: v for k, v in _heartbeat(0).__dict__.items()}
        for i in range(pings + 50):
            t = time.perf_counter()
            sock.send(msgpack.packb({**body, "seq": i}))
            msgpack.unpackb(sock.recv())
            if i >= 50:
                rtts.append((time.perf_counter() - t) * 1e6)
        sock.send(msgpack.packb({"stop": True}))
        sock.close(linger=100)
        ctx.term()
    else:
        async def run() -> None:
            ctx = zmq.asyncio.Context()
            with Dealer(ctx, options=OPTS) as dealer:
                dealer.connect(endpoint)
                for i in range(pings + 50):
                    t = time.perf_counter()
                    await dealer.send(_heartbeat(i))
                    await dealer.recv()
                    if i >= 50:
                        rtts.append((time.perf_counter() - t) * 1e6)
                stop = Heartbeat(**{**_heartbeat(0).__dict__, "state": "stopping"})
                await dealer.send(stop)
                await asyncio.sleep(0.1)  # let the stop leave before linger-0 close
            ctx.term()

        _run(run())
    proc.join(timeout=30)
    return rtts


def codec_us(msg: object, number: int) -> float:
    """encode + decode, microseconds per message."""
    frames_limit = 64 << 20
    t = timeit.repeat(lambda: decode(encode(msg), max_frame_bytes=frames_limit),  # type: ignore[arg-type]
                      number=number, repeat=5)
    return min(t) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs per cell; the best is kept")
    ap.add_argument("--quick", action="store_true", help="fewer messages (smoke test)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    scale = 0.1 if args.quick else 1.0
    sizes = [(64 << 10, 3000), (1 << 20, 300), (16 << 20, 24)]
    print(f"# transport bench  python {sys.version.split()[0]}  pyzmq {zmq.__version__}  "
          f"libzmq {zmq.zmq_version()}  cpus {os.cpu_count()}")
    print("\n| tensor size | messages | codec MB/s | raw MB/s | codec/raw |")
    print("|---|---|---|---|---|")
    for nbytes, count in sizes:
        count = max(8, int(count * scale))
        best = {m: max(goodput(m, nbytes, count) for _ in range(args.repeats))
                for m in ("codec", "raw")}
        print(f"| {nbytes >> 10} KiB | {count} | {best['codec'] / 1e6:,.0f} | "
              f"{best['raw'] / 1e6:,.0f} | {best['codec'] / best['raw']:.2f} |", flush=True)

    pings = max(200, int(2000 * scale))
    lat = {m: latency(m, pings) for m in ("codec", "raw")}
    print("\n| Heartbeat round trip | median us | p99 us |")
    print("|---|---|---|")
    for m in ("codec", "raw"):
        q = statistics.quantiles(lat[m], n=100)
        print(f"| {m} | {statistics.median(lat[m]):.0f} | {q[98]:.0f} |")
    print(f"| codec/raw (median) | {statistics.median(lat['codec']) / statistics.median(lat['raw']):.2f} | |")

    print("\n| codec only (encode+decode) | us/message |")
    print("|---|---|")
    print(f"| Heartbeat | {codec_us(_heartbeat(1), 2000):.1f} |")
    print(f"| Chunk, 2 x 64 KiB | {codec_us(_chunk(64 << 10), 2000):.1f} |")
    print(f"| Chunk, 2 x 16 MiB | {codec_us(_chunk(16 << 20), 200):.1f} |")


if __name__ == "__main__":
    main()
