"""Weight-set checksums: what a publish and a fetch pay per byte, CRC-32 against blake2b.

    .venv/bin/python bench/weights.py [--mib 256] [--repeats 5]

Every optimizer step, trainer rank 0 checksums the new weight set once (``publish_parts``)
and every rollout checksums it once more as the parts land (``WeightAssembly.add``). This
measures, in one run and interleaved, ``tensor_checksum`` (CRC-32, what the runtime uses)
and the blake2b digest it replaced (the same names, dtypes, shapes and bytes), on the tiny
default model's full weight set and on a synthetic set of ``--mib`` MiB in 4 MiB parts. It
also times ``publish_parts`` + ``WeightAssembly`` end to end for the tiny set.
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

from digenrl.config import load_config
from digenrl.rl.policy import build_policy
from digenrl.transport.frames import tensor_checksum
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tiny = build_policy(load_config(None, [])).model.sync_state_dict()
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


if __name__ == "__main__":
    sys.exit(main())
