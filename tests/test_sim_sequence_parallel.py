"""Sequence parallelism in the cost model, the simulator and ``digenrl plan``: a rank's share of
a sample's compute, the Ulysses exchanges over the group's link, the trainer pool as groups and
a rollout node over several devices."""

from __future__ import annotations

import dataclasses

import pytest

from digenrl.config import ConfigError, load_config
from digenrl.core.costmodel import (
    GPUS,
    MODELS,
    CostModelError,
    Network,
    Workload,
    node_costs,
    sp_exchange_s,
    sp_forward_flop,
    sp_seconds,
    step_sync_s,
    train_passes,
)
from digenrl.sim.cluster import Cluster, ClusterError, GpuGroup
from digenrl.sim.plan import mode_run, plan, render, throughput_at
from digenrl.sim.simulator import simulate, trained_timesteps

FREE = Network(link_gbs=1e15, weight_gbs=1e15, latency_s=0.0)
COSTS = {"gen_step_s": 0.01, "colo_gen_step_s": 0.01, "train_step_s": 0.02, "reward_s": 0.0,
         "optimizer_s": 0.0, "switch_s": 0.5}
WAN = Workload(model="wan", num_steps=16, trained_steps=9, cfg_gen=True, cfg_train=True, grad_ckpt=True,
               kl=False, lora_rank=0)
"""configs/models/wan.toml's recipe: Wan2.1-14B at 480 x 832 x 81 (32,760 video tokens), CFG."""


def _sp(wl: Workload, n: int, g: int = 1) -> Workload:
    return dataclasses.replace(wl, sequence_parallel=n, rollout_gpus=g)


def test_a_long_video_trains_faster_per_rank_and_the_group_pays_only_the_exchanges() -> None:
    """Wan's text is cross-attention context (no replicated tokens in the sharded stream), so a
    rank's compute is exactly 1/N of the sample's and a group's GPU-seconds exceed one rank's at
    N = 1 by exactly the exchanges."""
    t1 = node_costs("H100", WAN).train_step_s
    for n in (2, 4, 8):
        tn = node_costs("H100", _sp(WAN, n)).train_step_s
        ex = train_passes(WAN) * sp_exchange_s("wan", n, "H100")
        assert tn < t1
        assert tn == pytest.approx(t1 / n + ex, rel=1e-12)
        assert 0 < ex < 0.01 * t1  # 32,760 tokens: attention dominates, the exchanges are small
        assert n * tn - t1 == pytest.approx(n * ex, rel=1e-9)


def test_a_short_image_sequence_costs_a_group_more_gpu_time_than_it_saves() -> None:
    """Qwen-Image at 512 px (1,024 image + 256 replicated text tokens): a rank's time falls, but
    the group's GPU-seconds per sample rise by the replicated text and the exchanges, more than a
    long video's do (costmodel.md 8: verl-omni finds Ulysses does not pay at ~1k tokens)."""
    qwen = dataclasses.replace(WAN, model="qwenimage", cfg_train=False)
    q1 = node_costs("H100", qwen).train_step_s
    w1 = node_costs("H100", WAN).train_step_s
    for n in (2, 4, 8):
        qn = node_costs("H100", _sp(qwen, n)).train_step_s
        assert qn < q1  # the sample's latency still falls
        overhead = n * qn / q1 - 1
        assert overhead > 0.15
        assert overhead > 10 * (n * node_costs("H100", _sp(WAN, n)).train_step_s / w1 - 1)
        # what the text costs: each rank carries all 256 text tokens through the linear layers
        a = MODELS["qwenimage"].arch
        assert a is not None
        text = 2 * a.p_tok_b * 1e9 * a.text_tokens / sp_forward_flop("qwenimage", 1)
        exchange = train_passes(qwen) * sp_exchange_s("qwenimage", n, "H100") / q1
        assert overhead == pytest.approx((n - 1) * text + n * exchange, rel=1e-9)


def test_the_compute_share_scales_as_one_over_n_on_image_tokens_and_the_text_stays_whole() -> None:
    for model in ("flux", "qwenimage", "hunyuanvideo", "wan", "flux_kontext", "flux2", "flux2_klein_4b",
                  "flux2_klein_9b", "zimage"):
        a = MODELS[model].arch
        assert a is not None
        # the split gives back the entry's forward FLOPs (cm 0's formula) within 1 %
        assert sp_forward_flop(model, 1) / 1e12 == pytest.approx(MODELS[model].fwd_tflop, rel=0.01)
        fixed = 2 * a.p_tok_b * 1e9 * a.text_tokens  # the replicated text's linear layers
        for n in (2, 4, 8):
            if a.heads % n:
                continue
            assert sp_forward_flop(model, n) - fixed == pytest.approx((sp_forward_flop(model, 1) - fixed) / n,
                                                                     rel=1e-12)


def test_the_exchange_term_is_bytes_over_the_link_bandwidth() -> None:
    a = MODELS["wan"].arch
    assert a is not None
    for n in (2, 4, 8):
        lat = a.layers * 4 * GPUS["H100"].exchange_latency_s
        moved = a.layers * 4 * (a.image_tokens / n) * a.hidden * 2 * (n - 1) / n  # bf16 q, k, v, out
        assert sp_exchange_s("wan", n, "H100") == pytest.approx(moved / (GPUS["H100"].nvlink_gbs * 1e9) + lat,
                                                                rel=1e-12)
        # the same bytes over H800's cut NVLink take 370 / 164 as long; twice the tokens twice the bytes
        h800 = sp_exchange_s("wan", n, "H800") - lat
        assert h800 == pytest.approx((sp_exchange_s("wan", n, "H100") - lat) * GPUS["H100"].nvlink_gbs
                                     / GPUS["H800"].nvlink_gbs, rel=1e-12)
        assert sp_exchange_s("wan", n, "H100", image_tokens=2 * a.image_tokens) - lat == pytest.approx(
            2 * (sp_exchange_s("wan", n, "H100") - lat), rel=1e-12)
    # a group over more than 8 GPUs spans hosts: its exchanges go at the NIC's bandwidth
    f = MODELS["flux"].arch
    assert f is not None
    share, lat = 11 / 12, f.layers * 5 * GPUS["H100"].exchange_latency_s  # 4 all-to-alls + the text gather
    moved = f.layers * (4 * f.image_tokens / 12 + f.text_tokens) * f.hidden * 2 * share
    for gbs in (45.0, 4.5):
        assert sp_exchange_s("flux", 12, "H100", net=Network(link_gbs=gbs)) == pytest.approx(
            moved / (gbs * 1e9) + lat, rel=1e-12)


def test_a_ranks_step_time_grows_with_the_tokens_at_every_degree() -> None:
    tokens = [1560, 4680, 9360, 32760, 75600]  # 480 x 832 x 1, 9, 21, 81 frames; 720 x 1280 x 81
    for n in (1, 2, 4, 8):
        times = [sp_seconds(1.0, "wan", n, "H100", 3, image_tokens=s) for s in tokens]
        assert times == sorted(times) and len(set(times)) == len(times)
    # and at each length a wider group is faster per rank
    for s in tokens:
        times = [sp_seconds(1.0, "wan", n, "H100", 3, image_tokens=s) for n in (1, 2, 4, 8)]
        assert times == sorted(times, reverse=True)


def test_a_family_without_a_sequence_parallel_forward_or_an_indivisible_degree_is_refused() -> None:
    with pytest.raises(CostModelError, match=r"'qwenimage_edit': its family has no sequence-parallel forward"):
        node_costs("H100", _sp(dataclasses.replace(WAN, model="qwenimage_edit"), 2))
    with pytest.raises(CostModelError, match=r"over 3 ranks .* divisor of its 40 attention heads"):
        node_costs("H100", _sp(WAN, 3))


def test_a_rollout_node_over_g_devices_generates_at_a_ranks_share_plus_the_exchanges() -> None:
    g1 = node_costs("H100", WAN).gen_step_s
    g4 = node_costs("H100", _sp(WAN, 1, 4))
    assert g4.gen_step_s == pytest.approx(g1 / 4 + 2 * sp_exchange_s("wan", 4, "H100"), rel=1e-12)  # 2: CFG
    assert g4.train_step_s == node_costs("H100", WAN).train_step_s  # same inputs, same arithmetic


# ----------------------------------------------------------------------------- simulator


def _cfg(*overrides: str):
    return load_config(None, ["run.steps=6", *overrides])


def _cluster(trainers: int, rollouts: int) -> Cluster:
    return Cluster(name=f"{trainers}+{rollouts}", gpus=(GpuGroup(type="cpu", count=trainers, role="trainer"),
                                                        GpuGroup(type="cpu", count=rollouts, role="rollout")),
                   network=FREE)


def test_sp2_over_four_trainers_trains_as_two_groups_at_the_groups_rank_time() -> None:
    """disagg-sync (one fragment, data parallel over the groups): a step is the generation plus
    half the batch's sample-timesteps at one SP rank's time, plus the all-reduce."""
    for sp in (1, 2, 4):
        cfg = _cfg(f"train.sequence_parallel={sp}")
        c, setup = mode_run(cfg, "disagg-sync", _cluster(4, 1), calibration=COSTS)
        r = simulate(c, setup)
        B, T, nt = cfg.batch_size, cfg.sampler.num_steps, len(trained_timesteps(cfg))
        wl = Workload(model="sd3", num_steps=T, trained_steps=nt, cfg_gen=False, cfg_train=False,
                      grad_ckpt=cfg.model.gradient_checkpointing, kl=cfg.train.kl_beta > 0, lora_rank=cfg.model.lora_rank,
                      sequence_parallel=sp)
        rank_s = sp_seconds(COSTS["train_step_s"], "sd3", sp, "cpu", train_passes(wl))
        assert r.sequence_parallel == sp and r.train_step_s == pytest.approx(rank_s, rel=1e-12)
        sync = step_sync_s("sd3", cfg.model.lora_rank, ["cpu"] * 4, FREE)
        expect = B * T * COSTS["gen_step_s"] + B / (4 // sp) * nt * rank_s + sync
        assert r.s_per_step == pytest.approx(expect, rel=1e-6)


def test_sp2_over_four_trainers_in_digenrl_mode_runs_at_the_groups_pace() -> None:
    """GAP + TSP over two groups: the steady state is the slower of generation and the groups'
    training, each group training its leader's timesteps; the scheduler plans over leaders."""
    cfg = _cfg("run.steps=12", "train.sequence_parallel=2", "runtime.tag=never", "runtime.fragments_per_step=2")
    costs = {**COSTS, "gen_step_s": 0.002}
    c, setup = mode_run(cfg, "digenrl", _cluster(4, 2), calibration=costs)
    r = simulate(c, setup)
    B, T, nt = cfg.batch_size, cfg.sampler.num_steps, len(trained_timesteps(cfg))
    rank_s = r.train_step_s
    gen = B * T * costs["gen_step_s"] / 2  # two rollouts
    train = B * nt * rank_s / 2  # two groups, TSP splitting each fragment's timesteps between them
    assert train > gen
    assert r.s_per_step == pytest.approx(train, rel=0.05)
    assert r.scheduler["tag_granted"] == 0 and r.rejected_stale == 0
    busy = r.busy  # a group's ranks do the same work
    assert busy["trainer-0"] == pytest.approx(busy["trainer-1"]) and busy["trainer-2"] == pytest.approx(busy["trainer-3"])


def test_rollout_gpus_make_each_rollout_node_several_gpus() -> None:
    cfg = _cfg("cluster.rollout_gpus=2")
    c, setup = mode_run(cfg, "disagg-sync", _cluster(1, 4), calibration=COSTS)
    assert c.cluster.rollouts == 2 and c.runtime.fragments_per_step == 2
    r = simulate(c, setup)
    assert r.rollout_gpus == 2 and sum(1 for k in r.busy if k.startswith("rollout")) == 2
    B, T, nt = cfg.batch_size, cfg.sampler.num_steps, len(trained_timesteps(cfg))
    gen = sp_seconds(COSTS["gen_step_s"], "sd3", 2, "cpu", 1)
    assert r.s_per_step == pytest.approx(B / 2 * T * gen + B * nt * COSTS["train_step_s"], rel=1e-6)
    with pytest.raises(ClusterError, match=r"cluster\.rollout_gpus = 2: 1 rollout GPUs"):
        mode_run(cfg, "disagg-sync", _cluster(1, 1))
    with pytest.raises(ClusterError, match=r"train.sequence_parallel = 2: 3 trainer GPUs .* multiple of 2"):
        mode_run(_cfg("train.sequence_parallel=2"), "digenrl", _cluster(3, 1))


def test_the_plan_names_each_rows_degrees_and_tries_every_degree_the_trainers_allow() -> None:
    cfg = _cfg("train.sequence_parallel=2", "runtime.fragments_per_step=2")
    report = plan(cfg, _cluster(4, 2), ["colocated", "digenrl"], calibration=COSTS, ablate=False)
    rows = {r["name"]: r for r in report["modes"]}
    assert rows["colocated"]["sequence_parallel"] == 1 and rows["colocated"]["rollout_gpus"] is None
    assert rows["digenrl"]["sequence_parallel"] == 2 and rows["digenrl"]["rollout_gpus"] == 1
    # the tiny SD3 has 4 heads: degrees 1, 2, 4 over 4 trainers
    assert [r["sequence_parallel"] for r in report["sequence_parallel"]] == [1, 2, 4]
    assert report["sequence_parallel"][1]["samples_per_s"] == pytest.approx(rows["digenrl"]["samples_per_s"])
    text = render({**report, "modes": report["modes"]})
    assert "digenrl sp=4" in text
    s = plan(cfg, _cluster(2, 2), ["digenrl"], calibration=COSTS, ablate=False, search=True)["search"]
    assert {(t["trainers"], t["sequence_parallel"]) for t in s["tried"]} == {
        (1, 1), (2, 1), (2, 2), (3, 1)}
    assert s["best"]["sequence_parallel"] in (1, 2)


def test_throughput_at_a_memory_fit_evaluates_that_layout_or_names_why_not() -> None:
    cfg = _cfg("runtime.fragments_per_step=2")
    got = throughput_at(cfg, _cluster(4, 2), sequence_parallel=4, gradient_checkpointing=True,
                        rows=cfg.train.group_size, calibration=COSTS)
    assert got["sequence_parallel"] == 4 and got["samples_per_s"] > 0
    bad = throughput_at(cfg, _cluster(3, 2), sequence_parallel=2, gradient_checkpointing=True,
                        rows=cfg.train.group_size, calibration=COSTS)
    assert "multiple of 2" in bad["error"]


def test_the_colocated_baseline_of_a_sequence_parallel_config_is_planned_at_one() -> None:
    """Colocated ranks generate, which a sequence-parallel rank does not (the config refuses
    the pair): its row is the baseline without sequence parallelism."""
    cfg = _cfg("train.sequence_parallel=2")
    with pytest.raises(ConfigError, match=r"train\.sequence_parallel = 2 with run\.mode = 'colocated'"):
        load_config(None, ["train.sequence_parallel=2", 'run.mode="colocated"'])
    two = Cluster(name="two", gpus=(GpuGroup(type="cpu", count=2, role="trainer"),), network=FREE)
    c, setup = mode_run(cfg, "colocated", two, calibration=COSTS)
    assert c.train.sequence_parallel == 1 and simulate(c, setup).sequence_parallel == 1
