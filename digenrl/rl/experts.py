"""Wan2.2 A14B's two experts over the trainer ranks: which rank holds which expert.

With TSP each trainer rank trains its own step indices, and each index is denoised by one
expert (``transformer`` where ``sigma * 1000 >= boundary_ratio * 1000``, else
``transformer_2``). A rank holds (loads, trains, keeps optimizer state for) only the experts
of the indices the run's plan can give it, over all of the run's steps (:func:`placement_for`,
a pure function of the config, so every rank and every resume agree without asking):

* the run trains an expert only if ``model.train_experts`` names it *and* some trained index of
  some step falls on it; an expert no step trains is never held by a non-generating rank,
  never synced and never saved;
* a rank that generates (colocated ranks, TAG with ``runtime.tag = "always"``, rank 0 when the
  run evaluates) holds both experts: a trajectory crosses the boundary;
* every rank of a run with an EMA (``train.ema_decay > 0``) holds both experts, and every rank
  of a forward-process algorithm (nft / awm: noise levels drawn over the whole range) holds
  and trains both (or the one ``model.train_experts`` names).

When some rank lacks an expert the run trains (:attr:`ExpertPlacement.partial`), gradients
of an expert are summed over its holders only (:func:`holder_groups`), the clipping norm over
all experts (each expert's share from its lowest holder), and rank 0 receives the experts it
lacks from their lowest holders to publish, save and checkpoint them (:func:`send_state`,
:func:`recv_state`: point-to-point, only the two ranks involved).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from digenrl.models.video import EXPERTS, TRAINED_EXPERTS

if TYPE_CHECKING:
    from digenrl.config import Config


PLAN_STEPS_MAX = 100_000
"""Runs of more steps are placed by the indices ``train.timesteps`` may ever train (on every
rank), not step by step."""

BUCKET_BYTES = 256 * 2**20
"""Largest single message of :func:`send_state` (tensors packed as bytes)."""


@dataclass(frozen=True)
class ExpertPlacement:
    """The experts each trainer rank holds (``held[rank]``) and those the run trains."""

    held: tuple[tuple[str, ...], ...]
    trained: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.held)

    def trainable(self, rank: int) -> tuple[str, ...]:
        """The experts ``rank`` trains: held and trained by the run."""
        return tuple(e for e in EXPERTS if e in self.held[rank] and e in self.trained)

    def holders(self, expert: str) -> list[int]:
        """Ranks that train ``expert``."""
        return [r for r in range(self.world_size) if expert in self.trainable(r)]

    def source(self, expert: str) -> int:
        """The lowest rank training ``expert``: it sends it to rank 0 and adds its norm."""
        return self.holders(expert)[0]

    @property
    def partial(self) -> bool:
        """Some rank lacks an expert the run trains: reductions and gathers go by expert."""
        return any(self.trainable(r) != self.trained for r in range(self.world_size))

    def code(self, rank: int) -> int:
        """``rank``'s held experts as a number: 1 = transformer, 2 = transformer_2, 3 = both."""
        return sum(1 << i for i, e in enumerate(EXPERTS) if e in self.held[rank])


def boundary_of(cfg: Config) -> float | None:
    """The folder's ``boundary_ratio`` (a two-expert Wan2.2 folder), else None."""
    from digenrl.models.folder import PipelineFolder, is_pipeline_folder

    if cfg.model.path in ("random", "emulated", "builtin"):
        return None
    path = Path(cfg.model.path)
    if not is_pipeline_folder(path):
        return None
    pf = PipelineFolder(path)
    ratio = pf.index.get("boundary_ratio")
    if pf.entry("transformer_2") is None or not isinstance(ratio, int | float):
        return None
    return float(ratio)


def expert_of_index(cfg: Config, ratio: float) -> list[str]:
    """The expert of each denoising step index, as the model routes its sigma."""
    from digenrl.rl.sde import sigma_schedule

    sc = cfg.sampler
    sigmas = sigma_schedule(sc.num_steps, sc.shift).tolist()[:-1]
    return ["transformer" if s * 1000 >= ratio * 1000 else "transformer_2" for s in sigmas]


def step_experts(cfg: Config, step: int, expert: list[str] | None) -> tuple[str, ...] | None:
    """The experts ``step``'s trained indices fall on (``expert``: :func:`expert_of_index`):
    the only ones its optimizer update may change. None: every part of the model (not two
    experts, or a forward-process algorithm, whose noise levels span both). A pure function of
    the config, so every trainer rank and every resume agree on it without asking."""
    from digenrl.core.plan import FORWARD_ALGORITHMS, plan_for_step

    if expert is None or cfg.train.algorithm in FORWARD_ALGORITHMS:
        return None
    used = {expert[t] for t in plan_for_step(cfg, step)[0]}
    return tuple(e for e in EXPERTS if e in used)


def split_by_expert(sd: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A sync state by expert (its keys' first component: ``transformer``, ``transformer_2``);
    keys of no expert under "" (every key of a one-transformer model)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        head = k.split(".", 1)[0]
        out.setdefault(head if head in EXPERTS else "", {})[k] = v
    return out


def _plans(cfg: Config) -> list[list[int]] | None:
    """The distinct trained-index lists of the run's steps; None for a run longer than
    PLAN_STEPS_MAX (then every rank is placed by the indices ``train.timesteps`` may train)."""
    from digenrl.core.plan import plan_for_step

    if cfg.run.steps > PLAN_STEPS_MAX:
        return None
    seen: dict[tuple[int, ...], None] = {}
    for step in range(cfg.run.steps):
        seen.setdefault(tuple(plan_for_step(cfg, step)[0]), None)
    return [list(t) for t in seen]


def _may_train(cfg: Config) -> list[int]:
    """Every index ``train.timesteps`` may train (as launch's check of one-expert runs counts)."""
    tc, n = cfg.train, cfg.sampler.num_steps
    if tc.timesteps in ("window", "mix"):
        return list(range(tc.window_lo, tc.window_hi or max(n // 2, 1)))
    return list(range(n))


def placement_for(cfg: Config, world_size: int) -> ExpertPlacement | None:
    """Which experts each of ``world_size`` trainer ranks holds (module docstring); None for a
    model that is not two experts."""
    from digenrl.core.plan import FORWARD_ALGORITHMS, owners_for

    ratio = boundary_of(cfg)
    if ratio is None:
        return None
    named = TRAINED_EXPERTS[cfg.model.train_experts]
    rt = cfg.runtime
    if cfg.train.algorithm in FORWARD_ALGORITHMS:  # noise levels drawn over both experts' range
        return ExpertPlacement(held=(EXPERTS,) * world_size, trained=named)
    expert = expert_of_index(cfg, ratio)
    used: list[set[str]] = [set() for _ in range(world_size)]
    F = rt.fragments_per_step
    plans = _plans(cfg)
    if plans is None:  # too many steps to walk: any rank may own any index
        used = [{expert[t] for t in _may_train(cfg)} for _ in range(world_size)]
    for trained in plans or []:
        for f in range(F):
            for t, rank in zip(trained, owners_for(trained, world_size, rt.tsp, f, F), strict=True):
                used[rank].add(expert[t])
    every = set().union(*used)
    trained_by_run = tuple(e for e in named if e in every) or named
    # an EMA is kept whole on every rank (final/ema, checkpoints): it holds every expert too
    generates = [cfg.run.mode == "colocated" or rt.tag == "always" or cfg.train.ema_decay > 0
                 or (r == 0 and cfg.run.eval_every > 0) for r in range(world_size)]
    held: list[tuple[str, ...]] = []
    for r in range(world_size):
        if generates[r]:
            held.append(EXPERTS)
            continue
        mine = tuple(e for e in EXPERTS if e in used[r] and e in trained_by_run)
        held.append(mine or trained_by_run[:1])  # a rank TSP never gives an index: the first expert
    return ExpertPlacement(held=tuple(held), trained=trained_by_run)


# ---------------------------------------------------------------------------- collectives

def holder_groups(placement: ExpertPlacement) -> dict[str, Any]:
    """Expert -> the process group of its holders (None: the default group, all ranks hold
    it; absent: one holder, nothing to reduce). Every rank must call this, in the same order
    (``new_group`` is a collective over the default group)."""
    import torch.distributed as dist

    groups: dict[str, Any] = {}
    for e in placement.trained:
        ranks = placement.holders(e)
        if len(ranks) == placement.world_size:
            groups[e] = None
        elif len(ranks) > 1:
            groups[e] = dist.new_group(ranks)
    return groups


def comm_device(model_device: torch.device) -> torch.device:
    """Where tensors go through the default process group: the model's GPU with NCCL (given,
    not the thread's current device: gathers may run off the compute thread), else the host."""
    import torch.distributed as dist

    if dist.get_backend() != "nccl":
        return torch.device("cpu")
    # offloaded shards (model.offload = "params") live on the host: NCCL still needs the GPU
    return model_device if model_device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def _buckets(meta: list[tuple[str, tuple[int, ...], str, int]]) -> Iterator[list[int]]:
    """Indices of ``meta`` entries packed into messages of at most BUCKET_BYTES (one larger
    tensor is a message of its own)."""
    bucket: list[int] = []
    size = 0
    for i, (_k, _shape, _dtype, nbytes) in enumerate(meta):
        if bucket and size + nbytes > BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(i)
        size += nbytes
    if bucket:
        yield bucket


def send_state(sd: Mapping[str, torch.Tensor], dst: int, device: torch.device) -> None:
    """Send ``sd`` to rank ``dst`` (which calls :func:`recv_state`): names, shapes and dtypes as
    one object, then the bytes of the tensors packed into buckets, through ``device``
    (:func:`comm_device`)."""
    import torch.distributed as dist

    tensors = [v.detach().contiguous() for v in sd.values()]
    meta = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch."), v.numel() * v.element_size())
            for k, v in zip(sd, tensors, strict=True)]
    dist.send_object_list([meta], dst=dst, device=device)
    for bucket in _buckets(meta):
        flat = torch.cat([tensors[i].reshape(-1).view(torch.uint8).to(device) for i in bucket])
        dist.send(flat, dst=dst)


def recv_state(src: int, device: torch.device) -> dict[str, torch.Tensor]:
    """What :func:`send_state` on rank ``src`` sends, as host tensors."""
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, device=device)
    meta: list[tuple[str, tuple[int, ...], str, int]] = box[0]
    out: dict[str, torch.Tensor] = {}
    for bucket in _buckets(meta):
        flat = torch.empty(sum(meta[i][3] for i in bucket), dtype=torch.uint8, device=device)
        dist.recv(flat, src=src)
        flat = flat.cpu()
        offset = 0
        for i in bucket:
            key, shape, dtype, nbytes = meta[i]
            out[key] = flat[offset:offset + nbytes].view(getattr(torch, dtype)).reshape(shape).clone()
            offset += nbytes
    return out


__all__ = ["EXPERTS", "TRAINED_EXPERTS", "ExpertPlacement", "boundary_of", "expert_of_index",
           "holder_groups", "placement_for", "recv_state", "send_state", "split_by_expert", "step_experts"]
