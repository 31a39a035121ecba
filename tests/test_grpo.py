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


# ----------------------------------------------------------------------------- MixGRPO window


def test_mix_window_slides_by_the_stride_every_shift_interval_and_rolls_back():
    from digenrl.core.plan import mix_window_start

    starts = [mix_window_start(s, window_size=2, window_lo=1, window_hi=6, shift_every=3, stride=1)
              for s in range(15)]
    # positions 1, 2, 3, 4 (the window [4, 6) is the last that ends by hi = 6), then back to 1
    assert starts == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 1, 1, 1]
    stride2 = [mix_window_start(s, window_size=2, window_lo=0, window_hi=8, shift_every=1, stride=2)
               for s in range(5)]
    assert stride2 == [0, 2, 4, 6, 0]


def test_mix_window_with_exp_decay_stays_shorter_at_each_start_past_the_threshold():
    import math

    from digenrl.config import load_config
    from digenrl.core.plan import mix_window_start, plan_for_step

    # tau(p) = ceil(4 exp(-ln2 max(0, p - 1))): 4 at starts 0 and 1, then 2, 1, 1 (ceil 0.5 = 1)
    kw = dict(window_size=2, window_lo=0, window_hi=6, shift_every=4, stride=1, decay=math.log(2),
              decay_from=1)
    starts = [mix_window_start(s, **kw) for s in range(15)]
    assert starts == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 4, 0, 0, 0]
    # the reference's values (tau 5, k 0.1, threshold 13): at start 20, ceil(5 e^-0.7) = ceil(2.48)
    ref = dict(window_size=1, window_lo=20, window_hi=22, shift_every=5, stride=1, decay=0.1,
               decay_from=13)
    assert [mix_window_start(s, **ref) for s in range(7)] == [20, 20, 20, 21, 21, 21, 20]  # 21: ceil(2.25)
    cfg = load_config(None, ["sampler.num_steps=8", "train.timesteps=mix", "train.window_hi=6",
                             "train.window_shift_every=4", f"train.window_shift_decay={math.log(2)}",
                             "train.window_decay_from=1"])
    assert [plan_for_step(cfg, s)[0][0] for s in range(12)] == starts[:12]
    with pytest.raises(ValueError, match="decay = -1"):
        mix_window_start(0, **{**kw, "decay": -1.0})


def test_mix_plan_is_the_sliding_window_sde_inside_and_trained_and_a_pure_function_of_the_step():
    from digenrl.config import load_config
    from digenrl.core.plan import plan_for_step

    cfg = load_config(None, ["sampler.num_steps=8", "train.timesteps=mix", "train.window_size=2",
                             "train.window_lo=0", "train.window_hi=6", "train.window_shift_every=2",
                             "train.window_stride=1"])
    plans = [plan_for_step(cfg, s) for s in range(12)]
    assert [p[0] for p in plans[::2]] == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [0, 1]]
    assert all(trained == sde for trained, sde in plans)
    assert plan_for_step(cfg, 7) == plans[7]  # no state: a restarted node computes the same


def test_mix_window_that_does_not_fit_is_a_config_error_naming_the_key():
    from digenrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"train\.window_size = 5"):
        load_config(None, ["sampler.num_steps=8", "train.timesteps=mix", "train.window_size=5"])


def test_forward_algorithms_plan_the_trainers_draw_slots_and_sample_sde_unless_ode():
    from digenrl.config import ConfigError, load_config
    from digenrl.core.plan import plan_for_step

    cfg = load_config(None, ["sampler.num_steps=6", "train.algorithm=nft", "train.forward_timesteps=3"])
    assert plan_for_step(cfg, 5) == ([0, 1, 2], [0, 1, 2, 3, 4, 5])
    ode = load_config(None, ["train.algorithm=awm", "sampler.sde_type=ode"])
    assert plan_for_step(ode, 0)[1] == []
    with pytest.raises(ConfigError, match=r"train\.forward_timesteps = 9"):
        load_config(None, ["sampler.num_steps=8", "train.algorithm=nft", "train.forward_timesteps=9"])
    with pytest.raises(ConfigError, match=r"train\.guard = true"):
        load_config(None, ["train.algorithm=nft", "train.guard=true"])


# ----------------------------------------------------------------------------- GRPO-Guard


def test_guarded_log_ratio_is_the_noise_projected_mean_gap_written_out():
    """x' = mu_old + s eps: RatioNorm's log-ratio is exactly mean(eps (mu_new - mu_old))."""
    from digenrl.rl.grpo import guarded_surrogate

    g = torch.Generator().manual_seed(0)
    b, shape = 3, (2, 4, 4)
    s = torch.tensor([0.3, 0.05, 0.8])
    mu_old = torch.randn(b, *shape, generator=g)
    mu_new = mu_old + 0.01 * torch.randn(b, *shape, generator=g)
    eps = torch.randn(b, *shape, generator=g)
    sb = s.view(b, 1, 1, 1)
    x = mu_old + sb * eps

    def logp(mu):  # Gaussian log-density averaged over elements
        return (-((x - mu) ** 2) / (2 * sb**2) - sb.log() - 0.5 * math.log(2 * math.pi)).reshape(b, -1).mean(1)

    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, stats = guarded_surrogate(logp(mu_new), logp(mu_old), mu_new, mu_old, s, adv, clip_range=10.0)
    expected_delta = (eps * (mu_new - mu_old)).reshape(b, -1).mean(1)
    # no clipping at eps = 10: the loss is -A exp(delta)
    torch.testing.assert_close(loss, -adv * torch.exp(expected_delta), rtol=1e-5, atol=1e-6)
    # the plain log-ratio is shifted below 0 by mean(dmu^2) / (2 s^2): the bias RatioNorm removes
    plain = logp(mu_new) - logp(mu_old)
    gap = ((mu_new - mu_old) ** 2).reshape(b, -1).mean(1)
    torch.testing.assert_close(plain, expected_delta / s - gap / (2 * s**2), rtol=1e-4, atol=1e-6)
    assert stats["approx_kl"] == pytest.approx(0.5 * float((expected_delta**2).mean()), rel=1e-4)


def test_guard_weight_is_one_over_the_step_length():
    from digenrl.rl.grpo import guard_weight

    assert guard_weight(0.75, 0.5) == pytest.approx(4.0)
    with pytest.raises(ValueError, match=r"sigma = 0\.5, sigma_next = 0\.5"):
        guard_weight(0.5, 0.5)
