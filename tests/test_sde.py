"""The step math in digenrl.rl.sde against torch.distributions, diffusers and written-out formulas."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from digenrl.rl.sde import sde_step, sigma_schedule

T, SHIFT = 6, 3.0
SIGMAS = sigma_schedule(T, SHIFT)
SIGMA_MAX = float(SIGMAS[1])


def _xv(seed: int = 0, shape=(3, 2, 4, 4)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _step(kind, x, v, i, **kw):
    kw.setdefault("noise_level", 0.7)
    kw.setdefault("eta", 0.3)
    return sde_step(kind, x, v, float(SIGMAS[i]), float(SIGMAS[i + 1]), sigma_max=SIGMA_MAX, **kw)


def test_schedule_runs_from_one_to_zero_and_matches_diffusers_shifted_sigmas():
    sched = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    sched.set_timesteps(sigmas=torch.linspace(1.0, 0.0, T + 1)[:-1].tolist())
    assert SIGMAS.shape == (T + 1,)
    assert SIGMAS[0] == 1.0 and SIGMAS[-1] == 0.0
    assert bool((SIGMAS[1:] < SIGMAS[:-1]).all())
    torch.testing.assert_close(SIGMAS, sched.sigmas.float(), rtol=0, atol=1e-6)


def test_schedule_rejects_zero_steps():
    with pytest.raises(ValueError, match="num_steps = 0"):
        sigma_schedule(0, 3.0)


@pytest.mark.parametrize("i", range(T))
def test_sde_log_prob_equals_normal_log_prob_averaged_over_elements(i):
    x, v = _xv(i)
    out = _step("sde", x, v, i, generator=torch.Generator().manual_seed(7))
    ref = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean)).log_prob(out.x_next)
    # our formula against torch.distributions': two computations, so equal up to rounding
    torch.testing.assert_close(out.log_prob, ref.mean(dim=(1, 2, 3)), rtol=1e-6, atol=1e-6)
    assert bool(torch.isfinite(out.log_prob).all())


def test_sde_mean_and_std_follow_flow_grpo_formulas():
    x, v = _xv(1)
    i = 2
    s, sn = float(SIGMAS[i]), float(SIGMAS[i + 1])
    dt = sn - s
    st = 0.7 * math.sqrt(s / (1 - s))
    out = _step("sde", x, v, i, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.mean, x + (v + st**2 / (2 * s) * (x + (1 - s) * v)) * dt)
    assert out.std.item() == pytest.approx(st * math.sqrt(-dt), rel=1e-6)
    assert out.noise_scale.item() == pytest.approx(st, rel=1e-6)


def test_sde_first_step_at_sigma_one_uses_sigma_max_guard_and_stays_finite():
    x, v = _xv(2)
    out = _step("sde", x, v, 0, generator=torch.Generator().manual_seed(0))
    assert out.noise_scale.item() == pytest.approx(0.7 * math.sqrt(1 / (1 - SIGMA_MAX)), rel=1e-6)
    assert all(bool(torch.isfinite(t).all()) for t in (out.x_next, out.mean, out.log_prob))


def test_sde_last_step_to_sigma_zero_keeps_positive_std():
    x, v = _xv(3)
    out = _step("sde", x, v, T - 1, generator=torch.Generator().manual_seed(0))
    assert out.std.item() > 0
    assert bool(torch.isfinite(out.log_prob).all())


def test_ode_step_equals_diffusers_euler_step():
    sched = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    sched.set_timesteps(sigmas=torch.linspace(1.0, 0.0, T + 1)[:-1].tolist())
    x, v = _xv(4)
    for i, t in enumerate(sched.timesteps):
        ours = _step("ode", x, v, i)
        theirs = sched.step(v, t, x, return_dict=False)[0]
        torch.testing.assert_close(ours.x_next, theirs, rtol=0, atol=1e-6)
        assert torch.equal(ours.log_prob, torch.zeros(x.shape[0]))
        x = theirs


def test_sde_with_zero_noise_level_is_rejected_with_the_value_named():
    x, v = _xv(5)
    with pytest.raises(ValueError, match="noise_level = 0"):
        _step("sde", x, v, 1, noise_level=0.0)


def test_cps_step_matches_its_formula_written_out():
    x, v = _xv(6)
    i, a = 2, 0.8
    s, sn = float(SIGMAS[i]), float(SIGMAS[i + 1])
    out = _step("cps", x, v, i, noise_level=a, generator=torch.Generator().manual_seed(1))
    std = sn * math.sin(a * math.pi / 2)
    mu = (1 - sn) * (x - s * v) + math.sqrt(sn**2 - std**2) * (x + (1 - s) * v)
    torch.testing.assert_close(out.mean, mu)
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    torch.testing.assert_close(out.log_prob, -((out.x_next - mu) ** 2).mean(dim=(1, 2, 3)))


def test_cps_last_step_to_sigma_zero_is_deterministic_and_finite():
    x, v = _xv(7)
    out = _step("cps", x, v, T - 1, noise_level=0.8, generator=torch.Generator().manual_seed(1))
    s = float(SIGMAS[T - 1])
    torch.testing.assert_close(out.x_next, x - s * v)
    assert torch.equal(out.log_prob, torch.zeros(3))
    assert not bool(torch.isnan(out.mean).any())


def test_dance_step_matches_dancegrpo_score_form_written_out():
    x, v = _xv(8)
    i, eta = 3, 0.3
    s, sn = float(SIGMAS[i]), float(SIGMAS[i + 1])
    dsigma = sn - s
    x0 = x - s * v
    score = -(x - (1 - s) * x0) / s**2
    mu = x + dsigma * v - 0.5 * eta**2 * score * dsigma
    out = _step("dance", x, v, i, eta=eta, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(out.mean, mu)
    assert out.std.item() == pytest.approx(eta * math.sqrt(s - sn), rel=1e-6)
    ref = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean)).log_prob(out.x_next)
    # our formula against torch.distributions': two computations, so equal up to rounding
    torch.testing.assert_close(out.log_prob, ref.mean(dim=(1, 2, 3)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
def test_bf16_wire_log_prob_recomputed_from_stored_latent_equals_rollout_exactly(kind):
    x, v = _xv(9)
    for i in range(T):
        out = _step(kind, x, v, i, generator=torch.Generator().manual_seed(i),
                    wire_dtype=torch.bfloat16)
        stored = out.x_next.to(torch.bfloat16)  # what travels
        assert torch.equal(stored.float(), out.x_next)
        again = _step(kind, x, v, i, x_next=stored.float())
        assert torch.equal(again.log_prob, out.log_prob)


def test_per_sample_generators_make_noise_independent_of_batch_composition():
    x, v = _xv(10)
    gens = [torch.Generator().manual_seed(s) for s in (11, 12, 13)]
    full = _step("sde", x, v, 1, generator=gens)
    part = _step("sde", x[1:2], v[1:2], 1, generator=[torch.Generator().manual_seed(12)])
    # exact on purpose: the step is elementwise (no reductions), so a sample's result cannot
    # depend on its batch; replaying a fragment's trajectory relies on that bit for bit
    assert torch.equal(full.x_next[1:2], part.x_next)


def test_recompute_log_prob_carries_gradient_to_velocity():
    x, v = _xv(11)
    out = _step("sde", x, v, 1, generator=torch.Generator().manual_seed(0))
    v_param = v.clone().requires_grad_(True)
    again = _step("sde", x, v_param, 1, x_next=out.x_next)
    again.log_prob.sum().backward()
    assert v_param.grad is not None and bool(v_param.grad.abs().sum() > 0)


def test_bad_sigma_order_is_rejected_with_values_named():
    x, v = _xv(12)
    with pytest.raises(ValueError, match=r"sigma = 0\.3"):
        sde_step("sde", x, v, 0.3, 0.5, noise_level=0.7, eta=0.3, sigma_max=SIGMA_MAX)
    with pytest.raises(ValueError, match="step kind 'euler'"):
        sde_step("euler", x, v, 0.5, 0.3, noise_level=0.7, eta=0.3, sigma_max=SIGMA_MAX)


# ----------------------------------------------------------------------------- DPM-Solver++(2M)


def test_dpm2_without_a_previous_evaluation_is_exactly_the_euler_step():
    from digenrl.rl.sde import dpm2_step

    x, v = _xv(3)
    s, s_next = float(SIGMAS[2]), float(SIGMAS[3])
    euler = _step("ode", x, v, 2).x_next
    # same process, same operations: bit-identical (exactness is the point)
    assert torch.equal(dpm2_step(x, v, s, s_next, prev=None).x_next, euler)
    # the last step into sigma 0 is first order too (DPM-Solver's lower-order final step)
    last = dpm2_step(x, v, float(SIGMAS[-2]), 0.0, prev=(float(SIGMAS[-3]), x))
    assert torch.equal(last.x_next, _step("ode", x, v, T - 1).x_next)


def test_dpm2_second_order_step_matches_the_formula_written_out():
    from digenrl.rl.sde import dpm2_step

    x, v = _xv(4)
    d_prev = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    sp, s, sn = 0.8, 0.6, 0.35
    out = dpm2_step(x, v, s, sn, prev=(sp, d_prev))
    lam = lambda z: math.log((1 - z) / z)  # noqa: E731
    h, h_prev = lam(sn) - lam(s), lam(s) - lam(sp)
    r = h_prev / h
    d = x - s * v
    d_eff = (1 + 1 / (2 * r)) * d - (1 / (2 * r)) * d_prev
    # DPM-Solver++ data-prediction update with alpha = 1 - sigma: x' = (sn/s) x - alpha' (e^-h - 1) D
    expected = (sn / s) * x - (1 - sn) * (math.exp(-h) - 1) * d_eff
    torch.testing.assert_close(out.x_next, expected, rtol=1e-5, atol=1e-6)
    assert out.log_prob.tolist() == [0.0] * x.shape[0] and float(out.std.max()) == 0.0


class _GaussianFlow:
    """The exact velocity field carrying N(0, 1) noise to N(m, c^2) data (per element): a real
    flow whose ODE solution is known, x(t) = (1 - t) m + sqrt((1 - t)^2 c^2 + t^2) eps."""

    latent_shape = (1, 4, 4)

    def __init__(self, m: float = 0.7, c: float = 0.3) -> None:
        self.m, self.c = m, c

    def velocity(self, x, sigma, cond):
        t = sigma.view(-1, 1, 1, 1)
        q = (1 - t) ** 2 * self.c**2 + t**2
        z = x - (1 - t) * self.m
        return (t - (1 - t) * self.c**2) * z / q - self.m


def test_dpm2_reaches_the_exact_ode_endpoint_far_closer_than_euler():
    from digenrl.config import SamplerConfig
    from digenrl.rl.sampler import rollout

    flow = _GaussianFlow()
    eps = torch.randn(4, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    exact = flow.m + flow.c * eps
    errs = {}
    # 16 uniform steps: Euler is off by ~0.12, DPM-Solver++(2M) by ~1e-3 (its last step into
    # sigma 0 is first order, which bounds it; the margin below is two orders of magnitude)
    for solver in ("euler", "dpm2"):
        cfg = SamplerConfig(num_steps=16, sde_type="ode", shift=1.0, ode_solver=solver)
        recs = list(rollout(flow, {"emb": torch.zeros(4, 1)}, generator=torch.Generator(),
                            sampler_cfg=cfg, x_init=eps))
        errs[solver] = float((recs[-1].x_next - exact).abs().max())
    assert errs["dpm2"] < errs["euler"] / 10, errs


def test_compression_takes_a_share_of_the_steps_after_the_last_sde_step():
    from digenrl.rl.sampler import step_grid

    assert step_grid(10, {2, 3}, 1.0) == [(i, i + 1) for i in range(10)]
    grid = step_grid(10, {2, 3}, 0.4)  # 6 steps after the window -> ceil(2.4) = 3 of them
    assert grid[:4] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert grid[4:] == [(4, 6), (6, 8), (8, 10)]
    assert step_grid(8, set(), 0.5) == [(0, 2), (2, 4), (4, 6), (6, 8)]  # all-ODE: the whole run
    with pytest.raises(ValueError, match="ode_compress = 0"):
        step_grid(8, set(), 0.0)


def test_mixgrpo_flash_rollout_keeps_the_window_steps_and_compresses_after_it():
    from digenrl.config import SamplerConfig
    from digenrl.rl.sampler import rollout, seeded_generators

    flow = _GaussianFlow()
    sig8 = sigma_schedule(8, 3.0)
    cfg = SamplerConfig(num_steps=8, sde_type="sde", shift=3.0, ode_solver="dpm2", ode_compress=0.4)
    recs = list(rollout(flow, {"emb": torch.zeros(2, 1)}, generator=seeded_generators([1, 2]),
                        sampler_cfg=cfg, sde_steps={1, 2}))
    assert [(r.index, r.sigma_next) for r in recs][3:] == [(3, float(sig8[5])), (5, 0.0)]  # 5 -> 2 steps
    assert [r.sde for r in recs][:3] == [False, True, True]
    assert len(recs) == 3 + math.ceil(0.4 * 5) and recs[-1].sigma_next == 0.0
    assert all(a.x_next is b.x_t for a, b in itertools.pairwise(recs))


def _lora_model_with_a_trained_adapter():
    """The tiny SD3 with a rank-4 adapter whose B matrices are non-zero (a freshly added
    adapter is the identity: B = 0), so adapter on and off give different velocities."""
    from digenrl.config import ModelConfig
    from digenrl.models import build_model

    model = build_model(ModelConfig(family="sd3", path="random", lora_rank=4), seed=0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def test_base_tail_takes_the_last_steps_with_the_adapter_off_and_leaves_it_on():
    from digenrl.config import SamplerConfig
    from digenrl.rl.sampler import rollout, seeded_generators

    model = _lora_model_with_a_trained_adapter()
    cond = model.encode_prompts(["a red circle on a bluish background"] * 2)
    cfg = SamplerConfig(num_steps=6, sde_type="ode", shift=3.0)
    tail = list(rollout(model, cond, generator=seeded_generators([1, 2]),
                        sampler_cfg=SamplerConfig(num_steps=6, sde_type="ode", shift=3.0, base_tail=2)))
    full = list(rollout(model, cond, generator=seeded_generators([1, 2]), sampler_cfg=cfg))
    # same process, same model, same inputs: the steps before the tail are bit-identical
    for a, b in zip(tail[:4], full[:4]):
        assert torch.equal(a.x_next, b.x_next)
    # the tail written out: Euler steps of the adapter-free velocity from the same state
    x = tail[3].x_next
    with torch.no_grad(), model.adapter_disabled():
        for rec in tail[4:]:
            v = model.velocity(x, rec.sigma, cond)
            x = sde_step("ode", x, v, rec.sigma, rec.sigma_next, noise_level=0.7, eta=0.3,
                         sigma_max=rec.sigma).x_next  # the ODE step uses none of the three
    # exact on purpose: the same instance, process and inputs run the same float32 ops
    assert torch.equal(x, tail[-1].x_next)
    assert not torch.allclose(tail[-1].x_next, full[-1].x_next)  # the adapter mattered there
    # and the adapter is on again afterwards: the policy's velocity, not the base's
    with torch.no_grad():
        v_after = model.velocity(full[0].x_t, full[0].sigma, cond)
        with model.adapter_disabled():
            v_base = model.velocity(full[0].x_t, full[0].sigma, cond)
    assert not torch.allclose(v_after, v_base)


def test_base_tail_refuses_an_sde_step_inside_it():
    from digenrl.config import SamplerConfig
    from digenrl.rl.sampler import rollout, seeded_generators

    model = _lora_model_with_a_trained_adapter()
    cfg = SamplerConfig(num_steps=6, sde_type="sde", shift=3.0, base_tail=2)
    with pytest.raises(ValueError, match=r"SDE steps \[5\] fall in the base model's tail"):
        list(rollout(model, model.encode_prompts(["a"]), generator=seeded_generators([1]),
                     sampler_cfg=cfg, sde_steps={1, 5}))
