"""The per-step math of flow-matching RL: sigma schedule, stochastic steps and their log-probs.

One pure module shared by the rollout (sampling) and the trainer (log-prob recompute), so the
two can never disagree on a formula. Everything runs in float32: inputs are upcast, because
bf16 overflows in the SDE mean (flowgrpo.md, section 1).

Notation: sigmas run from 1 (noise) down to 0 (data); at one step ``sigma`` is the current
level, ``sigma_next`` the next one, ``dt = sigma_next - sigma < 0`` and ``v`` the model's
velocity, so the plain Euler (ODE) step is ``x + dt * v``.

Step kinds (``kind``):

* ``"sde"`` (Flow-GRPO): ``s_t = a * sqrt(sigma / (1 - sigma))`` with ``a = noise_level``;
  at ``sigma = 1`` the ``sigma`` in the denominator is replaced by ``sigma_max`` (the
  schedule's second entry, as flow_grpo does) so it cannot divide by zero.
  ``mu = x + (v + s_t^2 / (2 sigma) * (x + (1 - sigma) v)) dt``, ``std = s_t * sqrt(-dt)``.
  The last step (``sigma_next = 0``) is applied like any other: ``dt = -sigma`` keeps
  ``std > 0``.
* ``"cps"`` (coefficient-preserving sampling): ``std = sigma_next * sin(a pi / 2)``,
  ``x0 = x - sigma v``, ``x1 = x + (1 - sigma) v``,
  ``mu = (1 - sigma_next) x0 + sqrt(sigma_next^2 - std^2) x1`` and the log-prob is
  ``-mean((x' - mu)^2)`` (constants and variance dropped). At ``sigma_next = 0`` the step is
  deterministic (``std = 0``, ``x' = x0``); the log-prob stays finite because it never
  divides by ``std``.
* ``"dance"`` (DanceGRPO): ``mu = x + dt v - 1/2 eta^2 score dt`` with
  ``score = -(x - (1 - sigma) x0) / sigma^2`` and ``x0 = x - sigma v``, which expands to
  ``mu = x + (v + eta^2 / (2 sigma) * (x + (1 - sigma) v)) dt``: Flow-GRPO's drift with
  ``s_t^2`` replaced by a constant ``eta^2``. ``std = eta * sqrt(-dt)``.
* ``"ode"``: ``x' = x + dt v``, ``std = 0``, log-prob 0 (no noise, nothing to train).

Higher-order ODE steps (:func:`dpm2_step`, MixGRPO-Flash's solver outside the SDE window):
DPM-Solver++(2M) in data prediction, written for flow matching (``alpha = 1 - sigma``,
``lambda = log(alpha / sigma)``, data prediction ``D = x - sigma v``)::

    x' = (sigma' / sigma) x + (alpha' - alpha sigma' / sigma) D_eff
    D_eff = (1 + 1 / (2 r)) D - 1 / (2 r) D_prev,   r = (lambda - lambda_prev) / (lambda' - lambda)

with ``D_prev`` the data prediction of the previous model evaluation. With ``D_eff = D`` (first
order: no previous evaluation, or ``sigma' = 0`` as DPM-Solver's "lower order final") this is
exactly the Euler step ``x + dt v``.

Log-probs (``"sde"``, ``"dance"``) are the Gaussian log-density
``-(x' - mu)^2 / (2 std^2) - log std - log sqrt(2 pi)`` *averaged* over every non-batch
element, which is why PPO clip ranges are ~1e-4.

Precision trap (DESIGN.md): when a sample is drawn here, ``x'`` is rounded to ``wire_dtype``
(and back to float32) *before* its log-prob is computed, so a trainer that recomputes the
log-prob from the stored (rounded) latent gets exactly the behaviour log-prob.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

StepKind = Literal["sde", "cps", "dance", "ode"]
STEP_KINDS: tuple[str, ...] = ("sde", "cps", "dance", "ode")

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:
    """Sigmas ``[T+1]`` from 1 to 0: ``t = linspace(1, 0, T+1)``, then ``s t / (1 + (s-1) t)``.

    Equal (to float32 rounding) to diffusers' ``FlowMatchEulerDiscreteScheduler(shift=s)``
    after ``set_timesteps(sigmas=linspace(1, 1/T, T))``, which is what the SD3/FLUX
    pipelines pass; the last entry is exactly 0.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps = {num_steps}: expected at least 1")
    if not shift > 0:
        raise ValueError(f"shift = {shift}: expected a positive number")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    sigmas = shift * t / (1 + (shift - 1) * t)
    sigmas[-1] = 0.0
    return sigmas.to(torch.float32)


@dataclass
class StepOut:
    """One denoising step.

    ``mean`` has ``x``'s shape; ``std`` (the per-element scale of the Gaussian) and
    ``noise_scale`` (``s_t`` for "sde", ``eta`` for "dance", ``std`` for "cps", 0 for "ode";
    the denominator of the KL penalty) are float32 tensors broadcastable to ``x``;
    ``log_prob`` is ``[B]``.
    """

    x_next: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    noise_scale: torch.Tensor
    log_prob: torch.Tensor


def _per_sample(value: float | torch.Tensor, x: torch.Tensor, name: str) -> torch.Tensor:
    """A scalar or ``[B]`` sigma as a float32 tensor shaped ``(B or 1, 1, ..., 1)``."""
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.dim() == 0:
        return t.reshape((1,) * x.dim())
    if t.dim() != 1 or t.shape[0] != x.shape[0]:
        raise ValueError(f"{name} has shape {tuple(t.shape)}: expected a scalar or [{x.shape[0]}]")
    return t.reshape((-1,) + (1,) * (x.dim() - 1))


def _draw_noise(
    shape: torch.Size,
    generator: torch.Generator | Sequence[torch.Generator] | None,
    device: torch.device,
) -> torch.Tensor:
    """Standard normal noise on ``device``, drawn on each generator's own device.

    A sequence of generators draws each sample from its own one. Drawing on the generator's
    device (then moving) lets CPU generators give the same noise whatever device computes.
    """
    if generator is None:
        return torch.randn(shape, device=device, dtype=torch.float32)
    if isinstance(generator, torch.Generator):
        return torch.randn(shape, generator=generator, device=generator.device).to(device)
    if len(generator) != shape[0]:
        raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
    return torch.stack([torch.randn(shape[1:], generator=g, device=g.device)
                        for g in generator]).to(device)


def _mean_over_elements(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).mean(dim=1)


def sde_step(
    kind: StepKind,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    noise_level: float,
    eta: float,
    sigma_max: float,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    x_next: torch.Tensor | None = None,
    wire_dtype: torch.dtype = torch.float32,
) -> StepOut:
    """One step of kind ``kind`` from ``x`` with velocity ``v`` (formulas in the module doc).

    ``sigma``/``sigma_next`` are floats or per-sample ``[B]`` tensors. With ``x_next=None``
    a sample is drawn (noise from ``generator``: one generator, or one per sample so a
    sample's noise does not depend on its batch), rounded to ``wire_dtype`` and its log-prob
    computed on the rounded value. With ``x_next`` given, its log-prob under this step's
    Gaussian is computed (the trainer's recompute; gradients flow through ``v``).
    """
    if kind not in STEP_KINDS:
        raise ValueError(f"step kind {kind!r}: expected one of {', '.join(STEP_KINDS)}")
    if x.shape != v.shape:
        raise ValueError(f"velocity shape {tuple(v.shape)} differs from latent shape {tuple(x.shape)}")
    x, v = x.float(), v.float()
    s = _per_sample(sigma, x, "sigma")
    s_next = _per_sample(sigma_next, x, "sigma_next")
    if bool((s <= 0).any() or (s > 1).any() or (s_next < 0).any() or (s_next >= s).any()):
        raise ValueError(f"sigma = {sigma}, sigma_next = {sigma_next}: expected 1 >= sigma > "
                         "sigma_next >= 0")
    dt = s_next - s
    zero = torch.zeros((), dtype=torch.float32, device=x.device)

    if kind == "ode":
        mean = x + dt * v
        std = noise_scale = zero.reshape((1,) * x.dim())
    elif kind == "cps":
        std = s_next * math.sin(noise_level * math.pi / 2)
        noise_scale = std
        x0 = x - s * v
        x1 = x + (1 - s) * v
        # clamp: sigma_next^2 - std^2 is >= 0 in exact arithmetic but may round below 0
        mean = (1 - s_next) * x0 + (s_next**2 - std**2).clamp_min(0).sqrt() * x1
    else:
        if kind == "sde":
            if noise_level <= 0:
                raise ValueError(f"noise_level = {noise_level}: an 'sde' step needs a > 0; use 'ode'")
            denom = 1 - torch.where(s >= 1, torch.full_like(s, sigma_max), s)
            noise_scale = noise_level * torch.sqrt(s / denom)
        else:
            if eta <= 0:
                raise ValueError(f"eta = {eta}: a 'dance' step needs eta > 0; use 'ode'")
            noise_scale = torch.full_like(s, eta)
        mean = x + (v + noise_scale**2 / (2 * s) * (x + (1 - s) * v)) * dt
        std = noise_scale * torch.sqrt(-dt)

    if x_next is None:
        if kind == "ode":  # draws no noise, so the generators' streams skip ODE steps
            x_next = mean.detach().to(wire_dtype).float()
        else:
            eps = _draw_noise(x.shape, generator, x.device)
            x_next = (mean.detach() + std * eps).to(wire_dtype).float()
    else:
        if x_next.shape != x.shape:
            raise ValueError(f"x_next shape {tuple(x_next.shape)} differs from {tuple(x.shape)}")
        x_next = x_next.detach().float()

    if kind == "ode":
        log_prob = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    elif kind == "cps":
        log_prob = -_mean_over_elements((x_next - mean) ** 2)
    else:
        # same operation order as torch.distributions.Normal.log_prob, so the two agree exactly
        var = std**2
        dens = -((x_next - mean) ** 2) / (2 * var) - std.log() - _LOG_SQRT_2PI
        log_prob = _mean_over_elements(dens)
    return StepOut(x_next=x_next, mean=mean, std=std, noise_scale=noise_scale, log_prob=log_prob)


def dpm2_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: float,
    sigma_next: float,
    *,
    prev: tuple[float, torch.Tensor] | None = None,
    wire_dtype: torch.dtype = torch.float32,
) -> StepOut:
    """One DPM-Solver++(2M) ODE step (formula in the module doc); ``prev = (sigma_prev,
    D_prev)`` is the previous evaluation's noise level and data prediction ``x - sigma v``.

    Falls back to first order (= Euler) without a usable ``prev`` (none, or at ``sigma = 1``
    where ``lambda`` is infinite) and on the last step into ``sigma' = 0``. Deterministic:
    ``std = 0`` and log-prob 0 like an ``"ode"`` step.
    """
    if not 1 >= sigma > sigma_next >= 0:
        raise ValueError(f"sigma = {sigma}, sigma_next = {sigma_next}: expected 1 >= sigma > "
                         "sigma_next >= 0")
    first_order = prev is None or sigma_next <= 0 or sigma >= 1 or prev[0] >= 1 or prev[0] <= sigma
    if first_order:  # exactly the "ode" step (same operations, same rounding)
        return sde_step("ode", x, v, sigma, sigma_next, noise_level=0.0, eta=0.0, sigma_max=1.0,
                        wire_dtype=wire_dtype)
    assert prev is not None
    x, v = x.float(), v.float()
    d = x - sigma * v
    lam = math.log((1 - sigma) / sigma)
    lam_next = math.log((1 - sigma_next) / sigma_next)
    lam_prev = math.log((1 - prev[0]) / prev[0])
    r = (lam - lam_prev) / (lam_next - lam)
    d_eff = (1 + 1 / (2 * r)) * d - 1 / (2 * r) * prev[1].float()
    x_next = (sigma_next / sigma) * x + ((1 - sigma_next) - (1 - sigma) * sigma_next / sigma) * d_eff
    x_next = x_next.to(wire_dtype).float()
    zero = torch.zeros((1,) * x.dim(), dtype=torch.float32, device=x.device)
    return StepOut(x_next=x_next, mean=x_next, std=zero, noise_scale=zero,
                   log_prob=torch.zeros(x.shape[0], dtype=torch.float32, device=x.device))
