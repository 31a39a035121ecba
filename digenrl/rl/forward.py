"""Forward-process RL: DiffusionNFT and Advantage Weighted Matching on final clean samples.

Neither needs the sampler's log-probabilities or its trajectory: a rollout may sample with any
solver (ODE, DPM-Solver, SDE) and sends only the final latents ``x0`` with the rewards. The
trainer re-noises each sample itself on the flow-matching path at levels it draws::

    x_t = (1 - t) x0 + t eps,        target velocity  v* = eps - x0

``t`` and ``eps`` come from :func:`forward_draws`, a pure function of the trajectory's seed and
the draw slot ``j``, so the colocated loop, every trainer rank and a re-run draw the same
values. Draw slots play the role of trained timesteps: a step trains ``J =
train.forward_timesteps`` slots per sample, each term weighted ``1 / (B J)``, and TSP splits the
slots over trainer ranks (GAP and TSP stay exact, as for Flow-GRPO).

Both losses compare the trained velocity ``v = v_theta(x_t, t)`` with the *behaviour* velocity
``v_old``: that of the policy version that generated the sample. At staleness 0 it is ``v``'s
own value (detached); a stale fragment's ``v_old`` is recomputed with the generating version's
weights (:meth:`~digenrl.rl.policy.Policy.behaviour_weights`).

DiffusionNFT (arXiv 2509.16117, Eqs. 4-7): the optimality probability of a sample is
``r = 1/2 + 1/2 clip(A / adv_clip, -1, 1)`` (``A`` the group advantage), the implicit positive and
negative policies are ``v+ = (1 - beta) v_old + beta v`` and ``v- = (1 + beta) v_old - beta v``,
and the per-sample loss is::

    (adv_clip / beta) * (r e(v+) + (1 - r) e(v-))

with ``e(u) = mean((u - v*)^2)``, or with ``nft_adaptive`` the reference's adaptive weighting in
x0 space, ``e(u) = mean((x0_u - x0)^2) / sg(mean|x0_u - x0|)``, ``x0_u = x_t - t u``. The factor
``adv_clip / beta`` makes the first gradient ``2 A (v_old - v*)`` (uniform weighting): the
advantage-weighted flow-matching gradient, whatever ``beta`` and the clip are.

AWM (arXiv 2509.25050): the flow-matching log-likelihood surrogate ``l(u) = -mean((u - v*)^2)``
in a PPO ratio, per sample and draw::

    max(-A rho, -A clip(rho, 1 - c, 1 + c)),   rho = exp(l(v) - l(v_old)),  c = train.awm_clip

At staleness 0, ``rho = 1`` and the gradient is ``A`` times the flow-matching gradient
(high-reward samples pulled toward, low-reward ones pushed away).

With ``kl_beta > 0`` both add ``kl_beta * mean((v - v_ref)^2)`` against the frozen reference
(the velocity-space KL both references use).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from digenrl.config import SamplerConfig, TrainConfig
from digenrl.core.plan import stable_int
from digenrl.models.base import Cond, cond_select
from digenrl.rl.grpo import loss_weight, ppo_surrogate


class ForwardPolicy(Protocol):
    """What the forward-process losses need of the trained policy
    (:class:`~digenrl.rl.policy.Policy` is one)."""

    train_cfg: TrainConfig
    sampler_cfg: SamplerConfig
    version: int
    params: list[torch.Tensor]

    def behaviour_weights(self, version: int) -> AbstractContextManager[None]: ...
    def velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Cond) -> torch.Tensor: ...
    def ref_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Cond) -> torch.Tensor: ...


def forward_draw_t(traj_seed: int, j: int, n_draws: int, shift: float) -> float:
    """Noise level of draw slot ``j`` of ``n_draws``: stratified ``u = (j + U) / J`` with ``U``
    uniform from the seed, then shifted like the sampler's schedule, ``s u / (1 + (s - 1) u)``."""
    if not 0 <= j < n_draws:
        raise ValueError(f"draw slot {j}: expected 0 <= j < {n_draws}")
    u = (j + random.Random(stable_int("fm-t", traj_seed, j)).random()) / n_draws
    u = min(max(u, 1e-4), 1 - 1e-4)
    return shift * u / (1 + (shift - 1) * u)


def forward_draws(seeds: Sequence[int], j: int, n_draws: int, shift: float,
                  latent_shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t[B], eps[B, *latent_shape])`` of draw slot ``j`` for trajectories with these seeds
    (float32, CPU): each sample's draw depends only on its own seed and ``j``."""
    t = torch.tensor([forward_draw_t(int(s), j, n_draws, shift) for s in seeds], dtype=torch.float32)
    eps = torch.stack([torch.randn(tuple(latent_shape),
                                   generator=torch.Generator().manual_seed(stable_int("fm-eps", int(s), j)))
                       for s in seeds])
    return t, eps


def noised(x0: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, v*)``: the flow-matching interpolant ``(1 - t) x0 + t eps`` and its velocity."""
    tb = t.reshape((-1,) + (1,) * (x0.dim() - 1)).to(x0)
    return (1 - tb) * x0 + tb * eps, eps - x0


def optimality(adv: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """DiffusionNFT's ``r = 1/2 + 1/2 clip(A / adv_clip, -1, 1)`` in [0, 1]."""
    return 0.5 + 0.5 * (adv / adv_clip).clamp(-1.0, 1.0)


def _mean(z: torch.Tensor) -> torch.Tensor:
    return z.reshape(z.shape[0], -1).mean(dim=1)


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, t: torch.Tensor,
             r: torch.Tensor, *, beta: float, adv_clip: float, adaptive: bool) -> torch.Tensor:
    """Per-sample DiffusionNFT loss (formula in the module doc); gradients flow through ``v``.

    ``target`` is ``v* = eps - x0``; the x0-space error of a velocity ``u`` is
    ``x_t - t u - x0 = t (v* - u)``.
    """
    v_old = v_old.detach()
    r = r.to(v)
    pos = (1 - beta) * v_old + beta * v
    neg = (1 + beta) * v_old - beta * v
    tb = t.reshape((-1,) + (1,) * (v.dim() - 1)).to(v)

    def err(u: torch.Tensor) -> torch.Tensor:
        if not adaptive:
            return _mean((u - target) ** 2)
        gap = tb * (target - u)  # x0_u - x0
        with torch.no_grad():
            scale = _mean(gap.abs()).clamp_min(1e-5)
        return _mean(gap**2) / scale

    return (adv_clip / beta) * (r * err(pos) + (1 - r) * err(neg))


def fm_log_likelihood(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """AWM's per-sample surrogate log-likelihood ``-mean((v - v*)^2)``."""
    return -_mean((v - target) ** 2)


def fragment_backward(policy: ForwardPolicy, final: torch.Tensor, cond: Cond, adv: torch.Tensor,
                      keep: torch.Tensor, *, seeds: Sequence[int], draws: Sequence[int],
                      gen_version: int, batch_size_total: int, n_draws_total: int) -> dict[str, float]:
    """Accumulate into ``.grad`` the forward-process loss of one fragment at draw slots ``draws``.

    ``final`` is the fragment's clean latents ``[B_f, ...]`` (rows aligned with ``cond``,
    ``adv``, ``keep`` and ``seeds``); rows with ``keep = False`` are skipped; each (sample,
    draw) term is weighted ``1 / (batch_size_total * n_draws_total)``. ``gen_version`` is the
    policy version that generated the samples (its weights give ``v_old``). Returns this call's
    stats, as :meth:`~digenrl.rl.policy.Policy.fragment_loss_backward` does.
    """
    tc, sc = policy.train_cfg, policy.sampler_cfg
    w = loss_weight(batch_size_total, n_draws_total)
    keep = torch.as_tensor(keep, dtype=torch.bool).flatten()
    if not final.shape[0] == adv.shape[0] == keep.shape[0] == len(seeds):
        raise ValueError(f"fragment of {final.shape[0]} samples with {adv.shape[0]} advantages, "
                         f"{keep.shape[0]} keep flags and {len(seeds)} seeds")
    rows = keep.nonzero().flatten()
    totals: dict[str, float] = {"loss": 0.0, "ratio_mean": 0.0, "ratio_max_dev": 0.0,
                                "clipfrac": 0.0, "approx_kl": 0.0, "kl": 0.0, "n": 0}
    if rows.numel() == 0 or not draws:
        return totals
    device = policy.params[0].device
    if rows.numel() != keep.numel():
        cond = cond_select(cond, rows)
    cond = {k: v.to(device) for k, v in cond.items()}
    x0 = final[rows].float().to(device)
    adv_k = adv[rows].to(device)
    kept_seeds = [int(seeds[i]) for i in rows.tolist()]
    r = optimality(adv_k, tc.adv_clip)
    drawn = {j: forward_draws(kept_seeds, j, n_draws_total, sc.shift, x0.shape[1:]) for j in draws}

    v_old_of: dict[int, torch.Tensor] = {}
    if gen_version != policy.version:  # a stale fragment: v_old under the generating weights
        with torch.no_grad(), policy.behaviour_weights(gen_version):
            for j, (t, eps) in drawn.items():
                x_t, _ = noised(x0, t.to(device), eps.to(device))
                v_old_of[j] = policy.velocity(x_t, t.to(device), cond)

    n = int(rows.numel())
    for j in sorted(drawn):
        t, eps = (z.to(device) for z in drawn[j])
        x_t, target = noised(x0, t, eps)
        v = policy.velocity(x_t, t, cond).float()
        v_old = v_old_of.get(j, v.detach())
        st: dict[str, float] = {}
        if tc.algorithm == "nft":
            per_sample = nft_loss(v, v_old, target, t, r, beta=tc.nft_beta, adv_clip=tc.adv_clip,
                                  adaptive=tc.nft_adaptive)
        elif tc.algorithm == "awm":
            delta = fm_log_likelihood(v, target) - fm_log_likelihood(v_old.float(), target)
            per_sample, st = ppo_surrogate(delta, adv_k, tc.awm_clip)
        else:
            raise ValueError(f"train.algorithm = {tc.algorithm!r}: not a forward-process algorithm")
        kl = torch.zeros_like(per_sample)
        if tc.kl_beta > 0:
            kl = _mean((v - policy.ref_velocity(x_t, t, cond).float()) ** 2)
            per_sample = per_sample + tc.kl_beta * kl
        loss = per_sample.sum() * w
        loss.backward()
        totals["loss"] += float(loss.detach())
        totals["ratio_max_dev"] = max(totals["ratio_max_dev"], st.get("ratio_max_dev", 0.0))
        totals["ratio_mean"] += st.get("ratio_mean", 1.0) * n
        for key in ("clipfrac", "approx_kl"):
            totals[key] += st.get(key, 0.0) * n
        totals["kl"] += float(kl.detach().sum())
        totals["n"] += n
    for key in ("ratio_mean", "clipfrac", "approx_kl", "kl"):
        totals[key] /= max(totals["n"], 1)
    return totals
