"""Policy: GAP/TSP gradient equivalence, exact first ratio, helper forwards, sync; rollout streaming."""

from __future__ import annotations

import pytest
import torch

from digenrl.config import ModelConfig
from digenrl.models.base import Cond, cond_select
from digenrl.rl.grpo import group_advantages
from digenrl.rl.policy import Policy
from digenrl.rl.sampler import StepRecord, rollout, seeded_generators
from tests.conftest import assert_close_across_instances, assert_same_weights
from tests.factories import batch_config

P, G, T = 4, 2, 4
B = P * G


class TinyVelocityNet(torch.nn.Module):
    """A conv on the latent, modulated by sigma and a conditioning vector: a real (tiny) net."""

    def __init__(self, channels: int = 2, emb: int = 3) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.sigma_proj = torch.nn.Linear(1, channels)
        self.cond_proj = torch.nn.Linear(emb, channels)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        film = self.sigma_proj(sigma[:, None]) + self.cond_proj(emb)
        return self.conv(x) * (1 + film[:, :, None, None]) - x


class TinyFlow:
    """The FlowModel protocol over :class:`TinyVelocityNet`, prompts hashed to fixed vectors."""

    family = "tiny"
    latent_shape = (2, 4, 4)

    def __init__(self, seed: int = 0) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.transformer = TinyVelocityNet()

    def encode_prompts(self, prompts) -> Cond:
        vecs = [torch.randn(3, generator=torch.Generator().manual_seed(sum(map(ord, p)) + len(p)))
                for p in prompts]
        return {"emb": torch.stack(vecs)}

    def velocity(self, x, sigma, cond):
        sigma = torch.as_tensor(sigma, dtype=torch.float32).expand(x.shape[0])
        return self.transformer(x, sigma, cond["emb"])

    def decode(self, x):
        return (x[:, :1].repeat(1, 3, 1, 1).clamp(-1, 1) * 127.5 + 127.5).to(torch.uint8)

    def trainable_parameters(self):
        return (p for p in self.transformer.parameters() if p.requires_grad)


def _cfg(*extra: str):
    return batch_config(T, P, G, "train.clip_range=0.2", "train.timesteps=all", *extra)


def _batch(model, cfg, seeds=None):
    prompts = [f"prompt {i}" for i in range(P) for _ in range(G)]
    cond = model.encode_prompts(prompts)
    seeds = seeds if seeds is not None else list(range(100, 100 + B))
    records = {r.index: r for r in rollout(model, cond, generator=seeded_generators(seeds),
                                           sampler_cfg=cfg.sampler)}
    rewards = torch.rand(B, generator=torch.Generator().manual_seed(3))
    adv, stats = group_advantages(rewards, [i // G for i in range(B)])
    return cond, records, adv, stats.keep


def _slice(records, rows):
    return {t: StepRecord(r.index, r.sigma, r.sigma_next, r.x_t[rows], r.x_next[rows],
                          r.log_prob[rows], r.sde) for t, r in records.items()}


def _perturb(model, seed=1, scale=1e-2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.transformer.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_gradient_accumulated_over_four_fragments_equals_full_batch_gradient(kl_beta):
    cfg = _cfg(f"train.kl_beta={kl_beta}", "train.clip_range=0.005")
    model = TinyFlow()
    policy = Policy(model, cfg.train, cfg.sampler)
    cond, records, adv, keep = _batch(model, cfg)
    _perturb(model)  # off-policy weights: ratios != 1, some clipped, KL != 0
    full_stats = policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=B, n_trained_total=T)
    full = policy.grads_snapshot()
    policy.zero_grad()
    for f in range(4):
        rows = list(range(f * G, (f + 1) * G))
        policy.fragment_loss_backward(_slice(records, rows), cond_select(cond, rows), adv[rows], keep[rows],
                                      batch_size_total=B, n_trained_total=T)
    assert 0 < full_stats["clipfrac"] < 1 and (kl_beta == 0) == (full_stats["kl"] == 0)
    assert any(bool(g.abs().sum() > 0) for g in full)
    for a, b in zip(policy.grads_snapshot(), full):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_gradient_of_two_disjoint_timestep_halves_sums_to_full_gradient():
    cfg = _cfg()
    model = TinyFlow()
    policy = Policy(model, cfg.train, cfg.sampler)
    cond, records, adv, keep = _batch(model, cfg)
    _perturb(model)
    policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=B, n_trained_total=T)
    full = policy.grads_snapshot()
    parts = []
    for half in ({0, 2}, {1, 3}):  # two TSP ranks, each with its own timesteps
        policy.zero_grad()
        policy.fragment_loss_backward({t: records[t] for t in half}, cond, adv, keep,
                                      batch_size_total=B, n_trained_total=T)
        parts.append(policy.grads_snapshot())
    for a, b, f in zip(*parts, full):
        torch.testing.assert_close(a + b, f, rtol=0, atol=1e-6)


@pytest.mark.parametrize("extra", [(), ("sampler.wire_dtype=bfloat16",), ("sampler.guidance_scale=3.0",),
                                   ("sampler.sde_type=cps", "sampler.noise_level=0.8"),
                                   ("sampler.sde_type=dance",)])
def test_first_recompute_at_rollout_weights_gives_ratio_exactly_one(extra):
    cfg = _cfg(*extra)
    model = TinyFlow()
    policy = Policy(model, cfg.train, cfg.sampler)
    cond, records, adv, _ = _batch(model, cfg)
    stats = policy.fragment_loss_backward(records, cond, adv, torch.ones(B, dtype=torch.bool),
                                          batch_size_total=B, n_trained_total=T)
    assert stats["ratio_max_dev"] == 0.0
    assert stats["ratio_mean"] == 1.0 and stats["n"] == B * T


def test_helper_generation_between_fragments_leaves_accumulated_grads_unchanged():
    cfg = _cfg()
    model = TinyFlow()
    policy = Policy(model, cfg.train, cfg.sampler)
    cond, records, adv, keep = _batch(model, cfg)
    rows = list(range(G))
    policy.fragment_loss_backward(_slice(records, rows), cond_select(cond, rows), adv[rows], keep[rows],
                                  batch_size_total=B, n_trained_total=T)
    before = policy.grads_snapshot()
    # a TAG helper generates a fragment with the trainer's own weights, without backward
    for _ in rollout(model, cond, generator=seeded_generators(range(B)), sampler_cfg=cfg.sampler):
        pass
    assert torch.is_grad_enabled()
    assert all(torch.equal(a, b) for a, b in zip(policy.grads_snapshot(), before))


def test_rows_with_keep_false_contribute_nothing():
    cfg = _cfg()
    model = TinyFlow()
    policy = Policy(model, cfg.train, cfg.sampler)
    cond, records, adv, _ = _batch(model, cfg)
    _perturb(model)
    keep = torch.tensor([True, True, False, False] * 2)
    kept = [0, 1, 4, 5]
    stats = policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=B, n_trained_total=T)
    masked = policy.grads_snapshot()
    policy.zero_grad()
    policy.fragment_loss_backward(_slice(records, kept), cond_select(cond, kept), adv[kept],
                                  torch.ones(4, dtype=torch.bool), batch_size_total=B, n_trained_total=T)
    assert stats["n"] == 4 * T
    for a, b in zip(policy.grads_snapshot(), masked):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    none = policy.fragment_loss_backward(records, cond, adv, torch.zeros(B, dtype=torch.bool),
                                         batch_size_total=B, n_trained_total=T)
    assert none["n"] == 0


def test_optimizer_step_clips_updates_and_counts_versions():
    cfg = _cfg("train.max_grad_norm=1e-3", "train.lr=1e-2")
    model = TinyFlow()
    policy = Policy(model, cfg.train, cfg.sampler)
    cond, records, adv, keep = _batch(model, cfg)
    before = [p.detach().clone() for p in policy.params]
    policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=B, n_trained_total=T)
    out = policy.optimizer_step()
    assert out["version"] == 1 == policy.version and not out["skipped"]
    assert out["grad_norm"] > 1e-3  # the raw norm, before clipping
    assert any(not torch.equal(a, p) for a, p in zip(before, policy.params))
    assert all(p.grad is None for p in policy.params)
    again = policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=B, n_trained_total=T)
    assert again["ratio_max_dev"] > 0  # the step moved the policy


def test_sync_state_round_trip_makes_a_second_policy_identical():
    cfg = _cfg()
    a, b = TinyFlow(seed=0), TinyFlow(seed=1)
    pa, pb = Policy(a, cfg.train, cfg.sampler), Policy(b, cfg.train, cfg.sampler)
    pb.load_sync_state(pa.state_dict_for_sync())
    _, ra, _, _ = _batch(a, cfg)
    _, rb, _, _ = _batch(b, cfg)
    assert_same_weights(pb.state_dict_for_sync(), pa.state_dict_for_sync())
    for t in ra:  # two instances: equal weights, outputs equal up to kernel rounding
        assert_close_across_instances(ra[t].x_next, rb[t].x_next)
    with pytest.raises(ValueError, match="sync state keys differ"):
        pb.load_sync_state({"conv.weight": torch.zeros(2, 2, 3, 3)})


def test_rollout_yields_each_step_before_computing_the_next():
    cfg = _cfg()
    model = TinyFlow()
    calls = []
    real = model.velocity
    model.velocity = lambda x, s, c: (calls.append(float(s[0])), real(x, s, c))[1]
    it = rollout(model, model.encode_prompts(["a"] * 2), generator=seeded_generators([1, 2]),
                 sampler_cfg=cfg.sampler)
    first = next(it)
    assert first.index == 0 and len(calls) == 1 and first.sigma == 1.0
    rest = list(it)
    assert [r.index for r in rest] == [1, 2, 3] and rest[-1].sigma_next == 0.0
    assert all(torch.equal(a.x_next, b.x_t) for a, b in zip([first, *rest], rest))


def test_trajectories_depend_only_on_each_samples_seed_not_on_the_fragment():
    cfg = _cfg()
    model = TinyFlow()
    cond, full, _, _ = _batch(model, cfg)
    rows = [2, 3]
    seeds = [102, 103]
    part = {r.index: r for r in rollout(model, cond_select(cond, rows), generator=seeded_generators(seeds),
                                        sampler_cfg=cfg.sampler)}
    for t in range(T):
        torch.testing.assert_close(part[t].x_next, full[t].x_next[rows], rtol=0, atol=1e-6)


def test_window_rollout_injects_noise_only_inside_the_window():
    cfg = _cfg()
    model = TinyFlow()
    recs = list(rollout(model, model.encode_prompts(["a"] * 2), generator=seeded_generators([1, 2]),
                        sampler_cfg=cfg.sampler, sde_steps={1, 2}))
    assert [r.sde for r in recs] == [False, True, True, False]
    assert recs[0].log_prob.tolist() == [0.0, 0.0] and recs[1].log_prob.abs().sum() > 0


def test_real_tiny_sd3_lora_adapter_recomputes_ratio_one_and_kl_against_disabled_adapter():
    from digenrl.models import build_model

    cfg = _cfg("train.kl_beta=0.05", "sampler.num_steps=2")
    model = build_model(ModelConfig(family="sd3", path="random", lora_rank=2), seed=0)
    policy = Policy(model, cfg.train, cfg.sampler)
    with torch.no_grad():  # peft starts lora_B at 0 (adapter = identity); move it off the base
        for i, p in enumerate(policy.params):
            p.add_(1e-2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    cond = model.encode_prompts(["a red square", "a red square", "a blue circle", "a blue circle"])
    records = {r.index: r for r in rollout(model, cond, generator=seeded_generators([1, 2, 3, 4]),
                                           sampler_cfg=cfg.sampler)}
    adv, stats = group_advantages(torch.tensor([0.1, 0.5, 0.2, 0.9]), [0, 0, 1, 1])
    out = policy.fragment_loss_backward(records, cond, adv, stats.keep, batch_size_total=4, n_trained_total=2)
    assert out["ratio_max_dev"] == 0.0
    assert out["kl"] > 0  # the adapter-disabled base is the reference
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in policy.params)
    assert all("lora_" in k for k in policy.state_dict_for_sync())


def _bf16_lora_policy(cfg, seed=0):
    from digenrl.models import build_model

    model = build_model(ModelConfig(family="sd3", path="random", lora_rank=2, dtype="bfloat16"), seed=seed)
    with torch.no_grad():  # peft starts lora_B at 0, where lora_A gets no gradient: move it off
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model, Policy(model, cfg.train, cfg.sampler)


def _sd3_batch(model, cfg):
    cond = model.encode_prompts(["a red square", "a red square", "a blue circle", "a blue circle"])
    records = {r.index: r for r in rollout(model, cond, generator=seeded_generators([1, 2, 3, 4]),
                                           sampler_cfg=cfg.sampler)}
    adv, stats = group_advantages(torch.tensor([0.1, 0.5, 0.2, 0.9]), [0, 0, 1, 1])
    return cond, records, adv, stats.keep


def test_a_bf16_lora_step_at_lr_1e5_changes_every_trained_weight_through_float32_masters():
    cfg = _cfg("sampler.num_steps=2", "train.lr=1e-5")
    model, policy = _bf16_lora_policy(cfg)
    assert policy.has_masters and all(p.dtype == torch.float32 for p in policy.params)
    assert all(p.dtype == torch.bfloat16 for p in policy.model_params)
    before = [p.detach().clone() for p in policy.params]
    cond, records, adv, keep = _sd3_batch(model, cfg)
    policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=4, n_trained_total=2)
    assert all(p.grad is None for p in policy.model_params)  # moved into the masters as they came
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in policy.params)
    moved = [m.grad != 0 for m in policy.params]  # the last block's text query feeds nothing: 0
    policy.optimizer_step()
    changed = [a != p for a, p in zip(before, policy.params)]
    # every element with a gradient moved (a bf16 AdamW leaves 84% of them where they were)
    assert all(torch.equal(c, m) for c, m in zip(changed, moved))
    assert sum(int(c.sum()) for c in changed) > 0.95 * sum(p.numel() for p in policy.params)
    state = policy.optimizer.state[policy.params[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # the model the passes run holds the masters rounded to bf16
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(policy.model_params, policy.params))


def test_a_bf16_rollout_copy_synced_from_the_masters_gives_ratio_exactly_one_after_a_step():
    from digenrl.models import build_model

    cfg = _cfg("sampler.num_steps=2", "train.lr=1e-3")
    model, policy = _bf16_lora_policy(cfg)
    cond, records, adv, keep = _sd3_batch(model, cfg)
    policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=4, n_trained_total=2)
    policy.optimizer_step()
    sd = policy.state_dict_for_sync()
    assert all(v.dtype == torch.float32 for v in sd.values())  # the masters, not their rounding
    rollout_model = build_model(ModelConfig(family="sd3", path="random", lora_rank=2, dtype="bfloat16"), seed=0)
    rollout_model.load_sync_state_dict(sd)
    # the rollout rounds the masters exactly as the trainer's own model did: the same bf16 bits
    assert_same_weights(rollout_model.transformer.state_dict(), model.transformer.state_dict())
    # generated by the trainer's model after the step (TAG): the recompute is exact
    cond, records, adv, keep = _sd3_batch(model, cfg)
    out = policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=4, n_trained_total=2)
    assert out["n"] > 0 and out["ratio_max_dev"] == 0.0
    # by the rollout's instance: the same bits and ops, so the same result up to another kernel
    # path on another memory layout (tests/conftest.py); a different precision layout (fp32 LoRA,
    # autocast) moves the ratio by ~1e-3, a hundred times this bound (1/10 of the clip range)
    cond, records, adv, keep = _sd3_batch(rollout_model, cfg)
    out = policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=4, n_trained_total=2)
    assert out["n"] > 0 and out["ratio_max_dev"] <= 1e-5


def test_masters_survive_a_sync_state_round_trip_exactly():
    cfg = _cfg("sampler.num_steps=2", "train.lr=1e-5")
    model, policy = _bf16_lora_policy(cfg)
    cond, records, adv, keep = _sd3_batch(model, cfg)
    policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=4, n_trained_total=2)
    policy.optimizer_step()
    saved = policy.state_dict_for_sync()  # what a checkpoint writes
    _, fresh = _bf16_lora_policy(cfg, seed=1)
    fresh.load_sync_state(saved)
    assert all(torch.equal(a, b) for a, b in zip(fresh.params, policy.params))
    assert all(torch.equal(a, b) for a, b in zip(fresh.model_params, policy.model_params))
