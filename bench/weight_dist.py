"""Weight distribution methods, one process per node, on emulated NICs (``bench/weights.py --fanout``).

Every method moves one synthetic weight set of ``--mib`` MiB (4 MiB float32 tensors, split
and checksummed per part exactly as trainer rank 0 publishes) from a source to N receivers,
each a real process, and every receiver verifies every part's checksum and the set's:

* ``router``: the runtime with ``runtime.weights_fanout = 0``: one ROUTER serves every
  receiver (:func:`~digenrl.transport.weights.serve_weights`), receivers fetch with
  :meth:`WeightsRelay.fetch <digenrl.actors.weightsfetch.WeightsRelay.fetch>`.
* ``relay``: the runtime's relay (``weights_fanout = 1``): the same code, each receiver also
  serving what it has verified to the next one as the parts land (a chain).
* ``broadcast``: torch.distributed (gloo here; NCCL on GPUs) over a group of the source and
  the receivers, ``dist.broadcast`` per part, as verl and its descendants do. Forming the
  group (``init_process_group``, which a membership change has to repeat) is timed apart.
* ``shard``: W = 4 sources (FSDP ranks) each serve their own parts (every W-th) to every
  receiver, with no gather on rank 0.

With root and iproute2, every process lives in its own network namespace behind a veth whose
both directions ``tc tbf`` limits to ``--link-mbit`` (one NIC per node: upload and download),
on one bridge; a source's egress is then read from its veth's counters, whatever the method.
Without them, everything runs on loopback with no link limit (CPU-bound on this host), and
the zmq methods' egress comes from the sockets' own counters (gloo's is not measurable there).
Times: from the orchestrator's start signal to the last receiver's verified set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for the namespaces helper the tests share: tests/netns.py

from tests import netns  # noqa: E402

METHODS = ("router", "relay", "broadcast", "shard")
SHARD_SOURCES = 4


# ----------------------------------------------------------------------------- the weight set

def weight_set(mib: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {f"w{i:04d}": torch.randn(1 << 20, generator=g) for i in range(max(1, mib // 4))}


# ----------------------------------------------------------------------------- namespaces

def netns_unavailable() -> str:
    return netns.netns_unavailable("tc")


@dataclass
class Node:
    ns: str | None  # None: loopback, no namespace
    addr: str
    port: str = ""  # the bridge-side veth: its rx_bytes are this node's egress

    def cmd(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns] if self.ns else []


class Fabric(netns.Fabric):
    """``count`` nodes, each in a namespace with one rate-limited veth on a shared bridge."""

    def __init__(self, count: int, link_mbit: float | None) -> None:
        super().__init__(count, name="dgw", net=214, first=2, link_mbit=link_mbit)
        self.nodes = [Node(ns=h.ns, addr=h.addr, port=h.port) for h in self.hosts]


# ----------------------------------------------------------------------------- workers

class _Control:
    """A WeightsRelay reports WeightsHeld to the coordinator; here nobody listens."""

    async def send(self, msg: Any, *, to: bytes | None = None) -> None:
        return None


class _Actor:
    role = "rollout"

    def __init__(self) -> None:
        import structlog

        from digenrl.telemetry.trace import SpanRecorder

        self.recorder = SpanRecorder("bench", "rollout")
        self.log = structlog.get_logger()

    def working(self, name: str, **args: Any) -> Any:
        return self.recorder.span(name, **args)

    def unexpected(self, socket: str, msg: object, why: str = "") -> None:
        raise RuntimeError(f"unexpected {type(msg).__name__} on {socket}: {why}")


def _say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


async def _line() -> dict[str, Any]:
    text = await asyncio.to_thread(sys.stdin.readline)
    if not text:
        raise SystemExit(0)  # the orchestrator went away
    return json.loads(text)


async def worker(args: Any) -> None:
    import torch
    import zmq.asyncio

    from digenrl.transport.options import SocketOptions
    from digenrl.transport.sockets import Dealer, Router
    from digenrl.transport.weights import WeightStore, publish_parts, serve_weights

    torch.set_num_threads(1)
    opts = SocketOptions(max_frame_bytes=64 << 20, hwm=16)
    ctx = zmq.asyncio.Context()
    host = f"tcp://{args.addr}:*"
    if args.method == "broadcast":
        await _broadcast_worker(args)
        return
    if args.worker == "source":
        sd = weight_set(args.mib)
        parts, whole = publish_parts(sd)
        mine = [(i, p) for i, p in enumerate(parts) if args.method != "shard" or i % args.of == args.index]
        store = WeightStore()
        if args.method == "shard":  # this rank serves only its own parts; the others are never asked
            from digenrl.transport.weights import WeightAssembly
            asm = WeightAssembly(1, len(parts), whole)
            for i, (tensors, checksum) in mine:
                asm.parts[i], asm.sums[i] = tensors, checksum
            store.begin(asm)
        else:
            store.publish(1, parts, whole)
        router = Router(ctx, options=opts)
        endpoint = router.bind(host)
        serving = asyncio.ensure_future(serve_weights(router, store))
        _say(endpoint=endpoint, nparts=len(parts), checksum=whole, nbytes=sum(t.numel() * 4 for t in sd.values()))
        while (await _line()).get("do") != "quit":
            _say(bytes_sent=router.statistics().bytes_sent)
        serving.cancel()
        return
    # receivers
    from digenrl.actors.weightsfetch import WeightsRelay
    from digenrl.config import load_config
    from digenrl.transport.protocol import VersionAnnounce, WeightsRoute

    relay = Router(ctx, options=opts)
    relay_ep = relay.bind(host)
    _say(relay=relay_ep)
    go = await _line()
    ann = VersionAnnounce(version=1, step=1, nparts=go["nparts"], nbytes=go["nbytes"], checksum=go["checksum"],
                          segments=[], segment_since=[], segment_parts=[], segment_sums=[])
    actor = _Actor()
    if args.method == "shard":
        held = await _fetch_shards(ctx, opts, go["sources"], ann)
        _say(held=time.time(), nbytes=sum(t.numel() * t.element_size() for t in held.values()))
    else:
        def connect(ep: str) -> Dealer:
            d = Dealer(ctx, options=opts)
            d.connect(ep)
            return d

        fetcher = WeightsRelay(node_id=f"rollout-{args.index}", cfg=load_config(None, []),
                               control=_Control(), weights=connect(go["sources"][0]),
                               store=WeightStore(), relay=relay, connect=connect)
        serving = asyncio.ensure_future(fetcher.serve_loop(actor)())
        if go.get("upstream"):
            fetcher.on_route(WeightsRoute(upstream=go["upstream"], upstream_node="previous"))
        held = await fetcher.fetch(actor, ann, "weight_prefetch")
        _say(held=time.time(), nbytes=sum(t.numel() * t.element_size() for t in held.values()),
             fallbacks=fetcher.fallbacks)
    while (await _line()).get("do") != "quit":  # keep serving downstream until told
        _say(bytes_sent=relay.statistics().bytes_sent)


async def _fetch_shards(ctx: Any, opts: Any, sources: list[str], ann: Any) -> dict[str, Any]:
    """Part i from source i mod W, two requests in flight per source; every part verified."""
    from digenrl.transport.protocol import WeightsPart, WeightsRequest
    from digenrl.transport.sockets import Dealer
    from digenrl.transport.weights import WeightAssembly

    asm = WeightAssembly(ann.version, ann.nparts, ann.checksum)
    W = len(sources)

    async def from_source(k: int, ep: str) -> None:
        d = Dealer(ctx, options=opts)
        d.connect(ep)
        todo = list(range(k, ann.nparts, W))
        asked = 0
        for _ in range(min(2, len(todo))):
            await d.send(WeightsRequest(version=ann.version, part=todo[asked]))
            asked += 1
        for _ in range(len(todo)):
            _, msg = await d.recv()
            assert isinstance(msg, WeightsPart), msg
            await asyncio.to_thread(asm.add, msg.part, dict(msg.tensors), msg.checksum)
            if asked < len(todo):
                await d.send(WeightsRequest(version=ann.version, part=todo[asked]))
                asked += 1
        d.close()

    await asyncio.gather(*(from_source(k, ep) for k, ep in enumerate(sources)))
    return await asyncio.to_thread(asm.state_dict)


async def _broadcast_worker(args: Any) -> None:
    """Rank 0 (the source) broadcasts every part's bytes to the group; receivers verify each
    part against the checksum the source published (handed over by the orchestrator)."""
    import torch
    import torch.distributed as dist

    from digenrl.transport.weights import WeightAssembly, publish_parts

    rank = 0 if args.worker == "source" else args.index + 1
    parts: list[Any] = []
    ready: dict[str, Any] = {}
    if rank == 0:
        parts, whole = publish_parts(weight_set(args.mib))  # one 4 MiB tensor per part
        ready = {"sums": [c for _, c in parts], "checksum": whole}
    t0 = time.perf_counter()
    await asyncio.to_thread(dist.init_process_group, "gloo", init_method=args.init, rank=rank,
                            world_size=args.world)
    _say(ready=True, form_s=time.perf_counter() - t0, **ready)
    go = await _line()
    n = max(1, args.mib // 4)
    asm = WeightAssembly(1, n, go.get("checksum", ""))
    for i in range(n):
        name = f"w{i:04d}"
        flat = parts[i][0][name] if rank == 0 else torch.empty(1 << 20)
        await asyncio.to_thread(dist.broadcast, flat, 0)
        if rank:
            await asyncio.to_thread(asm.add, i, {name: flat}, go["sums"][i])  # raises on a mismatch
    if rank:
        held = asm.state_dict()
        _say(held=time.time(), nbytes=sum(t.numel() * t.element_size() for t in held.values()))
    else:
        _say(sent=time.time())
    await _line()  # quit
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- orchestration

class Proc:
    def __init__(self, node: Node, argv: list[str]) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   GLOO_SOCKET_IFNAME="eth0" if node.ns else "lo")
        self.node = node
        self.p = subprocess.Popen([*node.cmd(), sys.executable, str(ROOT / "bench" / "weights.py"),
                                   "--addr", node.addr, *argv], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=env, text=True)

    def read(self, timeout: float = 600.0) -> dict[str, Any]:
        while True:
            line = self.p.stdout.readline() if self.p.stdout else ""
            if not line:
                raise RuntimeError(f"worker on {self.node.addr} exited with {self.p.wait(timeout)}")
            if line.startswith("{"):
                return json.loads(line)
            # a log line of the runtime's own (structlog prints to stdout): pass it on
            print(f"# {self.node.addr}: {line.rstrip()}", file=sys.stderr, flush=True)

    def send(self, **kw: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(kw) + "\n")
        self.p.stdin.flush()

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.send(do="quit")
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def run_once(method: str, n: int, mib: int, nodes: list[Node], fabric: Fabric | None) -> dict[str, Any]:
    """One distribution of the set to ``n`` receivers; seconds, source egress bytes, set bytes."""
    sources = SHARD_SOURCES if method == "shard" else 1
    src_nodes, rcv_nodes = nodes[:sources], nodes[sources:sources + n]
    common = ["--method", method, "--mib", str(mib)]
    procs: list[Proc] = []
    try:
        if method == "broadcast":
            init = f"tcp://{src_nodes[0].addr}:{29500 + os.getpid() % 1000}"
            extra = ["--init", init, "--world", str(n + 1)]
            procs.append(Proc(src_nodes[0], ["--worker", "source", *common, *extra]))
            procs += [Proc(node, ["--worker", "receiver", "--index", str(i), *common, *extra])
                      for i, node in enumerate(rcv_nodes)]
            ready = [p.read() for p in procs]
            before = fabric.egress(src_nodes[0].port) if fabric else 0
            t0 = time.time()
            for p in procs[1:]:
                p.send(do="go", sums=ready[0]["sums"], checksum=ready[0]["checksum"])
            procs[0].send(do="go")
            held = [p.read() for p in procs[1:]]
            procs[0].read()
            egress = fabric.egress(src_nodes[0].port) - before if fabric else None
            return {"t_s": max(h["held"] for h in held) - t0, "egress": egress,
                    "set_bytes": held[0]["nbytes"], "form_s": max(r["form_s"] for r in ready)}
        srcs = [Proc(node, ["--worker", "source", "--index", str(k), "--of", str(sources), *common])
                for k, node in enumerate(src_nodes)]
        procs += srcs
        info = [s.read() for s in srcs]
        rcvs = [Proc(node, ["--worker", "receiver", "--index", str(i), *common]) for i, node in enumerate(rcv_nodes)]
        procs += rcvs
        relays = [r.read()["relay"] for r in rcvs]
        before = fabric.egress(src_nodes[0].port) if fabric else 0
        zmq_before = _ask_bytes(srcs[0]) if not fabric else 0
        t0 = time.time()
        for i, r in enumerate(rcvs):
            r.send(sources=[x["endpoint"] for x in info], nparts=info[0]["nparts"], nbytes=info[0]["nbytes"],
                   checksum=info[0]["checksum"], upstream=relays[i - 1] if method == "relay" and i else "")
        held = [r.read() for r in rcvs]
        t = max(h["held"] for h in held) - t0
        egress = (fabric.egress(src_nodes[0].port) - before) if fabric else _ask_bytes(srcs[0]) - zmq_before
        return {"t_s": t, "egress": egress, "set_bytes": held[0]["nbytes"],
                "fallbacks": sum(h.get("fallbacks", 0) for h in held)}
    finally:
        for p in procs:
            p.close()


def _ask_bytes(src: Proc) -> int:
    src.send(do="stats")
    return int(src.read()["bytes_sent"])
