"""Simulator and planner: determinism, scheduler invariants under losses, closed-form step times."""

from __future__ import annotations

import dataclasses
import json

import pytest

from digenrl.config import load_config
from digenrl.core.costmodel import CostModelError, Network, Workload, load_calibration, node_costs
from digenrl.sim.cluster import Cluster, ClusterError, GpuGroup, cluster_from_dict
from digenrl.sim.plan import mode_run, plan
from digenrl.sim.simulator import simulate, trained_timesteps

FREE = Network(link_gbs=1e15, weight_gbs=1e15, latency_s=0.0)
COSTS = {"gen_step_s": 0.01, "colo_gen_step_s": 0.01, "train_step_s": 0.02, "reward_s": 0.0,
         "optimizer_s": 0.0, "switch_s": 0.5}


def _cfg(steps: int = 6, *overrides: str):
    return load_config(None, [f"run.steps={steps}", *overrides])


def _one_each() -> Cluster:
    return Cluster(name="one-each", gpus=(GpuGroup(type="cpu", count=1, role="trainer"),
                                          GpuGroup(type="cpu", count=1, role="rollout")), network=FREE)


def _run(cfg, mode, cluster, **kw):
    c, setup = mode_run(cfg, mode, cluster, calibration=COSTS, **kw)
    return c, simulate(c, setup)


def _gen_train(cfg):
    B, T, nt = cfg.batch_size, cfg.sampler.num_steps, len(trained_timesteps(cfg))
    return B * T * COSTS["gen_step_s"], B * nt * COSTS["train_step_s"]


def test_colocated_step_time_is_generation_plus_training_plus_two_switches():
    cfg = _cfg()
    one = Cluster(name="one", gpus=(GpuGroup(type="cpu", count=1, role="trainer"),), network=FREE)
    _, r = _run(cfg, "colocated", one)
    gen, train = _gen_train(cfg)
    assert r.s_per_step == pytest.approx(gen + train + 2 * COSTS["switch_s"], rel=1e-9)


def test_disagg_sync_step_time_is_generation_plus_training():
    cfg = _cfg()
    _, r = _run(cfg, "disagg-sync", _one_each())
    gen, train = _gen_train(cfg)
    assert r.s_per_step == pytest.approx(gen + train, rel=1e-6)


@pytest.mark.parametrize("train_step_s", [0.005, 0.02, 0.05])
def test_digenrl_steady_state_step_time_is_the_slower_of_generation_and_training(train_step_s):
    cfg = _cfg(12, "runtime.tag=never")
    costs = {**COSTS, "train_step_s": train_step_s}
    c, setup = mode_run(cfg, "digenrl", _one_each(), calibration=costs)
    r = simulate(c, setup)
    B, T, nt = cfg.batch_size, cfg.sampler.num_steps, len(trained_timesteps(cfg))
    gen, train = B * T * costs["gen_step_s"], B * nt * train_step_s
    assert r.s_per_step == pytest.approx(max(gen, train), rel=0.02)
    # and it is a real pipeline: far below the sum
    assert r.s_per_step < 0.9 * (gen + train)


def test_same_inputs_give_byte_identical_json():
    cfg = _cfg(5)
    cluster = dataclasses.replace(_one_each(), gpus=(GpuGroup(type="cpu", count=2, role="trainer"),
                                                     GpuGroup(type="cpu", count=3, role="rollout")))

    def once() -> str:
        rep = plan(cfg, cluster, ["colocated", "disagg-sync", "digenrl"], calibration=COSTS)
        rep.pop("_results")
        return json.dumps(rep, sort_keys=True)

    assert once() == once()


def test_random_rollout_losses_keep_staleness_bound_and_exact_accounting():
    cfg = _cfg(15, "runtime.fragments_per_step=4")
    cluster = dataclasses.replace(_one_each(), gpus=(GpuGroup(type="cpu", count=2, role="trainer"),
                                                     GpuGroup(type="cpu", count=4, role="rollout")))
    c, setup = mode_run(cfg, "digenrl", cluster, calibration=COSTS, seed=7, jitter=0.2,
                        loss_rate_per_h=200.0, rejoin_s=1.0)
    r = simulate(c, setup)
    s = r.scheduler
    assert r.losses > 0 and s["discarded"].get("node_lost", 0) > 0
    assert r.steps == cfg.run.steps and s["version"] == cfg.run.steps
    assert s["admitted"] == s["trained"] + sum(s["discarded"].values()) + s["in_flight"]
    assert s["trained"] >= cfg.run.steps * cfg.batch_size
    assert 0 <= s["max_trained_staleness"] <= c.runtime.staleness
    assert r.rejected_stale == 0 and s["stale_commits"] == 0


def test_more_rollouts_never_slow_a_generation_bound_run_down():
    cfg = _cfg(8, "runtime.tag=never", "runtime.fragments_per_step=4")
    costs = {**COSTS, "train_step_s": 0.001}
    rates = []
    for n in (1, 2, 4):
        cl = dataclasses.replace(_one_each(), gpus=(GpuGroup(type="cpu", count=1, role="trainer"),
                                                    GpuGroup(type="cpu", count=n, role="rollout")))
        c, setup = mode_run(cfg, "digenrl", cl, calibration=costs)
        rates.append(simulate(c, setup).samples_per_s)
    assert rates[0] < rates[1] < rates[2]


def test_cost_model_training_multipliers_follow_checkpointing_kl_and_cfg():
    base = Workload(model="flux", num_steps=16, trained_steps=9, cfg_gen=False, cfg_train=False,
                    grad_ckpt=False, kl=False, lora_rank=0)
    t3 = node_costs("H100", base).train_step_s
    assert node_costs("H100", dataclasses.replace(base, grad_ckpt=True)).train_step_s == pytest.approx(t3 * 4 / 3)
    assert node_costs("H100", dataclasses.replace(base, kl=True)).train_step_s == pytest.approx(t3 * 4 / 3)
    assert node_costs("H100", dataclasses.replace(base, cfg_train=True)).train_step_s == pytest.approx(t3 * 2)
    g = node_costs("H100", base).gen_step_s
    assert node_costs("H100", dataclasses.replace(base, cfg_gen=True)).gen_step_s == pytest.approx(2 * g)
    with pytest.raises(CostModelError, match="gpu = 'B300'"):
        node_costs("B300", base)


def test_cluster_toml_errors_name_the_key_and_value():
    with pytest.raises(ClusterError, match=r"gpus\[0\].type = 'V100'"):
        cluster_from_dict({"gpus": [{"type": "V100", "count": 2}]})
    with pytest.raises(ClusterError, match=r"gpus\[0\].count = 0"):
        cluster_from_dict({"gpus": [{"type": "H100", "count": 0}]})
    with pytest.raises(ClusterError, match=r"unknown key network.bandwidth"):
        cluster_from_dict({"gpus": [{"type": "H100"}], "network": {"bandwidth": 1}})


def test_calibration_file_with_unknown_key_is_rejected(tmp_path):
    p = tmp_path / "fit.json"
    p.write_text(json.dumps({"costs": {"gen_step_s": 0.1, "warp_s": 1}}))
    with pytest.raises(CostModelError, match=r"costs\.warp_s"):
        load_calibration(p)


# ----------------------------------------------------------------------------- calibration
# Synthetic run dirs: spans laid out exactly as the real nodes record them, with known
# per-phase seconds; step 0 is WARM x slower (first torch passes), which the fit must ignore.

WARM = 5.0
PH = {"gen": 0.16, "reward": 0.003, "commit": 0.002, "apply": 0.004, "fetch": 0.018, "train": 0.12,
      "opt": 0.011, "pub": 0.004, "lat_c": 0.0015, "lat_a": 0.006, "switch": 0.004}


class _Trace:
    def __init__(self) -> None:
        self.ev: dict[str, list[dict]] = {}

    def span(self, node: str, name: str, start: float, dur: float, **args) -> float:
        self.ev.setdefault(node, []).append({"ph": "X", "name": name, "ts_ns": round(start * 1e9),
                                             "dur_ns": round(dur * 1e9), "tid": 0, "args": args,
                                             "node": node, "role": node.split("-")[0]})
        return start + dur

    def write(self, d, cfg, metrics=()) -> None:
        from digenrl.config import to_toml
        (d / "trace").mkdir(parents=True)
        (d / "config.toml").write_text(to_toml(cfg))
        for node, evs in self.ev.items():
            (d / "trace" / f"{node}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def _disagg_sync_run(d, steps: int = 6):
    """A disagg-sync run: rollout and trainer take turns; every gap between them is a latency.

    As actors/following.py does it: the announcement starts a background ``weight_prefetch``; the
    rollout, at its trajectory boundary, waits for it, applies, then generates.
    """
    from digenrl.config import resolve_mode
    cfg = resolve_mode(_cfg(steps), "disagg-sync")
    tr, p = _Trace(), PH
    t, last_pub = 1.0, 0.9
    for s in range(steps):
        w = WARM if s == 0 else 1.0
        if s > 0:  # catch up: the prefetch runs, the boundary waits for it, applies, generates
            end = tr.span("rollout-0", "weight_prefetch", t, p["fetch"], version=s)
            tr.span("rollout-0", "wait", t + 0.0005, end - t - 0.0005, waiting_for=f"weights {s}")
            tr.span("rollout-0", "weight_apply", end, p["apply"] - 0.001, version=s)
            t = end + p["apply"]
        for k, frac in enumerate((0.3, 0.2, 0.5)):  # three pulls, chunk sends in between
            t = tr.span("rollout-0", "denoise_step", t, frac * p["gen"] * w - 0.001, step=s, task=s + 1)
            t = tr.span("rollout-0", "send_chunk", t, 0.001, t=k) if k < 2 else t + 0.001
        t = tr.span("rollout-0", "reward", t, p["reward"], task=s + 1) + p["commit"]
        t_train = t + p["lat_c"]
        tr.span("trainer-0", "wait", last_pub, t_train - last_pub)
        end = tr.span("trainer-0", "fragment_train", t_train, p["train"] * w, step=s, fragment=0)
        end = tr.span("trainer-0", "optimizer_step", end, p["opt"] * w, step=s)
        last_pub = tr.span("trainer-0", "weight_publish", end, p["pub"], version=s + 1)
        tr.span("rollout-0", "wait", t, last_pub + p["lat_a"] - t)
        t = last_pub + p["lat_a"]
    tr.write(d, cfg)
    return cfg


def test_calibration_reads_steady_state_phases_and_skips_warm_up(tmp_path):
    from digenrl.sim.calibrate import calibrate
    cfg = _disagg_sync_run(tmp_path)
    fit = calibrate(tmp_path)
    c, p = fit["costs"], PH
    B, T, nt = cfg.batch_size, cfg.sampler.num_steps, len(trained_timesteps(cfg))
    assert fit["warmup_steps"] == 1 and fit["samples_per_fragment"] == B
    assert c["gen_step_s"] == pytest.approx(p["gen"] / (B * T), rel=1e-6)
    assert c["train_step_s"] == pytest.approx(p["train"] / (B * nt), rel=1e-6)
    assert c["reward_s"] == pytest.approx((p["reward"] + p["commit"]) / B, rel=1e-6)
    assert c["weight_fetch_s"] == pytest.approx(p["fetch"], rel=1e-6)
    assert c["weight_apply_s"] == pytest.approx(p["apply"], rel=1e-6)
    assert c["optimizer_s"] == pytest.approx(p["opt"] + p["pub"], rel=1e-6)
    assert c["latency_s"] == pytest.approx((p["lat_c"] + p["lat_a"]) / 2, rel=1e-6)
    # step 0 is left out of every figure (and a fit loads as a --cost file)
    assert all(n == 5 for k, n in fit["n"].items() if k != "latency_s"), fit["n"]
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    assert load_calibration(tmp_path / "fit.json") == c
    # counting the 5x slower step 0 in (warmup_steps=0) moves the medians of a short run
    short = tmp_path / "short"
    _disagg_sync_run(short, steps=2)
    assert calibrate(short)["costs"]["train_step_s"] == pytest.approx(c["train_step_s"], rel=1e-6)
    assert calibrate(short, warmup_steps=0)["costs"]["train_step_s"] > 2 * c["train_step_s"]


def test_calibrated_disagg_sync_reproduces_the_real_cycle(tmp_path):
    """Closed form with a fit: the simulated step is the run's steady cycle, phase by phase."""
    from digenrl.sim.calibrate import calibrate
    cfg = _disagg_sync_run(tmp_path)
    fit = calibrate(tmp_path)["costs"]
    c, setup = mode_run(cfg, "disagg-sync", _one_each(), calibration=fit)
    r = simulate(c, setup)
    p = PH
    cycle = (p["fetch"] + p["apply"] + p["gen"] + p["reward"] + p["commit"] + p["lat_c"] + p["train"] + p["opt"]
             + p["pub"] + p["lat_a"])
    assert r.s_per_step == pytest.approx(cycle, rel=1e-4)


def test_calibrated_colocated_switch_is_the_unspanned_rest_of_the_step(tmp_path):
    from digenrl.config import resolve_mode
    from digenrl.sim.calibrate import calibrate
    cfg = resolve_mode(_cfg(6), "colocated")
    tr, p, t, metrics = _Trace(), PH, 0.0, []
    for s in range(6):
        w = WARM if s == 0 else 1.0
        t0 = t
        t = tr.span("colocated-0", "generate", t + p["switch"], p["gen"] * w, step=s)
        t = tr.span("colocated-0", "fragment_train", t + p["switch"], p["train"] * w, step=s)
        t = tr.span("colocated-0", "optimizer_step", t, p["opt"] * w, step=s)
        metrics.append({"step": s, "step_seconds": t - t0})
    tr.write(tmp_path, cfg, metrics)
    fit = calibrate(tmp_path)["costs"]
    assert fit["switch_s"] == pytest.approx(p["switch"], rel=1e-4)
    one = Cluster(name="one", gpus=(GpuGroup(type="cpu", count=1, role="trainer"),), network=FREE)
    c, setup = mode_run(cfg, "colocated", one, calibration=fit)
    assert simulate(c, setup).s_per_step == pytest.approx(p["gen"] + p["train"] + p["opt"] + 2 * p["switch"],
                                                          rel=1e-4)


@pytest.mark.parametrize("fetch_s", [0.0, 0.5, 1.2, 3.0])
def test_rollout_weight_fetch_is_hidden_behind_generation_unless_longer(fetch_s):
    """The rollout prefetches each version while it generates (actors/following.py): a
    generation-bound digenrl step pays only the boundary apply, until the fetch is longer
    than a fragment's generation."""
    cfg = _cfg(12, "runtime.tag=never")
    costs = {**COSTS, "train_step_s": 0.001, "weight_fetch_s": fetch_s, "weight_apply_s": 0.05}
    c, setup = mode_run(cfg, "digenrl", _one_each(), calibration=costs)
    r = simulate(c, setup)
    gen = cfg.batch_size * cfg.sampler.num_steps * costs["gen_step_s"]  # 1.28 s, one fragment
    if fetch_s < gen:
        assert r.s_per_step == pytest.approx(gen + costs["weight_apply_s"], rel=0.02)
    else:  # the fetch is exposed
        assert r.s_per_step > fetch_s + costs["weight_apply_s"]


def test_the_relay_prices_one_set_plus_a_part_per_hop_and_rank_0_alone_n_sets() -> None:
    from digenrl.core.costmodel import PART_BYTES, relay_depth, sync_bytes, weight_sync_s

    net = Network(link_gbs=45.0, weight_gbs=8.0, latency_s=0.001)
    b, bw = sync_bytes("flux", 0), 8.0e9
    assert b == 4 * 11.8e9  # float32 masters travel, not their bf16 rounding
    chain = [weight_sync_s("flux", 0, net, position=j, fanout=1, rollouts=16) for j in (1, 16)]
    assert chain[0] == pytest.approx(b / bw + 0.001)
    assert chain[1] == pytest.approx(b / bw + 15 * PART_BYTES / bw + 16 * 0.001)
    assert [relay_depth(j, 2) for j in range(1, 8)] == [1, 2, 2, 3, 3, 3, 3]
    # a binary tree: position 1 serves 2 and 3 over one uplink, so each gets half of it
    tree = weight_sync_s("flux", 0, net, position=4, fanout=2, rollouts=7)
    assert tree == pytest.approx(2 * (b + 2 * PART_BYTES) / bw + 3 * 0.001)
    alone = weight_sync_s("flux", 0, net, position=16, fanout=0, rollouts=16)
    assert alone == pytest.approx(16 * b / bw + 0.001)  # rank 0's link carries all sixteen


def test_the_planner_prices_rank_0_serving_every_rollout_as_slower_than_the_relay() -> None:
    cfg = load_config("configs/models/flux.toml", ["run.steps=6"])
    cluster = cluster_from_dict({"name": "mixed", "network": {"weight_gbs": 1.0},
                                 "gpus": [{"type": "H100", "count": 8, "role": "trainer"},
                                          {"type": "H20", "count": 8, "role": "rollout"}]})
    report = plan(cfg, cluster, ["digenrl"])
    steps = {r["name"]: r["s_per_step"] for r in report["modes"] + report["ablation"]}
    # 47 GB at 1 GB/s: relayed, ~47 s per version in the background; from rank 0, 8 x that
    assert steps["digenrl -relay"] > 1.2 * steps["digenrl"]


def test_calibration_fits_a_batching_rollouts_curve_and_the_planner_prices_its_occupancy(tmp_path):
    """A batching rollout's steps carry 4, 8 and 12 rows (one span per fragment it stepped, as
    actors/stepengine.py hands them): the fit is the line through them, and node_costs prices a
    sample-step at the planned rows per forward."""
    from digenrl.config import resolve_mode
    from digenrl.sim.calibrate import calibrate
    from digenrl.sim.simulator import rows_per_forward, workload_from_config

    fixed, per_row = 0.03, 0.005
    cfg = resolve_mode(_cfg(4, "sampler.max_batch=16", "runtime.fragments_per_step=4"), "digenrl")
    tr, t = _Trace(), 1.0
    for s in range(4):
        for rows in (4, 8, 12, 8):
            dur = (fixed + per_row * rows) * (WARM if s == 0 else 1.0)
            for task in range(rows // 4):  # the same step, recorded once per fragment in it
                tr.span("rollout-0", "denoise_step", t, dur, step=s, task=10 * s + task, rows=rows)
            t += dur + 0.001
    tr.write(tmp_path, cfg)
    fit = calibrate(tmp_path)
    assert fit["batch_curve"] == pytest.approx({"4": fixed + 4 * per_row, "8": fixed + 8 * per_row,
                                                "12": fixed + 12 * per_row}, rel=1e-6)
    c = fit["costs"]
    assert c["forward_fixed_s"] == pytest.approx(fixed, rel=1e-5)
    assert c["forward_row_s"] == pytest.approx(per_row, rel=1e-5)
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    cal = load_calibration(tmp_path / "fit.json")
    wl = workload_from_config(cfg)
    frag = cfg.batch_size // cfg.runtime.fragments_per_step
    assert wl.rows_per_forward == rows_per_forward(cfg) == 16 and frag == 4
    assert node_costs("cpu", wl, calibration=cal).gen_step_s == pytest.approx((fixed + 16 * per_row) / 16, rel=1e-5)
    one = dataclasses.replace(wl, rows_per_forward=frag)  # one fragment a forward costs more a sample
    assert node_costs("cpu", one, calibration=cal).gen_step_s == pytest.approx((fixed + 4 * per_row) / 4, rel=1e-5)
    # without the curve (a run one fragment at a time) the measured gen_step_s stands
    assert node_costs("cpu", wl, calibration={"gen_step_s": 0.2}).gen_step_s == 0.2
