"""Algorithms x staleness: does each learn, how fast in wall-clock, and does staleness cost it?

    python bench/algorithms.py [--quick] [--json] [--seeds 0 1 2] [--steps N] [--target R]
                               [--algorithms nft awm ...] [--staleness 0 1 2 4]
                               [--config PATH] [--set key=value]...
                               [--out docs/algorithms.png]

Runs every algorithm on the default config (whatever ``digenrl launch`` would train: the
embedded tiny-cpu.toml, or ``--config``) in digenrl mode, at staleness K = 0 and 1 (DiffusionNFT
also at K = 2 and 4; ``--staleness`` sets the levels for every algorithm), once per seed. Runs
are interleaved (seed outermost) so a change in the machine's load falls on every algorithm
alike.

Per run: the learning criterion of bench/learning.py (the last 5 steps' mean reward beats the
first 2 steps' by >= 3 standard errors) and the wall-clock seconds until the reward (a 3-step
trailing mean of the step means) first reaches the target level. The target is one fixed reward
for the whole invocation: ``--target``, or else the initial reward (the first 2 steps of every
run, pooled) plus half the mean gain of Flow-GRPO at K = 1. Wall-clock is the run's own
``wall_time`` (from the coordinator's start, node start-up included, the same for every
algorithm).

``--json`` prints one object per (algorithm, K): ``algorithm``, ``staleness``, ``gain_se`` (the
smallest gap in standard errors over the seeds), ``learns`` (every seed >= 3 SE),
``s_to_target`` (median over seeds; null if a seed never reached it), ``reached`` (seeds that
did), ``target``, ``wall_s`` (median run wall time) and ``seeds``. ``--quick``: one seed,
40 steps. Exits non-zero if an algorithm fails the criterion on some seed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import criterion

from digenrl.config import load_config, resolve_mode
from digenrl.launch import launch, make_run_dir

#: The config this bench's figures were measured with (docs/benchmarks.md):
#: a full fine-tune at lr 3e-5 on the JPEG reward, 60 steps, no evaluation, no base-model tail
#: (the shipped default trains a LoRA on the shapes judge for 500 steps: docs/judge.md).
#: ``--set`` overrides come after these.
EARLIER_DEFAULT = ["model.lora_rank=0", "train.lr=3e-5", "sampler.base_tail=0", "run.steps=60",
                   "run.eval_every=0", 'reward.terms=[{ name = "jpeg_compressibility", weight = 1.0 }]']

ALGORITHMS: dict[str, list[str]] = {
    # the (earlier) default config as it is: Flow-GRPO(-Fast window), the baseline the others are read against
    "flow-grpo": [],
    # MixGRPO: the same SDE window, sliding from the high-noise end down as training advances
    "mixgrpo": ["train.timesteps=mix", "train.window_shift_every=10"],
    # MixGRPO-Flash: DPM-Solver++(2M) for the ODE steps, half of those after the window
    "mixgrpo-flash": ["train.timesteps=mix", "train.window_shift_every=10",
                      "sampler.ode_solver=dpm2", "sampler.ode_compress=0.5"],
    # GRPO-Guard on the default window
    "grpo-guard": ["train.guard=true"],
    # forward-process: clean samples from an ODE sampler (DPM-Solver++), trainer-drawn timesteps
    "nft": ["train.algorithm=nft", "sampler.sde_type=ode", "sampler.ode_solver=dpm2"],
    "awm": ["train.algorithm=awm", "sampler.sde_type=ode", "sampler.ode_solver=dpm2"],
}
FORWARD = ("nft", "awm")


def staleness_levels(algorithm: str, chosen: list[int] | None = None) -> list[int]:
    if chosen:
        return sorted(set(chosen))
    return [0, 1, 2, 4] if algorithm == "nft" else [0, 1]


def time_to(rows: list[dict[str, Any]], target: float, window: int = 3) -> float | None:
    """Wall time of the first step whose trailing ``window``-step mean reward reaches ``target``."""
    for i in range(len(rows)):
        sel = rows[max(0, i - window + 1):i + 1]
        if len(sel) == window and sum(r["reward_mean"] for r in sel) / window >= target:
            return float(rows[i]["wall_time"])
    return None


def run_one(algorithm: str, k: int, seed: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    ov = [*EARLIER_DEFAULT, *ALGORITHMS[algorithm], *args.overrides, f"run.seed={seed}",
          f"runtime.staleness={k}"]
    if args.steps:
        ov.append(f"run.steps={args.steps}")
    cfg = resolve_mode(load_config(args.config, ov), "digenrl")
    run_dir = make_run_dir(cfg, str(tmp / f"{algorithm}-k{k}-s{seed}"))
    t0 = time.perf_counter()
    summary = launch(cfg, run_dir)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    m0, m1, z = criterion(rows, cfg.batch_size)
    hist: dict[str, int] = {}
    for r in rows:
        for key, n in r.items():
            if key.startswith("staleness/"):
                hist[key.split("/", 1)[1]] = hist.get(key.split("/", 1)[1], 0) + int(n)
    return {"algorithm": algorithm, "staleness": k, "seed": seed, "first2": m0, "last5": m1, "z": z,
            "wall_s": wall, "rows": [{"step": r["step"], "wall_time": r["wall_time"],
                                      "reward_mean": r["reward_mean"]} for r in rows],
            "trained_staleness": hist, "rejected_stale": rows[-1].get("rejected_stale", 0) if rows else 0,
            "accounting": summary.get("accounting", {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one seed, 40 steps")
    ap.add_argument("--json", action="store_true", help="one JSON object per (algorithm, K) on stdout")
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--target", type=float, default=None)
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    ap.add_argument("--staleness", type=int, nargs="+", default=None,
                    help="staleness levels K for every algorithm (default: 0 1, NFT also 2 4)")
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default="docs/algorithms.png")
    args = ap.parse_args()
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    if args.quick and args.steps is None:
        args.steps = 40
    out = sys.stdout
    if args.json:  # runs print progress (child processes too): keep stdout for the JSON alone
        sys.stdout.flush()
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    log = sys.stderr if args.json else sys.stdout
    for k in args.staleness or []:  # a bad level fails now, in one line, not after hours of runs
        try:
            resolve_mode(load_config(args.config, [*EARLIER_DEFAULT, *args.overrides,
                                                    f"runtime.staleness={k}"]), "digenrl")
        except ValueError as e:
            ap.error(f"--staleness {k}: {e}")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for algorithm in args.algorithms:
                for k in staleness_levels(algorithm, args.staleness):
                    r = run_one(algorithm, k, seed, args, Path(tmp))
                    runs.append(r)
                    print(f"{algorithm:14s} K={k} seed {seed}: first-2 {r['first2']:.4f}  last-5 "
                          f"{r['last5']:.4f}  gap {r['z']:.1f} SE  wall {r['wall_s']:.0f}s  "
                          f"trained by staleness {r['trained_staleness']}", file=log, flush=True)
    target = args.target
    if target is None:
        first = statistics.mean(r["first2"] for r in runs)
        base = [r for r in runs if r["algorithm"] == "flow-grpo" and r["staleness"] == 1] or runs
        target = first + 0.5 * statistics.mean(r["last5"] - r["first2"] for r in base)
    results, ok = [], True
    for algorithm in args.algorithms:
        for k in staleness_levels(algorithm, args.staleness):
            sel = [r for r in runs if r["algorithm"] == algorithm and r["staleness"] == k]
            times = [time_to(r["rows"], target) for r in sel]
            reached = [t for t in times if t is not None]
            learns = all(r["z"] >= 3.0 for r in sel)
            ok &= learns
            results.append({
                "algorithm": algorithm, "staleness": k, "gain_se": round(min(r["z"] for r in sel), 2),
                "learns": learns,
                "s_to_target": round(statistics.median(reached), 1) if len(reached) == len(sel) else None,
                "reached": len(reached), "target": round(target, 5),
                "wall_s": round(statistics.median(r["wall_s"] for r in sel), 1), "seeds": len(sel),
                "max_trained_staleness": max((int(s) for r in sel for s in r["trained_staleness"]), default=0),
                "rejected_stale": sum(int(r["rejected_stale"]) for r in sel),
            })
    if args.json:
        for res in results:
            print(json.dumps(res), file=out, flush=True)
    else:
        print(f"\ntarget reward {target:.4f}")
        print("| algorithm | K | gain (min SE over seeds) | learns | s to target (median) | reached | run wall s |")
        print("|---|---|---|---|---|---|---|")
        for res in results:
            s = "-" if res["s_to_target"] is None else f"{res['s_to_target']:.0f}"
            print(f"| {res['algorithm']} | {res['staleness']} | {res['gain_se']:.1f} | "
                  f"{'yes' if res['learns'] else 'NO'} | {s} | {res['reached']}/{res['seeds']} | "
                  f"{res['wall_s']:.0f} |")
    plot(runs, target, args.out)
    print(f"curves: {args.out}", file=log)
    return 0 if ok else 1


def plot(runs: list[dict[str, Any]], target: float, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["algorithm"] for r in runs))
    cols = min(3, len(names))
    rows_n = -(-len(names) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.2 * rows_n), squeeze=False,
                             sharey=True)
    for ax, name in zip(axes.flat, names):
        for k in sorted({r["staleness"] for r in runs if r["algorithm"] == name}):
            sel = [r for r in runs if r["algorithm"] == name and r["staleness"] == k]
            if not sel:
                continue
            n = min(len(r["rows"]) for r in sel)
            xs = [statistics.mean(r["rows"][i]["wall_time"] for r in sel) for i in range(n)]
            ys = [statistics.mean(r["rows"][i]["reward_mean"] for r in sel) for i in range(n)]
            ax.plot(xs, ys, label=f"K={k}")
        ax.axhline(target, color="grey", ls="--", lw=0.8)
        ax.set_title(name)
        ax.set_xlabel("wall-clock s")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes[0][0].set_ylabel(f"reward (mean of {len({r['seed'] for r in runs})} seeds)")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
