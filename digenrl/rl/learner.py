"""The trainer's view of one optimizer step: fragments in, one update out.

Used as-is by the colocated loop and by every trainer rank of the disaggregated runtime, so
the two cannot drift apart. A step's batch arrives as fragments of whole GRPO groups (GAP);
each fragment's advantages need only its own rewards, its loss is scaled by
1 / (B * T_trained) and its gradient is accumulated, so the sum over fragments (and over the
TSP ranks' disjoint timestep sets, after an all-reduce) is the full-batch gradient.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from digenrl.config import Config, TrainConfig
from digenrl.models.base import Cond
from digenrl.rl.algorithm import TrainInputs, algorithm_for
from digenrl.rl.finite import NONFINITE, fragment_tensors, nonfinite_rows
from digenrl.rl.grpo import AdvStats, gdpo_advantages, group_advantages
from digenrl.rl.policy import Policy, StepLike


def advantages(train: TrainConfig, weights: Mapping[str, float], rewards: torch.Tensor,
               group_ids: torch.Tensor, terms: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, AdvStats]:
    """A fragment's advantages by ``train.advantage``, with each reward term's share of them
    (``AdvStats.terms``) for the terms among ``terms`` (per-trajectory values, by the names of
    ``weights``: each term's label or name).

    "sum" normalises the summed ``rewards`` (Flow-GRPO). "gdpo" with several terms normalises
    each term, then their weighted sum (:func:`~digenrl.rl.grpo.gdpo_advantages`). With one
    term there is nothing to balance: "gdpo" takes the "sum" path on the same ``rewards``, so
    its advantages are those of "sum" bit for bit.
    """
    known = {k: v for k, v in terms.items() if k in weights}
    if train.advantage == "gdpo" and len(weights) > 1:
        if set(known) != set(weights):
            raise ValueError(f"train.advantage = 'gdpo' needs every reward term's value per "
                             f"trajectory; the commit carries {sorted(terms)} for {rewards.numel()} "
                             f"trajectories, expected {sorted(weights)}")
        return gdpo_advantages(known, weights, group_ids, std_mode=train.adv_std, clip=train.adv_clip)
    parts = {k: weights[k] * v for k, v in known.items()}
    return group_advantages(rewards, group_ids, std_mode=train.adv_std, clip=train.adv_clip, parts=parts)


@dataclass
class StepStats:
    """What one step's fragments add up to (reduced into metrics.jsonl by rank 0)."""

    rewards: list[float] = field(default_factory=list)
    reward_terms: dict[str, list[float]] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)
    trained_staleness: dict[int, int] = field(default_factory=dict)  # staleness -> trained samples
    loss: float = 0.0
    kl: float = 0.0
    clipfrac_num: float = 0.0
    ratio_max_dev: float = 0.0
    n_loss: int = 0
    trained: int = 0
    discarded: dict[str, int] = field(default_factory=dict)
    zero_adv_groups: int = 0
    adv_terms: dict[str, list[float]] = field(default_factory=dict)  # term -> its advantage shares
    train_seconds: float = 0.0
    passes: int = 0  # forward/backward passes run (sharded ranks keep these equal)
    fragments: list[str] = field(default_factory=list)  # each trained fragment's source label
    nonfinite_loss: list[str] = field(default_factory=list)  # those whose loss was not finite
    experts: dict[int, str] = field(default_factory=dict)  # trained step index -> expert (two-expert models)
    held: dict[int, int] = field(default_factory=dict)  # trainer rank -> the experts it holds (code)


class Learner:
    """Accumulates fragment gradients for the current step and applies the optimizer step."""

    def __init__(self, policy: Policy, cfg: Config) -> None:
        self.policy = policy
        self.cfg = cfg
        self.algorithm = algorithm_for(cfg.train)
        self.weights = {t.label or t.name: t.weight for t in cfg.reward.terms}
        """Each reward term's weight, by its name in a commit's ``reward_terms``."""
        self.stats = StepStats()
        #: a two-expert model (Wan2.2 A14B): each trained timestep's expert goes in the metrics
        self._two_experts = getattr(policy.model, "expert_of", lambda _s: None)(0.5) is not None
        #: two experts: the expert of each denoising step index (which the step's plan trains)
        self._expert_of: list[str] | None = None
        if self._two_experts:
            from digenrl.rl.experts import boundary_of, expert_of_index
            ratio = boundary_of(cfg)
            self._expert_of = None if ratio is None else expert_of_index(cfg, ratio)
        self.last_changed: tuple[str, ...] | None = None
        """What the last optimizer step changed: the experts it updated (two-expert models; () if
        it was skipped), or None: the whole model. The version it made carries only those."""
        self.last_discarded: dict[str, int] = {}
        self.skipped_steps = 0
        """Optimizer steps skipped for a non-finite loss or gradient (weights left untouched)."""
        self.last_skipped: tuple[list[str], list[str]] | None = None
        """The last step, if skipped: (its fragments, those whose loss was not finite)."""

    @property
    def version(self) -> int:
        return self.policy.version

    def train_fragment(self, *, records: Mapping[int, StepLike], cond: Cond, rewards: Sequence[float],
                       gen_version: int, n_trained_total: int, sigma_max: float,
                       reward_terms: Mapping[str, Sequence[float]] | None = None,
                       passes: int | None = None, final: torch.Tensor | None = None,
                       seeds: Sequence[int] | None = None, source: str = "") -> dict[str, float]:
        """Accumulate one fragment's gradient. ``records`` are this rank's trained steps only.

        ``passes``: the forward/backward passes this rank owes the fragment (its trained
        timesteps of it, by the plan; default ``len(records)``). A sharded policy runs exactly
        that many, padding with idle passes where the fragment trains less (zero advantages,
        a missing chunk), so the ranks' collectives stay paired.

        The loss is the run's algorithm's (``rl/algorithm.py``). Forward-process algorithms
        (``train.algorithm`` nft / awm): ``records`` holds this rank's draw slots (values
        unused), ``final`` the fragment's clean latents and ``seeds`` its trajectory seeds (they
        fix each draw's noise level and noise).

        A trajectory with a non-finite value in what is read of it (rl/finite.py) is discarded
        as ``nonfinite`` before advantages: its group's advantages are those of its finite
        members. ``source`` names the fragment in the log of a skipped step.
        """
        t0 = time.perf_counter()
        g = self.cfg.train.group_size
        n = len(rewards)
        bad = nonfinite_rows(n, tensors=fragment_tensors(records, final, cond),
                             values=reward_terms, rewards=rewards)
        n_bad = int(bad.sum())
        good = ~bad
        r = torch.tensor(list(rewards), dtype=torch.float32)
        group_ids = torch.arange(n) // g
        adv, keep, zero_groups = torch.zeros(n), torch.zeros(n, dtype=torch.bool), 0
        shares: dict[str, torch.Tensor] = {}  # each reward term's share of the advantages
        if n_bad < n or n == 0:
            terms = {k: torch.as_tensor(v, dtype=torch.float64)[good] for k, v in (reward_terms or {}).items()
                     if len(v) == n}
            adv_good, adv_stats = advantages(self.cfg.train, self.weights, r[good], group_ids[good], terms)
            adv[good], keep[good], zero_groups = adv_good, adv_stats.keep, adv_stats.zero_groups
            for k, share in adv_stats.terms.items():
                shares[k] = torch.zeros(n, dtype=torch.float64)
                shares[k][good] = share
        st = self.stats
        st.fragments.append(source)
        if n_bad:
            self.discard(n_bad, NONFINITE)
        st.rewards += [float(x) for x, ok in zip(rewards, good.tolist(), strict=True) if ok]
        for k, v in (reward_terms or {}).items():
            rows = v if len(v) != n else [x for x, ok in zip(v, good.tolist(), strict=True) if ok]
            st.reward_terms.setdefault(k, []).extend(float(x) for x in rows)
        staleness = self.policy.version - gen_version
        st.staleness += [staleness] * n
        if not self.policy.behaviour_available(gen_version) and self.algorithm.needs_behaviour:
            # the generating version's weights are gone (a resume dropped them): no v_old
            keep = torch.zeros_like(keep)
            self.discard(n - n_bad, "behaviour_unavailable")
            n_keep = 0
        else:
            n_keep = int(keep.sum())
            if n - n_bad - n_keep:
                st.discarded["zero_advantage"] = st.discarded.get("zero_advantage", 0) + n - n_bad - n_keep
        if n_keep:
            st.trained_staleness[staleness] = st.trained_staleness.get(staleness, 0) + n_keep
        st.zero_adv_groups += int(zero_groups)
        for k, share in shares.items():  # over the trained trajectories
            st.adv_terms.setdefault(k, []).extend(share[keep].tolist())
        st.trained += n_keep
        out: dict[str, float] = {}
        if n_keep and records:
            out = self.algorithm.fragment_backward(
                self.policy, TrainInputs(records=dict(records), final=final,
                                         seeds=None if seeds is None else list(seeds)),
                cond, adv, keep, gen_version=gen_version, batch_size_total=self.cfg.batch_size,
                n_trained_total=n_trained_total, sigma_max=sigma_max)
        if n_keep and records and self._two_experts:
            for t, rec in records.items():
                st.experts[t] = self.policy.model.expert_of(rec.sigma)  # type: ignore[attr-defined]
        if out:
            if not math.isfinite(float(out.get("loss", 0.0))):
                st.nonfinite_loss.append(source)
            st.loss += float(out.get("loss", 0.0))
            st.kl += float(out.get("kl", 0.0))
            st.clipfrac_num += float(out.get("clipfrac", 0.0)) * len(records)
            st.ratio_max_dev = max(st.ratio_max_dev, float(out.get("ratio_max_dev", 0.0)))
            st.n_loss += len(records)
            st.passes += len(records)
        ran = len(records) if n_keep and records else 0
        owed = len(records) if passes is None else passes
        if self.policy.sharded:
            if ran > owed:
                raise RuntimeError(f"fragment trained {ran} timesteps but the plan gives this rank "
                                   f"{owed}: sharded ranks would fall out of lockstep")
            self.idle(owed - ran)
        st.train_seconds += time.perf_counter() - t0
        return out

    def discard(self, n: int, reason: str) -> None:
        self.stats.discarded[reason] = self.stats.discarded.get(reason, 0) + n

    def idle(self, passes: int) -> None:
        """Sharded only: ``passes`` passes that move no gradient (see Policy.idle_pass)."""
        if not self.policy.sharded:
            return
        for _ in range(passes):
            self.policy.idle_pass()
        self.stats.passes += passes

    def pad(self, pad_to: int) -> None:
        """Sharded: idle passes up to ``pad_to``, the step's pass count on the busiest rank, so
        that every rank's FSDP collectives have paired up pass for pass (a no-op once there)."""
        if self.stats.passes > pad_to:
            raise RuntimeError(f"this rank ran {self.stats.passes} passes, more than the "
                               f"step's {pad_to}: sharded ranks fell out of lockstep")
        self.idle(pad_to - self.stats.passes)

    def reduce_gradients(self, all_reduce: Callable[[torch.Tensor], None], *, stop: bool = False) -> bool:
        """Sum the accumulated gradients over ranks (unsharded), in one all-reduce that also
        carries each rank's vote to stop: True if no rank voted, and the summed gradients are
        then in place; False if one did, and every rank's gradients are left as they were.

        A rank told to stop joins this all-reduce with ``stop`` instead of leaving at once:
        another rank may already be inside it for the step in progress, and would otherwise
        wait for a peer that never comes (gloo: "Connection closed by peer"; NCCL: a hang).
        With the vote, every rank learns in the same collective that the step is not taken,
        so all of them stay at the same version (the boundary a drain checkpoint keeps)."""
        self._spread_nonfinite_loss()
        params = self.policy.params  # the float32 masters where the model computes in bf16
        placed = getattr(self.policy, "placement", None) is not None
        like = params[0].detach()
        # experts placed over ranks (rl/experts.py): this all-reduce carries the counts and the
        # vote; each expert's gradients then sum over its holders (Policy.reduce_expert_grads)
        grads = [] if placed else [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        vote = like.new_full((1,), 1.0 if stop else 0.0)
        reports = self.reports(like)  # two experts: which one each rank's timesteps used, held
        flat = torch.cat([*(g_.reshape(-1) for g_ in grads), reports, vote])
        all_reduce(flat)
        if float(flat[-1]) > 0:
            return False
        self.take_reports(flat[flat.numel() - 1 - reports.numel():-1])
        if placed:
            self.policy.reduce_expert_grads()
            return True
        offset = 0
        for p in params:
            numel = p.numel()
            p.grad = flat[offset:offset + numel].view_as(p).clone()
            offset += numel
        return True

    def reports(self, like: torch.Tensor) -> torch.Tensor:
        """What each rank adds to the step's all-reduce besides gradients (two experts: which
        expert its trained timesteps used, which experts it holds); empty otherwise."""
        return torch.cat([self._expert_counts(like), self._held_codes(like)])

    def take_reports(self, summed: torch.Tensor) -> None:
        """The summed :meth:`reports` into this step's stats (its metrics)."""
        if not self._two_experts:
            return
        n = 2 * self.cfg.sampler.num_steps
        self._set_experts(summed[:n])
        self.stats.held = {r: int(v) for r, v in enumerate(summed[n:].tolist())}

    def _held_codes(self, like: torch.Tensor) -> torch.Tensor:
        """(W,) the experts each of the W ranks holds (rank r's entry: 1 = transformer, 2 =
        transformer_2, 3 = both; rl/experts.py), set by each rank from the modules it has
        loaded and summed over ranks; empty for a one-expert model."""
        if not self._two_experts:
            return like.new_zeros(0)
        import torch.distributed as dist

        on = dist.is_available() and dist.is_initialized()
        codes = like.new_zeros(dist.get_world_size() if on else 1)
        codes[dist.get_rank() if on else 0] = self._held_code()
        return codes

    def _held_code(self) -> int:
        held = getattr(self.policy.model.transformer, "held", ())
        return sum(1 << i for i, e in enumerate(("transformer", "transformer_2")) if e in held)

    def _expert_counts(self, like: torch.Tensor) -> torch.Tensor:
        """(2 T,) this rank's trained timesteps per expert (high-noise, low-noise; T = the
        sampler's steps), summed over ranks with the gradients; empty for a one-expert model."""
        if not self._two_experts:
            return like.new_zeros(0)
        steps = self.cfg.sampler.num_steps
        counts = like.new_zeros(2 * steps)
        for t, name in self.stats.experts.items():
            counts[t + (0 if name == "transformer" else steps)] += 1
        return counts

    def _set_experts(self, summed: torch.Tensor) -> None:
        steps = self.cfg.sampler.num_steps
        self.stats.experts = {t: "transformer" if float(summed[t]) > 0 else "transformer_2"
                              for t in range(steps) if float(summed[t]) + float(summed[steps + t]) > 0}

    def _spread_nonfinite_loss(self) -> None:
        """A rank whose step loss is not finite makes its gradient so too. The gradient's
        reduction over ranks (the all-reduce's sum; sharded, the norm's own all-reduce) then
        carries it to every rank: all of them see a non-finite norm and skip the same step
        (Policy.optimizer_step), so no rank's weights move while another's stay."""
        st = self.stats
        if not st.nonfinite_loss and math.isfinite(st.loss):
            return
        p = self.policy.params[0]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.fill_(math.nan)

    def finish_step(self, all_reduce: Callable[[torch.Tensor], None] | None = None, *,
                    pad_to: int | None = None) -> dict[str, float]:
        """All-reduce (sum) the accumulated gradients over ranks, step the optimizer.

        Sharded: the gradients are already summed (reduce-scattered pass by pass); first pad
        with idle passes to ``pad_to``, the step's pass count on the busiest rank.

        A non-finite loss (on any rank) or gradient norm skips the update: the weights stay as
        they were, the gradients are dropped, the version still advances (versions count
        steps), ``skipped_steps`` counts it and :attr:`last_skipped` names the step's fragments.
        """
        t0 = time.perf_counter()
        self._spread_nonfinite_loss()
        if self.policy.sharded:
            if pad_to is not None:
                self.pad(pad_to)
        elif all_reduce is not None and not self.reduce_gradients(all_reduce):
            # only TrainerActor's ranks vote, and they call reduce_gradients themselves
            raise RuntimeError("a rank voted to stop in an all-reduce that carries no votes")
        from digenrl.rl.experts import step_experts
        experts = step_experts(self.cfg, self.policy.version, self._expert_of)
        opt = self.policy.optimizer_step() if experts is None else self.policy.optimizer_step(experts)
        self.last_changed = () if opt.get("skipped") else experts
        st = self.stats
        self.last_skipped = None
        if opt.get("skipped"):
            self.policy.zero_grad()  # the model's own gradients too, where masters are kept
            self.skipped_steps += 1
            self.last_skipped = (list(st.fragments), list(st.nonfinite_loss))
        rewards = torch.tensor(st.rewards) if st.rewards else torch.zeros(1)
        metrics = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "loss": st.loss,
            "kl": st.kl,
            "clipfrac": st.clipfrac_num / max(st.n_loss, 1),
            "ratio_max_dev": st.ratio_max_dev,
            "grad_norm": float(opt.get("grad_norm", math.nan)),
            "max_staleness": max(st.staleness, default=0),
            "mean_staleness": sum(st.staleness) / max(len(st.staleness), 1),
            **{f"staleness/{k}": v for k, v in sorted(st.trained_staleness.items())},
            "zero_adv_groups": st.zero_adv_groups,
            "trained": st.trained,
            "discarded": sum(st.discarded.values()),
            "discarded_nonfinite": st.discarded.get(NONFINITE, 0),
            "train_seconds": st.train_seconds + time.perf_counter() - t0,
            "skipped_steps": self.skipped_steps,
        }
        for t, name in sorted(st.experts.items()):  # 0: transformer (high noise), 1: transformer_2
            metrics[f"expert/t{t}"] = 0 if name == "transformer" else 1
        if self._expert_of is not None:  # the experts this step's update changed (same code as held)
            metrics["expert/changed"] = sum(1 << i for i, e in enumerate(("transformer", "transformer_2"))
                                            if e in (self.last_changed or ()))
        if self._two_experts:  # one rank alone: its own; several: what each reported in the reduction
            for r, code in sorted((st.held or {0: self._held_code()}).items()):
                metrics[f"expert/held/r{r}"] = code
        for k, v in st.reward_terms.items():
            metrics[f"reward/{k}"] = sum(v) / max(len(v), 1)
        for k, v in st.adv_terms.items():
            shares = torch.tensor(v, dtype=torch.float64)
            metrics[f"adv/{k}/std"] = float(shares.std(unbiased=False)) if v else 0.0
            metrics[f"adv/{k}/mean_abs"] = float(shares.abs().mean()) if v else 0.0
        self.last_discarded = dict(st.discarded)
        self.stats = StepStats()
        return metrics



def save_final(policy: Policy, run_dir: Path, *, write: bool = True) -> Path:
    """The trained weights in run_dir/final/: ``policy.safetensors`` (the exact float32 state,
    LoRA: the adapter only) and what diffusers loads, in float32 (a LoRA as
    ``pytorch_lora_weights.safetensors`` for the pipeline's ``load_lora_weights``; a full
    fine-tune as a transformer folder: ``config.json`` + ``diffusion_pytorch_model.safetensors``,
    a hard link to policy.safetensors). Each file appears whole (written aside, then renamed).
    With an EMA (``train.ema_decay``), ``final/ema/`` holds the same files for the EMA weights.

    Sharded, or experts placed over ranks (rl/experts.py): a collective (every rank gathers
    or sends), only the caller with ``write`` (rank 0) writes.
    """
    out = run_dir / "final"
    # a rank that does not write joins the gathers and keeps nothing
    whole = getattr(policy, "whole_sync_state", policy.state_dict_for_sync)  # test fakes: their own
    sd = {k: v.detach().to("cpu").contiguous() for k, v in whole(keep=write).items()}
    if not write:
        return out / "policy.safetensors"
    _write_weights(policy, out, sd, aside=run_dir / "final.tmp")
    ema = getattr(policy, "ema", None)  # test fakes keep none
    if ema is not None:
        _write_weights(policy, out / "ema", ema.state_dict(), aside=run_dir / "final-ema.tmp")
    return out / "policy.safetensors"


def _write_weights(policy: Policy, out: Path, sd: dict[str, torch.Tensor], *, aside: Path) -> None:
    """``policy.safetensors`` and the diffusers files of ``sd`` in ``out`` (see save_final)."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "policy.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"version": str(policy.version), "format": "pt"})
    tmp.replace(out / "policy.safetensors")
    save = getattr(policy.model, "save", None)
    if save is not None:  # a diffusers adapter (test fakes have no diffusers format)
        shutil.rmtree(aside, ignore_errors=True)
        # float32 as trained: diffusers casts at load (torch_dtype=bfloat16 rounds exactly as the
        # trainer's bf16 compute did); a full fine-tune shares policy.safetensors' bytes
        save(aside, state=sd, same_as=out / "policy.safetensors")
        for f in aside.iterdir():
            f.replace(out / f.name)
        aside.rmdir()
