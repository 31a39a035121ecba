"""GRPO advantages, timestep plans, surrogate, KL and the loss weight of digenrl.rl.grpo."""

from __future__ import annotations

import math
import random

import pytest
import torch

from digenrl.core.plan import select_timesteps
from digenrl.rl.grpo import (
    clipped_surrogate,
    group_advantages,
    kl_penalty,
    loss_weight,
)


def test_group_advantages_by_hand_on_two_groups():
    rewards = torch.tensor([1.0, 3.0, 10.0, 20.0, 30.0, 40.0])
    adv, stats = group_advantages(rewards, [0, 0, 1, 1, 1, 1], eps=0.0)
    # group 0: mean 2, population std 1; group 1: mean 25, std sqrt(125)
    s1 = math.sqrt(125.0)
    expected = [-1.0, 1.0, -15 / s1, -5 / s1, 5 / s1, 15 / s1]
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert stats.groups == 2 and stats.zero_groups == 0 and bool(stats.keep.all())


def test_zero_advantage_groups_are_flagged_and_counted():
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 2.0, 5.0])
    adv, stats = group_advantages(rewards, [7, 7, 7, 9, 9, 8])
    # group 7: identical rewards; group 8: a singleton; both exactly zero
    assert stats.zero_groups == 2
    assert stats.keep.tolist() == [False, False, False, True, True, False]
    assert adv[[0, 1, 2, 5]].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[3].item() == pytest.approx(-0.5 / (0.5 + 1e-4), rel=1e-6)


def test_global_std_divides_by_the_std_of_all_rewards():
    rewards = torch.tensor([1.0, 3.0, 10.0, 30.0])
    ids = [0, 0, 1, 1]
    adv_g, _ = group_advantages(rewards, ids, std_mode="group", eps=0.0)
    adv_all, _ = group_advantages(rewards, ids, std_mode="global", eps=0.0)
    std_all = rewards.double().std(unbiased=False).item()
    torch.testing.assert_close(adv_all, torch.tensor([-1, 1, -10, 10]) / torch.tensor(std_all).float())
    torch.testing.assert_close(adv_g, torch.tensor([-1.0, 1.0, -1.0, 1.0]))


def test_advantages_are_clipped_and_clipping_counted():
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    adv, stats = group_advantages(rewards, [0] * 10, clip=2.0)
    assert adv.max().item() == 2.0
    assert stats.clipped == 1
    assert adv[0].item() == pytest.approx(-0.1 / (0.3 + 1e-4), rel=1e-5)


def test_bad_rewards_and_modes_are_rejected_by_name():
    with pytest.raises(ValueError, match="3 rewards but 2 group ids"):
        group_advantages(torch.ones(3), [0, 0])
    with pytest.raises(ValueError, match="std_mode = 'batch'"):
        group_advantages(torch.ones(2), [0, 0], std_mode="batch")
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), [0, 0])


def test_timestep_plan_all_trains_and_noises_every_step():
    plan = select_timesteps("all", 5, rng=random.Random(0))
    assert plan.trained == [0, 1, 2, 3, 4] and plan.sde == [0, 1, 2, 3, 4]


def test_timestep_plan_fraction_trains_the_leading_steps_at_least_one():
    assert select_timesteps("fraction", 10, fraction=0.99, rng=random.Random(0)).trained == list(range(9))
    plan = select_timesteps("fraction", 10, fraction=0.01, rng=random.Random(0))
    assert plan.trained == [0] and plan.sde == list(range(10))


def test_timestep_plan_window_is_drawn_in_range_and_covers_every_start():
    rng = random.Random(3)
    starts = set()
    for _ in range(200):
        plan = select_timesteps("window", 10, window_size=2, window_lo=1, rng=rng)
        k = plan.trained[0]
        assert plan.trained == [k, k + 1] == plan.sde
        starts.add(k)
    assert starts == {1, 2, 3}  # [lo, hi - W] with hi = T // 2 = 5


def test_timestep_plan_window_replays_from_the_same_seed():
    a = [select_timesteps("window", 20, window_size=3, window_hi=15, rng=r).trained
         for r in [random.Random(5)] for _ in range(5)]
    b = [select_timesteps("window", 20, window_size=3, window_hi=15, rng=r).trained
         for r in [random.Random(5)] for _ in range(5)]
    assert a == b


def test_timestep_plan_window_that_does_not_fit_is_rejected():
    with pytest.raises(ValueError, match="window_size = 4"):
        select_timesteps("window", 6, window_size=4, rng=random.Random(0))


def test_clipped_surrogate_takes_the_pessimistic_side():
    eps = 0.1
    logp_old = torch.zeros(4)
    logp_new = torch.log(torch.tensor([1.5, 1.5, 0.5, 1.05]))
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0])
    loss, stats = clipped_surrogate(logp_new, logp_old, adv, eps)
    # A>0, r>1+eps: clipped -1.1; A<0, r>1+eps: unclipped 1.5; A<0, r<1-eps: clipped 0.9
    torch.testing.assert_close(loss, torch.tensor([-1.1, 1.5, 0.9, -2.1]))
    assert stats["clipfrac"] == 0.75
    assert stats["ratio_max_dev"] == pytest.approx(0.5, rel=1e-6)


def test_clipped_surrogate_gradient_vanishes_once_clipped_in_the_advantage_direction():
    logp_new = torch.tensor([math.log(1.5)], requires_grad=True)
    loss, _ = clipped_surrogate(logp_new, torch.zeros(1), torch.ones(1), 0.1)
    loss.sum().backward()
    assert logp_new.grad.item() == 0.0


def test_kl_penalty_is_mean_squared_mean_gap_over_twice_noise_variance():
    mu_t = torch.ones(2, 3, 4)
    mu_r = torch.zeros(2, 3, 4)
    mu_r[1] = 0.5
    kl = kl_penalty(mu_t, mu_r, torch.tensor([0.5, 0.0]).view(2, 1, 1))
    torch.testing.assert_close(kl, torch.tensor([1.0 / (2 * 0.25), 0.0]))


def test_loss_weight_is_one_over_batch_times_trained_steps():
    assert loss_weight(16, 8) == 1 / 128
    with pytest.raises(ValueError, match="n_trained = 0"):
        loss_weight(16, 0)
