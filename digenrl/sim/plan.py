"""``digenrl plan``: throughput, step time and bubbles per mode, ablations, split search, calibration.

    digenrl plan --config configs/models/flux.toml --cluster configs/clusters/h800-32.toml
    digenrl plan --config configs/models/flux.toml --cluster ... --search --timeline flux.png
    digenrl plan --calibrate runs/colocated-x          # writes runs/colocated-x/costfit.json
    digenrl plan --cost runs/colocated-x/costfit.json  # predicts the tiny config on this machine

Modes are the scheduler configurations of DESIGN.md, with two simulator choices that make
the baselines fair (documented in docs/benchmarks.md): colocated splits each step into one
fragment per trainer (its SPMD data-parallel generation), and disagg-sync spreads the batch over
all rollouts but trains only once the whole batch is in (no GAP).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from digenrl.config import Config, ResolvedConfig, check_mode, resolve_mode
from digenrl.core.costmodel import load_calibration
from digenrl.sim.calibrate import calibrate
from digenrl.sim.cluster import Cluster, load_cluster
from digenrl.sim.simulator import SimResult, SimSetup, simulate, trained_timesteps

ABLATIONS = ("gap", "tsp", "k1", "tag", "relay")


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(1, cap))


def mode_run(cfg: Config, mode: str, cluster: Cluster, *, trainers: int | None = None,
             off: str | None = None, **setup_kw: Any) -> tuple[ResolvedConfig, SimSetup]:
    """The (config, SimSetup) pair one simulated mode (optionally with one mechanism off) runs:
    ``cfg`` resolved for ``mode`` (the planner's question is this config in each mode), with
    the planner's choices on top: the baselines' fragments, the ablated mechanism, the split."""
    rollouts: list[str]
    if mode == "colocated":
        rollouts, train = [], cluster.all_gpus()
    else:
        rollouts, train = cluster.split(trainers)
    c = resolve_mode(cfg, mode)
    rt = c.runtime
    P = c.train.prompts_per_step
    gap = mode == "digenrl"
    if mode == "colocated":
        rt = dataclasses.replace(rt, fragments_per_step=_divisor_at_most(P, len(train)))
    elif mode == "disagg-sync":
        rt = dataclasses.replace(rt, fragments_per_step=_divisor_at_most(P, len(rollouts)))
    if off == "gap":
        gap = False
    elif off == "tsp":
        rt = dataclasses.replace(rt, tsp=False)
    elif off == "k1":
        rt = dataclasses.replace(rt, staleness=0)
    elif off == "tag":
        rt = dataclasses.replace(rt, tag="never")
    elif off == "relay":  # every rollout fetches each version from trainer rank 0
        rt = dataclasses.replace(rt, weights_fanout=0)
    cl = dataclasses.replace(c.cluster, rollouts=len(rollouts), trainers=len(train))
    # still resolved: the mode's K, TSP and TAG are kept or switched off, the rollout count
    # stays 0 for colocated; only the baselines' fragments are the planner's own
    c = ResolvedConfig(dataclasses.replace(c, runtime=rt, cluster=cl))
    return c, SimSetup(rollout_gpus=tuple(rollouts), trainer_gpus=tuple(train),
                       network=cluster.network, gap=gap, **setup_kw)


def _row(name: str, r: SimResult, base: float | None) -> dict[str, Any]:
    return {"name": name, "samples_per_s": r.samples_per_s, "s_per_step": r.s_per_step,
            "busy_rollout": r.busy_by_role.get("rollout"), "busy_trainer": r.busy_by_role.get("trainer"),
            "bubble_s_per_step": r.bubble_s_per_step,
            "speedup_vs_colocated": r.samples_per_s / base if base else None}


def plan(cfg: Config, cluster: Cluster, modes: list[str], *, calibration: dict[str, Any] | None = None,
         search: bool = False, ablate: bool = True) -> dict[str, Any]:
    """Simulate every mode (+ ablations and split search); plain data, deterministic."""
    kw: dict[str, Any] = {"calibration": calibration, "seed": cfg.run.seed}  # SimSetup fields
    results: dict[str, SimResult] = {}
    for m in modes:
        results[m] = simulate(*mode_run(cfg, m, cluster, **kw))
    base = results["colocated"].samples_per_s if "colocated" in results else None
    out: dict[str, Any] = {"cluster": cluster.name, "gpus": cluster.size, "model": cfg.model.family,
                           "batch": cfg.batch_size, "steps": cfg.run.steps,
                           "trained_timesteps": len(trained_timesteps(cfg)),
                           "modes": [_row(m, r, base) for m, r in results.items()]}
    if ablate and "digenrl" in modes:
        out["ablation"] = [_row(f"digenrl -{a}", simulate(*mode_run(cfg, "digenrl", cluster, off=a, **kw)), base)
                           for a in ABLATIONS]
    if search:
        best: dict[str, Any] | None = None
        tried = []
        for t in range(1, cluster.size):
            for off in (None, "tsp"):
                r = simulate(*mode_run(cfg, "digenrl", cluster, trainers=t, off=off, **kw))
                tried.append({"trainers": t, "rollouts": cluster.size - t, "tsp": off is None,
                              "samples_per_s": r.samples_per_s})
                if best is None or r.samples_per_s > best["samples_per_s"]:
                    best = {**tried[-1], **_row("digenrl best split", r, base)}
        out["search"] = {"best": best, "tried": tried}
    out["_results"] = results
    return out


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render(report: dict[str, Any]) -> str:
    """The human table."""
    lines = [f"model {report['model']}  cluster {report['cluster']} ({report['gpus']} GPUs)  "
             f"batch {report['batch']}  trained timesteps {report['trained_timesteps']}  "
             f"simulated steps {report['steps']}", "",
             f"{'mode':24} {'samples/s':>10} {'s/step':>10} {'busy roll':>9} {'busy train':>10} "
             f"{'bubble s':>9} {'x coloc':>8}"]
    rows = report["modes"] + report.get("ablation", [])
    if report.get("search"):
        rows = [*rows, report["search"]["best"]]
    for r in rows:
        lines.append(f"{r['name']:24} {r['samples_per_s']:10.4g} {r['s_per_step']:10.4g} "
                     f"{_fmt(r['busy_rollout'], '9.2f')} {_fmt(r['busy_trainer'], '10.2f')} "
                     f"{r['bubble_s_per_step']:9.3g} {_fmt(r['speedup_vs_colocated'], '8.2f')}")
    if report.get("search"):
        b = report["search"]["best"]
        lines.append(f"best split: {b['trainers']} trainers + {b['rollouts']} rollouts, "
                     f"TSP {'on' if b['tsp'] else 'off (data parallel)'}")
    return "\n".join(lines)


def draw_timeline(results: dict[str, SimResult], path: str | Path) -> Path:
    """Gantt of the last simulated steps of each mode (matplotlib Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"generate": "tab:blue", "tag_generate": "tab:cyan", "fragment_train": "tab:orange",
              "optimizer_step": "tab:red", "weight_apply": "tab:green"}
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 2 + 2.2 * len(results)), squeeze=False)
    for ax, (mode, r) in zip(axes[:, 0], results.items()):
        nodes = sorted({s[0] for s in r.timeline}, key=lambda n: (n.startswith("trainer"), n))
        t0 = min((s[2] for s in r.timeline), default=0.0)
        for y, node in enumerate(nodes):
            for n, name, a, b in r.timeline:
                if n == node:
                    ax.barh(y, b - a, left=a - t0, color=colors.get(name, "grey"), height=0.8)
        ax.set_yticks(range(len(nodes)), nodes, fontsize=6)
        ax.set_title(f"{mode}: {r.samples_per_s:.3g} samples/s, {r.s_per_step:.3g} s/step", fontsize=9)
        ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ----------------------------------------------------------------------------- calibration


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What ``digenrl plan`` was asked besides the config (digenrl/cli.py builds it)."""

    cluster: str | None = None
    """--cluster: cluster TOML (GPU types per role); None = the planner's default."""
    modes: tuple[str, ...] = ("colocated", "disagg-sync", "digenrl")
    """--modes: the modes to simulate, in the report's order."""
    cost: str | None = None
    """--cost: a cost model fitted by --calibrate (costfit.json)."""
    json: bool = False
    """--json: the report as JSON instead of the table."""
    timeline: str | None = None
    """--timeline: write a Gantt chart of each mode's last steps to this PNG."""
    search: bool = False
    """--search: also search the rollout/trainer split."""


def calibrate_run(run_dir: str) -> int:
    """``digenrl plan --calibrate RUN_DIR``: fit the cost model to a run, write costfit.json."""
    fit = calibrate(run_dir)
    out = Path(run_dir) / "costfit.json"
    out.write_text(json.dumps(fit, indent=2, sort_keys=True) + "\n")
    print(json.dumps(fit, indent=2, sort_keys=True))
    print(f"written {out}; predict with: digenrl plan --config <tiny> --cost {out}")
    return 0


def run_plan(cfg: Config, opts: PlanOptions) -> int:
    """Entry point of ``digenrl plan`` (wired in digenrl/cli.py): ``cfg`` in each of
    ``opts.modes``, printed as a table or JSON."""
    cluster = load_cluster(opts.cluster)
    calibration = load_calibration(opts.cost) if opts.cost else None
    for m in opts.modes:
        check_mode(m)  # names the bad mode before anything is simulated
    report = plan(cfg, cluster, list(opts.modes), calibration=calibration, search=opts.search)
    results = report.pop("_results")
    if opts.timeline:
        print(f"timeline: {draw_timeline(results, opts.timeline)}")
    print(json.dumps(report, indent=2, sort_keys=True) if opts.json else render(report))
    return 0
