"""GRPO pieces of Flow-GRPO: group advantages, the clipped surrogate and KL.

Which timesteps are trained (the step plan) lives in :mod:`digenrl.core.plan`.

Loss normalisation (what makes GAP and TSP exact): the loss of one optimizer step is

    L = 1 / (B * T_trained) * sum over samples b and trained timesteps t of loss[b, t]

with ``B`` the step's trajectories and ``T_trained`` its trained timesteps. Every term is
weighted by :func:`loss_weight` independently of how the batch was cut, so the gradients of
fragments (of whole groups) and of timestep subsets (TSP ranks) sum to exactly the
full-batch gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass
class AdvStats:
    """What :func:`group_advantages` saw.

    ``keep[N]`` is False for samples of zero-advantage groups (all advantages exactly 0:
    identical rewards or a singleton group), which carry no policy gradient and are skipped;
    ``zero_groups`` counts those groups out of ``groups``. ``terms`` holds each reward term's
    share of the advantage per sample (before clipping; they add up to the advantage), when
    the call was given the terms.
    """

    keep: torch.Tensor
    groups: int
    zero_groups: int
    reward_mean: float
    reward_std: float
    clipped: int = 0
    terms: dict[str, torch.Tensor] = field(default_factory=dict)


def _checked(rewards: torch.Tensor | Sequence[float], group_ids: torch.Tensor | Sequence[int],
             std_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    gid = torch.as_tensor(group_ids).flatten()
    if r.shape != gid.shape:
        raise ValueError(f"{r.numel()} rewards but {gid.numel()} group ids")
    if r.numel() == 0:
        raise ValueError("group_advantages needs at least one reward")
    if not bool(torch.isfinite(r).all()):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    if std_mode not in ("group", "global"):
        raise ValueError(f"std_mode = {std_mode!r}: expected 'group' or 'global'")
    return r, gid


def _normalised(r: torch.Tensor, gid: torch.Tensor, std_mode: str,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Unclipped ``(r - mean_group) / (std + eps)`` in float64, with the keep flags, each
    sample's denominator ``std + eps`` (1 in zero-advantage groups), the zero-advantage
    groups and all groups. ``std_mode="none"``: centred only (denominator 1)."""
    adv = torch.zeros_like(r)
    denom = torch.ones_like(r)
    keep = torch.ones(r.shape, dtype=torch.bool)
    global_std = r.std(unbiased=False)
    uniq = torch.unique(gid)
    zero_groups = 0
    for g in uniq:
        idx = (gid == g).nonzero().flatten()
        rg = r[idx]
        if rg.numel() < 2 or bool(rg.max() == rg.min()):
            # exact zero, not (r - mean) ~ 1e-17 rounding noise that clipping would amplify
            keep[idx] = False
            zero_groups += 1
            continue
        if std_mode == "none":
            adv[idx] = rg - rg.mean()
            continue
        d = (rg.std(unbiased=False) if std_mode == "group" else global_std) + eps
        denom[idx] = d
        adv[idx] = (rg - rg.mean()) / d
    return adv, keep, denom, zero_groups, len(uniq)


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[int],
    *,
    std_mode: Literal["group", "global"] = "group",
    clip: float = 5.0,
    eps: float = 1e-4,
    parts: Mapping[str, torch.Tensor | Sequence[float]] | None = None,
) -> tuple[torch.Tensor, AdvStats]:
    """GRPO advantages ``A = (r - mean_group) / (std + eps)`` clipped to ``+-clip``.

    ``std`` is the group's population std, or with ``std_mode="global"`` the std of all N
    rewards. A group whose rewards are all equal (including a singleton) gets advantage
    exactly 0 and is flagged in ``AdvStats.keep``. Computed in float64, returned float32.

    ``parts``: the weighted pieces whose sum is ``rewards`` (``w_k r_k`` per reward term);
    ``AdvStats.terms[k]`` is then piece k's share of the advantage, ``(p_k - mean_group p_k) /
    (std + eps)`` over the same denominator (0 in zero-advantage groups).
    """
    r, gid = _checked(rewards, group_ids, std_mode)
    adv, keep, denom, zero_groups, groups = _normalised(r, gid, std_mode, eps)
    clipped = int((adv.abs() > clip).sum())
    adv = adv.clamp(-clip, clip)
    stats = AdvStats(keep=keep, groups=groups, zero_groups=zero_groups,
                     reward_mean=float(r.mean()), reward_std=float(r.std(unbiased=False)),
                     clipped=clipped, terms=_shares(parts or {}, gid, keep, denom))
    return adv.float(), stats


def _shares(parts: Mapping[str, torch.Tensor | Sequence[float]], gid: torch.Tensor,
            keep: torch.Tensor, denom: torch.Tensor) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, values in parts.items():
        p = torch.as_tensor(values, dtype=torch.float64).flatten()
        if p.shape != gid.shape:
            raise ValueError(f"reward term {name!r}: {p.numel()} values for {gid.numel()} samples")
        share = torch.zeros_like(p)
        for g in torch.unique(gid[keep]):
            idx = (gid == g).nonzero().flatten()
            share[idx] = (p[idx] - p[idx].mean()) / denom[idx]
        out[name] = share
    return out


def gdpo_advantages(
    terms: Mapping[str, torch.Tensor | Sequence[float]],
    weights: Mapping[str, float],
    group_ids: torch.Tensor | Sequence[int],
    *,
    std_mode: Literal["group", "global"] = "group",
    clip: float = 5.0,
    eps: float = 1e-4,
) -> tuple[torch.Tensor, AdvStats]:
    """GDPO (group reward-decoupled normalisation): each reward term normalised on its own,
    then their weighted sum::

        A_k = (r_k - mean_group r_k) / (std_k + eps)       per term, unclipped
        S   = sum_k w_k A_k
        A   = clip(S, +-clip)                                std_mode "group"
        A   = clip((S - mean S) / (std S + eps), +-clip)     std_mode "global"

    ``std_k`` is the group's std of term k, or with "global" its std over all N samples (as in
    :func:`group_advantages`). With "global" the sum is normalised again over all N samples: the
    published GDPO's batch normalisation, which needs the whole step's rewards (the config
    allows "global" only where a step is one fragment). With "group" the sum is left as it is:
    a step-wide statistic would make a fragment wait for the others (GAP), and rescaling each
    group's sum by its own std would blow up the residue of a group whose terms cancel; the
    weights set the scale (weights summing to 1 keep ``|S| <= max_k |A_k|``).

    A group in which a term is constant gets ``A_k = 0`` exactly from that term; a group whose
    ``S`` is constant (every term constant, or terms that cancel) gets advantage exactly 0 and
    is flagged in ``AdvStats.keep``, as in :func:`group_advantages`. ``AdvStats.terms[k]`` is
    term k's share of ``A`` (before clipping; the shares add up to it). ``reward_mean`` and
    ``reward_std`` are those of the weighted sum of the raw terms.
    """
    if not terms or set(terms) != set(weights):
        raise ValueError(f"reward terms {sorted(terms)} but weights for {sorted(weights)}: "
                         "expected the same names")
    gid = torch.as_tensor(group_ids).flatten()
    total = torch.zeros(gid.shape, dtype=torch.float64)
    weighted: dict[str, torch.Tensor] = {}
    for name in terms:
        r, _ = _checked(terms[name], gid, std_mode)
        a_k, _, _, _, _ = _normalised(r, gid, std_mode, eps)
        weighted[name] = weights[name] * a_k
        total += weights[name] * r
    summed = torch.stack(list(weighted.values())).sum(dim=0)
    adv, keep, denom, zero_groups, groups = _normalised(
        summed, gid, "global" if std_mode == "global" else "none", eps)
    clipped = int((adv.abs() > clip).sum())
    stats = AdvStats(keep=keep, groups=groups, zero_groups=zero_groups, reward_mean=float(total.mean()),
                     reward_std=float(total.std(unbiased=False)), clipped=clipped,
                     terms=_shares(weighted, gid, keep, denom))
    return adv.clamp(-clip, clip).float(), stats


def clipped_surrogate(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    adv: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sample PPO loss ``max(-A r, -A clip(r, 1 - eps, 1 + eps))``, ``r = exp(new - old)``.

    Stats: ``ratio_mean``, ``ratio_max_dev`` (max ``|r - 1|``), ``clipfrac`` (share with
    ``|r - 1| > eps``) and ``approx_kl`` (``1/2 mean((new - old)^2)``).
    """
    return ppo_surrogate(logp_new - logp_old.detach(), adv, clip_range)


def guarded_surrogate(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    mean_new: torch.Tensor,
    mean_old: torch.Tensor,
    std: torch.Tensor,
    adv: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO-Guard's regulated clipping (arXiv 2510.22319): the PPO loss of the normalised ratio.

    For a Gaussian step with std ``s`` and ``x' = mu_old + s eps``, the log-ratio is
    ``mean(eps (mu_new - mu_old)) / s - mean((mu_new - mu_old)^2) / (2 s^2)``: the second term
    shifts every ratio below 1 (so positive-advantage samples rarely reach the upper clip) by an
    amount that varies with the timestep. RatioNorm adds it back and rescales by ``s``::

        log r = s * (logp_new - logp_old + mean_elements((mu_new - mu_old)^2) / (2 s^2))

    which is ``mean(eps (mu_new - mu_old))``: centred on 0 with a spread that no longer depends
    on the step's noise level. ``std`` is the step's ``s`` per sample (``[B]`` or broadcastable).
    The gradient reweighting half of the method (``1 / |dt|``) is :func:`guard_weight`.
    """
    b = logp_new.shape[0]
    s = torch.as_tensor(std, dtype=logp_new.dtype, device=logp_new.device).reshape(-1)
    s = s.expand(b) if s.numel() == 1 else s
    if bool((s <= 0).any()):
        raise ValueError("GRPO-Guard needs a stochastic step (std > 0); this one is deterministic")
    gap = ((mean_new - mean_old.detach()) ** 2).reshape(b, -1).mean(dim=1)
    delta = s * (logp_new - logp_old.detach() + gap / (2 * s**2))
    return ppo_surrogate(delta, adv, clip_range)


def guard_weight(sigma: float, sigma_next: float) -> float:
    """GRPO-Guard's gradient reweighting ``1 / |dt|`` (= ``1 / mean(sqrt(-dt))^2``).

    The normalised log-ratio's gradient in the velocity is ``|dt| (1 + s_t^2 (1 - sigma) /
    (2 sigma))``, which for the Flow-GRPO SDE is ``|dt| (1 + a^2 / 2)``: dividing by ``|dt|``
    gives every timestep the same gradient scale.
    """
    dt = sigma - sigma_next
    if not dt > 0:
        raise ValueError(f"sigma = {sigma}, sigma_next = {sigma_next}: expected sigma > sigma_next")
    return 1.0 / dt


def ppo_surrogate(delta: torch.Tensor, adv: torch.Tensor,
                  clip_range: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The PPO loss and stats of :func:`clipped_surrogate` for a given log-ratio ``delta``."""
    ratio = torch.exp(delta)
    adv = adv.detach().to(ratio.dtype)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range))
    with torch.no_grad():
        dev = (ratio - 1).abs()
        stats = {
            "ratio_mean": float(ratio.mean()) if ratio.numel() else 1.0,
            "ratio_max_dev": float(dev.max()) if ratio.numel() else 0.0,
            "clipfrac": float((dev > clip_range).float().mean()) if ratio.numel() else 0.0,
            "approx_kl": float(0.5 * (delta**2).mean()) if ratio.numel() else 0.0,
        }
    return loss, stats


def kl_penalty(mean_theta: torch.Tensor, mean_ref: torch.Tensor, noise_scale: torch.Tensor) -> torch.Tensor:
    """Per-sample ``mean_elements((mu_theta - mu_ref)^2) / (2 s^2)`` (flow_grpo's KL).

    ``s`` is the step's ``noise_scale`` from :func:`~digenrl.rl.sde.sde_step`: ``s_t`` for
    "sde" (so this is the Gaussian KL times ``|dt|``), ``eta`` for "dance" and ``std`` for
    "cps". Where ``s = 0`` (a deterministic step, e.g. CPS into sigma 0) the KL of two point
    masses is undefined and the term is 0.
    """
    b = mean_theta.shape[0]
    sq = ((mean_theta - mean_ref.detach()) ** 2).reshape(b, -1).mean(dim=1)
    s = torch.as_tensor(noise_scale, dtype=sq.dtype, device=sq.device).reshape(-1)
    s = s.expand(b) if s.numel() == 1 else s
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.where(s > 0, sq / (2 * safe**2), torch.zeros_like(sq))


def loss_weight(batch_size: int, n_trained: int) -> float:
    """``1 / (B * T_trained)``: the weight of one (sample, timestep) loss term in a step."""
    if batch_size < 1 or n_trained < 1:
        raise ValueError(f"batch_size = {batch_size}, n_trained = {n_trained}: expected both >= 1")
    return 1.0 / (batch_size * n_trained)
