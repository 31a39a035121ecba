"""The real runtime at paper scale on emulated accelerators, against the planner's prediction.

    .venv/bin/python bench/scale.py --recipe configs/models/flux.toml \\
        --cluster configs/clusters/mixed-h100-h20-32.toml [--json] [--steps 10] [--time-scale 0.1]
        [--churn-at STEP]

Every node is a real process on loopback (coordinator in this process, rollouts and trainer
ranks as the launcher's supervised children, gloo between the ranks), running the recipe with
``model.path = "emulated"`` (:mod:`digenrl.models.emulated`): each forward, backward, decode
and optimizer step sleeps the cost model's seconds for the node's GPU type x ``--time-scale``.
The split is the planner's default (fixed roles honoured, half/half for ``any``), and
``planned_s_per_step`` is :func:`digenrl.sim.plan.plan` of the same recipe, cluster, split and
steps. Times are undilated (wall seconds / time scale), comparable with the plan.

Keys of ``--json``: ``nodes``, ``measured_s_per_step`` (mean over the steps after the
planner's warm-up, from the coordinator's step times), ``planned_s_per_step``,
``overhead_vs_slower_role`` (measured over the slower role's emulated step time alone, from
the same cost-model seconds the nodes sleep: rollouts generating one step's fragments spread
over them; the busiest trainer rank training its TSP x DP share plus the step's all-reduce
and optimizer), ``coordinator_cpu_share`` (this process's CPU seconds over the run's wall
seconds: the coordinator and the launcher's supervision), ``messages_per_step`` and
``bytes_per_step`` (every socket's sends over the steady steps, from heartbeats),
``weight_sync_s`` (median over versions of the time from trainer rank 0's publish to the
last rollout holding the version, from the nodes' traces; loopback with weights x
``--weight-scale``, so it is not the emulated network's figure), plus ``accounting``,
``latent_shape``, ``weight_set_bytes`` and the knobs. ``accounting_exact`` and
``every_live_rollout_holds_final`` (summary.json's weights section) are checked for every run;
``--churn-at STEP`` also kills a rollout and adds one mid-run (``churn``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from digenrl.config import Config, load_config, resolve_mode
from digenrl.core import costmodel as cm
from digenrl.core.plan import owners_for, plan_for_step
from digenrl.sim.cluster import Cluster, load_cluster
from digenrl.sim.plan import plan
from digenrl.sim.simulator import workload_from_config

ROOT = Path(__file__).resolve().parents[1]


def emulated_config(recipe: Config, cluster: Cluster, *, steps: int, time_scale: float,
                    latent_scale: float, weight_scale: float) -> tuple[Config, list[str], list[str]]:
    """The recipe on ``cluster``'s default split, emulated; (config, rollout GPUs, trainer GPUs)."""
    rollouts, trainers = cluster.split()
    for role, gpus in (("rollout", rollouts), ("trainer", trainers)):
        if len(set(gpus)) != 1:
            raise SystemExit(f"bench/scale.py: {cluster.name}: the {role}s mix GPU types {sorted(set(gpus))}; "
                             "a launch declares one type per role")
    emulate = dataclasses.replace(recipe.model.emulate, time_scale=time_scale, latent_scale=latent_scale,
                                  weight_scale=weight_scale, link_gbs=cluster.network.link_gbs)
    cfg = dataclasses.replace(
        recipe,
        run=dataclasses.replace(recipe.run, steps=steps, threads=1),
        model=dataclasses.replace(recipe.model, path="emulated", emulate=emulate),
        cluster=dataclasses.replace(recipe.cluster, rollouts=len(rollouts), trainers=len(trainers),
                                    rollout_gpu=rollouts[0], trainer_gpu=trainers[0]))
    return resolve_mode(cfg), rollouts, trainers


def role_alone_s(cfg: Config, rollouts: list[str], trainers: list[str], net: cm.Network) -> dict[str, float]:
    """Seconds a step takes each role alone, from the cost-model seconds the emulated nodes sleep."""
    wl = workload_from_config(cfg)
    F, R = cfg.runtime.fragments_per_step, len(trainers)
    n = cfg.batch_size // F
    gen = cm.node_costs(rollouts[0], wl)
    frag_gen = n * cfg.sampler.num_steps * gen.gen_step_s + n * gen.reward_s
    rollout = F * frag_gen / len(rollouts)  # steady state: K = 1 lets fragments of two steps mix
    train = cm.node_costs(trainers[0], wl, trainer_ranks=R)
    trained = plan_for_step(cfg, 0)[0]
    units = [0.0] * R
    for f in range(F):
        for rank in owners_for(trained, R, cfg.runtime.tsp, f, F):
            units[rank] += n
    trainer = max(units) * train.train_step_s + train.optimizer_s \
        + cm.step_sync_s(wl.model, wl.lora_rank, trainers, net)
    return {"rollout": rollout, "trainer": trainer}


def steady_s_per_step(rows: list[dict[str, Any]], steps: int) -> tuple[float, int, int]:
    """(mean wall seconds per step after the planner's warm-up, first, last step index used)."""
    warm = min(2, steps // 4)
    t = {int(r["step"]): float(r["wall_time"]) for r in rows}
    first = warm - 1
    if first < 0:
        return t[steps - 1] / steps, -1, steps - 1
    return (t[steps - 1] - t[first]) / (steps - 1 - first), first, steps - 1


def weight_sync(run_dir: Path) -> list[float]:
    """Per version >= 1: seconds from rank 0's publish (end of its weight_publish span) to the
    last rollout holding it (end of its weight_prefetch / weight_fetch span of that version)."""
    published: dict[int, float] = {}
    held: dict[int, dict[str, float]] = {}
    for path in sorted((run_dir / "trace").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e.get("ph") != "X" or "version" not in e.get("args", {}):
                continue
            end = (e["ts_ns"] + e["dur_ns"]) / 1e9
            v = int(e["args"]["version"])
            if e["name"] == "weight_publish" and e["node"] == "trainer-0":
                published[v] = end
            elif e["name"] in ("weight_prefetch", "weight_fetch"):
                held.setdefault(v, {})[e["node"]] = min(end, held.get(v, {}).get(e["node"], math.inf))
    return [max(held[v].values()) - published[v] for v in sorted(published) if v >= 1 and v in held]


class Churn:
    """``--churn-at STEP``: once step STEP is logged, SIGKILL ``rollout-1`` (the launcher restarts
    it: a leave, then a join) and start one rollout more, ``rollout-extra``, dialling the
    coordinator from outside the launcher (a join the launcher knows nothing about)."""

    def __init__(self, run_dir: Path, at: int) -> None:
        self.run_dir, self.at = run_dir, at
        self.extra: subprocess.Popen[bytes] | None = None
        self.done = threading.Event()
        self.stop = threading.Event()
        self.error = ""
        self.thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self.thread.start()

    def _reached(self) -> bool:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return False
        return any(json.loads(line).get("step", -1) >= self.at for line in path.read_text().splitlines()
                   if line.strip())

    def _run(self) -> None:
        while not self.stop.is_set() and not self._reached():
            time.sleep(0.5)
        if self.stop.is_set():
            self.error = f"the run ended before step {self.at}"
            return
        pids = json.loads((self.run_dir / "logs" / "pids.json").read_text())
        argv = Path(f"/proc/{pids['rollout-1']}/cmdline").read_bytes().decode().split("\0")
        coordinator = argv[argv.index("--coordinator") + 1]
        gpu = argv[argv.index("--gpu") + 1]
        os.kill(pids["rollout-1"], signal.SIGKILL)
        err = open(self.run_dir / "logs" / "rollout-extra.stderr", "ab")  # noqa: SIM115 - the child owns it
        self.extra = subprocess.Popen(
            [sys.executable, "-m", "digenrl.cli", "node", "--role", "rollout", "--coordinator", coordinator,
             "--node-id", "rollout-extra", "--run-dir", str(self.run_dir), "--gpu", gpu],
            stdout=err, stderr=err, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
        err.close()
        self.done.set()

    def finish(self) -> dict[str, Any]:
        self.stop.set()
        self.thread.join(30)
        code = None
        if self.extra is not None:
            try:
                code = self.extra.wait(120)
            except subprocess.TimeoutExpired:
                self.extra.kill()
                code = self.extra.wait()
        return {"at_step": self.at, "killed": "rollout-1", "added": "rollout-extra",
                "acted": self.done.is_set(), "error": self.error, "added_exit_code": code}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from digenrl.launch import launch, make_run_dir

    recipe = load_config(args.recipe)
    cluster = load_cluster(args.cluster)
    cfg, rollouts, trainers = emulated_config(recipe, cluster, steps=args.steps, time_scale=args.time_scale,
                                              latent_scale=args.latent_scale, weight_scale=args.weight_scale)
    planned_cfg = dataclasses.replace(recipe, run=dataclasses.replace(recipe.run, steps=args.steps))
    report = plan(planned_cfg, cluster, ["digenrl"], ablate=False)
    report.pop("_results")
    planned = report["modes"][0]["s_per_step"]
    run_dir = make_run_dir(cfg, args.run_dir or tempfile.mkdtemp(prefix="scale-"))
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    churn = Churn(run_dir, args.churn_at) if args.churn_at is not None else None
    try:
        summary = launch(cfg, run_dir)
    finally:
        churned = churn.finish() if churn is not None else None
    cpu1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    measured_wall, first, last = steady_s_per_step(rows, args.steps)
    by_step = {int(r["step"]): r for r in rows}
    span = last - first
    msgs = (by_step[last]["net_messages"] - (by_step[first]["net_messages"] if first >= 0 else 0)) / span
    nbytes = (by_step[last]["net_bytes"] - (by_step[first]["net_bytes"] if first >= 0 else 0)) / span
    scale = args.time_scale
    measured = measured_wall / scale
    alone = role_alone_s(cfg, rollouts, trainers, cluster.network)
    syncs = weight_sync(run_dir)
    from digenrl.models.emulated import latent_shape, weight_numel
    elem = 2 if cfg.model.dtype in ("bfloat16", "float16") else 4
    return {
        "recipe": args.recipe, "cluster": cluster.name, "nodes": len(rollouts) + len(trainers),
        "rollouts": f"{len(rollouts)} x {rollouts[0]}", "trainers": f"{len(trainers)} x {trainers[0]}",
        "steps": args.steps, "steady_steps": f"{first + 1}..{last}",
        "measured_s_per_step": measured, "planned_s_per_step": planned,
        "measured_over_planned": measured / planned,
        "role_alone_s": alone, "slower_role": max(alone, key=alone.__getitem__),
        "overhead_vs_slower_role": measured / max(alone.values()),
        "coordinator_cpu_share": (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / wall,
        "messages_per_step": msgs, "bytes_per_step": nbytes,
        "weight_sync_s": statistics.median(syncs) / scale if syncs else None,
        "weight_sync_s_max": max(syncs) / scale if syncs else None,
        "accounting": summary["accounting"], "stop_reason": summary.get("stop_reason"),
        "accounting_exact": _exact(summary["accounting"]),
        "weights": {k: summary.get("weights", {}).get(k) for k in ("live_rollouts", "held_final")},
        "every_live_rollout_holds_final": set(summary.get("weights", {}).get("live_rollouts") or ["?"])
        == set(summary.get("weights", {}).get("held_final") or []),
        "recovery": summary.get("recovery"), "churn": churned,
        "time_scale": scale, "latent_scale": args.latent_scale, "weight_scale": args.weight_scale,
        "latent_shape": list(latent_shape(cfg.model)), "weight_set_bytes": weight_numel(cfg.model) * elem,
        "wall_s": wall, "run_dir": str(run_dir),
        "load_average": os.getloadavg(),
    }


def _exact(acc: dict[str, Any]) -> bool:
    """Every admitted trajectory trained or discarded with a reason, none left in flight."""
    return acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) and acc["in_flight"] == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True, help="a recipe TOML (configs/models/*.toml)")
    ap.add_argument("--cluster", required=True, help="a cluster TOML (configs/clusters/*.toml)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--time-scale", type=float, default=0.1, help="wall seconds per emulated second")
    ap.add_argument("--latent-scale", type=float, default=1 / 64)
    ap.add_argument("--weight-scale", type=float, default=1e-4)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--churn-at", type=int, default=None, metavar="STEP",
                    help="at STEP: SIGKILL rollout-1 (restarted by the launcher) and add one rollout")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:26s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
