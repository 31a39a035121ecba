"""Trainer-assisted generation: TAG (BTS) vs TAG off, in one run, 1 rollout + 1 trainer process.

    python bench/tag.py [--steps 10] [--set key=value ...]

Three configurations of the default model, each run with runtime.tag=bts and =never:
  gen-bound     generation dominates (16 denoising steps, 1 trained step): BTS should grant TAG
  default       the default config (one fragment per step: a helper would take the whole
                step, so BTS should refuse); also compared with colocated (2 ranks)
  default-f4    the default with 4 fragments per step (room for a helper)
  train-bound   training dominates (all 8 steps trained): BTS should refuse TAG
Prints samples/s, the trainer's busy fraction, TAG fragments granted/refused, and ratios.
Results also go to bench/results/tag.json.

Simulator's prediction (the cost model, digenrl/sim): for each configuration the
TAG-off run is fitted (`digenrl plan --calibrate`, steady-state spans) and the simulator,
driving the real scheduler, predicts both TAG off and TAG (BTS) for that configuration on
one CPU rollout + one CPU trainer. The prediction is compared with the steady-state
measurement (samples/s over the steps after the first; see `steady`). `--predict-only` skips the
real runs and prints the planner's TAG never / bts / always predictions for the mixed-GPU
testbeds (configs/clusters/mixed-*.toml x configs/models/*.toml).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from digenrl.config import load_config, resolve_mode
from digenrl.launch import launch, make_run_dir
from digenrl.sim.calibrate import calibrate
from digenrl.sim.cluster import Cluster, GpuGroup, load_cluster
from digenrl.sim.plan import mode_run
from digenrl.sim.simulator import simulate
from digenrl.telemetry.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {
    "gen-bound": ["sampler.num_steps=16", "train.window_size=1", "runtime.fragments_per_step=4"],
    "default": [],
    "default-f4": ["runtime.fragments_per_step=4"],
    # every step trained: the base model's tail (the default: the last 2) must be off
    "train-bound": ["train.timesteps=all", "sampler.base_tail=0", "runtime.fragments_per_step=4"],
}


def steady(run_dir: Path, batch: int) -> tuple[float, float]:
    """Samples/s after the first step: (mean, median). The simulator reports the mean over its
    steady steps; with TAG, step times are bimodal (a step the trainer helped in, or not), so
    the median step is not the throughput and the mean is what the prediction is held to."""
    rows = read_metrics(run_dir)  # train rows (evaluation rows apart)
    secs = [r["step_seconds"] for r in rows if r.get("step", 0) >= 1]
    return batch * len(secs) / sum(secs), batch / statistics.median(secs)


def run(name: str, mode: str, ov: list[str], tmp: Path) -> dict:
    cfg = resolve_mode(load_config(None, ov), mode)
    run_dir = make_run_dir(cfg, str(tmp / name))
    s = launch(cfg, run_dir)
    sched = s.get("scheduler", {})
    trainer_busy = [v for k, v in s.get("busy", {}).items() if k.startswith(("trainer", "colocated"))]
    mean, median = steady(Path(run_dir), cfg.batch_size)
    out = {"samples_per_s": s["samples_per_s"], "steady_samples_per_s": mean, "steady_median_samples_per_s": median,
           "trainer_busy": max(trainer_busy, default=0.0),
           "tag_granted": sched.get("tag_granted", 0), "tag_refused": sched.get("tag_refused", 0),
           "busy": s.get("busy", {})}
    if mode == "digenrl":
        out["fit"] = calibrate(run_dir)["costs"]
    return out


def predict(ov: list[str], tag: str, fit: dict) -> dict:
    """Simulated steady state of the digenrl run with these overrides, on its own 2 CPU nodes."""
    cfg = resolve_mode(load_config(None, [*ov, f"runtime.tag={tag}"]), "digenrl")
    cluster = Cluster(name="cpu", gpus=(GpuGroup(type="cpu", count=cfg.cluster.trainers, role="trainer"),
                                        GpuGroup(type="cpu", count=cfg.cluster.rollouts, role="rollout")))
    r = simulate(*mode_run(cfg, "digenrl", cluster, calibration=fit))
    return {"samples_per_s": r.samples_per_s, "trainer_busy": r.busy_by_role["trainer"],
            "tag_granted": r.scheduler["tag_granted"], "tag_refused": r.scheduler["tag_refused"]}


def predict_testbeds() -> dict:
    """TAG never / bts / always on the mixed-GPU testbeds, as configured (fixed roles)."""
    out: dict[str, dict] = {}
    for cl in sorted((ROOT / "configs" / "clusters").glob("mixed-*.toml")):
        cluster = load_cluster(cl)
        for model in ("flux", "wan", "hunyuanvideo", "qwenimage"):
            cfg = load_config(ROOT / "configs" / "models" / f"{model}.toml")
            row = {}
            for tag in ("never", "bts", "always"):
                c = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, tag=tag))
                r = simulate(*mode_run(c, "digenrl", cluster, seed=cfg.run.seed))
                row[tag] = {"samples_per_s": r.samples_per_s, "trainer_busy": r.busy_by_role["trainer"],
                            "rollout_busy": r.busy_by_role.get("rollout"),
                            "tag_granted": r.scheduler["tag_granted"], "tag_refused": r.scheduler["tag_refused"]}
            out[f"{model} {cluster.name}"] = row
            print(f"{model:13s} {cluster.name:20s} " + "  ".join(
                f"{t} {v['samples_per_s']:.4g}/s trainer {v['trainer_busy']:.0%} TAG {v['tag_granted']}/"
                f"{v['tag_granted'] + v['tag_refused']}" for t, v in row.items())
                + f"  bts/never {row['bts']['samples_per_s'] / row['never']['samples_per_s']:.3f}"
                + f"  always/never {row['always']['samples_per_s'] / row['never']['samples_per_s']:.3f}",
                flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--predict-only", action="store_true",
                    help="no real runs: the simulator's TAG predictions for the mixed-GPU testbeds")
    args = ap.parse_args()
    if args.predict_only:
        path = Path(__file__).parent / "results" / "tag_testbeds.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(predict_testbeds(), indent=2) + "\n")
        return 0
    out: dict[str, dict] = {}
    print(f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for cname, cov in CONFIGS.items():
            if args.only and cname not in args.only:
                continue
            # evaluation off: it is not part of the throughput (the default evaluates at version 0)
            base = ["run.eval_every=0", *args.overrides, *cov, f"run.steps={args.steps}", "run.threads=1"]
            res = {tag: run(f"{cname}-{tag}", "digenrl", [*base, f"runtime.tag={tag}"], tmp)
                   for tag in ("never", "bts")}
            if cname.startswith("default"):
                res["colocated-2rank"] = run(f"{cname}-colo", "colocated", [*base, "cluster.trainers=2"], tmp)
            out[cname] = res
            for k, r in res.items():
                print(f"{cname:12s} {k:16s} {r['samples_per_s']:7.2f} samples/s (after step 0: mean "
                      f"{r['steady_samples_per_s']:6.2f}, median {r['steady_median_samples_per_s']:6.2f})  trainer busy "
                      f"{r['trainer_busy']:.0%}  TAG granted {r['tag_granted']} refused {r['tag_refused']}",
                      flush=True)
            # the simulator, fitted to the TAG-off run only, predicts both
            pred = {tag: predict(base, tag, res["never"]["fit"]) for tag in ("never", "bts")}
            res["predicted"] = pred
            for tag, p in pred.items():
                real = res[tag]["steady_samples_per_s"]
                print(f"{cname:12s} sim {tag:12s} {p['samples_per_s']:7.2f} samples/s (vs mean after step 0 {real:6.2f}: "
                      f"{100 * (p['samples_per_s'] / real - 1):+.0f}%)  trainer busy {p['trainer_busy']:.0%}  "
                      f"TAG granted {p['tag_granted']} refused {p['tag_refused']}", flush=True)
            print(f"{cname:12s} sim TAG(bts) / TAG off = "
                  f"{pred['bts']['samples_per_s'] / pred['never']['samples_per_s']:.3f}  load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
            ratio = res["bts"]["samples_per_s"] / res["never"]["samples_per_s"]
            print(f"{cname:12s} TAG(bts) / TAG off = {ratio:.3f}", flush=True)
            if "colocated-2rank" in res:
                print(f"{cname:12s} digenrl+TAG / colocated-2rank = "
                      f"{res['bts']['samples_per_s'] / res['colocated-2rank']['samples_per_s']:.3f}")
    path = Path(__file__).parent / "results" / "tag.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
