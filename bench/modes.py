"""Modes side by side on this machine: digenrl vs disagg-sync vs colocated, plus each role alone.

    python bench/modes.py [--steps 12] [--repeats 3] [--config PATH] [--set key=value ...]
                          [--only NAME ...] [--max-batch ROWS]

One invocation runs, one after another on the same (2-core) machine and the same config:
  digenrl          1 rollout + 1 trainer process, one thread each, TAG off
  digenrl+tag      the same with TAG on (BTS admission)
  digenrl+batch    digenrl with step-level batching (sampler.max_batch: a step's fragments share forwards)
  disagg-sync      1 rollout + 1 trainer process, one thread each
  colocated-2thr   one process on two threads
  colocated-2rank  two ranks (gloo), one thread each
  rollout-alone    generation only, one thread (no trainer)
  trainer-alone    training only on a recording, one thread (no rollout)
  both alone       the two at once in two processes that never talk (same core sharing as
                   digenrl, no pipeline): separates contention from pipeline bubbles
For each: samples/s (first assignment to last step), steady-state seconds per step (median of
the steps after the first two), each process's busy fraction (whole run, and over the steady
steps from the trace: the busiest role's idle share there is the pipeline's bubbles), and
the ratios the runtime issue targets. The machine is shared and noisy, so the variants run interleaved
(A B C ... A B C ...) ``--repeats`` times and the medians are reported.
``--set`` overrides apply to every variant, after the variant's own settings.
Results also go to bench/results/modes.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from digenrl.config import load_config, resolve_mode
from digenrl.launch import launch, make_run_dir
from digenrl.telemetry.metrics import read_metrics
from digenrl.telemetry.trace import busy_by_node, read_trace


def steady_step_s(run_dir: Path) -> float:
    rows = read_metrics(run_dir)  # train rows (evaluation rows apart)
    secs = [r["step_seconds"] for r in rows[2:]] or [r["step_seconds"] for r in rows]
    return statistics.median(secs)


def steady_busy(run_dir: Path) -> dict[str, float]:
    """Each node's busy fraction in steady state, from trace.json: from the end of the second
    optimizer step to the end of the last but one (in the last step the rollout has nothing
    left to generate: the pipeline drains). What is not busy there is the pipeline's bubbles
    plus the imbalance between the roles."""
    _, spans = read_trace(run_dir / "trace.json")
    ends = sorted(s.end for s in spans if s.name == "optimizer_step" and s.node in ("trainer-0", "colocated-0"))
    if len(ends) < 4:
        return {}
    return busy_by_node(spans, ends[1], ends[-2])


def run_mode(name: str, mode: str, overrides: list[str], tmp: Path, config: str | None) -> dict:
    cfg = resolve_mode(load_config(config, overrides), mode)
    run_dir = make_run_dir(cfg, str(tmp / name))
    summary = launch(cfg, run_dir)
    step_s = steady_step_s(run_dir)
    return {"samples_per_s": summary["samples_per_s"], "steady_step_s": step_s,
            "steady_samples_per_s": cfg.batch_size / step_s, "busy": summary.get("busy", {}),
            "tag_granted": summary.get("scheduler", {}).get("tag_granted", 0),
            "steady_busy": steady_busy(run_dir)}


def _median_steady(xs: list[float]) -> float:
    return statistics.median(xs[2:] or xs)


def _trainer_until(cfg_overrides: list[str], config: str | None, rec: Path, started: Any,
                   stop: Any, out: Any) -> None:
    """Train on the recording over and over until ``stop`` is set (the side-by-side load);
    ``started`` once the first pass over it is done (imports and warm-up behind it)."""
    from digenrl.actors import roles_alone
    cfg = load_config(config, [*cfg_overrides, "run.threads=1"])
    times: list[float] = []
    while not stop.is_set():
        times += roles_alone.trainer_only(cfg, rec)["step_seconds"]
        started.set()
    out.put(times)


def run_alone(cfg_overrides: list[str], config: str | None, steps: int, tmp: Path) -> dict:
    """Each role alone; then both at once, in two processes that never talk: the rollout's
    step there is the floor under the same sharing of the 2 cores that digenrl runs with."""
    import multiprocessing as mp

    from digenrl.actors import roles_alone
    cfg = load_config(config, [*cfg_overrides, "run.threads=1"])
    rec = tmp / "recording.pt"
    r = roles_alone.rollout_only(cfg, steps, record=rec)
    t = roles_alone.trainer_only(cfg, rec)
    ctx = mp.get_context("spawn")
    started, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    side = ctx.Process(target=_trainer_until, args=(cfg_overrides, config, rec, started, stop, out))
    side.start()
    if not started.wait(timeout=300):
        raise RuntimeError("bench: the side-by-side trainer did not start training")
    both = roles_alone.rollout_only(cfg, steps)
    stop.set()
    t_both = out.get(timeout=300)
    side.join(timeout=60)
    return {"rollout_step_s": _median_steady(r["step_seconds"]),
            "trainer_step_s": _median_steady(t["step_seconds"]),
            "rollout_beside_trainer_step_s": _median_steady(both["step_seconds"]),
            "trainer_beside_rollout_step_s": _median_steady(t_both)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=4096,
                    help="sampler.max_batch of the digenrl+batch variant (trajectory rows per forward)")
    args = ap.parse_args()
    # no held-out evaluation (the default evaluates 640 samples at version 0, inside the
    # measured window, on trainer rank 0 in one mode and the only process in another)
    base = [f"run.steps={args.steps}", "run.eval_every=0"]
    plan = {
        "digenrl": ("digenrl", ["runtime.tag=never", "run.threads=1"]),
        "digenrl+tag": ("digenrl", ["runtime.tag=bts", "run.threads=1"]),
        # step-level batching: every fragment of a step in one forward (rl/batching.py)
        "digenrl+batch": ("digenrl", ["runtime.tag=never", "run.threads=1", f"sampler.max_batch={args.max_batch}",
                                      "sampler.cond_cache_mb=256"]),
        "disagg-sync": ("disagg-sync", ["run.threads=1"]),
        "colocated-2thr": ("colocated", ["run.threads=2", "cluster.trainers=1"]),
        "colocated-2rank": ("colocated", ["run.threads=1", "cluster.trainers=2"]),
    }
    runs: dict[str, list[dict]] = {}
    alone: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for rep in range(args.repeats):
            for name, (mode, ov) in plan.items():
                if args.only and name not in args.only:
                    continue
                r = run_mode(f"{name}-{rep}", mode, [*base, *ov, *args.overrides], tmp, args.config)
                runs.setdefault(name, []).append(r)
                busy = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["busy"].items()))
                steady = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["steady_busy"].items()))
                print(f"[{rep}] {name:16s} {r['samples_per_s']:7.2f} samples/s  steady "
                      f"{r['steady_step_s']:.3f} s/step  busy: {busy}  steady busy: {steady}"
                      + (f"  TAG fragments {r['tag_granted']}" if r["tag_granted"] else ""), flush=True)
            if not args.only or "alone" in args.only:  # interleaved too: the host's speed drifts
                a = run_alone([*base, *args.overrides], args.config, args.steps, tmp)
                alone.append(a)
                print(f"[{rep}] alone            rollout {a['rollout_step_s']:.3f}, trainer "
                      f"{a['trainer_step_s']:.3f} s/step; both at once: rollout "
                      f"{a['rollout_beside_trainer_step_s']:.3f}, trainer "
                      f"{a['trainer_beside_rollout_step_s']:.3f} s/step", flush=True)
        res: dict[str, dict] = {}
        for name, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs)
                   for k in ("samples_per_s", "steady_step_s", "steady_samples_per_s", "tag_granted")}
            med["busy"] = {n: statistics.median(r["busy"].get(n, 0.0) for r in rs) for n in rs[0]["busy"]}
            med["steady_busy"] = {n: statistics.median(r["steady_busy"].get(n, 0.0) for r in rs)
                                  for n in rs[0]["steady_busy"]}
            med["all_samples_per_s"] = [r["samples_per_s"] for r in rs]
            res[name] = med
            busy = ", ".join(f"{k} {v:.0%}" for k, v in sorted(med["busy"].items()))
            steady = ", ".join(f"{k} {v:.1%}" for k, v in sorted(med["steady_busy"].items()))
            print(f"median {name:16s} {med['samples_per_s']:7.2f} samples/s  steady "
                  f"{med['steady_step_s']:.3f} s/step  busy: {busy}  steady busy: {steady}", flush=True)
        if alone:
            res["alone"] = a = {k: statistics.median(x[k] for x in alone) for k in alone[0]}
            print(f"rollout alone    {a['rollout_step_s']:.3f} s/step;  trainer alone "
                  f"{a['trainer_step_s']:.3f} s/step", flush=True)
            print(f"both alone at once (no messages): rollout {a['rollout_beside_trainer_step_s']:.3f} "
                  f"s/step, trainer {a['trainer_beside_rollout_step_s']:.3f} s/step", flush=True)
    ratios = {}
    if "digenrl" in res and "digenrl+batch" in res:
        ratios["digenrl+batch / digenrl"] = res["digenrl+batch"]["samples_per_s"] / res["digenrl"]["samples_per_s"]
    if "digenrl" in res and "disagg-sync" in res:
        ratios["digenrl / disagg-sync"] = res["digenrl"]["samples_per_s"] / res["disagg-sync"]["samples_per_s"]
    colo = [res[k]["samples_per_s"] for k in ("colocated-2thr", "colocated-2rank") if k in res]
    if colo:
        for k in ("digenrl", "digenrl+tag"):
            if k in res:
                ratios[f"{k} / best colocated"] = res[k]["samples_per_s"] / max(colo)
    if "alone" in res:
        floor = max(res["alone"]["rollout_step_s"], res["alone"]["trainer_step_s"])
        shared = max(res["alone"]["rollout_beside_trainer_step_s"],
                     res["alone"]["trainer_beside_rollout_step_s"])
        for k in ("digenrl", "digenrl+tag"):  # TAG off: the pipeline alone; bts: the default config
            if k in res:
                ratios[f"{k} steady step / slower role alone"] = res[k]["steady_step_s"] / floor
                ratios[f"{k} steady step / slower role, both alone at once"] = (
                    res[k]["steady_step_s"] / shared)
    if "digenrl" in res and res["digenrl"]["steady_busy"]:
        # the bubbles themselves: the share of the steady state the busiest role is not busy
        ratios["digenrl (TAG off) busiest role idle in steady state"] = 1.0 - max(
            res["digenrl"]["steady_busy"].values())
    for k, v in ratios.items():
        print(f"{k:42s} {v:.3f}")
    out = Path(__file__).parent / "results" / "modes.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"results": res, "ratios": ratios, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
