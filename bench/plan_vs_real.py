"""Plan vs real: calibrate the tiny-CPU cost model from real runs A, predict real runs B.

    .venv/bin/python bench/plan_vs_real.py [--modes colocated,disagg-sync,digenrl]
                                           [--steps 10] [--repeats 3] [--root runs/pvr]

For each mode and repeat: run A (`digenrl launch --mode M --steps N`, seed 0) and run B
(seed 1), interleaved (a1 b1 for every mode, then a2 b2, ...) so that a change in the
machine's load hits every mode alike. Each A is fitted with `digenrl plan --calibrate`
(digenrl/sim/calibrate.py: steady-state spans only) and simulated on the run's own cluster
(its trainer processes, plus its rollout processes when disaggregated); the prediction is
the median over the A fits. The measurement is the median over the B runs of each run's
steady-state samples/s (batch / median step_seconds after the first step). Nothing of B
goes into the fit. Target: |error| <= 15%. Also prints A's own measurement (how well the
simulator reproduces the run it was fitted to) and the spread of the B runs (the noise
floor of this comparison on a shared 2-core machine). Results: bench/results/plan_vs_real.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from digenrl.config import load_config
from digenrl.sim.calibrate import calibrate
from digenrl.sim.cluster import Cluster, GpuGroup
from digenrl.sim.plan import mode_run
from digenrl.sim.simulator import simulate
from digenrl.telemetry.metrics import read_metrics


def launch(mode: str, steps: int, run_dir: Path, seed: int, reuse: bool) -> None:
    if reuse and (run_dir / "summary.json").is_file():
        return
    load = os.getloadavg()[0]
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    subprocess.run([sys.executable, "-m", "digenrl.cli", "launch", "--mode", mode, "--steps", str(steps),
                    "--run-dir", str(run_dir), "--set", f"run.seed={seed}"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (run_dir / "load.json").write_text(json.dumps({"before": load, "after": os.getloadavg()[0]}) + "\n")


def measured(run_dir: Path, mean: bool = False) -> float:
    """Steady-state samples/s of a real run: batch / median step_seconds after the first step
    (``mean``: samples / seconds over those steps, which stalls of the machine weigh on)."""
    cfg = load_config(run_dir / "config.toml")
    rows = read_metrics(run_dir)  # train rows (evaluation rows apart)
    secs = [r["step_seconds"] for r in rows if r.get("step", 0) >= 1 and "step_seconds" in r]
    return cfg.batch_size * len(secs) / sum(secs) if mean else cfg.batch_size / statistics.median(secs)


def predict(run_dir: Path) -> tuple[float, dict[str, float]]:
    """The simulator's samples/s for the run's own configuration, fitted to that run."""
    cfg = load_config(run_dir / "config.toml")
    mode = cfg.run.mode
    groups = [GpuGroup(type="cpu", count=cfg.cluster.trainers, role="trainer")]
    if mode != "colocated":
        groups.append(GpuGroup(type="cpu", count=max(1, cfg.cluster.rollouts), role="rollout"))
    fit = calibrate(run_dir)["costs"]
    return simulate(*mode_run(cfg, mode, Cluster(name="cpu", gpus=tuple(groups)), calibration=fit)).samples_per_s, fit


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="colocated,disagg-sync,digenrl")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--root", default="runs/pvr")
    ap.add_argument("--reuse", action="store_true", help="keep finished run dirs instead of re-running")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    root = Path(args.root)
    failed: set[str] = set()
    for rep in range(args.repeats):
        for mode in modes:
            for role, seed in (("a", 0), ("b", 1)):
                try:
                    launch(mode, args.steps, root / f"{mode}-{role}{rep}", seed, args.reuse)
                except subprocess.CalledProcessError as e:
                    print(f"{mode}: real run {role}{rep} failed ({e})", flush=True)
                    failed.add(mode)
    out: dict[str, dict] = {}
    for mode in modes:
        if mode in failed:
            print(f"{mode}: a real run failed; no comparison")
            continue
        a_runs = [root / f"{mode}-a{i}" for i in range(args.repeats)]
        b_runs = [root / f"{mode}-b{i}" for i in range(args.repeats)]
        preds = [predict(a) for a in a_runs]
        pred = statistics.median(p for p, _ in preds)
        real_a = [measured(a) for a in a_runs]
        real_b = [measured(b) for b in b_runs]
        real = statistics.median(real_b)
        err = pred / real - 1
        real_mean = statistics.median(measured(b, mean=True) for b in b_runs)
        out[mode] = {"predicted": pred, "measured_b": real, "error": err,
                     "measured_b_mean": real_mean, "error_vs_mean": pred / real_mean - 1,
                     "predicted_each_a": [p for p, _ in preds], "measured_each_a": real_a,
                     "measured_each_b": real_b, "fits": [f for _, f in preds]}
        print(f"{mode:12s} predicted {pred:6.2f} samples/s, measured (B) {real:6.2f}, error {100 * err:+5.1f}%"
              f"  {'OK' if abs(err) <= 0.15 else 'MISS'} | per A: predicted "
              f"{', '.join(f'{p:.1f}' for p, _ in preds)} vs its own {', '.join(f'{x:.1f}' for x in real_a)}"
              f" | B runs {', '.join(f'{x:.1f}' for x in real_b)} | vs B's mean step "
              f"{real_mean:.2f}: {100 * (pred / real_mean - 1):+.1f}%", flush=True)
    load = [v for f in sorted(root.glob("*/load.json")) for v in json.loads(f.read_text()).values()]
    if load:
        print(f"load average (1 min) before/after each real run: min {min(load):.2f}, median "
              f"{statistics.median(load):.2f}, max {max(load):.2f} ({len(load) // 2} runs, {os.cpu_count()} CPUs)")
    path = Path(__file__).parent / "results" / "plan_vs_real.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"steps": args.steps, "repeats": args.repeats, "load_avg_1min": load,
                                "modes": out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
