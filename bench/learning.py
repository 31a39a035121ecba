"""Learning evidence: does the default config learn, on every seed, within 5 minutes, and keep its diversity?

    python bench/learning.py [--mode digenrl] [--seeds 0 1 2] [--steps N] [--out docs/learning.png] [--json]

Runs the default config once per seed (each launch must finish within 300 s) and applies two
criteria:

* **training reward** (per seed): the mean reward of the last tenth of the steps beats that of
  the first tenth (runs under 100 steps: the last 5 and the first 2) by at least 3 standard errors
  (per-trajectory rewards of those steps, from metrics.jsonl means and stds);
* **held-out evaluation** (when the config evaluates, ``run.eval_every``): the first and the
  last evaluation of each run (``eval/v<n>.jsonl``: the same test prompts and noise seeds at
  every version) give, for every 0/1 value whose name ends in ``all`` (the all-attributes-correct
  rate), the change end - start per seed with its standard error. The criterion is on the
  change *pooled over the seeds* (their mean; its SE is ``sqrt(sum SE_i^2) / seeds``): >= 3 SE.
  Two SEs are reported: ``unpaired`` treats the two evaluations as independent binomial samples
  (conservative), ``paired`` is the SE of the per-sample differences (same prompt and noise, so
  it removes the between-sample variance); the criterion uses the unpaired one. And no
  collapse: ``pixel_std`` (when evaluated) at the end is >= 0.5x its value at the start, per seed;
* **diversity kept** (when the evaluation reports ``eval/diversity``, rl/diversity.py): the
  within-prompt diversity of the last evaluation is >= 0.8x that of the first, per seed.

Prints a table (``--json``: one object), saves the training-reward curves as a PNG, exits
non-zero if any criterion fails.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from digenrl.config import load_config, resolve_mode
from digenrl.launch import launch, make_run_dir
from digenrl.telemetry.metrics import read_metrics


def windows(n: int) -> tuple[int, int]:
    """Steps compared by the training-reward criterion: a run of 100 steps or more compares its
    first and last tenth, a shorter one its first 2 and last 5 steps (bench/algorithms.py's
    60-step runs)."""
    return (n // 10, n // 10) if n >= 100 else (2, 5)


def criterion(rows: list[dict], batch: int) -> tuple[float, float, float]:
    """(first-window mean, last-window mean, gap in standard errors); see :func:`windows`."""
    def pooled(sel: list[dict]) -> tuple[float, float]:
        n = batch * len(sel)
        mean = sum(r["reward_mean"] for r in sel) / len(sel)
        # pooled variance of per-trajectory rewards: within-step variance + between-step spread
        var = sum(batch * (r["reward_std"] ** 2 + (r["reward_mean"] - mean) ** 2) for r in sel) / n
        return mean, var / n
    first, last = windows(len(rows))
    m0, v0 = pooled(rows[:first])
    m1, v1 = pooled(rows[-last:])
    return m0, m1, (m1 - m0) / math.sqrt(v0 + v1 + 1e-18)


def eval_change(run_dir: Path) -> dict | None:
    """Start and end of a run's held-out evaluation (``eval/v<n>.jsonl``), or None if it has none.

    Per 0/1 value ending in ``all``: start and end rates, the change, its unpaired and paired
    standard errors; per ``pixel_std`` value: start, end, ratio. ``n`` samples each.
    """
    files = sorted((run_dir / "eval").glob("v*.jsonl"))
    if len(files) < 2:
        return None
    first, last = ([json.loads(x) for x in f.read_text().splitlines() if x] for f in (files[0], files[-1]))
    key = lambda r: (r["prompt_index"], r["seed"])  # noqa: E731
    end = {key(r): r for r in last}
    pairs = [(r, end[key(r)]) for r in first if key(r) in end]
    out: dict = {"start_version": first[0]["version"], "end_version": last[0]["version"], "n": len(pairs),
                 "rates": {}, "pixel_std": {}}
    n = len(pairs)
    for name in pairs[0][0]:
        if name.endswith("all"):
            a = [p[0][name] for p in pairs]
            b = [p[1][name] for p in pairs]
            p0, p1 = sum(a) / n, sum(b) / n
            d = [y - x for x, y in zip(a, b)]
            dm = sum(d) / n
            paired = math.sqrt(sum((x - dm) ** 2 for x in d) / (n - 1) / n) if n > 1 else float("nan")
            unpaired = math.sqrt((p0 * (1 - p0) + p1 * (1 - p1)) / n)
            out["rates"][name] = {"start": p0, "end": p1, "change": p1 - p0,
                                  "se_unpaired": unpaired, "se_paired": paired}
        elif name.endswith("pixel_std"):
            s0 = sum(p[0][name] for p in pairs) / n
            s1 = sum(p[1][name] for p in pairs) / n
            out["pixel_std"][name] = {"start": s0, "end": s1, "ratio": s1 / s0 if s0 else float("nan")}
    return out


def diversity_change(run_dir: Path) -> dict | None:
    """``eval/diversity`` (or ``eval_ema/diversity``) at the first and the last evaluation of a
    run, from its metrics.jsonl, and their ratio; None if the run did not measure it."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    for key in ("eval/diversity", "eval_ema/diversity"):
        pts = sorted((r["policy_version"], r[key]) for r in rows if key in r)
        if len(pts) >= 2:
            (v0, d0), (v1, d1) = pts[0], pts[-1]
            return {"key": key, "start_version": v0, "end_version": v1, "start": d0, "end": d1,
                    "ratio": d1 / d0 if d0 else float("nan")}
    return None


def pooled_change(per_seed: list[dict], name: str) -> dict:
    """The seeds' mean change of rate ``name`` with its pooled SEs and the gap in (unpaired) SEs."""
    rates = [e["rates"][name] for e in per_seed]
    k = len(rates)
    change = sum(r["change"] for r in rates) / k
    se_u = math.sqrt(sum(r["se_unpaired"] ** 2 for r in rates)) / k
    se_p = math.sqrt(sum(r["se_paired"] ** 2 for r in rates)) / k
    return {"change": change, "se_unpaired": se_u, "se_paired": se_p,
            "gap_se_unpaired": change / se_u if se_u else float("nan"),
            "gap_se_paired": change / se_p if se_p else float("nan")}


def score_run(seed: int, run_dir: Path, batch: int, wall: float) -> tuple[dict, bool]:
    """One run's entry of the report (training-reward criterion, evaluation change, collapse)
    and whether it passed; prints its lines."""
    rows = read_metrics(run_dir)  # train rows (evaluation rows apart)
    m0, m1, z = criterion(rows, batch)
    first, last = windows(len(rows))
    passed = z >= 3.0 and wall <= 300
    print(f"seed {seed}: reward first-{first} {m0:.4f}  last-{last} {m1:.4f}  gap {z:.1f} SE  "
          f"wall {wall:.0f}s  {'PASS' if passed else 'FAIL'}", flush=True)
    entry: dict = {"reward_first": m0, "reward_last": m1, "reward_windows": [first, last],
                   "reward_gap_se": z, "wall_s": wall, "reward_pass": passed,
                   "curve": [(r["step"], r["reward_mean"], r["reward_std"]) for r in rows]}
    ev = eval_change(run_dir)
    if ev is not None:
        entry["eval"] = ev
        for name, r in ev["rates"].items():
            print(f"        eval {name} v{ev['start_version']} {r['start']:.4f} -> "
                  f"v{ev['end_version']} {r['end']:.4f}  change {r['change']:+.4f} "
                  f"(SE unpaired {r['se_unpaired']:.4f}, paired {r['se_paired']:.4f}; n {ev['n']})",
                  flush=True)
        for name, r in ev["pixel_std"].items():
            collapsed = not r["ratio"] >= 0.5
            passed &= not collapsed
            print(f"        eval {name} {r['start']:.4f} -> {r['end']:.4f}  ratio {r['ratio']:.2f}  "
                  f"{'COLLAPSED' if collapsed else 'kept'}", flush=True)
    div = diversity_change(run_dir)
    if div is not None:
        entry["diversity"] = div
        kept = div["ratio"] >= 0.8
        passed &= kept
        print(f"        {div['key']} v{div['start_version']} {div['start']:.4f} -> "
              f"v{div['end_version']} {div['end']:.4f}  ratio {div['ratio']:.2f}  "
              f"{'kept' if kept else 'LOST (< 0.8)'}", flush=True)
    return entry, passed


def plot(curves: dict[int, list], title: str, out: str) -> None:
    """Training-reward curves: the batch means (thin) and their 25-step running mean."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for seed, pts in curves.items():
        s, m, _ = zip(*pts)
        k = 25 if len(m) > 100 else 1
        run = [sum(m[max(0, i - k + 1):i + 1]) / len(m[max(0, i - k + 1):i + 1]) for i in range(len(m))]
        line, = ax.plot(s, run, label=f"seed {seed}" + (f" ({k}-step mean)" if k > 1 else ""))
        if k > 1:
            ax.plot(s, m, color=line.get_color(), alpha=0.2, linewidth=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel("training reward (batch mean)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"curves: {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", default="digenrl")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default="docs/learning.png")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ap.add_argument("--keep", default="", help="keep the run dirs under this folder (seed<N>/)")
    ap.add_argument("--rescore", default="", help="launch nothing: score the runs a --keep left here "
                    "(wall times from their summary.json)")
    args = ap.parse_args()
    curves, ok = {}, True
    report: dict = {"mode": args.mode, "seeds": {}}
    evals: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = args.rescore or args.keep or tmp_dir
        for seed in args.seeds:
            ov = [*args.overrides, f"run.seed={seed}"]
            if args.steps:
                ov.append(f"run.steps={args.steps}")
            if args.rescore:
                run_dir = Path(tmp) / f"seed{seed}"
                cfg = load_config(run_dir / "config.toml")
                wall = json.loads((run_dir / "summary.json").read_text())["wall_s"]
            else:
                cfg = resolve_mode(load_config(args.config, ov), args.mode)
                run_dir = make_run_dir(cfg, str(Path(tmp) / f"seed{seed}"))
                t0 = time.perf_counter()
                launch(cfg, run_dir)
                wall = time.perf_counter() - t0
            entry, passed = score_run(seed, run_dir, cfg.batch_size, wall)
            ok &= passed
            curves[seed] = entry.pop("curve")
            if "eval" in entry:
                evals.append(entry["eval"])
            report["seeds"][seed] = entry
        if evals and all(e["rates"] for e in evals):
            report["eval_pooled"] = {}
            for name in evals[0]["rates"]:
                pc = pooled_change(evals, name)
                passed = pc["gap_se_unpaired"] >= 3.0
                ok &= passed
                report["eval_pooled"][name] = {**pc, "pass": passed}
                print(f"pooled over {len(evals)} seeds: eval {name} change {pc['change']:+.4f}  "
                      f"SE unpaired {pc['se_unpaired']:.4f} ({pc['gap_se_unpaired']:.1f} SE), paired "
                      f"{pc['se_paired']:.4f} ({pc['gap_se_paired']:.1f} SE)  {'PASS' if passed else 'FAIL'}",
                      flush=True)
    plot(curves, f"Default config, {args.mode} mode", args.out)
    report["pass"] = ok
    if args.json:
        print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
