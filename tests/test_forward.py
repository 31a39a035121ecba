"""DiffusionNFT, AWM and GRPO-Guard on the trainer: each loss against its formula written out on
tiny tensors, the trainer's own draws, GAP/TSP exactness, and the behaviour (generating)
policy's weights for stale samples."""

from __future__ import annotations

import pytest
import torch

from digenrl.models.base import cond_select
from digenrl.rl.forward import (
    fm_log_likelihood,
    forward_draw_t,
    forward_draws,
    fragment_backward,
    nft_loss,
    noised,
    optimality,
)
from digenrl.rl.grpo import group_advantages
from digenrl.rl.learner import Learner
from digenrl.rl.policy import Policy
from digenrl.rl.sampler import rollout, seeded_generators
from tests.factories import batch_config
from tests.test_policy import TinyFlow, _perturb

P, G, T = 4, 2, 4
B = P * G
SEEDS = list(range(500, 500 + B))


def _cfg(algorithm: str, *extra: str):
    return batch_config(T, P, G, f"train.algorithm={algorithm}", "train.forward_timesteps=4", *extra)


def _batch(model, cfg):
    prompts = [f"prompt {i}" for i in range(P) for _ in range(G)]
    cond = model.encode_prompts(prompts)
    recs = list(rollout(model, cond, generator=seeded_generators(SEEDS), sampler_cfg=cfg.sampler))
    rewards = torch.rand(B, generator=torch.Generator().manual_seed(5))
    adv, stats = group_advantages(rewards, [i // G for i in range(B)])
    return cond, recs[-1].x_next, adv, stats.keep


def _tensors(seed: int, b: int = 3, shape=(2, 4, 4)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, *shape, generator=g) for _ in range(3)]


# ----------------------------------------------------------------------------- the formulas


@pytest.mark.parametrize("adaptive", [False, True])
def test_nft_loss_is_the_papers_two_branch_loss_written_out(adaptive):
    v, v_old, target = _tensors(0)
    t = torch.tensor([0.2, 0.5, 0.9])
    adv = torch.tensor([2.0, -0.5, 7.0])  # the last beyond the clip: r saturates at 1
    beta, clip = 0.7, 5.0
    r = 0.5 + 0.5 * torch.clamp(adv / clip, -1, 1)
    pos = (1 - beta) * v_old + beta * v
    neg = (1 + beta) * v_old - beta * v

    def err(u):
        sq = ((u - target) ** 2).mean(dim=(1, 2, 3))
        if not adaptive:
            return sq
        # x0-space error over its mean absolute value: t^2 sq / (t mean|u - v*|)
        return t * sq / (u - target).abs().mean(dim=(1, 2, 3))

    expected = clip / beta * (r * err(pos) + (1 - r) * err(neg))
    got = nft_loss(v, v_old, target, t, optimality(adv, clip), beta=beta, adv_clip=clip, adaptive=adaptive)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_nft_first_gradient_is_the_advantage_weighted_flow_matching_gradient():
    """At v = v_old (staleness 0) the loss's gradient is 2 A (v_old - v*) / n, whatever beta."""
    _, v_old, target = _tensors(1)
    adv = torch.tensor([1.5, -0.4, 0.0])
    n = v_old[0].numel()
    for beta in (0.1, 1.0):
        v = v_old.clone().requires_grad_(True)
        nft_loss(v, v_old, target, torch.full((3,), 0.4), optimality(adv, 5.0), beta=beta,
                 adv_clip=5.0, adaptive=False).sum().backward()
        expected = 2 * adv.view(3, 1, 1, 1) * (v_old - target) / n
        torch.testing.assert_close(v.grad, expected, rtol=1e-5, atol=1e-7)


def test_awm_loss_is_a_ppo_ratio_of_flow_matching_likelihoods_written_out():
    from digenrl.rl.grpo import ppo_surrogate

    v, v_old, target = _tensors(2)
    v_old = v + 0.01 * v_old
    adv = torch.tensor([1.0, -2.0, 0.5])
    ll = -((v - target) ** 2).mean(dim=(1, 2, 3))
    ll_old = -((v_old - target) ** 2).mean(dim=(1, 2, 3))
    rho = torch.exp(ll - ll_old)
    c = 1e-3
    expected = torch.maximum(-adv * rho, -adv * rho.clamp(1 - c, 1 + c))
    got, stats = ppo_surrogate(fm_log_likelihood(v, target) - fm_log_likelihood(v_old, target), adv, c)
    torch.testing.assert_close(got, expected)
    assert stats["ratio_max_dev"] == pytest.approx(float((rho - 1).abs().max()), rel=1e-5)
    # on-policy, the gradient is A times the flow-matching gradient 2 (v - v*) / n
    w = v.clone().requires_grad_(True)
    loss, _ = ppo_surrogate(fm_log_likelihood(w, target) - fm_log_likelihood(w.detach(), target), adv, 1.0)
    loss.sum().backward()
    torch.testing.assert_close(w.grad, 2 * adv.view(3, 1, 1, 1) * (v - target) / v[0].numel())


def test_the_trainers_draws_are_stratified_shifted_and_depend_only_on_seed_and_slot():
    J, shift = 4, 3.0
    for j in range(J):
        lo, hi = j / J, (j + 1) / J
        t = forward_draw_t(123, j, J, shift)
        assert shift * lo / (1 + (shift - 1) * lo) <= t <= shift * hi / (1 + (shift - 1) * hi)
    t_all, eps_all = forward_draws([1, 2, 3], 2, J, shift, (2, 4, 4))
    t_one, eps_one = forward_draws([2], 2, J, shift, (2, 4, 4))
    # exact: the same seeded generator draws, one sample's draws independent of its batch
    assert torch.equal(t_all[1:2], t_one) and torch.equal(eps_all[1:2], eps_one)
    assert not torch.equal(forward_draws([2], 1, J, shift, (2, 4, 4))[1], eps_one)
    x0 = torch.randn(3, 2, 4, 4)
    x_t, target = noised(x0, t_all, eps_all)
    torch.testing.assert_close(x_t, (1 - t_all.view(3, 1, 1, 1)) * x0 + t_all.view(3, 1, 1, 1) * eps_all)
    torch.testing.assert_close(target, eps_all - x0)


# ----------------------------------------------------------------------------- GAP / TSP


@pytest.mark.parametrize("algorithm", ["nft", "awm"])
def test_forward_gradient_over_fragments_and_draw_halves_sums_to_the_full_batch(algorithm):
    cfg = _cfg(algorithm, "train.kl_beta=0.1", "train.awm_clip=0.05")
    model = TinyFlow()
    policy = Policy(model, cfg.train, cfg.sampler, keep_versions=1)
    cond, x0, adv, keep = _batch(model, cfg)
    policy.optimizer_step()  # version 1 with version 0's weights kept...
    _perturb(model)          # ...and moved off them: the batch below is one version stale
    kw = dict(gen_version=0, batch_size_total=B, n_draws_total=4)
    full_stats = fragment_backward(policy, x0, cond, adv, keep, seeds=SEEDS, draws=range(4), **kw)
    full = policy.grads_snapshot()
    assert any(bool(g.abs().sum() > 0) for g in full) and full_stats["kl"] > 0
    if algorithm == "awm":
        assert full_stats["ratio_max_dev"] > 0  # v_old came from the generating weights
    policy.zero_grad()
    for f in range(4):  # GAP: four fragments of whole groups
        rows = list(range(f * G, (f + 1) * G))
        fragment_backward(policy, x0[rows], cond_select(cond, rows), adv[rows], keep[rows],
                          seeds=SEEDS[f * G:(f + 1) * G], draws=range(4), **kw)
    for a, b in zip(policy.grads_snapshot(), full):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    parts = []
    for half in ([0, 3], [1, 2]):  # TSP: two ranks, each with its own draw slots
        policy.zero_grad()
        fragment_backward(policy, x0, cond, adv, keep, seeds=SEEDS, draws=half, **kw)
        parts.append(policy.grads_snapshot())
    for a, b, f in zip(*parts, full):
        torch.testing.assert_close(a + b, f, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- behaviour weights


def test_behaviour_weights_are_the_generating_versions_and_the_current_ones_come_back():
    cfg = _cfg("nft")
    model, twin = TinyFlow(), TinyFlow()
    policy = Policy(model, cfg.train, cfg.sampler, keep_versions=2)
    cond, x0, adv, keep = _batch(model, cfg)
    fragment_backward(policy, x0, cond, adv, keep, seeds=SEEDS, draws=[0], gen_version=0,
                      batch_size_total=B, n_draws_total=4)
    grads = policy.grads_snapshot()
    policy.optimizer_step()
    _perturb(model)
    current = {k: v.clone() for k, v in policy.state_dict_for_sync().items()}
    x = torch.randn(2, *model.latent_shape)
    c2 = cond_select(cond, [0, 1])
    with torch.no_grad(), policy.behaviour_weights(0):
        v0 = policy.velocity(x, 0.5, c2)
    with torch.no_grad():  # twin never trained: it holds version 0's weights
        torch.testing.assert_close(v0, twin.velocity(x, torch.full((2,), 0.5), c2), rtol=0, atol=1e-6)
    assert all(torch.equal(current[k], v) for k, v in policy.state_dict_for_sync().items())
    policy.optimizer_step()
    policy.optimizer_step()
    assert not policy.behaviour_available(0) and policy.behaviour_available(1)
    with pytest.raises(ValueError, match="behaviour weights of version 0 are not kept"), \
            policy.behaviour_weights(0):
        pass
    assert any(bool(g.abs().sum() > 0) for g in grads)


def test_a_stale_nft_fragment_is_reflected_about_its_generating_policy():
    cfg = _cfg("nft", "train.nft_adaptive=false")
    model, twin = TinyFlow(), TinyFlow()
    policy = Policy(model, cfg.train, cfg.sampler, keep_versions=1)
    cond, x0, adv, keep = _batch(model, cfg)
    policy.optimizer_step()
    _perturb(model)
    fragment_backward(policy, x0, cond, adv, keep, seeds=SEEDS, draws=[1], gen_version=0,
                      batch_size_total=B, n_draws_total=4)
    got = policy.grads_snapshot()
    # by hand: v_old from the version-0 twin, the loss written with nft_loss, one backward
    policy.zero_grad()
    t, eps = forward_draws(SEEDS, 1, 4, cfg.sampler.shift, x0.shape[1:])
    x_t, target = noised(x0, t, eps)
    with torch.no_grad():
        v_old = twin.velocity(x_t, t, cond)
    v = model.velocity(x_t, t, cond)
    loss = nft_loss(v, v_old, target, t, optimality(adv, cfg.train.adv_clip), beta=1.0,
                    adv_clip=cfg.train.adv_clip, adaptive=False)
    (loss.sum() / (B * 4)).backward()
    for a, b in zip(got, policy.grads_snapshot()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_fragment_whose_generating_weights_are_gone_is_discarded_and_counted():
    cfg = _cfg("awm")
    model = TinyFlow()
    policy = Policy(model, cfg.train, cfg.sampler, keep_versions=0)  # a resumed trainer keeps none
    learner = Learner(policy, cfg)
    cond, x0, _, _ = _batch(model, cfg)
    policy.optimizer_step()
    rewards = torch.rand(B, generator=torch.Generator().manual_seed(1)).tolist()
    learner.train_fragment(records={0: None}, cond=cond, rewards=rewards, gen_version=0,
                           n_trained_total=4, sigma_max=0.9, final=x0, seeds=SEEDS)
    assert learner.stats.trained == 0
    assert learner.stats.discarded == {"behaviour_unavailable": B}
    assert all(p.grad is None for p in policy.params)


# ----------------------------------------------------------------------------- GRPO-Guard


def test_guard_ratio_is_exactly_one_on_policy_and_uses_the_behaviour_mean_when_stale():
    from digenrl.rl.grpo import guard_weight, guarded_surrogate
    from digenrl.rl.sde import sde_step
    from tests.test_policy import _batch as chunk_batch
    from tests.test_policy import _cfg as grpo_cfg

    cfg = grpo_cfg("train.guard=true", "train.clip_range=0.05")
    model, twin = TinyFlow(), TinyFlow()
    policy = Policy(model, cfg.train, cfg.sampler, keep_versions=1)
    cond, records, adv, keep = chunk_batch(model, cfg)
    on = policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=B, n_trained_total=T)
    assert on["ratio_max_dev"] == 0.0  # same weights, same layout: bit-identical recompute
    policy.zero_grad()
    policy.optimizer_step()
    _perturb(model)
    rec = records[2]
    policy.fragment_loss_backward({2: rec}, cond, adv, keep, batch_size_total=B, n_trained_total=T,
                                  gen_version=0)
    got = policy.grads_snapshot()
    policy.zero_grad()
    # by hand: the behaviour mean from the version-0 twin, the guarded surrogate, 1/|dt|
    sc = cfg.sampler
    kw = dict(noise_level=sc.noise_level, eta=sc.eta, sigma_max=policy.sigma_max, x_next=rec.x_next)
    with torch.no_grad():
        old = sde_step(sc.sde_type, rec.x_t, twin.velocity(rec.x_t, torch.full((B,), rec.sigma), cond),
                       rec.sigma, rec.sigma_next, **kw)
    new = sde_step(sc.sde_type, rec.x_t, model.velocity(rec.x_t, torch.full((B,), rec.sigma), cond),
                   rec.sigma, rec.sigma_next, **kw)
    per, st = guarded_surrogate(new.log_prob, rec.log_prob, new.mean, old.mean, new.std, adv,
                                cfg.train.clip_range)
    (per.sum() * guard_weight(rec.sigma, rec.sigma_next) / (B * T)).backward()
    assert st["ratio_max_dev"] > 0
    for a, b in zip(got, policy.grads_snapshot()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
