"""Weight sets: how they are distributed to N rollouts, and what checksums cost per byte.

    .venv/bin/python bench/weights.py --fanout 1,4,16 --mib 256 [--json] [--repeats 2]
        [--methods router,relay,broadcast,shard] [--link-mbit 400]
    .venv/bin/python bench/weights.py --checksums [--mib 256] [--repeats 5]

``--fanout``: one weight set of ``--mib`` MiB from a source to 1, 4, 16 receivers, every
node a process, by each method of ``bench/weight_dist.py`` (the runtime's ROUTER and relay,
a torch.distributed broadcast, FSDP ranks serving their own shards), interleaved, median of
``--repeats``. Per method: ``t_s`` (start to the last receiver holding the verified set),
``t_over_t1`` (t at each fan-out over t at 1) and ``rank0_egress_over_set`` (bytes the
source, or shard rank 0, sent over the set's bytes). Each node has its own network
namespace and a ``--link-mbit`` NIC (tc) when run as root; see weight_dist.py for the rest.

``--checksums``: every optimizer step, trainer rank 0 checksums the new weight set once
(``publish_parts``) and every rollout checksums it once more as the parts land
(``WeightAssembly.add``). This measures, in one run and interleaved, ``tensor_checksum``
(CRC-32, what the runtime uses) and the blake2b digest it replaced (the same names, dtypes,
shapes and bytes), on the tiny default model's full weight set and on a synthetic set of
``--mib`` MiB in 4 MiB parts. It also times ``publish_parts`` + ``WeightAssembly`` end to end
for the tiny set.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time

import msgpack
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from digenrl.transport.protocol import tensor_checksum
from digenrl.transport.weights import WeightAssembly, publish_parts, split_parts


def blake2b_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """The previous part checksum (protocol version 1), for comparison only."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        meta = msgpack.packb([name, str(t.dtype), list(t.shape)])
        h.update(len(meta).to_bytes(4, "little"))
        h.update(meta)
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def timed(fn, parts: list[dict[str, torch.Tensor]]) -> float:
    t0 = time.perf_counter()
    for p in parts:
        fn(p)
    return time.perf_counter() - t0


def checksums(args: argparse.Namespace) -> int:
    from digenrl.config import load_config
    from digenrl.rl.policy import build_policy  # here: --fanout's worker processes need no model

    torch.set_num_threads(1)
    tiny = build_policy(load_config(None, ["model.lora_rank=0", "sampler.base_tail=0"])).model.sync_state_dict()
    g = torch.Generator().manual_seed(0)
    big = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(args.mib // 4)}  # 4 MiB each
    sets = {"tiny model (full weights)": tiny, f"synthetic {args.mib} MiB": big}
    print(f"{'weight set':28s} {'MiB':>7s} {'crc32 ms':>9s} {'blake2b ms':>11s} {'crc32 GB/s':>11s} "
          f"{'blake2b GB/s':>13s} {'ratio':>6s}")
    for name, sd in sets.items():
        parts = split_parts(sd)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        crc, b2 = [], []
        for _ in range(args.repeats):  # interleaved: the host's speed drifts
            crc.append(timed(tensor_checksum, parts))
            b2.append(timed(blake2b_checksum, parts))
        c, b = statistics.median(crc), statistics.median(b2)
        print(f"{name:28s} {nbytes / 2**20:7.1f} {c * 1e3:9.2f} {b * 1e3:11.2f} {nbytes / c / 1e9:11.2f} "
              f"{nbytes / b / 1e9:13.2f} {b / c:6.1f}x")
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        served, whole = publish_parts(tiny)
        asm = WeightAssembly(1, len(served), whole)
        for i, (tensors, checksum) in enumerate(served):
            asm.add(i, tensors, checksum)
        asm.state_dict()
        times.append(time.perf_counter() - t0)
    print(f"tiny model: publish_parts + WeightAssembly (both sides, one version): "
          f"{statistics.median(times) * 1e3:.2f} ms")
    return 0


def fanout(args: argparse.Namespace) -> int:
    import json

    import weight_dist as wd

    fanouts = sorted({int(x) for x in args.fanout.split(",")} | {1})
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in wd.METHODS:
            raise SystemExit(f"bench/weights.py: --methods {m!r}: expected some of {', '.join(wd.METHODS)}")
    need = wd.SHARD_SOURCES + max(fanouts)
    why = wd.netns_unavailable()
    fabric = None if why else wd.Fabric(need, args.link_mbit)
    nodes = fabric.nodes if fabric else [wd.Node(ns=None, addr="127.0.0.1") for _ in range(need)]
    runs: dict[str, dict[int, list[dict]]] = {m: {n: [] for n in fanouts} for m in methods}
    try:
        for rep in range(args.repeats):
            for n in fanouts:  # interleaved: every method at a fan-out, then the next
                for m in methods:
                    r = wd.run_once(m, n, args.mib, nodes, fabric)
                    runs[m][n].append(r)
                    print(f"# repeat {rep} {m:9s} n={n:2d}: {r['t_s']:7.2f} s  egress "
                          f"{(r['egress'] or 0) / r['set_bytes']:5.2f} sets", file=sys.stderr, flush=True)
    finally:
        if fabric is not None:
            fabric.close()
    out: dict = {"mib": args.mib, "fanouts": fanouts, "repeats": args.repeats,
                 "link": f"{args.link_mbit} Mbit/s per node, both directions (tc tbf, netns)" if fabric
                 else f"loopback, no link limit ({why}): CPU-bound on this host",
                 "load_average": os.getloadavg(), "default_method": "relay", "methods": {}}
    for m in methods:
        t = {n: statistics.median(r["t_s"] for r in runs[m][n]) for n in fanouts}
        eg = {n: (statistics.median(r["egress"] for r in runs[m][n]) / runs[m][n][0]["set_bytes"]
                  if runs[m][n][0]["egress"] is not None else None) for n in fanouts}
        row: dict = {"t_s": t, "t_over_t1": {n: t[n] / t[1] for n in fanouts},
                     "rank0_egress_over_set": eg[max(fanouts)], "egress_over_set": eg}
        if m == "broadcast":
            row["group_form_s"] = {n: statistics.median(r["form_s"] for r in runs[m][n]) for n in fanouts}
        out["methods"][m] = row
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.mib} MiB, {out['link']}")
        print(f"{'method':10s} " + " ".join(f"{'t@' + str(n):>8s} {'x t1':>6s} {'egress':>7s}" for n in fanouts))
        for m, row in out["methods"].items():
            print(f"{m:10s} " + " ".join(
                f"{row['t_s'][n]:8.2f} {row['t_over_t1'][n]:6.2f} "
                f"{'-' if row['egress_over_set'][n] is None else format(row['egress_over_set'][n], '7.2f')}"
                for n in fanouts))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--checksums", action="store_true", help="the checksum bench instead")
    ap.add_argument("--fanout", default="1,4,16")
    ap.add_argument("--methods", default="router,relay,broadcast,shard")
    ap.add_argument("--link-mbit", type=float, default=400.0)
    ap.add_argument("--json", action="store_true")
    # a worker process (started by --fanout)
    ap.add_argument("--worker", choices=["source", "receiver"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--addr", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="router", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--of", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--init", default="", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import asyncio

        import weight_dist as wd
        asyncio.run(wd.worker(args))
        return 0
    if args.checksums:
        args.repeats = args.repeats or 5
        return checksums(args)
    args.repeats = args.repeats or 2
    return fanout(args)


if __name__ == "__main__":
    sys.exit(main())
