"""Fit the cost model to a real run: ``digenrl plan --calibrate RUN_DIR``.

Reads the spans every node recorded (``RUN_DIR/trace/<node>.jsonl``) and the run's
``config.toml``, and returns per-unit seconds in the simulator's terms (``NodeCosts`` fields
plus the cluster-level ``weight_fetch_s``, ``weight_apply_s`` and ``latency_s``). Only steady-state work counts:
spans of the first ``warmup_steps`` steps (torch's first passes, allocator growth, the
pipeline filling) are left out, which is also what ``bench/plan_vs_real.py`` measures (the
median step after the first).

Each figure is a median over fragments (or steps, or versions), and is measured the way the
simulator spends it, so that no time is counted twice or lost between spans:

============== ============================================================================
gen_step_s     rollout: first denoising pull of a task -> start of its reward, per sample and
               denoising step (covers the pulls and the chunk sends between them)
colo_gen_step_s the same on a trainer (TAG ``tag_generate``); colocated: ``generate`` (which
               includes the reward there) per sample and denoising step
reward_s       ``reward`` start -> the node's next span (reward + sending the commits), per
               sample
train_step_s   ``fragment_train`` per sample and trained timestep the rank trains
optimizer_s    rank 0: ``optimizer_step`` start -> ``weight_publish`` end (colocated:
               ``optimizer_step``)
switch_s       colocated only: per step, step_seconds minus generate, train and optimizer,
               halved (the simulator pays a switch into generation and one back)
weight_fetch_s rollout: one version's ``weight_prefetch`` (background, while generating; the
               simulator starts it on the announcement) or ``weight_fetch`` (at the boundary)
weight_apply_s rollout: ``weight_apply`` start -> the first denoising pull that follows
               (what a trajectory boundary costs once the weights are there)
latency_s      one message, the mean of two medians: commit (the rollout's commit sends end ->
               the waiting trainer's ``fragment_train`` start) and announce (rank 0
               ``weight_publish`` end -> the waiting rollout's ``weight_(pre)fetch`` start)
forward_fixed_s a batching rollout (``sampler.max_batch > 0``): the batching curve, one
forward_row_s  step-batcher step's seconds = fixed + row x rows, least squares over the
               median seconds at each row count its ``denoise_step`` spans carry (``rows``
               in the span's args; a span shared by several fragments counts once); needs
               two or more row counts. ``batch_curve`` holds the medians by rows
============== ============================================================================

The cost model is linear in samples (seconds per sample and step), except for a batching
rollout's curve: with it, ``node_costs`` prices a denoising step at the rows the planned
configuration puts in one forward (:func:`~digenrl.core.costmodel.node_costs`). On the tiny CPU model a
batch of 4 costs nearly what a batch of 16 does (Python overhead per call), so a fit is only
valid for the fragment size it was measured at; :func:`calibrate` records it
(``samples_per_fragment``) and the planner predicts the same configuration.
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from digenrl.config import load_config
from digenrl.telemetry.metrics import read_metrics

GEN_SPANS = ("denoise_step", "tag_generate")
FETCH_SPANS = ("weight_prefetch", "weight_fetch")
_OVERLAP_S = 0.02
"""How far a receiver may start before its sender's last send is done and still count."""


class _Ev:
    __slots__ = ("args", "end", "name", "start")

    def __init__(self, name: str, start: float, end: float, args: dict[str, Any]) -> None:
        self.name, self.start, self.end, self.args = name, start, end, args


def read_spans(run_dir: Path) -> dict[str, list[_Ev]]:
    """Node id -> its "X" spans (seconds on the shared wall clock), sorted by start."""
    out: dict[str, list[_Ev]] = defaultdict(list)
    for f in sorted((run_dir / "trace").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            ev = json.loads(line)
            if ev.get("ph") == "X":
                s = ev["ts_ns"] / 1e9
                out[ev.get("node", f.stem)].append(_Ev(ev["name"], s, s + ev["dur_ns"] / 1e9,
                                                       ev.get("args") or {}))
    for evs in out.values():
        evs.sort(key=lambda e: (e.start, -e.end))
    return dict(out)


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _next_start(evs: list[_Ev], after: float) -> float | None:
    """Start of the node's first span that begins at or after ``after``."""
    starts = [e.start for e in evs]
    i = bisect.bisect_left(starts, after)
    return evs[i].start if i < len(evs) else None


def _within(evs: list[_Ev], name: str, t: float) -> bool:
    """True if a ``name`` span of ``evs`` covers time ``t``."""
    return any(e.name == name and e.start <= t <= e.end for e in evs)


def _generation(evs: list[_Ev], warm: int) -> tuple[list[float], list[float]]:
    """Per task of step >= warm on one node: (generation seconds, reward + commit seconds)."""
    tasks: dict[Any, dict[str, Any]] = {}
    for e in evs:
        if e.name in GEN_SPANS and "task" in e.args:
            t = tasks.setdefault(e.args["task"], {"start": e.start, "step": e.args.get("step", 0)})
            t["start"] = min(t["start"], e.start)
    gen, rew = [], []
    for e in evs:
        if e.name != "reward" or e.args.get("task") not in tasks:
            continue
        t = tasks[e.args["task"]]
        if t["step"] < warm:
            continue
        gen.append(e.start - t["start"])
        nxt = _next_start(evs, e.end)
        if nxt is not None:
            rew.append(nxt - e.start)
    return gen, rew


def _weight_apply(evs: list[_Ev], warm: int) -> list[float]:
    out = []
    for i, e in enumerate(evs):
        if e.name != "weight_apply":
            continue
        for f in evs[i + 1:]:
            if f.name == "wait":
                break  # waited for a newer version: not a boundary's cost
            if f.name in GEN_SPANS:
                if f.args.get("step", 0) >= warm:
                    out.append(f.start - e.start)
                break
    return out


def _latencies(spans: dict[str, list[_Ev]], warm: int) -> list[list[float]]:
    """[commit latencies, announce latencies], each seen only where the receiver was waiting
    for exactly that message.

    A commit counts from the end of the sender's commit sends (its next span after
    ``reward``, the point ``reward_s`` ends) to the trainer's ``fragment_train``; an
    announce from rank 0's ``weight_publish`` end to a rollout's ``weight_(pre)fetch``. Negative
    gaps (the receiver starts while the sender is still sending) count as overlap.
    """
    commits, announces = [], []
    for evs in spans.values():
        for e in evs:
            if e.name == "reward":
                nxt = _next_start(evs, e.end)
                commits.append(e.end if nxt is None else nxt)
            elif e.name == "weight_publish":
                announces.append(e.end)
    commits.sort()
    announces.sort()
    seen: dict[str, list[float]] = {"commit": [], "announce": []}
    for evs in spans.values():
        for e in evs:
            if e.name == "fragment_train" and e.args.get("step", 0) >= warm:
                kind, src, t = "commit", commits, e.start
            elif e.name in FETCH_SPANS and e.args.get("version", 0) >= warm:
                kind, src, t = "announce", announces, e.start
            else:
                continue
            # the latest message sent no later than a little after t (overlap allowed)
            i = bisect.bisect_right(src, t + _OVERLAP_S) - 1
            if i < 0:
                continue
            sent = src[i]
            # the receiver was idle (waiting) just before it started: it waited for this
            if _within(evs, "wait", min(sent, t) - 1e-9):
                seen[kind].append(t - sent)
    return [seen["commit"], seen["announce"]]


def batch_curve(spans: dict[str, list[_Ev]], warm: int) -> dict[int, list[float]]:
    """Rows -> seconds of each step-batcher step of steps >= ``warm`` (the span the batcher's
    step hands every fragment it stepped, counted once per node)."""
    out: dict[int, list[float]] = defaultdict(list)
    for evs in spans.values():
        seen: set[tuple[float, float]] = set()
        for e in evs:
            rows = e.args.get("rows")
            if (e.name in GEN_SPANS and rows and e.args.get("step", 0) >= warm
                    and (e.start, e.end) not in seen):
                seen.add((e.start, e.end))
                out[int(rows)].append(e.end - e.start)
    return dict(out)


def fit_line(points: dict[int, float]) -> tuple[float, float] | None:
    """Least-squares ``(fixed, per_row)`` of seconds = fixed + per_row x rows through the
    points (rows -> seconds), each clamped at 0; None with fewer than two row counts."""
    if len(points) < 2:
        return None
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


def calibrate(run_dir: str | Path, *, warmup_steps: int = 1) -> dict[str, Any]:
    """Fit per-unit seconds (NodeCosts fields + CLUSTER_CALIBRATION keys) to a real run dir."""
    from digenrl.sim.simulator import trained_timesteps

    d = Path(run_dir)
    if not (d / "config.toml").is_file():
        raise ValueError(f"--calibrate {str(run_dir)!r}: no config.toml there (not a run dir)")
    cfg = load_config(d / "config.toml")
    spans = read_spans(d)
    if not spans:
        raise ValueError(f"--calibrate {str(run_dir)!r}: trace/*.jsonl holds no spans")
    T, nt = cfg.sampler.num_steps, len(trained_timesteps(cfg))
    R = max(1, cfg.cluster.trainers)
    colocated = cfg.run.mode == "colocated"
    share = cfg.batch_size // (R if colocated else cfg.runtime.fragments_per_step)
    warm = max(0, min(warmup_steps, cfg.run.steps - 1))

    def steady(name: str, role: str | None = None) -> list[float]:
        return [e.end - e.start for n, evs in spans.items() if role is None or n.startswith(role)
                for e in evs if e.name == name and e.args.get("step", warm) >= warm]

    costs: dict[str, float] = {}
    samples: dict[str, int] = {}
    batch: dict[str, float] = {}

    def put(key: str, values: list[float], per: float) -> None:
        m = _med(values)
        if m is not None:
            costs[key] = m / per
            samples[key] = len(values)

    if colocated:
        put("colo_gen_step_s", steady("generate"), share * T)
        if "colo_gen_step_s" in costs:
            costs["gen_step_s"] = costs["colo_gen_step_s"]
        costs["reward_s"] = 0.0  # inside ``generate``
        put("optimizer_s", steady("optimizer_step"), 1)
    else:
        gen: dict[str, list[float]] = {"rollout": [], "trainer": []}
        rew: list[float] = []
        fetch: list[float] = []
        apply: list[float] = []
        for node, evs in spans.items():
            role = "trainer" if node.startswith("trainer") else "rollout"
            g, r = _generation(evs, warm)
            gen[role] += g
            if role == "rollout":
                rew += r
                apply += _weight_apply(evs, warm)
                fetch += [e.end - e.start for e in evs
                          if e.name in FETCH_SPANS and e.args.get("version", 0) >= warm]
        put("gen_step_s", gen["rollout"], share * T)
        put("colo_gen_step_s", gen["trainer"], share * T)
        put("reward_s", rew, share)
        put("weight_fetch_s", fetch, 1)
        put("weight_apply_s", apply, 1)
        seen = _latencies(spans, warm)
        lat = [max(0.0, m) for m in (_med(x) for x in seen) if m is not None]
        if lat:  # the simulator pays one latency per commit and one per announce
            costs["latency_s"] = sum(lat) / len(lat)
            samples["latency_s"] = sum(len(x) for x in seen)
        rank0 = spans.get("trainer-0", [])
        opt = []
        for i, e in enumerate(rank0):
            if e.name == "optimizer_step" and e.args.get("step", 0) >= warm:
                pub = next((f for f in rank0[i + 1:] if f.name == "weight_publish"), None)
                opt.append((pub.end if pub is not None else e.end) - e.start)
        put("optimizer_s", opt, 1)
        curve = {r: statistics.median(v) for r, v in sorted(batch_curve(spans, warm).items())}
        line = fit_line(curve)
        if line is not None:
            costs["forward_fixed_s"], costs["forward_row_s"] = line
            samples["forward_fixed_s"] = samples["forward_row_s"] = sum(
                len(v) for v in batch_curve(spans, warm).values())
        batch = {str(r): m for r, m in curve.items()}
    per_rank = share * nt if colocated else share * max(1, nt // R if cfg.runtime.tsp else nt)
    put("train_step_s", steady("fragment_train"), per_rank)
    metrics = d / "metrics.jsonl"
    if colocated and metrics.is_file():
        rows = read_metrics(d)  # train rows (evaluation rows apart)
        by_step: dict[int, float] = defaultdict(float)
        for e in spans.get("colocated-0", []):
            if e.name in ("generate", "fragment_train", "optimizer_step"):
                by_step[e.args.get("step", -1)] += e.end - e.start
        rest = [r["step_seconds"] - by_step[r["step"]] for r in rows
                if r.get("step", 0) >= warm and "step_seconds" in r and r.get("step") in by_step]
        m = _med(rest)
        if m is not None:
            costs["switch_s"] = max(0.0, m / 2)
            samples["switch_s"] = len(rest)
    out = {"run_dir": str(d), "mode": cfg.run.mode, "model": cfg.model.family,
           "samples_per_fragment": share, "warmup_steps": warm, "n": samples, "costs": costs}
    if not colocated and batch:
        out["batch_curve"] = batch
    return out
