"""Start-up: how long `digenrl launch` takes to start its nodes, and a short run's wall clock.

    .venv/bin/python bench/startup.py [--repeats 3] [--mode digenrl] [--json]

Each repeat launches the suite's small run as a user would (``python -m digenrl.cli launch``,
the tiny random SD3, 2 prompts x 2 generations, 4 denoising steps, 2 steps, one thread) in a
fresh run dir, and reads from the run's own files:

* ``spawn_s``: launch start to the launcher writing ``logs/pids.json`` (it does so as it
  starts its child nodes; colocated mode has none): what the launcher does alone first
  (configuration, the model and reward checks, the coordinator's sockets);
* ``joined_s``: launch start to the last node's ``joined`` record (the node imported its
  stack, built its model and was admitted by the coordinator);
* ``wall_s``: launch start to the launcher's exit;
* ``exit_s``: the last node's ``node_final`` record (its last act) to the launcher's exit:
  the nodes' interpreter exits, which the launcher waits for, and its own.

Medians of the repeats. The nodes' own start (torch, diffusers with peft, the model) is most
of ``joined_s - spawn_s``; on a two-core machine the nodes share both cores with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL_RUN = ["run.threads=1", "run.eval_every=0", 'prompts.test_file=""', "model.lora_rank=0",
             "sampler.base_tail=0", 'reward.terms=[{ name = "jpeg_compressibility", weight = 1.0 }]',
             'model.path="random"', "train.prompts_per_step=2", "train.group_size=2",
             "runtime.fragments_per_step=2", "sampler.num_steps=4"]


def _last_record_at(logs: Path, event: str) -> float | None:
    """The epoch seconds of the last node's first ``event`` record, or None if a node has none."""
    times = []
    for log in sorted(logs.glob("*.log")):
        if log.name == "launcher.log":
            continue
        for line in log.read_text().splitlines():
            if f'"{event}"' in line:
                stamp = json.loads(line)["timestamp"].replace("Z", "+00:00")
                times.append(datetime.fromisoformat(stamp).timestamp())
                break
        else:
            return None
    return max(times) if times else None


def launch_once(mode: str, steps: int, run_dir: Path) -> dict[str, float]:
    """One launch of the small run; its start-up figures (seconds)."""
    sets = [a for s in SMALL_RUN for a in ("--set", s)]
    cmd = [sys.executable, "-m", "digenrl.cli", "launch", "--mode", mode, "--steps", str(steps),
           "--run-dir", str(run_dir), *sets]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench/startup.py: the launch failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = {"wall_s": wall}
    pids = run_dir / "logs" / "pids.json"
    if pids.exists():
        out["spawn_s"] = os.stat(pids).st_mtime - t0
    joined = _last_record_at(run_dir / "logs", "joined")
    if joined is not None:
        out["joined_s"] = joined - t0
    final = _last_record_at(run_dir / "logs", "node_final")
    if final is not None:
        out["exit_s"] = t0 + wall - final
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", default="digenrl", choices=("digenrl", "disagg-sync", "colocated"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="digenrl-startup-") as tmp:
        for i in range(args.repeats):
            runs.append(launch_once(args.mode, args.steps, Path(tmp) / f"run{i}"))
    keys = [k for k in ("spawn_s", "joined_s", "wall_s", "exit_s") if all(k in r for r in runs)]
    out = {"mode": args.mode, "steps": args.steps, "repeats": args.repeats, "cpus": os.cpu_count(),
           **{k: statistics.median(r[k] for r in runs) for k in keys},
           "runs": runs}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"# start-up, mode {args.mode}, {args.steps} steps, medians of {args.repeats} launches")
    for k in keys:
        print(f"{k:9s} {out[k]:6.1f}   ({', '.join(f'{r[k]:.1f}' for r in runs)})")


if __name__ == "__main__":
    main()
