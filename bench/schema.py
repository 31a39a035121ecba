"""What validating every decoded message costs: decode with the schema against decode without.

    .venv/bin/python bench/schema.py [--number 20000] [--json]

Per message kind: ``decode`` as the sockets call it (types, then :mod:`digenrl.transport.schema`),
the same decode with the schema check replaced by a no-op, and the check alone, in
microseconds per message; medians of interleaved repeats in one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import timeit

import torch

from digenrl.transport import codec, schema
from digenrl.transport.protocol import Chunk, Commit, Heartbeat, decode, encode


def _messages() -> dict[str, object]:
    x = torch.zeros(4, 16, 16, 16)  # 64 KiB of latents per tensor
    return {
        "Heartbeat": Heartbeat(node_id="rollout-0", incarnation=1, policy_version=3, state="running",
                               seq=7, gpu={"available": True, "reason": "", "gpus": [
                                   {"index": 0, "name": "H100", "mem_free_mb": 4e4, "util_pct": 93.0}]},
                               stats={"busy_s": 10.5, "wall_s": 11.0, "bad_frames": 0, "rss_mb": 400.0}),
        "Chunk 2x64KiB": Chunk(task_id=9, step=3, fragment=1, t_index=2, sigma=0.9, sigma_next=0.8,
                               policy_version=2, x_t=x, x_next=x, log_prob=torch.zeros(4)),
        "Commit": Commit(task_id=9, step=3, fragment=1, node_id="rollout-0", policy_version=2,
                         prompt_ids=[1, 2], rewards=[0.5] * 8, reward_terms={"jpeg": [0.5] * 8},
                         gen_seconds=1.5, cond={"e": torch.zeros(2, 8)},
                         images=torch.zeros(8, 3, 8, 8, dtype=torch.uint8), discard=""),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000, help="messages per timing")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    real = schema.check
    rows = {}
    for name, msg in _messages().items():
        frames = [bytes(f) for f in encode(msg)]  # type: ignore[arg-type]
        decoded = decode(frames, max_frame_bytes=1 << 24)
        on, off, alone = [], [], []
        def run(f: list[bytes] = frames) -> object:
            return decode(f, max_frame_bytes=1 << 24)

        def check(m: object = decoded) -> None:
            real(m)

        for _ in range(args.repeats):  # interleaved: the machine's load hits both alike
            codec.schema.check = real  # type: ignore[attr-defined]
            on.append(timeit.timeit(run, number=args.number))
            codec.schema.check = lambda m: None  # type: ignore[attr-defined]
            off.append(timeit.timeit(run, number=args.number))
            codec.schema.check = real  # type: ignore[attr-defined]
            alone.append(timeit.timeit(check, number=args.number))
        us = {k: statistics.median(v) / args.number * 1e6 for k, v in
              (("with_schema_us", on), ("without_us", off), ("check_us", alone))}
        rows[name] = {**us, "ratio": us["with_schema_us"] / us["without_us"]}
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| message | decode without schema, us | decode with schema, us | check alone, us | ratio |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['without_us']:.2f} | {r['with_schema_us']:.2f} | {r['check_us']:.2f} | "
              f"{r['ratio']:.2f} |")


if __name__ == "__main__":
    main()
