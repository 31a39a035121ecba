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
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from digenrl.config import load_config, resolve_mode
from digenrl.launch import launch, make_run_dir

CONFIGS = {
    "gen-bound": ["sampler.num_steps=16", "train.window_size=1", "runtime.fragments_per_step=4"],
    "default": [],
    "default-f4": ["runtime.fragments_per_step=4"],
    "train-bound": ["train.timesteps=all", "runtime.fragments_per_step=4"],
}


def run(name: str, mode: str, ov: list[str], tmp: Path) -> dict:
    cfg = resolve_mode(load_config(None, ov), mode)
    s = launch(cfg, make_run_dir(cfg, str(tmp / name)))
    sched = s.get("scheduler", {})
    trainer_busy = [v for k, v in s.get("busy", {}).items() if k.startswith(("trainer", "colocated"))]
    return {"samples_per_s": s["samples_per_s"], "trainer_busy": max(trainer_busy, default=0.0),
            "tag_granted": sched.get("tag_granted", 0), "tag_refused": sched.get("tag_refused", 0),
            "busy": s.get("busy", {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for cname, cov in CONFIGS.items():
            if args.only and cname not in args.only:
                continue
            base = [*args.overrides, *cov, f"run.steps={args.steps}", "run.threads=1"]
            res = {tag: run(f"{cname}-{tag}", "digenrl", [*base, f"runtime.tag={tag}"], tmp)
                   for tag in ("never", "bts")}
            if cname.startswith("default"):
                res["colocated-2rank"] = run(f"{cname}-colo", "colocated", [*base, "cluster.trainers=2"], tmp)
            out[cname] = res
            for k, r in res.items():
                print(f"{cname:12s} {k:16s} {r['samples_per_s']:7.2f} samples/s  trainer busy "
                      f"{r['trainer_busy']:.0%}  TAG granted {r['tag_granted']} refused {r['tag_refused']}",
                      flush=True)
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
