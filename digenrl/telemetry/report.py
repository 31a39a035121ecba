"""``digenrl report RUN_DIR``: a summary table and plots of a finished (or running) run.

Reads the run directory (format: docs/metrics.md) and writes into ``out_dir`` (default
``run_dir/report``):

* ``reward.png`` -- reward mean per step with a mean ± std band;
* ``throughput.png`` -- samples/s per step over wall time, with the run's average;
* ``timeline.png`` -- a Gantt chart of the last few steps from ``trace.json``, one row per
  process, coloured by span name; ``wait`` is hatched grey and idle time is white, so the
  bubbles are visible at a glance;
* ``samples.png`` -- the sample grids of the first and last step side by side (a step's
  first fragment when the trainer saved one grid per fragment);
* ``eval.png`` -- held-out evaluation (``eval/`` rows): each value's mean against the
  evaluated policy version, one panel per term.

Every figure has a fixed size (:data:`PNG_SIZES`, pixels) so reports compare across runs.
A missing input skips its figure; :func:`make_report` says which and why.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
from matplotlib.patches import Patch
from PIL import Image

from digenrl.fileio import DamagedFile
from digenrl.telemetry.metrics import is_eval_key, read_metrics
from digenrl.telemetry.trace import (
    BUSY_SPANS,
    SPAN_NAMES,
    Span,
    busy_by_node,
    merge_traces,
    read_trace,
)

__all__ = ["DPI", "PNG_SIZES", "format_summary", "make_report"]

DPI = 100
PNG_SIZES: dict[str, tuple[int, int]] = {  # (width, height) in pixels
    "reward": (900, 500), "throughput": (900, 500), "timeline": (1200, 600), "samples": (1000, 560),
    "eval": (900, 500)}
_EVAL_BOOKKEEPING = {"eval/samples", "eval/seconds", "eval_ema/samples", "eval_ema/seconds"}  # not scores: not plotted
_COLOURS = dict(zip(SPAN_NAMES, ["#1f77b4", "#aec7e8", "#2ca02c", "#ff7f0e", "#d62728",
                                 "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
                                 "#dbdb8d", "#d9d9d9", "#393b79", "#e7969c"], strict=True))
# step_<n>.png (colocated) or step_<n>_f<fragment>.png (trainer rank 0, one per fragment)
_SAMPLE = re.compile(r"step_(\d+)(?:_f(\d+))?\.png$")


def _figure(name: str) -> tuple[Any, Any]:
    w, h = PNG_SIZES[name]
    return plt.subplots(figsize=(w / DPI, h / DPI), dpi=DPI)


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": it would change the pixel size
    plt.close(fig)
    return path


def _bar(fraction: float, width: int = 30) -> str:
    return "#" * round(max(0.0, min(fraction, 1.0)) * width)


def _num(v: Any, spec: str) -> str:
    """``v`` formatted, or "n/a" where metrics.jsonl holds no number (null: a non-finite value
    the writer dropped, or a key the row lacks)."""
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        return format(v, spec)
    width = spec.split(".")[0]
    return format("n/a", f">{width}") if width else "n/a"


def format_summary(run_dir: Path, summary: Mapping[str, Any], busy_trace: Mapping[str, float],
                   metrics: Sequence[Mapping[str, Any]],
                   evals: Sequence[Mapping[str, Any]] = ()) -> str:
    """The text table :func:`make_report` prints."""
    lines = [f"DigenRL run report: {run_dir}"]
    steps = summary.get("steps", len(metrics))
    sps, wall = summary.get("samples_per_s"), summary.get("wall_s")
    lines.append(f"  steps {steps}   wall {wall:.1f} s   throughput {sps:.3f} samples/s"
                 if isinstance(sps, int | float) and isinstance(wall, int | float)
                 else f"  steps {steps}   (no summary.json: run unfinished?)")
    if metrics:
        last = metrics[-1]
        lines.append(f"  last step {last.get('step')}: reward {_num(last.get('reward_mean'), '.4f')}"
                     f" ± {_num(last.get('reward_std'), '.4f')}")
    if evals:
        first, final = evals[0], evals[-1]
        keys = sorted(k for k in final if is_eval_key(k) and k not in _EVAL_BOOKKEEPING)
        lines.append(f"held-out evaluation, version {first['policy_version']} -> {final['policy_version']}")
        lines += [f"  {k:<32} {_num(first.get(k), '8.4f')} -> {_num(final[k], '8.4f')}" for k in keys]
    busy = dict(summary.get("busy") or {})
    nodes = sorted(set(busy) | set(busy_trace))
    if nodes:
        lines.append("busy fraction per process (summary.json | trace.json)")
        width = max(len(n) for n in nodes)
        for n in nodes:
            s = f"{busy[n]:6.1%}" if n in busy else "     –"
            t = f"{busy_trace[n]:6.1%}" if n in busy_trace else "     –"
            lines.append(f"  {n:<{width}}  {s} | {t}  {_bar(busy.get(n, busy_trace.get(n, 0.0)))}")
    batch = dict(summary.get("batch_rows_per_forward") or {})
    if batch:
        lines.append("rollout batch occupancy (trajectory rows per denoiser forward, sampler.max_batch)")
        width = max(len(n) for n in batch)
        lines += [f"  {n:<{width}}  {batch[n]:6.2f}" for n in sorted(batch)]
    hist = {int(k): int(v) for k, v in (summary.get("staleness_hist") or {}).items()}
    if hist:
        total = sum(hist.values()) or 1
        lines.append("staleness of trained trajectories (versions behind)")
        for k in sorted(hist):
            lines.append(f"  {k:>3}  {hist[k]:>8}  {hist[k] / total:6.1%}  {_bar(hist[k] / total)}")
    acc = summary.get("accounting")
    if acc:
        discarded = dict(acc.get("discarded") or {})
        n_disc = sum(discarded.values())
        ok = acc["admitted"] == acc["trained"] + n_disc + acc["in_flight"]
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(discarded.items())) or "none"
        lines.append("accounting (every admitted trajectory ends exactly once)")
        lines.append(f"  admitted {acc['admitted']} = trained {acc['trained']} + discarded "
                     f"{n_disc} ({reasons}) + in flight {acc['in_flight']}   "
                     f"{'OK' if ok else 'MISMATCH'}")
    return "\n".join(lines)


def _plot_reward(metrics: Sequence[Mapping[str, Any]], path: Path) -> Path:
    metrics = [m for m in metrics if isinstance(m.get("reward_mean"), int | float)]  # null: no value
    steps = [m["step"] for m in metrics]
    mean = [m["reward_mean"] for m in metrics]
    std = [m.get("reward_std") or 0.0 for m in metrics]
    fig, ax = _figure("reward")
    ax.fill_between(steps, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                    alpha=0.25, color="#1f77b4", label="mean ± std")
    ax.plot(steps, mean, marker="o", ms=3, color="#1f77b4", label="mean reward")
    ax.set(title="Reward per optimizer step", xlabel="step", ylabel="reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


def _plot_throughput(metrics: Sequence[Mapping[str, Any]], average: float | None,
                     path: Path) -> Path:
    start = metrics[0]["wall_time"] - metrics[0].get("step_seconds", 0.0)
    span_s = metrics[-1]["wall_time"] - start
    unit, scale = ("min", 60.0) if span_s >= 120 else ("s", 1.0)
    t = [(m["wall_time"] - start) / scale for m in metrics]
    rate = [m["samples_per_s"] for m in metrics]
    fig, ax = _figure("throughput")
    ax.plot(t, rate, marker="o", ms=3, label="per step")
    if average is not None:
        ax.axhline(average, ls="--", color="#d62728", label=f"run average {average:.2f}")
    ax.set(title="Throughput (trajectories trained per second)",
           xlabel=f"wall time since start ({unit})", ylabel="samples / s")
    ax.set_ylim(0, 1.15 * max([*rate, average or 0.0]) or 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


def _plot_eval(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    keys = sorted({k for r in rows for k in r if is_eval_key(k)} - _EVAL_BOOKKEEPING)
    terms = sorted({k.split("/")[1] for k in keys})
    fig, _ = _figure("eval")
    fig.clf()
    for i, term in enumerate(terms):
        ax = fig.add_subplot(1, len(terms), i + 1)
        for k in (k for k in keys if k.split("/")[1] == term):
            pts = [(r["policy_version"], r[k]) for r in rows if k in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                    label=("ema " if k.startswith("eval_ema/") else "")
                    + (k.split("/", 2)[2] if k.count("/") > 1 else "mean"))
        ax.set(title=term, xlabel="policy version")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Held-out evaluation (deterministic sampling, fixed seeds)")
    fig.tight_layout()
    return _save(fig, path)


def _depths(spans: list[Span]) -> list[int]:
    """Nesting depth of each span within its (node, tid) track; spans sorted by start."""
    stacks: dict[tuple[str, int], list[float]] = {}
    depth = []
    for s in spans:
        stack = stacks.setdefault((s.node, s.tid), [])
        while stack and stack[-1] <= s.start:
            stack.pop()
        depth.append(len(stack))
        stack.append(s.end)
    return depth


def _plot_timeline(names: list[str], spans: list[Span], last_steps: int, path: Path) -> Path:
    # Step boundaries: the first trainer's optimizer_step ends.
    trainer = next((n for n in names if any(s.node == n and s.name == "optimizer_step"
                                            for s in spans)), None)
    ends = sorted(s.end for s in spans if s.node == trainer and s.name == "optimizer_step")
    t0 = ends[-last_steps - 1] if len(ends) > last_steps else min(s.start for s in spans)
    t1 = ends[-1] if len(ends) > 1 else max(s.end for s in spans)
    shown = sorted((s for s in spans if s.end > t0 and s.start < t1), key=lambda s: (s.start, -s.end))
    busy = busy_by_node(shown, t0, t1)
    fig, ax = _figure("timeline")
    row = {n: i for i, n in enumerate(names)}
    for s, depth in zip(shown, _depths(shown)):
        start, end = max(s.start, t0), min(s.end, t1)
        if s.tid == 0:
            height = 0.7 - 0.15 * min(depth, 3)
            y = row[s.node] - 0.05
        else:  # concurrent tasks: a thin strip under the main track
            height, y = 0.12, row[s.node] + 0.36
        ax.barh(y, (end - start) / 1e6, left=(start - t0) / 1e6, height=height,
                color=_COLOURS.get(s.name, "#7f7f7f"), edgecolor="#555555" if s.name == "wait" else "none",
                hatch="//" if s.name == "wait" else None, linewidth=0.3)
    for e in ends:
        if t0 < e <= t1:
            ax.axvline((e - t0) / 1e6, color="black", ls=":", lw=0.8)
    ax.set_yticks(range(len(names)), [f"{n}\n{busy.get(n, 0.0):.0%} busy" for n in names])
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(0, (t1 - t0) / 1e6)
    n_shown = sum(1 for e in ends if t0 < e <= t1)
    which = f"the last {n_shown} steps" if len(ends) > last_steps else f"all {n_shown} steps"
    ax.set(xlabel="time (s) — dotted lines: optimizer steps",
           title=f"Timeline of {which} (hatched = waiting, white = idle: the bubbles)")
    present = [n for n in SPAN_NAMES if any(s.name == n for s in shown)]
    present += sorted({s.name for s in shown} - set(present))
    handles = [Patch(facecolor=_COLOURS.get(n, "#7f7f7f"), hatch="//" if n == "wait" else None,
                     edgecolor="#555555", label=n + ("" if n in BUSY_SPANS else " (idle)"))
               for n in present]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8,
              title="span", frameon=False)
    fig.tight_layout()
    return _save(fig, path)


def _plot_samples(samples: list[tuple[int, Path]], path: Path) -> Path:
    fig, _ = _figure("samples")
    fig.clf()
    chosen = [samples[0], samples[-1]] if len(samples) > 1 else samples
    for i, (step, p) in enumerate(chosen):
        ax = fig.add_subplot(1, len(chosen), i + 1)
        with Image.open(p) as img:
            ax.imshow(img.convert("RGB"), interpolation="nearest")
        label = "first" if i == 0 else "last"
        ax.set_title(f"step {step} ({label})")
        ax.set_xticks([])
        ax.set_yticks([])  # keep the frame: samples often have white backgrounds
    fig.suptitle("Samples: first and last step")
    fig.tight_layout()
    return _save(fig, path)


def _read_summary(path: Path) -> dict[str, Any]:
    """summary.json, or DamagedFile naming it and what to do."""
    try:
        summary = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (json.JSONDecodeError, RecursionError) as e:
        why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deep"
        raise DamagedFile(f"{path}: not JSON ({why}); the run writes it at its end: resume or "
                          "rerun the run to rewrite it, or move it aside to report the metrics alone") from None
    if not isinstance(summary, dict):
        raise DamagedFile(f"{path}: a JSON {type(summary).__name__}, not an object; move it aside "
                          "to report the metrics alone")
    return summary


def make_report(run_dir: Path | str, out_dir: Path | str | None = None, *,
                stream: TextIO | None = sys.stdout, last_steps: int = 3) -> dict[str, Any]:
    """Print the summary table of ``run_dir`` to ``stream`` and write the report's PNGs.

    Returns ``{"table": str, "summary": dict, "busy_trace": {node: fraction over the
    whole trace}, "pngs": {name: path}, "skipped": {name: reason}}``.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist")
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary_path = run_dir / "summary.json"
    summary = _read_summary(summary_path) if summary_path.exists() else {}
    metrics = read_metrics(run_dir)

    trace_path = run_dir / "trace.json"
    if not trace_path.exists() and any((run_dir / "trace").glob("*.jsonl")):
        trace_path = merge_traces(run_dir)
    names, spans = read_trace(trace_path) if trace_path.exists() else ([], [])
    busy_trace = (busy_by_node(spans, min(s.start for s in spans), max(s.end for s in spans))
                  if spans else {})

    pngs: dict[str, str] = {}
    skipped: dict[str, str] = {}
    if metrics:
        pngs["reward"] = str(_plot_reward(metrics, out / "reward.png"))
        pngs["throughput"] = str(_plot_throughput(metrics, summary.get("samples_per_s"),
                                                  out / "throughput.png"))
    else:
        skipped["reward"] = skipped["throughput"] = "metrics.jsonl is missing or empty"
    evals = read_metrics(run_dir, kind="eval")
    if evals:
        pngs["eval"] = str(_plot_eval(evals, out / "eval.png"))
    else:
        skipped["eval"] = "no eval/ rows in metrics.jsonl (run.eval_every = 0)"
    if spans:
        pngs["timeline"] = str(_plot_timeline(names, spans, last_steps, out / "timeline.png"))
    else:
        skipped["timeline"] = "no trace.json and no trace/*.jsonl"
    found = sorted((int(m.group(1)), int(m.group(2) or 0), p)
                   for p in (run_dir / "samples").glob("step_*.png") if (m := _SAMPLE.search(p.name)))
    firsts: dict[int, Path] = {}  # each step's first fragment
    for step, _, p in found:
        firsts.setdefault(step, p)
    samples = sorted(firsts.items())
    if samples:
        pngs["samples"] = str(_plot_samples(samples, out / "samples.png"))
    else:
        skipped["samples"] = "no samples/step_<n>.png"

    table = format_summary(run_dir, summary, busy_trace, metrics, evals)
    table += "".join(f"\n  {name}: {p}" for name, p in pngs.items())
    table += "".join(f"\n  {name}: skipped ({why})" for name, why in skipped.items())
    if stream is not None:
        print(table, file=stream)
    return {"table": table, "summary": summary, "busy_trace": busy_trace, "pngs": pngs,
            "skipped": skipped}
