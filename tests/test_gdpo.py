"""GDPO (``train.advantage = "gdpo"``): each reward term normalised within its group, then the
weighted sum; against "sum" (Flow-GRPO's normalised weighted sum) on a worked example, the
single-term case, zero-variance groups, the trainer's gradient, and one real launch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from digenrl.config import load_config, resolve_mode
from digenrl.rl.grpo import gdpo_advantages, group_advantages
from digenrl.rl.learner import Learner, advantages
from digenrl.rl.policy import Policy
from digenrl.telemetry.metrics import StepMetrics, documented_keys, is_documented, read_metrics
from tests.conftest import SMALL
from tests.test_policy import T, TinyFlow, _batch, _cfg

# The worked example of docs/algorithms.md (GDPO): one group of 4, term A of spread 100,
# term B of spread 0.1, weight 1 each; A ranks samples {0, 1} over {2, 3}, B ranks {1, 3}
# over {0, 2}, so sample 1 is best on both and sample 2 worst on both.
A = [100.0, 100.0, 0.0, 0.0]
B = [0.0, 0.1, 0.0, 0.1]
WEIGHTS = {"a": 1.0, "b": 1.0}
ONE_GROUP = [0, 0, 0, 0]


def test_worked_example_sum_follows_the_wide_term_and_gdpo_weighs_both():
    total = [a + b for a, b in zip(A, B, strict=True)]  # 100, 100.1, 0, 0.1
    # sum: mean 50.05, deviations +-49.95 / +-50.05, population std sqrt(2500.0025)
    adv_sum, st_sum = group_advantages(total, ONE_GROUP, eps=0.0, parts={"a": A, "b": B})
    s = math.sqrt(2500.0025)
    expected_sum = [49.95 / s, 50.05 / s, -50.05 / s, -49.95 / s]  # ~ 0.999, 1.001, -1.001, -0.999
    torch.testing.assert_close(adv_sum.double(), torch.tensor(expected_sum, dtype=torch.float64),
                               rtol=0, atol=1e-7)
    # A's share +-50/s ~ +-1, B's share +-0.05/s ~ +-0.001: A decides, B is a 1e-3 ripple
    torch.testing.assert_close(st_sum.terms["a"], torch.tensor([50.0, 50.0, -50.0, -50.0]).double() / s)
    torch.testing.assert_close(st_sum.terms["b"], torch.tensor([-0.05, 0.05, -0.05, 0.05]).double() / s)
    # gdpo: A_a = [1, 1, -1, -1], A_b = [-1, 1, -1, 1], sum [0, 2, -2, 0]
    adv_gdpo, st_gdpo = gdpo_advantages({"a": A, "b": B}, WEIGHTS, ONE_GROUP, eps=0.0)
    torch.testing.assert_close(adv_gdpo, torch.tensor([0.0, 2.0, -2.0, 0.0]), rtol=0, atol=1e-12)
    torch.testing.assert_close(st_gdpo.terms["a"], torch.tensor([1.0, 1.0, -1.0, -1.0]).double())
    torch.testing.assert_close(st_gdpo.terms["b"], torch.tensor([-1.0, 1.0, -1.0, 1.0]).double())
    # sample 0 (best on A only) and sample 1 (best on both) are 0.002 apart under sum, 2 under gdpo
    assert float(adv_sum[1] - adv_sum[0]) == pytest.approx(0.1 / s, abs=1e-7)
    assert float(adv_gdpo[1] - adv_gdpo[0]) == pytest.approx(2.0, abs=1e-12)
    # with the trainer's eps = 1e-4: a = 50 / (50 + eps), b = 0.05 / (0.05 + eps)
    adv, _ = gdpo_advantages({"a": A, "b": B}, WEIGHTS, ONE_GROUP)
    a, b = 50 / (50 + 1e-4), 0.05 / (0.05 + 1e-4)  # 0.999998, 0.998004
    torch.testing.assert_close(adv.double(), torch.tensor([a - b, a + b, -a - b, -a + b], dtype=torch.float64),
                               rtol=0, atol=1e-7)


def test_each_terms_shares_add_up_to_the_advantage_in_both_modes():
    g = torch.Generator().manual_seed(0)
    terms = {"a": (100 * torch.rand(12, generator=g)).tolist(), "b": (0.1 * torch.rand(12, generator=g)).tolist()}
    weights = {"a": 0.7, "b": 0.3}
    gid = [i // 4 for i in range(12)]
    total = [0.7 * x + 0.3 * y for x, y in zip(terms["a"], terms["b"], strict=True)]
    for adv, st in (group_advantages(total, gid, parts={k: [weights[k] * x for x in v] for k, v in terms.items()}),
                    gdpo_advantages(terms, weights, gid)):
        torch.testing.assert_close(st.terms["a"] + st.terms["b"], adv.double(), rtol=0, atol=1e-6)
    # under sum the wide term holds nearly all of the advantage, under gdpo each a fair part
    _, st_sum = group_advantages(total, gid, parts={k: [weights[k] * x for x in v] for k, v in terms.items()})
    _, st_gdpo = gdpo_advantages(terms, weights, gid)
    assert float(st_sum.terms["b"].abs().mean()) < 3e-3 * float(st_sum.terms["a"].abs().mean())
    assert 0.2 < float(st_gdpo.terms["b"].abs().mean()) / float(st_gdpo.terms["a"].abs().mean()) < 1.0


def test_a_single_term_gives_the_sum_advantages_bit_for_bit():
    # The trainer's gdpo path for one term is the sum path on the commit's rewards (nothing to
    # balance), so the same function runs on the same inputs in one process: exact. The
    # composition itself (normalise, weight, centre) differs from sum in where eps and the
    # weight sit, hence the path rather than the formula.
    train_sum = load_config(None, ['reward.terms=[{ name = "jpeg_compressibility", weight = 0.5 }]']).train
    train_gdpo = load_config(None, ['reward.terms=[{ name = "jpeg_compressibility", weight = 0.5 }]',
                                    'train.advantage="gdpo"']).train
    raw = torch.rand(8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    rewards = (0.5 * raw.float())  # what Reward sums: the weighted term, in float32
    gid = torch.arange(8) // 4
    weights = {"jpeg_compressibility": 0.5}
    terms = {"jpeg_compressibility": raw.float().double()}
    adv_sum, st_sum = advantages(train_sum, weights, rewards, gid, terms)
    adv_gdpo, st_gdpo = advantages(train_gdpo, weights, rewards, gid, terms)
    assert torch.equal(adv_sum, adv_gdpo) and torch.equal(st_sum.keep, st_gdpo.keep)
    assert torch.equal(st_sum.terms["jpeg_compressibility"], st_gdpo.terms["jpeg_compressibility"])
    composed, _ = gdpo_advantages(terms, weights, gid)  # 0.5 * (r - m) / (s + eps), not renormalised
    assert not torch.equal(composed, adv_sum)
    torch.testing.assert_close(composed, 0.5 * adv_sum, rtol=1e-3, atol=0)


def test_zero_variance_groups_are_skipped_only_when_every_term_is_constant():
    # group 0: both terms constant -> skipped, exact zeros; group 1: A constant, B varies ->
    # trained on B alone; group 2: a singleton -> skipped
    terms = {"a": [7.0, 7.0, 7.0, 3.0, 3.0, 3.0, 1.0], "b": [0.2, 0.2, 0.2, 0.0, 0.1, 0.2, 5.0]}
    gid = [0, 0, 0, 1, 1, 1, 2]
    adv, st = gdpo_advantages(terms, WEIGHTS, gid, eps=0.0)
    assert st.groups == 3 and st.zero_groups == 2
    assert st.keep.tolist() == [False, False, False, True, True, True, False]
    assert adv[[0, 1, 2, 6]].tolist() == [0.0, 0.0, 0.0, 0.0]
    s_b = math.sqrt(2 * 0.1**2 / 3)  # B's population std in group 1
    torch.testing.assert_close(adv[3:6].double(), torch.tensor([-0.1 / s_b, 0.0, 0.1 / s_b], dtype=torch.float64),
                               rtol=0, atol=1e-6)
    assert st.terms["a"].tolist() == [0.0] * 7  # a constant term has no share
    # terms that cancel exactly (w_a A_a = -w_b A_b in every member): the sum is constant, skipped
    adv, st = gdpo_advantages({"a": [1.0, 3.0], "b": [3.0, 1.0]}, WEIGHTS, [0, 0], eps=0.0)
    assert st.zero_groups == 1 and adv.tolist() == [0.0, 0.0] and not st.keep.any()
    # global std mode: the sum is normalised again over all samples (GDPO's batch normalisation)
    adv, st = gdpo_advantages(terms, WEIGHTS, gid, std_mode="global", eps=0.0)
    assert st.zero_groups == 2 and adv[[0, 1, 2, 6]].tolist() == [0.0, 0.0, 0.0, 0.0]
    b = torch.tensor(terms["b"], dtype=torch.float64)
    summed = torch.zeros(7, dtype=torch.float64)
    summed[3:6] = (b[3:6] - b[3:6].mean()) / b.std(unbiased=False)  # A is constant in each group
    torch.testing.assert_close(adv.double(), summed / summed.std(unbiased=False), rtol=0, atol=1e-6)


def test_gdpo_without_every_terms_values_is_a_value_error_naming_them():
    train = load_config(None, ['train.advantage="gdpo"']).train
    with pytest.raises(ValueError, match=r"expected \['a', 'b'\]"):
        advantages(train, WEIGHTS, torch.tensor([1.0, 2.0]), torch.tensor([0, 0]),
                   {"a": torch.tensor([1.0, 2.0])})


def test_the_learner_trains_on_gdpo_advantages_and_reports_each_terms_share():
    terms_sets = ['reward.terms=[{ name = "jpeg_compressibility", label = "a" }, '
                  '{ name = "brightness", label = "b", weight = 2.0 }]', "sampler.base_tail=0",
                  "model.lora_rank=0", "train.group_size=4", "train.prompts_per_step=2"]
    cfg = _cfg(*terms_sets, 'train.advantage="gdpo"')
    model = TinyFlow()
    cond, records, _, _ = _batch(model, cfg)
    # group 0 (rows 0-3): both terms constant, skipped; group 1: A of spread 100, B of 0.1
    reward_terms = {"a": [5.0] * 4 + A, "b": [0.3] * 4 + B}
    rewards = [x + 2.0 * y for x, y in zip(reward_terms["a"], reward_terms["b"], strict=True)]
    policy = Policy(model, cfg.train, cfg.sampler)
    learner = Learner(policy, cfg)
    learner.train_fragment(records=records, cond=cond, rewards=rewards, gen_version=0, n_trained_total=T,
                           sigma_max=policy.sigma_max, reward_terms=reward_terms)
    assert learner.stats.zero_adv_groups == 1 and learner.stats.trained == 4
    assert learner.stats.discarded == {"zero_advantage": 4}
    # the same gradient as the hand-computed gdpo advantages given to the loss directly
    a, b = 50 / (50 + 1e-4), 2 * 0.05 / (0.05 + 1e-4)
    adv = torch.tensor([0.0] * 4 + [a - b, a + b, -a - b, -a + b])
    keep = torch.tensor([False] * 4 + [True] * 4)
    ref = Policy(TinyFlow(), cfg.train, cfg.sampler)
    ref.fragment_loss_backward(records, cond, adv, keep, batch_size_total=cfg.batch_size, n_trained_total=T)
    for got, want in zip(policy.grads_snapshot(), ref.grads_snapshot(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
    metrics = learner.finish_step()
    assert metrics["zero_adv_groups"] == 1
    assert metrics["adv/a/mean_abs"] == pytest.approx(a, rel=1e-9)
    assert metrics["adv/b/mean_abs"] == pytest.approx(b, rel=1e-9)
    assert metrics["adv/a/std"] == pytest.approx(a, rel=1e-9)
    # the same fragment under sum: B's share is a thousandth of A's
    learner_sum = Learner(Policy(TinyFlow(), cfg.train, cfg.sampler), _cfg(*terms_sets))
    learner_sum.train_fragment(records=records, cond=cond, rewards=rewards, gen_version=0, n_trained_total=T,
                               sigma_max=policy.sigma_max, reward_terms=reward_terms)
    m_sum = learner_sum.finish_step()
    assert m_sum["adv/b/mean_abs"] < 3e-3 * m_sum["adv/a/mean_abs"]
    # into metrics.jsonl: documented, and through StepMetrics unchanged
    row = {"step": 0, "policy_version": 1, "wall_time": 1.0, "step_seconds": 1.0, "samples_per_s": 8.0, **metrics}
    record = StepMetrics.from_record(row).to_record()
    assert record["adv/a/std"] == metrics["adv/a/std"] and not StepMetrics.from_record(row).extra
    docs = documented_keys()
    assert all(is_documented(k, docs) for k in metrics), [k for k in metrics if not is_documented(k, docs)]


@pytest.mark.slow
def test_a_gdpo_run_with_a_reward_worker_accounts_exactly_and_reports_each_term(tmp_path: Path) -> None:
    from digenrl.launch import launch, make_run_dir

    cfg = resolve_mode(load_config(None, [
        *SMALL, "run.steps=2", 'train.advantage="gdpo"', "cluster.rewards=1", 'runtime.tag="never"',
        'reward.terms=[{ name = "jpeg_compressibility", weight = 1.0 }, { name = "brightness", weight = 1.0 }]']),
        "digenrl")
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    summary = launch(cfg, run_dir)
    acc = summary["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
    assert acc["in_flight"] == 0 and {k for k, v in acc["discarded"].items() if v} <= {"zero_advantage"}, acc
    assert acc["trained"] + acc["discarded"].get("zero_advantage", 0) == 2 * cfg.batch_size
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert sum(r["trained"] for r in rows) == acc["trained"] > 0
    for r in rows:
        for term in ("jpeg_compressibility", "brightness"):
            assert math.isfinite(r[f"adv/{term}/std"]) and math.isfinite(r[f"adv/{term}/mean_abs"])
            assert f"reward/{term}" in r
    # the terms reached the trainer, which normalised each on its own: in groups of 2 every
    # varying term's normalised value is about +-1, so the two shares are alike although the
    # JPEG size (kB) and the brightness (0..1) differ in spread
    trained = [r for r in rows if r["trained"]]
    assert trained
    for r in trained:
        ratio = r["adv/brightness/mean_abs"] / r["adv/jpeg_compressibility/mean_abs"]
        assert 0.8 < ratio < 1.25, r  # the same run under "sum": 2.6 and 0.75
