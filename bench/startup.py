"""Start-up: how long `digenrl launch` takes to start its nodes, and a short run's wall clock.

    .venv/bin/python bench/startup.py [--repeats 3] [--mode digenrl] [--spawn fork exec]
                                      [--concurrent 1] [--json]

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

``--spawn fork exec`` measures both ways of starting the nodes (``cluster.spawn``: forked from
one pre-imported server, or each a fresh interpreter), interleaved repeat by repeat, and
reports ``fork_over_exec_wall`` (the median of the paired ratios). ``--concurrent N`` starts N
identical launches at once in every repeat (a machine whose cores are all busy, as under a test
suite); the figures are then the launches' means.

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


def launch_once(mode: str, steps: int, run_dir: Path, spawn: str = "fork", concurrent: int = 1
                ) -> dict[str, float]:
    """``concurrent`` launches of the small run at once; their mean start-up figures (seconds)."""
    if concurrent > 1:
        runs = []
        t0 = time.time()
        procs = [_start(mode, steps, run_dir / f"c{i}", spawn) for i in range(concurrent)]
        for i, proc in enumerate(procs):
            runs.append(_figures(proc, run_dir / f"c{i}", t0))
        return {k: statistics.mean(r[k] for r in runs) for k in runs[0] if all(k in r for r in runs)}
    t0 = time.time()
    return _figures(_start(mode, steps, run_dir, spawn), run_dir, t0)


def _start(mode: str, steps: int, run_dir: Path, spawn: str) -> subprocess.Popen[str]:
    sets = [a for s in [*SMALL_RUN, f'cluster.spawn="{spawn}"'] for a in ("--set", s)]
    cmd = [sys.executable, "-m", "digenrl.cli", "launch", "--mode", mode, "--steps", str(steps),
           "--run-dir", str(run_dir), *sets]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _figures(proc: subprocess.Popen[str], run_dir: Path, t0: float) -> dict[str, float]:
    _, err = proc.communicate(timeout=600)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench/startup.py: the launch failed ({proc.returncode}): {err[-2000:]}")
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
    ap.add_argument("--spawn", nargs="+", default=["fork"], choices=("fork", "exec"),
                    help="cluster.spawn values to measure, interleaved")
    ap.add_argument("--concurrent", type=int, default=1, help="identical launches at once per repeat")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in args.spawn}
    with tempfile.TemporaryDirectory(prefix="digenrl-startup-") as tmp:
        for i in range(args.repeats):
            for spawn in args.spawn:
                runs[spawn].append(launch_once(args.mode, args.steps, Path(tmp) / f"{spawn}{i}",
                                               spawn, args.concurrent))
    out: dict[str, object] = {"mode": args.mode, "steps": args.steps, "repeats": args.repeats,
                              "concurrent": args.concurrent, "cpus": os.cpu_count()}
    for spawn, rs in runs.items():
        keys = [k for k in ("spawn_s", "joined_s", "wall_s", "exit_s") if all(k in r for r in rs)]
        out[spawn] = {**{k: statistics.median(r[k] for r in rs) for k in keys}, "runs": rs}
    if "fork" in runs and "exec" in runs:
        out["fork_over_exec_wall"] = statistics.median(
            f["wall_s"] / e["wall_s"] for f, e in zip(runs["fork"], runs["exec"], strict=True))
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"# start-up, mode {args.mode}, {args.steps} steps, {args.concurrent} launch(es) at once, "
          f"medians of {args.repeats} repeats")
    for spawn, rs in runs.items():
        for k in ("spawn_s", "joined_s", "wall_s", "exit_s"):
            if all(k in r for r in rs):
                print(f"{spawn:5s} {k:9s} {statistics.median(r[k] for r in rs):6.1f}   "
                      f"({', '.join(f'{r[k]:.1f}' for r in rs)})")
    if "fork_over_exec_wall" in out:
        print(f"fork_over_exec_wall {out['fork_over_exec_wall']:.2f}")


if __name__ == "__main__":
    main()
