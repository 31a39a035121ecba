"""Plan vs real: calibrate the tiny-CPU cost model from one real run, predict a second one.

    .venv/bin/python bench/plan_vs_real.py [--modes colocated,digenrl] [--steps 6]

For each mode: run A (`digenrl launch --mode M --steps N --run-dir runs/pvr-M-a`), fit costs
with `digenrl plan --calibrate`, run B with a different seed, and compare B's measured
samples/s (steady state: median step_seconds after the first step) with the simulator's
prediction from A's fit. Target: |error| <= 15%. Prints one line per mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from digenrl.config import load_config
from digenrl.sim.cluster import Cluster, GpuGroup
from digenrl.sim.plan import calibrate, mode_run
from digenrl.sim.simulator import simulate


def launch(mode: str, steps: int, run_dir: Path, seed: int) -> None:
    if (run_dir / "summary.json").is_file():
        return  # reuse a finished run
    subprocess.run([sys.executable, "-m", "digenrl.cli", "launch", "--mode", mode, "--steps", str(steps),
                    "--run-dir", str(run_dir), "--set", f"run.seed={seed}"], check=True)


def measured(run_dir: Path, batch: int) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    secs = [r["step_seconds"] for r in rows[1:] if "step_seconds" in r]
    return batch / statistics.median(secs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="colocated,disagg-sync,digenrl")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    cfg = load_config(None, [f"run.steps={args.steps}"])
    for mode in args.modes.split(","):
        a, b = Path(f"runs/pvr-{mode}-a"), Path(f"runs/pvr-{mode}-b")
        try:
            launch(mode, args.steps, a, seed=0)
            launch(mode, args.steps, b, seed=1)
        except subprocess.CalledProcessError as e:
            print(f"{mode}: real run failed ({e}); no comparison")
            continue
        real_cfg = load_config(a / "config.toml")
        # the simulated cluster is the real run's: its trainers (+ its rollouts when disaggregated)
        groups = [GpuGroup(type="cpu", count=real_cfg.cluster.trainers, role="trainer")]
        if mode != "colocated":
            groups.append(GpuGroup(type="cpu", count=max(1, real_cfg.cluster.rollouts), role="rollout"))
        cluster = Cluster(name="cpu", gpus=tuple(groups))
        fit = calibrate(a)["costs"]
        pred = simulate(*mode_run(cfg, mode, cluster, calibration=fit)).samples_per_s
        real = measured(b, cfg.batch_size)
        print(f"{mode}: predicted {pred:.2f} samples/s, measured {real:.2f}, error {100 * (pred / real - 1):+.1f}%"
              f"  fit {json.dumps({k: round(v, 5) for k, v in fit.items()})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
