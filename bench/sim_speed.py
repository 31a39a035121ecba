"""Simulator speed: wall seconds to simulate N steps of a cluster, per mode.

    .venv/bin/python bench/sim_speed.py [--config configs/models/flux.toml]
        [--cluster configs/clusters/h800-32.toml] [--steps 1000] [--modes ...] [--repeats 3]
        [--profile digenrl]

The target: 1,000 steps of a 32-GPU cluster in under 10 s on the development machine.
Prints, per mode, the minimum and median wall seconds over the repeats (the minimum is the
least disturbed by other load on a shared machine), this process's CPU seconds (what the
wall time would be on an idle core), the simulated samples/s (to show the
result does not change) and the 1-minute load average. ``--profile MODE`` prints the top of
a cProfile of one run instead.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import statistics
import time

from digenrl.config import load_config
from digenrl.sim.cluster import load_cluster
from digenrl.sim.plan import mode_run
from digenrl.sim.simulator import simulate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/models/flux.toml")
    ap.add_argument("--cluster", default="configs/clusters/h800-32.toml")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--modes", default="colocated,disagg-sync,digenrl")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", default=None, metavar="MODE")
    args = ap.parse_args()
    cfg = load_config(args.config, [f"run.steps={args.steps}"])
    cluster = load_cluster(args.cluster)
    if args.profile:
        c, setup = mode_run(cfg, args.profile, cluster, seed=cfg.run.seed)
        prof = cProfile.Profile()
        prof.enable()
        simulate(c, setup)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return 0
    print(f"{args.config} on {args.cluster} ({cluster.size} GPUs), {args.steps} steps, "
          f"load average {os.getloadavg()[0]:.2f}")
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        c, setup = mode_run(cfg, mode, cluster, seed=cfg.run.seed)
        setup = dataclasses.replace(setup)
        walls, cpus, rate = [], [], 0.0
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            r = simulate(c, setup)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            rate = r.samples_per_s
        print(f"{mode:12s} wall min {min(walls):6.2f} s  median {statistics.median(walls):6.2f} s  "
              f"(CPU min {min(cpus):6.2f} s; {args.repeats} runs)  simulated {rate:.6g} samples/s  "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
