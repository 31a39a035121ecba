"""The algorithm interface: everything that differs between the RL algorithms, in one place.

The actors and the transport are algorithm-blind (``tests/test_layout.py`` keeps them so):
a rollout, a trainer rank, the colocated loop and the single-role runs ask the run's
:class:`Algorithm` (``algorithm_for(cfg.train)``) what to send per trajectory, what to stage,
what to train and how.

| | GRPO family (``grpo``: Flow-GRPO, its CPS and DanceGRPO SDE variants, GRPO-Guard) | forward process (``nft``: DiffusionNFT, ``awm``: AWM) |
|---|---|---|
| a step's trained slots | the plan's denoising steps (``train.timesteps``) | the trainer's draw slots ``0 .. forward_timesteps - 1`` |
| the rollout sends, per trajectory | a :class:`Chunk` per trained step, to the rank owning it (TSP) | nothing while denoising; the final latents, one :class:`CleanSample` per fragment to each owning rank, before the commit |
| the trainer stages | the chunks of its steps, one slot per step | the fragment's clean sample |
| the loss | clipped surrogate on the chunks' log-probs (``Policy.fragment_loss_backward``) | the NFT or AWM loss on noised clean samples at drawn levels (``rl/forward.py``) |
| behaviour weights | kept only with ``train.guard`` | always (``v_old`` of the generating version) |
| staleness rule | ``core.credits.within_staleness`` (at most K versions behind) | the same |
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from digenrl.config import Config, TrainConfig
from digenrl.core.credits import within_staleness
from digenrl.core.plan import plan_for_step, trajectory_seed
from digenrl.models.base import Cond
from digenrl.rl import forward
from digenrl.rl.fragment import FragmentResult
from digenrl.rl.sampler import StepRecord
from digenrl.transport.protocol import Assign, Chunk, CleanSample
from digenrl.transport.staging import Landed

Staged = Mapping[int, tuple[Any, Landed]]
"""A task's staged messages by slot (a chunk's timestep; ``-1``: a fragment's clean sample),
each with its tensors on their way to the training device."""


@dataclass(frozen=True)
class TrainInputs:
    """What one fragment trains on, on this rank: ``records`` keyed by this rank's trained
    slots (step records, or None per draw slot), and for the forward-process algorithms the
    fragment's clean latents and trajectory seeds."""

    records: dict[int, Any]
    final: torch.Tensor | None = None
    seeds: list[int] | None = None


class TrainablePolicy(forward.ForwardPolicy, Protocol):
    """What the losses need of the trained policy (:class:`~digenrl.rl.policy.Policy`)."""

    def fragment_loss_backward(self, records: Mapping[int, Any], cond: Cond, adv: torch.Tensor,
                               keep: torch.Tensor, *, batch_size_total: int, n_trained_total: int,
                               sigma_max: float, gen_version: int) -> dict[str, float]: ...


class Algorithm(Protocol):
    """One RL algorithm's part in generation, staging and training (see the module table)."""

    name: str
    staged_type: type[Chunk] | type[CleanSample]
    """The data message a trainer stages per fragment until its commit."""
    needs_behaviour: bool
    """Whether training needs the generating version's weights (``Policy.keep_versions``)."""

    def plan(self, cfg: Config, step: int) -> tuple[list[int], list[int]]:
        """(trained slots, SDE denoising steps) of ``step``: :func:`~digenrl.core.plan.plan_for_step`."""
        ...

    def within_staleness(self, version: int, gen_version: int, staleness: int) -> bool:
        """Whether a trajectory of ``gen_version`` may still train at ``version`` (K = ``staleness``)."""
        ...

    # -- the rollout
    def streamed_steps(self, trained: Sequence[int]) -> list[int]:
        """The denoising steps whose records the sampler hands out (one chunk each)."""
        ...

    def finish_on_thread(self, result: FragmentResult, wire: torch.dtype) -> None:
        """On the compute thread, once the trajectory is done: put in ``result`` what travels."""
        ...

    def after_trajectory(self, task: Assign, version: int, result: FragmentResult) -> list[tuple[int, CleanSample]]:
        """(rank, message) to send once the trajectory is done, before its commit."""
        ...

    def bytes_per_trajectory(self, cfg: Config, latent_numel: int) -> int:
        """Latent bytes one trajectory puts in flight to the trainers (the byte window's unit)."""
        ...

    # -- the trainer
    def refusal(self, msg: Chunk | CleanSample, *, trained: Sequence[int], owners: Sequence[int],
                rank: int, fragment_shape: tuple[int, ...]) -> str | None:
        """Why this rank cannot train ``msg`` (None: it can); ``owners``: the rank of each trained
        slot, ``fragment_shape``: a fragment's latents, trajectories first."""
        ...

    def slot(self, msg: Chunk | CleanSample) -> int:
        """Where ``msg`` is staged among its task's messages."""
        ...

    def tensors(self, msg: Chunk | CleanSample) -> list[torch.Tensor]:
        """The tensors of ``msg`` that go to the training device."""
        ...

    def staged_per_fragment(self, trained: Sequence[int]) -> int:
        """How many messages like one just staged make a whole fragment on a rank."""
        ...

    def to_train(self, staged: Staged, *, trained: Sequence[int], owners: Sequence[int], rank: int,
                 task_id: int) -> Staged:
        """Of a committed task's staged messages, what this rank trains (by slot)."""
        ...

    def landed(self, to_train: Staged, staged: Staged, *, cfg: Config, step: int,
               fragment: int) -> TrainInputs:
        """On the compute thread: the training inputs, once their copies have landed."""
        ...

    def local(self, records: dict[int, StepRecord], result: FragmentResult, trained: Sequence[int],
              seeds: list[int]) -> TrainInputs:
        """The training inputs of a fragment generated in this process (colocated, recordings)."""
        ...

    def fragment_backward(self, policy: TrainablePolicy, inputs: TrainInputs, cond: Cond,
                          adv: torch.Tensor, keep: torch.Tensor, *, gen_version: int,
                          batch_size_total: int, n_trained_total: int,
                          sigma_max: float) -> dict[str, float]:
        """Accumulate the fragment's loss gradient (weighted for the full batch); its stats."""
        ...


class _Common:
    name = ""

    def plan(self, cfg: Config, step: int) -> tuple[list[int], list[int]]:
        return plan_for_step(cfg, step)

    def within_staleness(self, version: int, gen_version: int, staleness: int) -> bool:
        return within_staleness(version, gen_version, staleness)


class GrpoFamily(_Common):
    """Flow-GRPO and its variants (the sampler's SDE picks CPS / DanceGRPO; ``train.guard``
    GRPO-Guard): per-step chunks with behaviour log-probs, the clipped surrogate."""

    name = "grpo"
    staged_type: type[Chunk] | type[CleanSample] = Chunk

    def __init__(self, train_cfg: TrainConfig) -> None:
        self.needs_behaviour = bool(train_cfg.guard)

    def streamed_steps(self, trained: Sequence[int]) -> list[int]:
        return sorted(int(t) for t in trained)

    def finish_on_thread(self, result: FragmentResult, wire: torch.dtype) -> None:
        return None

    def after_trajectory(self, task: Assign, version: int, result: FragmentResult) -> list[tuple[int, CleanSample]]:
        return []

    def bytes_per_trajectory(self, cfg: Config, latent_numel: int) -> int:
        elem = 2 if cfg.sampler.wire_dtype == "bfloat16" else 4
        return 2 * latent_numel * elem * max(1, len(self.plan(cfg, 0)[0]))

    def refusal(self, msg: Chunk | CleanSample, *, trained: Sequence[int], owners: Sequence[int],
                rank: int, fragment_shape: tuple[int, ...]) -> str | None:
        assert isinstance(msg, Chunk)
        if msg.t_index not in trained or owners[list(trained).index(msg.t_index)] != rank:
            return "not_owner"
        return None

    def slot(self, msg: Chunk | CleanSample) -> int:
        assert isinstance(msg, Chunk)
        return msg.t_index

    def tensors(self, msg: Chunk | CleanSample) -> list[torch.Tensor]:
        assert isinstance(msg, Chunk)
        return [msg.x_t, msg.x_next, msg.log_prob]

    def staged_per_fragment(self, trained: Sequence[int]) -> int:
        return len(trained)

    def to_train(self, staged: Staged, *, trained: Sequence[int], owners: Sequence[int], rank: int,
                 task_id: int) -> Staged:
        return staged

    def landed(self, to_train: Staged, staged: Staged, *, cfg: Config, step: int,
               fragment: int) -> TrainInputs:
        # on the compute thread: its stream is the one that waits for the chunks' copies
        return TrainInputs(records={t: _record(c, landed) for t, (c, landed) in to_train.items()})

    def local(self, records: dict[int, StepRecord], result: FragmentResult, trained: Sequence[int],
              seeds: list[int]) -> TrainInputs:
        return TrainInputs(records=dict(records))

    def fragment_backward(self, policy: TrainablePolicy, inputs: TrainInputs, cond: Cond,
                          adv: torch.Tensor, keep: torch.Tensor, *, gen_version: int,
                          batch_size_total: int, n_trained_total: int,
                          sigma_max: float) -> dict[str, float]:
        return policy.fragment_loss_backward(
            inputs.records, cond, adv, keep, batch_size_total=batch_size_total,
            n_trained_total=n_trained_total, sigma_max=sigma_max, gen_version=gen_version)


class ForwardProcess(_Common):
    """DiffusionNFT (``nft``) and AWM (``awm``): the rollout sends only final latents; the
    trainer draws each slot's noise level and noise from the trajectory seeds (``rl/forward.py``)."""

    staged_type: type[Chunk] | type[CleanSample] = CleanSample
    needs_behaviour = True

    def __init__(self, train_cfg: TrainConfig) -> None:
        self.name = train_cfg.algorithm

    def streamed_steps(self, trained: Sequence[int]) -> list[int]:
        return []  # trained slots are the trainer's draws, not denoising steps

    def finish_on_thread(self, result: FragmentResult, wire: torch.dtype) -> None:
        result.final = result.final.to(wire).cpu()  # what the trainer trains on, in the wire dtype

    def after_trajectory(self, task: Assign, version: int, result: FragmentResult) -> list[tuple[int, CleanSample]]:
        return [(rank, CleanSample(task_id=task.task_id, step=task.step, fragment=task.fragment,
                                   policy_version=version, x0=result.final))
                for rank in sorted({int(r) for r in task.owners.values()})]

    def bytes_per_trajectory(self, cfg: Config, latent_numel: int) -> int:
        return latent_numel * (2 if cfg.sampler.wire_dtype == "bfloat16" else 4)

    def refusal(self, msg: Chunk | CleanSample, *, trained: Sequence[int], owners: Sequence[int],
                rank: int, fragment_shape: tuple[int, ...]) -> str | None:
        assert isinstance(msg, CleanSample)
        if rank not in owners:
            return "not_owner"
        if tuple(msg.x0.shape) != fragment_shape:
            return "bad_shape"  # one final latent per trajectory of the fragment
        return None

    def slot(self, msg: Chunk | CleanSample) -> int:
        return -1  # one clean sample per fragment

    def tensors(self, msg: Chunk | CleanSample) -> list[torch.Tensor]:
        assert isinstance(msg, CleanSample)
        return [msg.x0]

    def staged_per_fragment(self, trained: Sequence[int]) -> int:
        return 1  # one clean sample is the whole fragment on this rank

    def to_train(self, staged: Staged, *, trained: Sequence[int], owners: Sequence[int], rank: int,
                 task_id: int) -> Staged:
        # this rank's draw slots of the fragment (TSP over the trainer's own draws)
        mine = [j for j, r in zip(trained, owners) if r == rank]
        if mine and -1 not in staged:
            raise RuntimeError(f"task {task_id}: committed without its clean sample")
        return {j: staged[-1] for j in mine}

    def landed(self, to_train: Staged, staged: Staged, *, cfg: Config, step: int,
               fragment: int) -> TrainInputs:
        records: dict[int, Any] = dict.fromkeys(to_train)
        if not to_train:
            return TrainInputs(records=records)
        final = next(iter(to_train.values()))[1].wait()[0].float()
        G, per = cfg.train.group_size, cfg.train.prompts_per_step // cfg.runtime.fragments_per_step
        # the fragment's trajectory seeds fix the trainer's draws
        seeds = [trajectory_seed(cfg.run.seed, step, q, g)
                 for q in range(fragment * per, (fragment + 1) * per) for g in range(G)]
        return TrainInputs(records=records, final=final, seeds=seeds)

    def local(self, records: dict[int, StepRecord], result: FragmentResult, trained: Sequence[int],
              seeds: list[int]) -> TrainInputs:
        return TrainInputs(records=dict.fromkeys(trained), final=result.final, seeds=list(seeds))

    def fragment_backward(self, policy: TrainablePolicy, inputs: TrainInputs, cond: Cond,
                          adv: torch.Tensor, keep: torch.Tensor, *, gen_version: int,
                          batch_size_total: int, n_trained_total: int,
                          sigma_max: float) -> dict[str, float]:
        if inputs.final is None or inputs.seeds is None:
            raise ValueError(f"train.algorithm = {self.name!r} trains on the fragment's final "
                             "latents and seeds; got none")
        return forward.fragment_backward(
            policy, inputs.final, cond, adv, keep, seeds=inputs.seeds, draws=sorted(inputs.records),
            gen_version=gen_version, batch_size_total=batch_size_total, n_draws_total=n_trained_total)


def algorithm_for(train_cfg: TrainConfig) -> Algorithm:
    """The run's algorithm (``train.algorithm``)."""
    if train_cfg.algorithm == "grpo":
        return GrpoFamily(train_cfg)
    if train_cfg.algorithm in ("nft", "awm"):
        return ForwardProcess(train_cfg)
    raise ValueError(f"train.algorithm = {train_cfg.algorithm!r}: expected 'grpo', 'nft' or 'awm'")


def _record(c: Chunk, landed: Landed) -> StepRecord:
    x_t, x_next, log_prob = landed.wait()  # this thread's stream waits for the copies (GPU side)
    return StepRecord(index=c.t_index, sigma=c.sigma, sigma_next=c.sigma_next,
                      x_t=x_t.float(), x_next=x_next.float(), log_prob=log_prob.float(), sde=True)
