"""Rollout: sample trajectories step by step and yield each step the moment it exists.

:func:`rollout` is a Python generator over :class:`StepRecord`; the rollout actor streams
each record to the trainer rank that owns its timestep (TSP) while the next step is being
denoised. The trainer recomputes log-probs from exactly the stored tensors.

Latents in records are **float32 tensors holding values representable in the wire dtype**:
the initial noise and every sampled ``x_next`` are rounded to ``wire_dtype`` and back before
the model or the log-prob sees them. So casting a record to the wire dtype for transport
is lossless, and the training recompute sees exactly what the rollout used.

Per-sample noise: pass one ``torch.Generator`` per sample (:func:`seeded_generators`). Each
sample then draws its initial noise and every step's noise from its own generator, so its
trajectory depends only on its seed (and the weights), not on which other samples share its
batch: generating a step in one fragment or in four gives the same trajectories (up to the
model's own batch-size rounding, ~1e-7 in float32).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from digenrl.config import SamplerConfig
from digenrl.models.base import Cond, FlowModel, cond_cat, cond_repeat
from digenrl.rl.sde import dpm2_step, sde_step, sigma_schedule

WIRE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class StepRecord:
    """Step ``index`` of a batch of trajectories: ``x_t -> x_next`` with its log-prob.

    ``x_t``/``x_next`` are ``(B, *latent_shape)`` float32 holding wire-dtype values;
    ``log_prob`` is ``[B]`` (0 for ODE steps); ``sde`` says whether noise was injected.
    """

    index: int
    sigma: float
    sigma_next: float
    x_t: torch.Tensor
    x_next: torch.Tensor
    log_prob: torch.Tensor
    sde: bool


def seeded_generators(seeds: Sequence[int], device: str | torch.device = "cpu") -> list[torch.Generator]:
    """One ``torch.Generator`` per sample, seeded with that sample's seed."""
    gens = []
    for seed in seeds:
        if not 0 <= int(seed) < 2**63:
            raise ValueError(f"seed {seed}: expected an integer in [0, 2**63)")
        gens.append(torch.Generator(device=device).manual_seed(int(seed)))
    return gens


def resolve_wire_dtype(name: str | torch.dtype | None) -> torch.dtype:
    """``"float32"``/``"bfloat16"`` (or a dtype, or None = float32) as a torch dtype."""
    if name is None:
        return torch.float32
    if isinstance(name, torch.dtype):
        if name not in WIRE_DTYPES.values():
            raise ValueError(f"wire dtype {name}: expected torch.float32 or torch.bfloat16")
        return name
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire dtype {name!r}: expected one of {', '.join(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def guided_velocity(
    model: FlowModel,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    cond: Cond,
    *,
    guidance_scale: float = 1.0,
    uncond: Cond | None = None,
    velocity: Callable[[torch.Tensor, torch.Tensor, Cond], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The model's velocity at ``(x, sigma)``; with CFG ``v_u + w (v_c - v_u)``.

    ``uncond`` is the one-row empty-prompt conditioning; with ``guidance_scale != 1`` the
    unconditional and conditional passes run as one forward over ``[uncond; cond]``. The
    trainer calls this too, so the recomputed log-prob is that of the same (guided) policy.
    ``sigma`` is one level for the batch or a ``[B]`` tensor (the forward-process losses draw
    one per sample). ``velocity``: what evaluates the model (default ``model.velocity``; the
    step batcher passes its compiled one).
    """
    fn = velocity or model.velocity
    b = x.shape[0]
    if isinstance(sigma, torch.Tensor):
        sig = sigma.to(dtype=torch.float32, device=x.device).reshape(-1).expand(b)
    else:
        sig = torch.full((b,), sigma, dtype=torch.float32, device=x.device)
    if guidance_scale == 1.0:
        return fn(x, sig, cond)
    if uncond is None:
        raise ValueError(f"guidance_scale = {guidance_scale} needs the unconditional conditioning")
    u = cond_repeat(uncond, b)
    # what the prompt does not set (an edit's input image) is the conditional pass's
    u.update({k: v for k, v in cond.items() if k not in u})
    both = cond_cat([u, cond])
    s = torch.cat([sig, sig])
    v_u, v_c = fn(torch.cat([x, x]), s, both).chunk(2)
    return v_u + guidance_scale * (v_c - v_u)


def initial_noise(
    shape: Sequence[int],
    generator: torch.Generator | Sequence[torch.Generator],
    wire_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Initial latents ``(B, *shape[1:])``, per-sample when given one generator per sample."""
    if isinstance(generator, torch.Generator):
        x = torch.randn(tuple(shape), generator=generator, device=generator.device)
    else:
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
        x = torch.stack([torch.randn(tuple(shape[1:]), generator=g, device=g.device)
                         for g in generator])
    return x.to(wire_dtype).float()


def rollout(
    model: FlowModel,
    cond: Cond,
    *,
    generator: torch.Generator | Sequence[torch.Generator],
    sampler_cfg: SamplerConfig,
    sde_steps: set[int] | None = None,
    x_init: torch.Tensor | None = None,
    wire_dtype: str | torch.dtype | None = None,
) -> Iterator[StepRecord]:
    """Denoise a batch from noise, yielding each step's :class:`StepRecord` as soon as it is done.

    ``generator`` is one generator per sample (see the module doc) or one for the batch;
    ``sde_steps`` are the step indices that inject noise (None: all; the others are ODE
    steps, as in a Flow-GRPO-Fast window); ``wire_dtype`` defaults to
    ``sampler_cfg.wire_dtype``. The final latents are the last record's ``x_next``.

    ODE steps use ``sampler_cfg.ode_solver`` (``dpm2``: DPM-Solver++(2M), MixGRPO-Flash). After
    the last SDE step, ``sampler_cfg.ode_compress < 1`` takes only that share of the remaining
    steps, spaced over the same sigmas (their records keep the index of the grid step they
    start at, so indices stay distinct but skip; nothing after the last SDE step is trained).
    The steps from ``num_steps - sampler_cfg.base_tail`` on are taken with the model's adapter
    off (the base model; LoRA models only, and none of them may be an SDE step).
    """
    wdtype = resolve_wire_dtype(wire_dtype if wire_dtype is not None else sampler_cfg.wire_dtype)
    b = next(iter(cond.values())).shape[0] if cond else None
    if x_init is None:
        if b is None:
            raise ValueError("rollout needs a non-empty cond or x_init to know the batch size")
        device = next(iter(cond.values())).device  # adapters encode onto the model's device
        x = initial_noise((b, *model.latent_shape), generator, wdtype).to(device)
    else:
        x = x_init.float().to(wdtype).float()
    sigmas = sigma_schedule(sampler_cfg.num_steps, sampler_cfg.shift).tolist()
    sigma_max = sigmas[1]
    uncond = None
    if sampler_cfg.guidance_scale != 1.0:
        with torch.no_grad():
            uncond = model.encode_prompts([""])
    noisy_steps = (set(range(sampler_cfg.num_steps)) if sde_steps is None else set(sde_steps)) \
        if sampler_cfg.sde_type != "ode" else set()
    tail_from = sampler_cfg.num_steps - sampler_cfg.base_tail
    if sampler_cfg.base_tail and not hasattr(model, "adapter_disabled"):
        raise ValueError(f"sampler.base_tail = {sampler_cfg.base_tail}: {type(model).__name__} has "
                         "no LoRA adapter to turn off")
    if any(i >= tail_from for i in noisy_steps):
        raise ValueError(f"sampler.base_tail = {sampler_cfg.base_tail}: SDE steps "
                         f"{sorted(i for i in noisy_steps if i >= tail_from)} fall in the base model's tail")
    prev: tuple[float, torch.Tensor] | None = None  # the last evaluation's (sigma, x0 prediction)
    for i, i_next in step_grid(sampler_cfg.num_steps, noisy_steps, sampler_cfg.ode_compress):
        noisy = i in noisy_steps
        sigma, sigma_next = sigmas[i], sigmas[i_next]
        # no_grad only around the work: a generator's `with` would leak into the caller's code;
        # the base model's tail turns the adapter off for this one evaluation only, so a
        # caller that stops iterating never leaves the model without its adapter
        with torch.no_grad(), (model.adapter_disabled() if i >= tail_from  # type: ignore[attr-defined]
                               else contextlib.nullcontext()):
            v = guided_velocity(model, x, sigma, cond,
                                guidance_scale=sampler_cfg.guidance_scale, uncond=uncond)
            if noisy or sampler_cfg.ode_solver == "euler":
                out = sde_step(sampler_cfg.sde_type if noisy else "ode", x, v, sigma, sigma_next,
                               noise_level=sampler_cfg.noise_level, eta=sampler_cfg.eta,
                               sigma_max=sigma_max, generator=generator, wire_dtype=wdtype)
            else:
                out = dpm2_step(x, v, sigma, sigma_next, prev=prev, wire_dtype=wdtype)
            prev = (sigma, x.float() - sigma * v.float())
        yield StepRecord(index=i, sigma=sigma, sigma_next=sigma_next, x_t=x,
                         x_next=out.x_next, log_prob=out.log_prob, sde=noisy)
        x = out.x_next


def step_grid(num_steps: int, sde_steps: set[int], compress: float) -> list[tuple[int, int]]:
    """(from, to) indices into the sigma schedule of each step the sampler takes.

    Every step up to the last SDE step is the grid's own ``(i, i + 1)``; the ``n`` steps after it
    become ``max(1, ceil(compress * n))`` steps between grid points spaced as evenly as the grid
    allows (``compress = 1``: all of them; MixGRPO-Flash compresses to 0.4).
    """
    if not 0 < compress <= 1:
        raise ValueError(f"ode_compress = {compress}: expected 0 < ode_compress <= 1")
    start = max(sde_steps) + 1 if sde_steps else 0
    pairs = [(i, i + 1) for i in range(start)]
    n = num_steps - start
    if n <= 0:
        return pairs
    m = max(1, math.ceil(compress * n - 1e-9))
    points = sorted({start + round(k * n / m) for k in range(m + 1)})
    return pairs + list(itertools.pairwise(points))
