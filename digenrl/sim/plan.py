"""``digenrl plan``: throughput, step time and bubbles per mode, ablations, split search, calibration.

    digenrl plan --config configs/models/flux.toml --cluster configs/clusters/h800-32.toml
    digenrl plan --config configs/models/flux.toml --cluster ... --search --timeline flux.png
    digenrl plan --calibrate runs/colocated-x          # writes runs/colocated-x/costfit.json
    digenrl plan --cost runs/colocated-x/costfit.json  # predicts the tiny config on this machine

Modes are the scheduler configurations of DESIGN.md, with two simulator choices that make
the baselines fair (documented in docs/benchmarks.md): colocated splits each step into one
fragment per trainer (its SPMD data-parallel generation), and disagg-sync spreads the batch over
all rollouts but trains only once the whole batch is in (no GAP).

Sequence parallelism is planned as configured: ``train.sequence_parallel`` = N groups the
trainer GPUs N at a time (colocated cannot: its row is planned at N = 1), ``cluster.rollout_gpus``
= G makes each rollout node G GPUs; every row names both. For a family with a sequence-parallel
forward the report's ``sequence_parallel`` table re-plans the digenrl mode at each degree that
divides the trainer count and the model's heads (up to 8), and ``--search`` searches the degree
with the split.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from digenrl.config import Config, ConfigError, ResolvedConfig, check_mode, resolve_mode
from digenrl.core.costmodel import GPUS, MODELS, load_calibration
from digenrl.sim.calibrate import calibrate
from digenrl.sim.cluster import Cluster, ClusterError, GpuGroup, load_cluster
from digenrl.sim.simulator import (
    SimResult,
    SimSetup,
    simulate,
    trained_timesteps,
    workload_from_config,
)

ABLATIONS = ("gap", "tsp", "k1", "tag", "relay")


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(1, cap))


def sp_degrees(cfg: Config, trainers: int, cap: int = 8) -> list[int]:
    """Sequence-parallel degrees the planner tries for ``cfg`` over ``trainers`` ranks: those up to
    ``cap`` dividing the trainer count and the model's attention heads; [1] for a family
    without a sequence-parallel forward."""
    arch = MODELS[workload_from_config(cfg).model].arch
    if arch is None:
        return [1]
    return [n for n in range(1, min(cap, trainers) + 1) if trainers % n == 0 and arch.heads % n == 0]


def with_sequence_parallel(cfg: Config, n: int) -> Config:
    """``cfg`` with ``train.sequence_parallel = n``; a TAG-always runtime becomes "bts" for n > 1
    (a sequence-parallel rank does not generate, and the config refuses the pair)."""
    rt = cfg.runtime
    if n > 1 and rt.tag == "always":
        rt = dataclasses.replace(rt, tag="bts")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, sequence_parallel=n), runtime=rt)


def mode_run(cfg: Config, mode: str, cluster: Cluster, *, trainers: int | None = None,
             off: str | None = None, **setup_kw: Any) -> tuple[ResolvedConfig, SimSetup]:
    """The (config, SimSetup) pair one simulated mode (optionally with one mechanism off) runs:
    ``cfg`` resolved for ``mode`` (the planner's question is this config in each mode), with
    the planner's choices on top: the baselines' fragments, the ablated mechanism, the split.
    Colocated runs at ``train.sequence_parallel = 1`` (its ranks generate, which a
    sequence-parallel rank does not)."""
    rollouts: list[str]
    if mode == "colocated":
        rollouts, train = [], cluster.all_gpus()
        cfg = with_sequence_parallel(cfg, 1)
    else:
        rollouts, train = cluster.split(trainers)
    sp, g = cfg.train.sequence_parallel, cfg.cluster.rollout_gpus
    if len(train) % sp:
        raise ClusterError(f"train.sequence_parallel = {sp}: {len(train)} trainer GPUs in {mode} on cluster "
                           f"{cluster.name}; expected a multiple of {sp}")
    if rollouts and len(rollouts) < g:
        raise ClusterError(f"cluster.rollout_gpus = {g}: {len(rollouts)} rollout GPUs in {mode} on cluster "
                           f"{cluster.name}; expected at least {g}")
    c = resolve_mode(cfg, mode)
    rt = c.runtime
    P = c.train.prompts_per_step
    gap = mode == "digenrl"
    if mode == "colocated":
        rt = dataclasses.replace(rt, fragments_per_step=_divisor_at_most(P, len(train)))
    elif mode == "disagg-sync":
        rt = dataclasses.replace(rt, fragments_per_step=_divisor_at_most(P, len(rollouts) // g))
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
    cl = dataclasses.replace(c.cluster, rollouts=len(rollouts) // g, trainers=len(train))
    # still resolved: the mode's K, TSP and TAG are kept or switched off, the rollout count
    # stays 0 for colocated; only the baselines' fragments are the planner's own
    c = ResolvedConfig(dataclasses.replace(c, runtime=rt, cluster=cl))
    return c, SimSetup(rollout_gpus=tuple(rollouts), trainer_gpus=tuple(train),
                       network=cluster.network, gap=gap, **setup_kw)


def config_cluster(cfg: Config) -> Cluster:
    """The cluster ``cfg`` itself describes: ``cluster.trainers`` trainer GPUs of its trainer type
    and ``cluster.rollouts`` x ``cluster.rollout_gpus`` rollout GPUs of its rollout type."""
    c = cfg.cluster
    groups = [GpuGroup(type=c.trainer_gpu or c.gpu, count=c.trainers, role="trainer")]
    if c.rollouts:
        groups.append(GpuGroup(type=c.rollout_gpu or c.gpu, count=c.rollouts * c.rollout_gpus, role="rollout"))
    for g in groups:
        if g.type not in GPUS:
            raise ClusterError(f"cluster.gpu = {g.type!r}: the cost model knows {', '.join(GPUS)}")
    return Cluster(name="config", gpus=tuple(groups))


def throughput_at(cfg: Config, cluster: Cluster, *, sequence_parallel: int, gradient_checkpointing: bool,
                  rows: int, calibration: dict[str, Any] | None = None) -> dict[str, Any]:
    """The digenrl mode's row for ``cfg`` changed to a trainer setting (what ``plan --memory``
    found to fit): its sequence-parallel degree, activation checkpointing and rows per
    forward (fragments per step). A layout the cluster cannot hold names why (``error``)."""
    t = cfg.train
    c = with_sequence_parallel(cfg, sequence_parallel)
    c = dataclasses.replace(
        c, model=dataclasses.replace(c.model, gradient_checkpointing=gradient_checkpointing),
        runtime=dataclasses.replace(c.runtime, fragments_per_step=max(1, t.prompts_per_step // max(1, rows // t.group_size))))
    try:
        r = simulate(*mode_run(c, "digenrl", cluster, calibration=calibration, seed=cfg.run.seed))
    except (ClusterError, ConfigError) as e:
        return {"cluster": cluster.name, "sequence_parallel": sequence_parallel, "error": str(e)}
    return {"cluster": cluster.name, **_row("digenrl", r, None)}


def _row(name: str, r: SimResult, base: float | None) -> dict[str, Any]:
    return {"name": name, "samples_per_s": r.samples_per_s, "s_per_step": r.s_per_step,
            "sequence_parallel": r.sequence_parallel, "rollout_gpus": r.rollout_gpus,
            "train_s_per_sample_timestep": r.train_step_s,
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
    if "digenrl" in modes:
        degrees = sp_degrees(cfg, len(cluster.split()[1]))
        if len(degrees) > 1:  # the digenrl mode at each degree the trainer count allows
            out["sequence_parallel"] = [
                _row(f"digenrl sp={n}", simulate(*mode_run(with_sequence_parallel(cfg, n), "digenrl",
                                                           cluster, **kw)), base)
                for n in degrees]
    if search:
        best: dict[str, Any] | None = None
        tried = []
        g = cfg.cluster.rollout_gpus
        for t in range(1, cluster.size):
            rollouts_t, trainers_t = cluster.split(t)
            if len(rollouts_t) < g:
                continue
            for n in sp_degrees(cfg, len(trainers_t)):
                for off in (None, "tsp"):
                    r = simulate(*mode_run(with_sequence_parallel(cfg, n), "digenrl", cluster, trainers=t,
                                           off=off, **kw))
                    tried.append({"trainers": t, "rollouts": len(rollouts_t) // g, "tsp": off is None,
                                  "sequence_parallel": n, "samples_per_s": r.samples_per_s})
                    if best is None or r.samples_per_s > best["samples_per_s"]:
                        best = {**tried[-1], **_row("digenrl best split", r, base)}
        out["search"] = {"best": best, "tried": tried}
    out["_results"] = results
    return out


def _fmt(x: Any, spec: str) -> str:
    return "-".rjust(int(spec.split(".")[0].rstrip("dfg") or 0)) if x is None else format(x, spec)


def render(report: dict[str, Any]) -> str:
    """The human table."""
    lines = [f"model {report['model']}  cluster {report['cluster']} ({report['gpus']} GPUs)  "
             f"batch {report['batch']}  trained timesteps {report['trained_timesteps']}  "
             f"simulated steps {report['steps']}", "",
             f"{'mode':24} {'samples/s':>10} {'s/step':>10} {'busy roll':>9} {'busy train':>10} "
             f"{'bubble s':>9} {'x coloc':>8} {'SP':>3} {'roll GPUs':>9}"]
    rows = report["modes"] + report.get("ablation", []) + report.get("sequence_parallel", [])
    if report.get("search"):
        rows = [*rows, report["search"]["best"]]
    for r in rows:
        lines.append(f"{r['name']:24} {r['samples_per_s']:10.4g} {r['s_per_step']:10.4g} "
                     f"{_fmt(r['busy_rollout'], '9.2f')} {_fmt(r['busy_trainer'], '10.2f')} "
                     f"{r['bubble_s_per_step']:9.3g} {_fmt(r['speedup_vs_colocated'], '8.2f')} "
                     f"{r['sequence_parallel']:3d} {_fmt(r['rollout_gpus'], '9d')}")
    if report.get("search"):
        b = report["search"]["best"]
        lines.append(f"best split: {b['trainers']} trainers + {b['rollouts']} rollouts, "
                     f"TSP {'on' if b['tsp'] else 'off (data parallel)'}, "
                     f"train.sequence_parallel = {b['sequence_parallel']}")
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
