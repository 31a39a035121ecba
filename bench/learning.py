"""Learning evidence: does the default config's reward rise, on every seed?

    python bench/learning.py [--mode colocated] [--seeds 0 1 2] [--steps 30] [--out docs/learning.png]

Runs the default config once per seed and applies the criterion of the algorithm issue: the
mean reward of the last 5 steps beats that of the first 2 steps by at least 3 standard
errors (per-trajectory rewards of those steps, from metrics.jsonl means and stds). Prints a
table, saves the curves as a PNG, exits non-zero if any seed fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

from digenrl.config import load_config, resolve_mode
from digenrl.launch import launch, make_run_dir
from digenrl.telemetry.metrics import read_metrics


def criterion(rows: list[dict], batch: int) -> tuple[float, float, float]:
    """(first-2 mean, last-5 mean, gap in standard errors)."""
    def pooled(sel: list[dict]) -> tuple[float, float]:
        n = batch * len(sel)
        mean = sum(r["reward_mean"] for r in sel) / len(sel)
        # pooled variance of per-trajectory rewards: within-step variance + between-step spread
        var = sum(batch * (r["reward_std"] ** 2 + (r["reward_mean"] - mean) ** 2) for r in sel) / n
        return mean, var / n
    m0, v0 = pooled(rows[:2])
    m1, v1 = pooled(rows[-5:])
    return m0, m1, (m1 - m0) / math.sqrt(v0 + v1 + 1e-18)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", default="colocated")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default="docs/learning.png")
    args = ap.parse_args()
    curves, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            ov = [*args.overrides, f"run.seed={seed}"]
            if args.steps:
                ov.append(f"run.steps={args.steps}")
            cfg = resolve_mode(load_config(args.config, ov), args.mode)
            run_dir = make_run_dir(cfg, str(Path(tmp) / f"seed{seed}"))
            t0 = time.perf_counter()
            launch(cfg, run_dir)
            wall = time.perf_counter() - t0
            rows = read_metrics(run_dir)  # train rows (evaluation rows apart)
            m0, m1, z = criterion(rows, cfg.batch_size)
            passed = z >= 3.0 and wall <= 300
            ok &= passed
            curves[seed] = [(r["step"], r["reward_mean"], r["reward_std"]) for r in rows]
            print(f"seed {seed}: first-2 {m0:.4f}  last-5 {m1:.4f}  gap {z:.1f} SE  wall {wall:.0f}s  "
                  f"{'PASS' if passed else 'FAIL'}", flush=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for seed, pts in curves.items():
        s, m, sd = zip(*pts)
        ax.plot(s, m, label=f"seed {seed}")
        ax.fill_between(s, [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)], alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel("reward (mean ± std over the batch)")
    ax.set_title(f"Default config, {args.mode} mode")
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"curves: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
