"""The trainer-side policy: recompute log-probs, accumulate the GRPO loss, step the optimizer.

Shared by the colocated loop and the distributed trainer actor. One optimizer step is::

    for each fragment (whole groups) as its rewards commit:         # GAP
        adv, stats = group_advantages(rewards, group_ids)
        policy.fragment_loss_backward(records_of_my_timesteps,     # TSP: a rank's own t only
                                      cond, adv, stats.keep, batch_size_total=B,
                                      n_trained_total=len(plan.trained))
    (all-reduce .grad over trainer ranks)
    policy.optimizer_step()                                        # version += 1

Each (sample, timestep) term carries :func:`~digenrl.rl.grpo.loss_weight` = 1/(B T_trained),
so whatever the cut into fragments and timestep subsets, the summed gradient is the
full-batch gradient. ``backward`` runs once per timestep, so one step's graph is alive at a time.

At the rollout's weights, dtype and batch layout the recomputed log-prob is bit-identical,
so the first ratio is exactly 1; dropping zero-advantage rows (``keep``) changes the layout,
which moves the ratio of the kept rows by ~1e-7 in float32.

Mixed precision (``model.dtype = "bfloat16"``): the model computes in bfloat16 with every
parameter in bfloat16, which is what a rollout holds and what diffusers runs; the optimizer
owns float32 *master* copies of the trained parameters (:attr:`Policy.params`), gradients are
accumulated into them in float32 (a hook moves each bf16 gradient over as autograd produces
it), AdamW's state is float32, and after each step the masters are rounded back into the
model. Without masters a bf16 AdamW step of lr 1e-5 leaves most weights unchanged (the
update is below bf16's resolution). Sharded (FSDP2), the sharded parameters *are* the float32
masters and ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` gives the same
bf16 compute. Not autocast: autocast keeps some ops (norms, parameter arithmetic) in float32
on float32 weights, so a trainer under autocast would not compute what a bf16 rollout
computes, and the first ratio would not be exactly 1.

``model.offload = "optimizer"`` moves AdamW's state and the float32 values it updates to the
host (:mod:`digenrl.rl.offload`): :attr:`Policy.params` are then the device leaves that take
the gradients and :attr:`Policy.masters` the host tensors the optimizer updates (sharded:
this rank's shards).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Collection, Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch

from digenrl.config import ResolvedConfig, SamplerConfig, TrainConfig
from digenrl.models.base import Cond, FlowModel, cond_select
from digenrl.rl.algorithm import algorithm_for
from digenrl.rl.ema import EMA, live_weights
from digenrl.rl.grpo import (
    clipped_surrogate,
    guard_weight,
    guarded_surrogate,
    kl_penalty,
    loss_weight,
)
from digenrl.rl.offload import HostMasters, grad_leaf
from digenrl.rl.sampler import guided_velocity
from digenrl.rl.sde import sde_step, sigma_schedule

if TYPE_CHECKING:
    from digenrl.rl.experts import ExpertPlacement


class StepLike(Protocol):
    """What :meth:`Policy.fragment_loss_backward` reads of a step (a StepRecord or a Chunk)."""

    sigma: float
    sigma_next: float
    x_t: torch.Tensor
    x_next: torch.Tensor
    log_prob: torch.Tensor


class Policy:
    """A :class:`FlowModel` under training: AdamW over its trainable parameters and a version.

    ``version`` counts optimizer steps done. With ``train_cfg.kl_beta > 0`` the KL reference
    is the base model with the LoRA adapter disabled (adapters with ``lora_rank > 0``), or
    else a frozen copy of the transformer made here.

    Behaviour weights: GRPO-Guard and the forward-process losses compare the trained policy
    with the one that *generated* a sample. With ``keep_versions = K > 0`` the policy keeps
    the sync state (LoRA adapter or trainable weights) of its last K versions, so a fragment
    generated up to K versions ago can be recomputed under its own weights
    (:meth:`behaviour_weights`); at staleness 0 the generating policy is the current one.
    """

    def __init__(self, model: FlowModel, train_cfg: TrainConfig, sampler_cfg: SamplerConfig, *,
                 shard: bool = False, keep_versions: int = 0, offload: str = "none",
                 placement: ExpertPlacement | None = None, rank: int = 0) -> None:
        self.model, self.train_cfg, self.sampler_cfg = model, train_cfg, sampler_cfg
        self.keep_versions = keep_versions if algorithm_for(train_cfg).needs_behaviour else 0
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._ref: FlowModel | None = None
        if train_cfg.kl_beta > 0 and not getattr(model, "lora_rank", 0):
            # shallow copy shares encoder/decoder; only the transformer is duplicated and frozen
            self._ref = copy.copy(model)
            # the copy's own attribute (FlowModel exposes ``transformer`` read-only)
            self._ref.__dict__["transformer"] = copy.deepcopy(model.transformer).requires_grad_(False)
        #: FSDP2: parameters, gradients and optimizer state are DTensor shards over the trainer
        #: ranks (see digenrl.rl.sharding); every pass must then run in lockstep on all ranks
        self.sharded = shard
        #: trainer ranks holding different experts (rl/experts.py; None: every rank holds every
        #: trained expert): gradients reduce per expert, rank 0 gathers what it lacks
        self.placement = placement if placement is not None and placement.partial else None
        self.rank = rank
        compute = getattr(model, "dtype", torch.float32)
        if shard:
            from digenrl.rl.sharding import shard_experts, shard_transformer
            with torch.no_grad():  # the sharded trained parameters are the float32 masters
                for p in model.trainable_parameters():
                    p.data = p.data.float()
            if self.placement is not None:  # each expert over the ranks that hold it
                shard_experts(model.transformer, self.placement, param_dtype=compute, offload=offload,
                              ref=None if self._ref is None else self._ref.transformer)
            else:
                shard_transformer(model.transformer, param_dtype=compute, offload=offload)
                if self._ref is not None:
                    shard_transformer(self._ref.transformer, param_dtype=compute, offload=offload)
        #: the model's own trained parameters (compute dtype)
        self.model_params: list[torch.Tensor] = list(model.trainable_parameters())
        if not self.model_params:
            raise ValueError("the model has no trainable parameters")
        #: ``model.offload = "optimizer"``: the float32 masters and AdamW state on the host
        #: (digenrl/rl/offload.py), else None
        self.host: HostMasters | None = HostMasters(self.model_params) if offload == "optimizer" else None
        #: the device leaves whose ``.grad`` holds the step's gradient (float32): float32
        #: masters of model_params, or model_params themselves; offloaded with a bf16 model,
        #: leaves that carry only the gradient (rl/offload.py's grad_leaf)
        self.params = self.model_params
        self.has_masters = any(p.dtype != torch.float32 for p in self.model_params)
        if self.has_masters:
            make = grad_leaf if self.host is not None else (lambda p: p.detach().float().requires_grad_(True))
            self.params = [make(p) for p in self.model_params]
            for param, master in zip(self.model_params, self.params):
                param.register_post_accumulate_grad_hook(partial(_to_master, master))
        #: what the optimizer updates (float32, index-aligned with params): params themselves,
        #: or their host masters (model.offload = "optimizer")
        self.masters: list[torch.Tensor] = self.params if self.host is None else self.host.masters
        self.optimizer = torch.optim.AdamW(self.masters, lr=train_cfg.lr, betas=train_cfg.adam_betas,
                                           weight_decay=train_cfg.weight_decay)
        #: two experts (Wan2.2 A14B): the indices in :attr:`params` of each held expert's
        self.expert_index: dict[str, list[int]] = _expert_index(model, self.model_params)
        self._holder_groups: dict[str, Any] = {}
        if self.placement is not None and not shard:  # sharded, FSDP reduces within each expert's mesh
            from digenrl.rl.experts import holder_groups
            self._holder_groups = holder_groups(self.placement)
        self.version = 0
        self.sigma_max = float(sigma_schedule(sampler_cfg.num_steps, sampler_cfg.shift)[1])
        self.uncond: Cond | None = None
        if sampler_cfg.guidance_scale != 1.0:
            with torch.no_grad():
                self.uncond = model.encode_prompts([""])
        self._idle_input: tuple[torch.Tensor, Cond] | None = None
        #: the moving average of the trained weights (train.ema_decay > 0; rl/ema.py), else None
        self.ema: EMA | None = None
        if train_cfg.ema_decay > 0:
            if shard:
                raise ValueError("train.ema_decay > 0 with a sharded (FSDP) policy: not implemented")
            self.ema = EMA.of(self, train_cfg.ema_decay)

    # -- the loss --------------------------------------------------------------------------------
    def _velocity(self, model: FlowModel, x: torch.Tensor, sigma: float | torch.Tensor,
                  cond: Cond) -> torch.Tensor:
        return guided_velocity(model, x, sigma, cond, guidance_scale=self.sampler_cfg.guidance_scale,
                               uncond=self.uncond)

    def velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Cond) -> torch.Tensor:
        """The trained policy's (guided) velocity, with gradients."""
        return self._velocity(self.model, x, sigma, cond)

    def ref_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Cond) -> torch.Tensor:
        """The frozen KL reference's velocity (no gradients)."""
        return self._ref_velocity(x, sigma, cond)

    def behaviour_available(self, version: int) -> bool:
        """Whether samples generated by ``version`` can be recomputed under its weights."""
        return version == self.version or version in self._snapshots

    @contextlib.contextmanager
    def behaviour_weights(self, version: int) -> Iterator[None]:
        """Within the block the model holds ``version``'s weights (no-grad use only).

        The current weights are put back on exit; accumulated gradients and the optimizer
        state are not touched. ``version`` must be the current one or a kept snapshot.
        """
        if version == self.version:
            yield
            return
        if version not in self._snapshots:
            raise ValueError(f"behaviour weights of version {version} are not kept (kept: "
                             f"{sorted(self._snapshots)}, current {self.version})")
        current = self.state_dict_for_sync()
        self.load_sync_state(self._snapshots[version])
        try:
            yield
        finally:
            self.load_sync_state(current)

    def _ref_velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: Cond) -> torch.Tensor:
        with torch.no_grad():
            if self._ref is not None:
                return self._velocity(self._ref, x, sigma, cond)
            with self.model.adapter_disabled():  # type: ignore[attr-defined]
                return self._velocity(self.model, x, sigma, cond)

    def fragment_loss_backward(
        self,
        records: Mapping[int, StepLike],
        cond: Cond,
        adv: torch.Tensor,
        keep: torch.Tensor,
        *,
        batch_size_total: int,
        n_trained_total: int,
        sigma_max: float | None = None,
        gen_version: int | None = None,
    ) -> dict[str, float]:
        """Accumulate into ``.grad`` the loss of these samples at the timesteps in ``records``.

        ``records`` maps trained step index -> step tensors of this fragment's ``B_f`` samples
        (rows aligned with ``cond``, ``adv[B_f]``, ``keep[B_f]``); rows with ``keep=False`` are
        skipped. ``batch_size_total`` (the step's B) and ``n_trained_total`` (its trained
        timesteps) fix the loss weight. Returns this call's stats: ``loss`` (its share of
        the step loss), ``ratio_mean``, ``ratio_max_dev``, ``clipfrac``, ``approx_kl``,
        ``kl`` and ``n`` (sample-timestep terms).

        With ``train.guard`` (GRPO-Guard) the ratio is normalised with the behaviour mean of the
        policy version ``gen_version`` that generated the samples (default: the current one)
        and each timestep's term is weighted by ``1 / |dt|``.
        """
        tc, sc = self.train_cfg, self.sampler_cfg
        w = loss_weight(batch_size_total, n_trained_total)
        sigma_max = self.sigma_max if sigma_max is None else sigma_max
        keep = torch.as_tensor(keep, dtype=torch.bool).flatten()
        if adv.shape[0] != keep.shape[0]:
            raise ValueError(f"{adv.shape[0]} advantages but {keep.shape[0]} keep flags")
        rows = keep.nonzero().flatten()
        all_rows = rows.numel() == keep.numel()
        device = self.params[0].device
        if not all_rows:
            cond = cond_select(cond, rows)
        cond = {k: v.to(device) for k, v in cond.items()}
        adv_k = adv[rows].to(device)
        totals = {"loss": 0.0, "ratio_mean": 0.0, "ratio_max_dev": 0.0, "clipfrac": 0.0,
                  "approx_kl": 0.0, "kl": 0.0, "n": 0}
        if rows.numel() == 0:
            return totals
        gen_version = self.version if gen_version is None else gen_version

        def tensors(t: int, rec: StepLike) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            if not getattr(rec, "sde", True):
                raise ValueError(f"step {t} was sampled without noise (ODE): it has no log-prob to train")
            if rec.x_t.shape[0] != keep.shape[0]:
                raise ValueError(f"step {t} holds {rec.x_t.shape[0]} samples, expected {keep.shape[0]}")
            x_t, x_next, logp_old = (z if all_rows else z[rows] for z in (rec.x_t, rec.x_next, rec.log_prob))
            return x_t.to(device), x_next.to(device), logp_old.to(device)

        behaviour_mean: dict[int, torch.Tensor] = {}
        if tc.guard and gen_version != self.version:
            # GRPO-Guard needs the generating policy's mean: recompute it under its weights
            with torch.no_grad(), self.behaviour_weights(gen_version):
                for t in sorted(records):
                    rec = records[t]
                    x_t, x_next, _ = tensors(t, rec)
                    v_b = self._velocity(self.model, x_t, rec.sigma, cond)
                    behaviour_mean[t] = sde_step(sc.sde_type, x_t, v_b, rec.sigma, rec.sigma_next,
                                                 noise_level=sc.noise_level, eta=sc.eta,
                                                 sigma_max=sigma_max, x_next=x_next).mean

        for t in sorted(records):
            rec = records[t]
            x_t, x_next, logp_old = tensors(t, rec)
            step: dict[str, Any] = dict(noise_level=sc.noise_level, eta=sc.eta, sigma_max=sigma_max,
                                        x_next=x_next)

            v = self._velocity(self.model, x_t, rec.sigma, cond)
            out = sde_step(sc.sde_type, x_t, v, rec.sigma, rec.sigma_next, **step)
            if tc.guard:
                mean_old = behaviour_mean.get(t, out.mean.detach())
                per_sample, st = guarded_surrogate(out.log_prob, logp_old, out.mean, mean_old,
                                                   out.std, adv_k, tc.clip_range)
                per_sample = per_sample * guard_weight(rec.sigma, rec.sigma_next)
            else:
                per_sample, st = clipped_surrogate(out.log_prob, logp_old, adv_k, tc.clip_range)
            kl = torch.zeros_like(per_sample)
            if tc.kl_beta > 0:
                v_ref = self._ref_velocity(x_t, rec.sigma, cond)
                ref = sde_step(sc.sde_type, x_t, v_ref, rec.sigma, rec.sigma_next,
                               noise_level=sc.noise_level, eta=sc.eta, sigma_max=sigma_max,
                               x_next=x_next)
                kl = kl_penalty(out.mean, ref.mean, out.noise_scale)
                per_sample = per_sample + tc.kl_beta * kl
            loss = per_sample.sum() * w
            loss.backward()

            n = int(rows.numel())
            totals["loss"] += float(loss.detach())
            totals["ratio_max_dev"] = max(totals["ratio_max_dev"], st["ratio_max_dev"])
            for key in ("ratio_mean", "clipfrac", "approx_kl"):
                totals[key] += st[key] * n
            totals["kl"] += float(kl.detach().sum())
            totals["n"] += n
        for key in ("ratio_mean", "clipfrac", "approx_kl", "kl"):
            totals[key] /= max(totals["n"], 1)
        return totals

    def idle_pass(self) -> None:
        """One pass that moves no gradient: the modules of a real pass (policy forward, the KL
        reference's when ``kl_beta > 0``, backward) on a one-sample dummy input, loss x 0.

        Sharded (FSDP) ranks pad with it so every rank runs the same number of passes per step
        and the passes' collectives pair up (see :mod:`digenrl.rl.sharding`).
        """
        if self._idle_input is None:
            p = self.params[0]
            with torch.no_grad():
                cond = self.model.encode_prompts([""])
            x = torch.zeros(1, *self.model.latent_shape, dtype=p.dtype, device=p.device)
            self._idle_input = (x, {k: v.to(p.device) for k, v in cond.items()})
        x, cond = self._idle_input
        sigma = self._idle_sigma()
        v = self._velocity(self.model, x, sigma, cond)
        if self.train_cfg.kl_beta > 0:
            self._ref_velocity(x, sigma, cond)
        (v.sum() * 0.0).backward()

    def _idle_sigma(self) -> float:
        """An idle pass's noise level: 0.5, or one on this rank's expert's side of the boundary
        (a rank holding one expert of two; its passes pair with that expert's holders only)."""
        experts = getattr(self.model, "transformer", None)
        held, boundary = getattr(experts, "held", None), getattr(experts, "boundary", None)
        if held is None or boundary is None or len(held) != 1:
            return 0.5
        edge = boundary / 1000
        return (1 + edge) / 2 if held[0] == "transformer" else edge / 2

    # -- the update ------------------------------------------------------------------------------
    def optimizer_step(self, experts: Collection[str] | None = None) -> dict[str, Any]:
        """Clip the gradient norm (``max_grad_norm``; 0 = off), step AdamW, update the EMA (if
        kept), zero grads, version += 1.

        ``experts`` (two-expert models): the experts the step's trained indices fall on (None:
        all). The others' parameters leave the update with no gradient, so AdamW skips them:
        their weights and moments stay bit for bit (a zero gradient would still move them by
        momentum and weight decay), and the version published after this step need not carry
        them. Reported as ``changed``: the experts the update changed (None: the whole model).

        A non-finite gradient norm skips the update (reported as ``skipped``) but still ends the
        step, so versions keep counting steps.
        """
        max_norm = self.train_cfg.max_grad_norm
        if self.placement is not None:  # the norm over both experts, which no rank holds alone
            grad_norm = self._placed_grad_norm()
            if max_norm > 0:
                # the coefficient clip_grad_norm_ computes (float32), applied as a number: the
                # gradients may be DTensors of one expert's mesh
                coef = float((torch.tensor(max_norm, dtype=torch.float32, device=grad_norm.device)
                              / (grad_norm + 1e-6)).clamp(max=1.0))
                torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], coef)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm > 0 else float("inf"))
        if self.sharded:
            from digenrl.rl.sharding import full
            grad_norm = full(grad_norm)
        skipped = not bool(torch.isfinite(grad_norm))
        if self.keep_versions:  # this version's weights, for its samples still to be trained
            self._snapshots[self.version] = self.state_dict_for_sync()
            for old in [v for v in self._snapshots if v < self.version + 1 - self.keep_versions]:
                del self._snapshots[old]
        if experts is not None:  # after the norm: a non-finite one may sit in any gradient
            for e, idx in self.expert_index.items():
                if e not in experts:
                    for i in idx:
                        self.params[i].grad = None
        if not skipped:
            if self.host is not None:  # the step on the host masters, then back to the device
                self.host.pull_grads([p.grad for p in self.params])
                self.optimizer.step()
                self.host.push()
            else:
                self.optimizer.step()
                if self.has_masters:  # round the new masters into the model the passes run
                    with torch.no_grad():
                        torch._foreach_copy_(self.model_params, self.params)
            if self.ema is not None:  # a skipped step leaves the average too
                self.ema.update(live_weights(self))
        self.optimizer.zero_grad(set_to_none=True)
        if self.host is not None:  # the device gradients are not the optimizer's
            for p in self.params:
                p.grad = None
        self.version += 1
        changed = () if skipped else (None if experts is None else tuple(experts))
        return {"grad_norm": float(grad_norm), "skipped": skipped, "version": self.version,
                "lr": self.optimizer.param_groups[0]["lr"], "changed": changed}

    # -- experts placed over ranks (rl/experts.py) -------------------------------------------------
    @property
    def collective(self) -> bool:
        """Publishing, saving and checkpointing are collectives every trainer rank joins
        (sharded: gathers of shards; experts placed over ranks: rank 0 receives those it lacks)."""
        return self.sharded or self.placement is not None

    def _placed_grad_norm(self) -> torch.Tensor:
        """The gradient norm over every trained expert: each expert's squared norm from its
        lowest holder (the holders' gradients are equal after :meth:`reduce_expert_grads`),
        summed over ranks."""
        import torch.distributed as dist

        from digenrl.rl.experts import EXPERTS
        pl = self.placement
        assert pl is not None
        sq = torch.zeros(len(EXPERTS), dtype=torch.float32, device=self.params[0].device)
        for j, e in enumerate(EXPERTS):
            if e in self.expert_index and pl.source(e) == self.rank:
                grads = [g for i in self.expert_index[e] if (g := self.params[i].grad) is not None]
                if grads:
                    sq[j] = self._norm(grads) ** 2
            elif e in self.expert_index and self.sharded:
                grads = [g for i in self.expert_index[e] if (g := self.params[i].grad) is not None]
                if grads:
                    self._norm(grads)  # the expert's other holders join its gathers
        dist.all_reduce(sq)
        return sq.sum().sqrt()

    def _norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The norm of ``grads`` (sharded: whole, a collective over their mesh), float32."""
        from digenrl.rl.sharding import full
        return full(torch.nn.utils.get_total_norm(grads)).float()

    def reduce_expert_grads(self) -> None:
        """Sum each held expert's gradients over the ranks that hold it (its holders' group;
        an expert one rank holds needs nothing), expert by expert in a fixed order."""
        import torch.distributed as dist
        pl = self.placement
        assert pl is not None
        for e in pl.trained:
            if e not in self.expert_index:
                continue
            params = [self.params[i] for i in self.expert_index[e]]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            if e in self._holder_groups:
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=self._holder_groups[e])
                offset = 0
                for i, p in enumerate(params):
                    grads[i] = flat[offset:offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
            for p, g in zip(params, grads, strict=True):
                p.grad = g

    def _gather_to_rank0(self, own: Callable[[str], dict[str, torch.Tensor]], keep: bool,
                         experts: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """Rank 0 (``keep``): ``own(e)`` of every trained expert, its own and, for those it
        lacks, received from their lowest holder; the holders that send return ``{}``."""
        from digenrl.rl.experts import comm_device, recv_state, send_state
        pl = self.placement
        assert pl is not None
        device = comm_device(self.model_params[0].device)
        out: dict[str, torch.Tensor] = {}
        for e in pl.trained:
            if experts is not None and e not in experts:
                continue
            src = pl.source(e)
            if e in self.expert_index:
                if self.rank == 0 or (src == self.rank and 0 not in pl.holders(e)):
                    part = own(e)
                    if self.rank == 0:
                        out.update(part)
                    else:
                        send_state(part, 0, device)
            elif self.rank == 0:
                out.update(recv_state(src, device))
        return out if keep else {}

    def whole_sync_state(self, *, keep: bool = True,
                         experts: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """:meth:`state_dict_for_sync` of every trained expert (of those in ``experts``, if
        given: every rank must pass the same), on the rank that ``keep``s it (rank 0): what is
        published, saved and checkpointed. A collective where :attr:`collective` (every rank
        calls it), else this rank's own state."""
        if self.placement is None:
            return self.state_dict_for_sync(keep=keep, experts=experts)
        pl = self.placement
        # sharded: every holder joins its expert's gathers; rank 0 and the senders keep them
        sends = any(pl.source(e) == self.rank for e in self.expert_index if experts is None or e in experts)
        mine = self.state_dict_for_sync(keep=self.rank == 0 or sends, experts=experts)
        return self._gather_to_rank0(lambda e: {k: v for k, v in mine.items() if k.startswith(e + ".")}, keep,
                                     experts=experts)

    def whole_optimizer_state(self, *, keep: bool = True) -> dict[str, Any]:
        """:meth:`optimizer_state` as one policy training every expert keeps it (parameters
        indexed expert by expert, high-noise first); a collective where experts are placed."""
        if self.placement is None:
            return self.optimizer_state()
        local = self.optimizer.state_dict()
        n = self._per_expert()

        def own(e: str) -> dict[str, torch.Tensor]:
            return {f"{e}/{i}/{name}": t for i, idx in enumerate(self.expert_index[e])
                    for name, t in local["state"].get(idx, {}).items()}

        parts = self._gather_to_rank0(own, keep)
        if not keep:
            return {}
        trained = self.placement.trained
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in parts.items():
            e, i, name = key.split("/")
            state.setdefault(trained.index(e) * n + int(i), {})[name] = t
        return {"state": state, "param_groups": [{**g, "params": list(range(len(trained) * n))}
                                                 for g in local["param_groups"]]}

    def _per_expert(self) -> int:
        """Trained parameters per expert (the two experts have one architecture)."""
        counts = {len(v) for v in self.expert_index.values()}
        if len(counts) != 1:
            raise ValueError(f"experts with different trained parameter counts: {self.expert_index}")
        return counts.pop()

    def _load_placed_optimizer(self, state: dict[str, Any]) -> None:
        """A :meth:`whole_optimizer_state` into this rank's optimizer: its experts' entries."""
        assert self.placement is not None
        n, trained = self._per_expert(), self.placement.trained
        total = sum(len(g["params"]) for g in state["param_groups"])
        if total != len(trained) * n:
            raise ValueError(f"optimizer state of {total} parameters: this run trains {len(trained)} "
                             f"expert(s) of {n}")
        local: dict[int, Any] = {}
        for e, idx in self.expert_index.items():
            for i, li in enumerate(idx):
                s = state["state"].get(trained.index(e) * n + i)
                if s is not None:
                    local[li] = s
        self.optimizer.load_state_dict({"state": local, "param_groups": [
            {**g, "params": list(range(len(self.params)))} for g in state["param_groups"]]})

    def zero_grad(self) -> None:
        """Drop accumulated gradients (an aborted step)."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in (*self.model_params, *self.params):
            p.grad = None

    def grads_snapshot(self) -> list[torch.Tensor]:
        """Clones of the trainable parameters' ``.grad`` (zeros where None); for tests/checks."""
        from digenrl.rl.sharding import full
        return [full(p.grad).detach().clone() if p.grad is not None else torch.zeros_like(full(p.detach()))
                for p in self.params]

    # -- weight sync -----------------------------------------------------------------------------
    def state_dict_for_sync(self, *, keep: bool = True,
                            experts: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """What a rollout needs to match this policy: the LoRA adapter, or the trainable weights,
        as host (CPU) copies: every user sends, saves or checksums them there. ``experts``
        (two-expert models): only the keys of those experts (every rank must pass the same).

        Sharded: whole tensors, gathered; a collective every trainer rank must call. A rank
        that only takes part (``keep=False``: not the one that publishes or writes) joins each
        tensor's gather and lets it go at once, so it never holds the whole set in host
        memory (for a 12B full fine-tune, ~48 GB a rank in float32); it gets ``{}``.
        """
        from digenrl.devices import host
        from digenrl.rl.sharding import full
        if hasattr(self.model, "sync_state_dict"):
            tensors = self.model.sync_state_dict().items()
        else:
            tensors = ((k, p) for k, p in self.model.transformer.named_parameters() if p.requires_grad)
        def wanted(key: str) -> bool:
            return experts is None or key.split(".", 1)[0] in experts

        sd = {}
        for k, v in tensors:
            if not wanted(k):
                continue
            whole = full(v)  # the collective, on every rank
            if keep:
                sd[k] = host(whole)
            del whole  # a dropped gather frees its device memory before the next one
        if not keep:
            return {}
        for key, i in self._master_keys().items():  # the float32 masters, not their rounding
            if wanted(key):
                sd[key] = host(self.masters[i])
        return sd

    def _master_keys(self) -> dict[str, int]:
        """Sync key -> index in :attr:`masters` of each float32 master kept apart from the
        model's own tensor (none when the optimizer updates the model's float32 tensors)."""
        if self.sharded or (not self.has_masters and self.host is None):
            return {}  # sharded: the module's float32 shards are the masters
        index = {id(p): i for i, p in enumerate(self.model_params)}
        lora = getattr(self.model, "lora_rank", 0)
        return {(k.replace(".default", "") if lora else k): index[id(p)]
                for k, p in self.model.transformer.named_parameters() if id(p) in index}

    def load_sync_state(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Apply a :meth:`state_dict_for_sync` (ValueError naming the keys on mismatch)."""
        if self.sharded:
            self._load_sharded(sd)
            if self.host is not None:
                self.host.refresh()
            return
        if self.placement is not None:  # a whole state (a checkpoint): this rank's experts of it
            sd = {k: v for k, v in sd.items() if k.split(".", 1)[0] in self.expert_index}
        if hasattr(self.model, "load_sync_state_dict"):
            self.model.load_sync_state_dict(dict(sd))
        else:
            named = {k: p for k, p in self.model.transformer.named_parameters() if p.requires_grad}
            if set(sd) != set(named):
                raise ValueError(f"sync state keys differ: missing {sorted(set(named) - set(sd))[:3]}, "
                                 f"unexpected {sorted(set(sd) - set(named))[:3]}")
            with torch.no_grad():
                for k, p in named.items():
                    if sd[k].shape != p.shape:
                        raise ValueError(f"sync state {k}: shape {tuple(sd[k].shape)}, expected {tuple(p.shape)}")
                    p.copy_(sd[k])
        if self.host is not None:
            self.host.wait()
        with torch.no_grad():  # masters take the values exactly (a checkpoint's float32)
            for key, i in self._master_keys().items():
                self.masters[i].copy_(sd[key])

    def _load_sharded(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Whole tensors (a checkpoint) into this rank's shards; sync keys -> module keys."""
        from digenrl.rl.sharding import load_full_state
        if self.placement is not None:  # a whole state (a checkpoint): this rank's experts of it
            sd = {k: v for k, v in sd.items() if k.split(".", 1)[0] in self.expert_index}
        own = self.model.transformer.state_dict()
        if getattr(self.model, "lora_rank", 0):  # peft's keys drop the adapter name
            to_module = {k.replace(".default", ""): k for k in own if "lora_" in k}
        elif hasattr(self.model, "sync_state_dict"):
            to_module = {k: k for k in own}
        else:
            to_module = {k: k for k, p in self.model.transformer.named_parameters() if p.requires_grad}
        if set(sd) != set(to_module):
            raise ValueError(f"sync state keys differ: missing {sorted(set(to_module) - set(sd))[:3]}, "
                             f"unexpected {sorted(set(sd) - set(to_module))[:3]}")
        load_full_state(self.model.transformer, {to_module[k]: v for k, v in sd.items()})

    # -- optimizer state (checkpoints) -----------------------------------------------------------
    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state for a checkpoint; sharded: gathered whole (a collective), keyed
        by parameter name, complete on rank 0 only."""
        if not self.sharded:
            return self.optimizer.state_dict()
        if self.host is not None:
            return self.sharded_host_state(whole=True)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )
        return get_optimizer_state_dict(self.model.transformer, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`optimizer_state` (every rank passes the whole saved state).

        Sharded, it also takes an unsharded trainer's state (keyed by parameter index: a
        single trainer's checkpoint resumed on several sharded ranks); the indices follow
        :attr:`params`, the same parameters in the same order sharded or not."""
        if self.placement is not None:
            self._load_placed_optimizer(state)
            return
        if not self.sharded:
            self.optimizer.load_state_dict(state)
            return
        if self.host is not None:
            self._load_sharded_host_state(state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )
        if any(isinstance(k, int) for k in state.get("state", {})):
            # this optimizer's parameter names in index order (a collective: state is empty here)
            mine: dict[str, Any] = dict(get_optimizer_state_dict(
                self.model.transformer, self.optimizer, options=StateDictOptions(full_state_dict=True)))
            names = [n for g in mine["param_groups"] for n in g["params"]]
            if len(names) != sum(len(g["params"]) for g in state["param_groups"]):
                raise ValueError(f"optimizer state of {sum(len(g['params']) for g in state['param_groups'])} "
                                 f"parameters: this policy trains {len(names)}")
            state = {"state": {names[i]: s for i, s in state["state"].items()},
                     "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                      for g in state["param_groups"]]}
        set_optimizer_state_dict(self.model.transformer, self.optimizer, state,
                                 options=StateDictOptions(full_state_dict=True))


    # -- sharded with the optimizer offloaded: its state by parameter name, as DTensors -----------
    def param_names(self) -> list[str]:
        """The module name of each of :attr:`model_params`, in their (and :attr:`masters`') order."""
        names = {id(p): n for n, p in self.model.transformer.named_parameters()}
        return [names[id(p)] for p in self.model_params]

    def sharded_host_state(self, *, whole: bool = False) -> dict[str, Any]:
        """A sharded policy's offloaded AdamW state in the layout of
        ``get_optimizer_state_dict``: keyed by parameter name, each moment a DTensor over the
        host tensor itself (a DCP save reads it and a DCP load writes into it in place), or
        ``whole``: gathered to whole host tensors (a collective)."""
        from torch.distributed.tensor import DTensor

        assert self.host is not None and self.sharded
        self.host.init_state(self.optimizer)
        names = self.param_names()
        out: dict[str, Any] = {}
        for name, p, m in zip(names, self.model_params, self.masters, strict=True):
            st = self.optimizer.state[m]
            entry: dict[str, Any] = {"step": st["step"]}
            for k in ("exp_avg", "exp_avg_sq"):
                local = st[k].to(self.host.device) if whole else st[k]  # NCCL gathers device tensors
                d = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,  # type: ignore[attr-defined]
                                       shape=p.shape, stride=p.stride())
                entry[k] = d.full_tensor().cpu() if whole else d
            out[name] = entry
        hyper = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        return {"state": out, "param_groups": [{**hyper, "params": names}]}

    def _load_sharded_host_state(self, state: dict[str, Any]) -> None:
        """Whole optimizer state (keyed by parameter index: a single trainer's; or by name)
        into this rank's host shards."""
        from torch.distributed.tensor import distribute_tensor

        assert self.host is not None
        saved = state.get("state", {})
        names = self.param_names()
        by_index = any(isinstance(k, int) for k in saved)
        if len(saved) != len(names):
            raise ValueError(f"optimizer state of {len(saved)} parameters: this policy trains {len(names)}")
        self.host.init_state(self.optimizer)
        with torch.no_grad():
            for i, (name, p, m) in enumerate(zip(names, self.model_params, self.masters, strict=True)):
                src, st = saved[i if by_index else name], self.optimizer.state[m]
                st["step"].copy_(torch.as_tensor(src["step"]))
                for k in ("exp_avg", "exp_avg_sq"):
                    whole = torch.as_tensor(src[k]).to(self.host.device, torch.float32)
                    st[k].copy_(distribute_tensor(whole, p.device_mesh, p.placements,  # type: ignore[attr-defined]
                                                  src_data_rank=None).to_local())


def build_policy(cfg: ResolvedConfig, world_size: int = 1, gpu: str | None = None, *,
                 device: str | torch.device = "cpu", rank: int = 0) -> Policy:
    """The trainer's policy on ``device`` (its transformer, reference, text encoders and VAE);
    with ``model.fsdp`` and several ranks (process group initialised) its transformer is
    sharded over them (FSDP2). One rank has nothing to shard. ``gpu``: the node's declared GPU
    type (default the config's trainer GPU; read by emulated models). ``rank``: this trainer
    rank (two experts: which it holds, :mod:`digenrl.rl.experts`)."""
    from digenrl.models import build_model
    from digenrl.rl.experts import placement_for

    gpu = gpu or cfg.cluster.trainer_gpu or cfg.cluster.gpu
    placement = placement_for(cfg, world_size)  # two experts: which this rank holds
    model = build_model(cfg.model, seed=cfg.run.seed, gpu=gpu, in_trainer=True, device=device,
                        embedded_guidance=cfg.sampler.embedded_guidance,
                        experts=None if placement is None else (placement.held[rank], placement.trained))
    return Policy(model, cfg.train, cfg.sampler, shard=cfg.model.fsdp and world_size > 1, offload=cfg.model.offload,
                  keep_versions=cfg.runtime.staleness, placement=placement, rank=rank)


def _expert_index(model: FlowModel, params: list[torch.Tensor]) -> dict[str, list[int]]:
    """Expert name -> indices in ``params`` of its parameters (two-expert models; else {})."""
    transformer = getattr(model, "transformer", None)
    if not hasattr(transformer, "expert_of"):
        return {}
    index = {id(p): i for i, p in enumerate(params)}
    out: dict[str, list[int]] = {}
    for name, p in transformer.named_parameters():  # type: ignore[union-attr]
        if id(p) in index:
            out.setdefault(name.split(".", 1)[0], []).append(index[id(p)])
    return out


def _to_master(master: torch.Tensor, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: move ``param``'s (bf16) gradient into ``master.grad`` (fp32)."""
    grad = param.grad
    if grad is None:
        return
    if master.grad is None:
        master.grad = grad.float()
    else:
        master.grad.add_(grad)
    param.grad = None
