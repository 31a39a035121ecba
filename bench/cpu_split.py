"""Where the CPU goes in a digenrl launch: per process and thread, per step, against the
rollout alone. CPU seconds (from /proc, Linux only) move far less with a noisy host than
wall time, so they show the pipeline's own cost when wall-clock ratios cannot.

    .venv/bin/python bench/cpu_split.py [--steps 40] [--repeats 2] [--set key=value]...

Each repeat: one ``digenrl launch`` (default config, TAG off) whose node threads are read
from ``/proc/PID/task/*/stat`` at step 10 and again 6 steps before the end; then the
rollout's generation alone in this process (``roles_alone.rollout_only``: the same
fragments, one thread) for the same number of steps, timed in CPU and wall seconds.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from digenrl.actors import roles_alone
from digenrl.config import load_config

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pids: dict[str, int]) -> dict[tuple[str, str, str], tuple[float, float, int]]:
    """(process, thread label, thread name) -> (CPU seconds, seconds runnable but waiting
    for a core, involuntary context switches) so far."""
    out = {}
    for proc, pid in pids.items():
        for task in glob.glob(f"/proc/{pid}/task/*"):
            try:
                stat = Path(task, "stat").read_text()
                name = Path(task, "comm").read_text().strip()
                sched = Path(task, "schedstat").read_text().split()
                status = Path(task, "status").read_text()
            except OSError:  # the thread ended between listing and reading
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            tid = task.rsplit("/", 1)[1]
            label = "main" if tid == str(pid) else tid
            preempted = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
            out[(proc, label, name)] = ((int(fields[11]) + int(fields[12])) / TICK,
                                        int(sched[1]) / 1e9, preempted)
    return out


def lines(path: Path) -> int:
    try:
        return sum(1 for _ in path.open())
    except OSError:
        return 0


def one_launch(steps: int, overrides: list[str], run_dir: Path) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "digenrl.cli", "launch", "--steps", str(steps), "--run-dir", str(run_dir),
           "--set", "runtime.tag=never", *[x for o in overrides for x in ("--set", o)]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    first, last = 10, steps - 6
    while lines(metrics) < first:
        if proc.poll() is not None:
            raise SystemExit(f"launch exited {proc.returncode}; see {run_dir}/logs")
        time.sleep(0.02)
    pids = json.loads((run_dir / "logs" / "pids.json").read_text())
    pids["launcher+coordinator"] = proc.pid
    a, t0, s0 = thread_cpu(pids), time.perf_counter(), lines(metrics)
    while lines(metrics) < last:
        time.sleep(0.02)
    b, t1, s1 = thread_cpu(pids), time.perf_counter(), lines(metrics)
    if proc.wait() != 0:
        raise SystemExit(f"launch exited {proc.returncode}; see {run_dir}/logs")
    n = s1 - s0
    zero = (0.0, 0.0, 0)
    per_thread = {k: tuple((x - y) / n for x, y in zip(b[k], a.get(k, zero))) for k in b}
    per_thread = {k: v for k, v in per_thread.items() if v[0] > 0}
    return {"wall_step_s": (t1 - t0) / n, "threads": per_thread}


def alone(steps: int, overrides: list[str]) -> dict:
    r = roles_alone.rollout_only(load_config(None, overrides), steps)
    return {"wall_step_s": statistics.median(r["step_seconds"][4:]),
            "cpu_step_s": statistics.median(r["cpu_seconds"][4:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    if args.steps < 20:
        raise SystemExit("--steps must be at least 20 (steps 10 to N-6 are measured)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.repeats):
            r = one_launch(args.steps, args.overrides, Path(d) / f"run{rep}")
            solo = alone(args.steps - 16, args.overrides)
            by_proc: collections.Counter[str] = collections.Counter()
            print(f"[{rep}] digenrl: {r['wall_step_s'] * 1e3:.1f} ms/step wall, "
                  f"{2 * r['wall_step_s'] * 1e3:.1f} ms of 2 cores")
            for (proc, label, name), (s, wait, pre) in sorted(r["threads"].items(), key=lambda kv: -kv[1][0]):
                by_proc[proc] += s
                if s * 1e3 >= 0.5:
                    print(f"    {proc:22s} {name:16s} {label:8s} {s * 1e3:6.1f} ms CPU/step, "
                          f"{wait * 1e3:5.1f} ms waiting for a core, {pre:5.1f} preemptions")
            print("    per process: " + ", ".join(f"{p} {s * 1e3:.1f}" for p, s in by_proc.items())
                  + f" ms CPU/step; all {sum(by_proc.values()) * 1e3:.1f}")
            print(f"[{rep}] rollout alone: {solo['wall_step_s'] * 1e3:.1f} ms/step wall, "
                  f"{solo['cpu_step_s'] * 1e3:.1f} ms CPU/step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
