"""Non-finite values: found per trajectory, discarded before advantages, never stepped on,
never written (the scheduler's side is in tests/test_scheduler.py, a live run in
tests/test_nonfinite_run.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from digenrl.faults import NAN_ENV, nan_point, poison
from digenrl.rl.finite import fragment_tensors, nonfinite_rows
from digenrl.rl.grpo import group_advantages
from digenrl.rl.learner import Learner
from digenrl.rl.policy import Policy
from digenrl.telemetry.metrics import MetricsWriter, StepMetrics, finite_only, read_metrics
from digenrl.telemetry.report import format_summary
from tests.test_policy import T, TinyFlow, _batch, _cfg

NAN, INF = float("nan"), float("inf")


def test_each_trajectory_holding_a_nan_or_an_infinity_is_flagged_alone() -> None:
    x = torch.zeros(4, 2, 3)
    x[1, 0, 2] = NAN
    logp = torch.tensor([0.0, 0.0, -INF, 0.0])
    bad = nonfinite_rows(4, tensors=[x, logp], rewards=[1.0, 2.0, 3.0, 4.0],
                         values={"jpeg": [0.0, 0.0, 0.0, INF]})
    assert bad.tolist() == [False, True, True, True]
    assert nonfinite_rows(4, rewards=[1.0, NAN, 0.0, 0.0]).tolist() == [False, True, False, False]
    # a per-prompt tensor (another first dimension) is checked whole: every row is flagged
    assert nonfinite_rows(4, tensors=[torch.tensor([[NAN], [0.0]])]).all()
    assert not nonfinite_rows(4, tensors=[torch.arange(4)], rewards=[0, 1, 2, 3]).any()


def _fragment(group_size: int = 4):
    # the suite's defaults spelt out: a spawned rank runs without conftest's fixtures
    cfg = _cfg(f"train.group_size={group_size}", f"train.prompts_per_step={8 // group_size}",
               "sampler.base_tail=0", "model.lora_rank=0")
    model = TinyFlow()
    cond, records, _, _ = _batch(model, cfg)
    rewards = torch.rand(8, generator=torch.Generator().manual_seed(5)).tolist()
    return cfg, model, cond, records, rewards


def test_a_trajectory_with_nan_latents_is_discarded_and_its_group_trains_on_its_finite_members() -> None:
    cfg, model, cond, records, rewards = _fragment()
    t = sorted(records)[1]
    records[t].x_next[1, 0, 0, 0] = NAN  # trajectory 1 of group 0 (rows 0-3)
    assert fragment_tensors(records, None, cond)  # what the learner checks: every record's tensors
    policy = Policy(model, cfg.train, cfg.sampler)
    learner = Learner(policy, cfg)
    learner.train_fragment(records=records, cond=cond, rewards=rewards, gen_version=0,
                           n_trained_total=T, sigma_max=policy.sigma_max, source="0/0 task 1 from r1")
    assert learner.stats.discarded == {"nonfinite": 1} and learner.stats.trained == 7
    assert all(math.isfinite(r) for r in learner.stats.rewards) and len(learner.stats.rewards) == 7
    got = policy.grads_snapshot()
    assert all(bool(g.isfinite().all()) for g in got) and any(float(g.abs().max()) > 0 for g in got)
    # by hand: group 0's advantages over its 3 finite members, the NaN row never read
    ref = Policy(TinyFlow(), cfg.train, cfg.sampler)
    good = torch.ones(8, dtype=torch.bool)
    good[1] = False
    adv_good, stats = group_advantages(torch.tensor(rewards)[good], (torch.arange(8) // 4)[good])
    adv, keep = torch.zeros(8), torch.zeros(8, dtype=torch.bool)
    adv[good], keep[good] = adv_good, stats.keep
    ref.fragment_loss_backward(records, cond, adv, keep, batch_size_total=cfg.batch_size, n_trained_total=T)
    for a, b in zip(got, ref.grads_snapshot(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    metrics = learner.finish_step()
    assert metrics["discarded_nonfinite"] == 1 and metrics["skipped_steps"] == 0
    assert all(bool(p.isfinite().all()) for p in policy.params)


def test_a_fragment_all_nonfinite_trains_nothing_and_counts_every_trajectory() -> None:
    cfg, model, cond, records, _ = _fragment()
    policy = Policy(model, cfg.train, cfg.sampler)
    learner = Learner(policy, cfg)
    learner.train_fragment(records=records, cond=cond, rewards=[NAN] * 8, gen_version=0,
                           n_trained_total=T, sigma_max=policy.sigma_max)
    assert learner.stats.discarded == {"nonfinite": 8} and learner.stats.trained == 0
    assert learner.stats.zero_adv_groups == 0 and all(p.grad is None for p in policy.params)


def test_a_step_with_a_nonfinite_gradient_leaves_the_weights_untouched_and_is_counted() -> None:
    cfg, model, cond, records, rewards = _fragment()
    policy = Policy(model, cfg.train, cfg.sampler)
    learner = Learner(policy, cfg)
    before = [p.detach().clone() for p in policy.params]
    learner.train_fragment(records=records, cond=cond, rewards=rewards, gen_version=0,
                           n_trained_total=T, sigma_max=policy.sigma_max, source="0/0 task 1 from r0")
    policy.params[0].grad[0] = INF  # a fault in this rank's backward
    metrics = learner.finish_step()
    assert all(torch.equal(a, p) for a, p in zip(before, policy.params, strict=True))
    assert all(p.grad is None for p in policy.params) and policy.version == 1
    assert learner.skipped_steps == 1 and metrics["skipped_steps"] == 1
    assert learner.last_skipped == (["0/0 task 1 from r0"], [])
    assert not math.isfinite(metrics["grad_norm"])  # the writer nulls it (below)
    # the next step trains as usual
    learner.train_fragment(records=records, cond=cond, rewards=rewards, gen_version=1,
                           n_trained_total=T, sigma_max=policy.sigma_max)
    metrics = learner.finish_step()
    assert learner.last_skipped is None and metrics["skipped_steps"] == 1
    assert not all(torch.equal(a, p) for a, p in zip(before, policy.params, strict=True))


def _two_ranks_worker(rank: int, store: str, out: str) -> None:
    """One of two gloo ranks: the same fragment trained, then rank 1's loss is not finite."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        cfg, model, cond, records, rewards = _fragment()
        policy = Policy(model, cfg.train, cfg.sampler)
        learner = Learner(policy, cfg)
        before = [p.detach().clone() for p in policy.params]
        learner.train_fragment(records=records, cond=cond, rewards=rewards, gen_version=0,
                               n_trained_total=T, sigma_max=policy.sigma_max)
        if rank == 1:
            learner.stats.loss = NAN  # what a fault in rank 1's forward leaves

        def all_reduce(t: torch.Tensor) -> None:
            torch.distributed.all_reduce(t)

        assert learner.reduce_gradients(all_reduce)
        learner.finish_step(None)
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "moved": not all(torch.equal(a, p) for a, p in zip(before, policy.params, strict=True)),
            "skipped": learner.skipped_steps, "version": policy.version}))
    finally:
        torch.distributed.destroy_process_group()


def test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    """Two real gloo ranks: only rank 1's loss is NaN, its gradients are finite. Were the
    decision rank 1's alone, rank 0 would step and the ranks' weights would part."""
    torch.multiprocessing.spawn(_two_ranks_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 == {"moved": False, "skipped": 1, "version": 1}


def _row(**kw: object) -> StepMetrics:
    base = dict(step=0, policy_version=1, wall_time=1.0, step_seconds=1.0, samples_per_s=4.0,
                reward_mean=0.5, reward_std=0.1, loss=0.1, kl=0.0, clipfrac=0.0, ratio_max_dev=0.0,
                grad_norm=1.0, max_staleness=0, mean_staleness=0.0, zero_adv_groups=0, trained=4,
                discarded=0)
    return StepMetrics(**{**base, **kw})  # type: ignore[arg-type]


def _no_constant(name: str) -> float:
    raise AssertionError(f"metrics.jsonl holds {name}")


def test_nonfinite_metrics_are_written_as_null_and_counted_and_read_back(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(_row())
        w.write(_row(step=1, loss=NAN, grad_norm=INF, reward_terms={"jpeg": -INF}))
        w.write_eval(1, 2.0, {"eval/jpeg": NAN, "eval/samples": 4})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=_no_constant) for line in lines]
    assert rows[0]["nonfinite_metrics"] == 0 and rows[0]["loss"] == 0.1
    assert rows[1]["nonfinite_metrics"] == 3
    assert rows[1]["loss"] is None and rows[1]["grad_norm"] is None and rows[1]["reward/jpeg"] is None
    assert rows[2]["eval/jpeg"] is None and rows[2]["nonfinite_metrics"] == 1
    assert StepMetrics.from_record(read_metrics(tmp_path)[1]).loss is None  # a resume reads it back
    assert finite_only({"a": [1.0, NAN], "b": {"c": INF}}) == ({"a": [1.0, None], "b": {"c": None}},
                                                                ["a", "b/c"])


def test_the_report_prints_n_a_where_metrics_hold_null(tmp_path: Path) -> None:
    text = format_summary(tmp_path, {}, {}, [{"step": 3, "reward_mean": None, "reward_std": 0.25}])
    assert "reward n/a ± 0.2500" in text and "nan" not in text.lower()


def test_the_nan_knob_names_one_node_and_a_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not nan_point("rollout-1", 5)  # unset: a no-op
    monkeypatch.setenv(NAN_ENV, "rollout-1:3")
    assert [nan_point("rollout-1", s) for s in (2, 3, 4)] == [False, True, True]
    assert not nan_point("rollout-0", 4)
    records = _fragment()[3]
    rec = records[sorted(records)[0]]
    poison(rec)
    assert nonfinite_rows(8, tensors=[rec.x_next, rec.log_prob]).all() and rec.x_t.isfinite().all()


def test_optimizer_steps_skipped_node_fault_limit_times_in_a_row_stop_the_run(tmp_path: Path) -> None:
    from digenrl.transport.protocol import StepDone
    from tests.conftest import bare_coordinator

    actor = bare_coordinator(tmp_path, ["run.node_fault_limit=3"])
    for step, skipped in enumerate([1, 2, 2, 3, 4]):  # a clean step (2 -> 2) resets the run
        actor._step_done(StepDone(step=step, version=step + 1, metrics={"skipped_steps": skipped}))
    assert not actor.stopping
    actor._step_done(StepDone(step=5, version=6, metrics={"skipped_steps": 5}))
    assert actor.stop_reason == ("failed: the trainer ranks skipped 3 optimizer steps in a row for "
                                 "a non-finite loss or gradient (see logs/trainer-*.log)")
