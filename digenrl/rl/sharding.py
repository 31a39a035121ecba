"""FSDP2 sharding of the trained transformer over the trainer ranks (``model.fsdp = true``).

Each transformer block, then the whole transformer, is wrapped with
``torch.distributed.fsdp.fully_shard``: parameters, gradients and AdamW state live as
``DTensor`` shards (1/W of the model per rank); a block's parameters are all-gathered for its
forward and its gradients reduce-scattered after its backward. Gradients are *summed* over
ranks (divide factor 1), the convention the rest of DigenRL uses (every loss term carries
1 / (B T_trained), so the sum over ranks is the full-batch gradient).

The constraint FSDP adds: every rank must run the same number of forward/backward passes per
optimizer step, in lockstep, because each pass's all-gathers and reduce-scatters pair up
across ranks. TSP ranks train different timesteps and may skip work (zero-advantage groups,
a rejected stale fragment), so the caller pads with :func:`pass_count`-many passes per
fragment and up to :func:`step_passes` per step; a padding pass
(:meth:`digenrl.rl.policy.Policy.idle_pass`) runs the same modules on a one-sample dummy
input with a zero loss, so it moves no gradient. The counts come from the step's plan alone
(no communication), so every rank knows them without asking.

Generation never runs sharded on a rollout (rollouts hold a full copy, fed by weight sync);
a sharded trainer rank does not offer TAG work (a lone generation pass would leave the other
ranks' collectives unmatched).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from digenrl.core.plan import owners_for


def _blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a diffusers transformer: every element of its ModuleLists."""
    out: list[torch.nn.Module] = []
    for child in module.modules():
        if isinstance(child, torch.nn.ModuleList) and len(child) and all(
                sum(1 for _ in m.parameters()) for m in child):
            out.extend(child)
    # nested lists (a block holding a ModuleList) would be wrapped twice: keep outermost only
    inner = {id(m) for b in out for m in b.modules() if m is not b}
    return [b for b in out if id(b) not in inner]


def shard_transformer(transformer: torch.nn.Module, param_dtype: torch.dtype = torch.float32,
                      offload: str = "none", mesh: Any = None) -> torch.nn.Module:
    """Wrap ``transformer`` in place with FSDP2 (per block, then the root); returns it.

    ``param_dtype`` other than float32 computes with parameters all-gathered in that dtype
    and reduce-scatters gradients in float32 (``MixedPrecisionPolicy``): the sharded
    parameters stay the float32 masters. Needs an initialised default process group (gloo on
    CPU, NCCL on GPU).

    ``offload = "params"`` (``model.offload``) keeps the sharded parameters, their gradients
    and so the optimizer state in host memory (FSDP2's ``CPUOffloadPolicy``, pinned when there
    is a GPU): each block's shard is copied to the device for its all-gather and the optimizer
    step runs on the CPU.

    ``mesh``: the device mesh to shard over (default: every rank of the default group).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("model.fsdp: torch.distributed is not initialised; FSDP2 needs the "
                           "trainer ranks' process group")
    # fp32 parameters: fully_shard's default policy (no casts); else compute in param_dtype
    # and reduce gradients in float32
    mp_policy = (MixedPrecisionPolicy() if param_dtype == torch.float32 else
                 MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    offload_policy = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload == "params"
                      else OffloadPolicy())
    for block in _blocks(transformer):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    fully_shard(transformer, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for m in transformer.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum over ranks, as the unsharded all-reduce does
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return transformer


def shard_experts(experts: Any, placement: Any, *, param_dtype: torch.dtype = torch.float32,
                  offload: str = "none", ref: Any = None) -> None:
    """Wan2.2's experts placed over ranks (rl/experts.py): each expert this rank holds sharded
    over the ranks that hold it (a device mesh of its own), as :func:`shard_transformer`
    shards one transformer; ``ref`` (a frozen copy, the KL reference) alike. Every rank calls
    this: each expert's group is created on all ranks, in the same order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    for name in placement.trained:
        ranks = placement.holders(name)
        group = dist.new_group(ranks)  # a collective over the default group: every rank
        if rank not in ranks:
            continue
        mesh = DeviceMesh.from_group(group, device_type)
        for module in (experts, ref):
            if module is not None:
                shard_transformer(getattr(module, name), param_dtype=param_dtype, offload=offload, mesh=mesh)


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank must call it), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def load_full_state(module: torch.nn.Module, sd: Mapping[str, torch.Tensor]) -> None:
    """Copy whole tensors ``sd`` (keys of ``module.state_dict()``; a subset, e.g. LoRA only)
    into a sharded ``module``.

    Every rank holds the whole tensors (a checkpoint file), so each takes its own shard
    without communication.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    own = module.state_dict()
    if set(sd) - set(own):
        raise ValueError(f"sharded load: unexpected keys {sorted(set(sd) - set(own))[:3]}")
    with torch.no_grad():
        for k, src in sd.items():
            cur = own[k]
            if tuple(src.shape) != tuple(cur.shape):
                raise ValueError(f"sharded load {k}: shape {tuple(src.shape)}, expected {tuple(cur.shape)}")
            if isinstance(cur, DTensor):
                local = distribute_tensor(src.to(cur.dtype), cur.device_mesh, cur.placements,
                                          src_data_rank=None).to_local()
                cur.to_local().copy_(local)
            else:
                cur.copy_(src)


def pass_count(trained: Sequence[int], ranks: int, tsp: bool, fragment: int, fragments: int,
               rank: int, sp: int = 1) -> int:
    """Forward/backward passes ``rank`` runs for ``fragment``: the trained timesteps it owns
    (with sequence parallelism ``sp``, its group's: owners are group leaders)."""
    leader = rank - rank % sp
    return sum(1 for o in owners_for(trained, ranks, tsp, fragment, fragments, sp) if o == leader)


def step_passes(trained: Sequence[int], ranks: int, tsp: bool, fragments: int, sp: int = 1) -> int:
    """Passes every rank runs in a step: the busiest rank's count (the others pad to it)."""
    return max(sum(pass_count(trained, ranks, tsp, f, fragments, r, sp) for f in range(fragments))
               for r in range(ranks))


# ---------------------------------------------------------------------------- checkpoints (DCP)

def _dcp_state(policy: object) -> dict[str, object]:
    """This rank's view of the trained state (model shards + optimizer state by parameter name)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(ignore_frozen_params=True)
    if getattr(policy, "host", None) is not None:  # model.offload = "optimizer": its host shards
        return {"model": get_model_state_dict(policy.model.transformer, options=options),  # type: ignore[attr-defined]
                "optim": policy.sharded_host_state()}  # type: ignore[attr-defined]
    model_sd, optim_sd = get_state_dict(policy.model.transformer, policy.optimizer,  # type: ignore[attr-defined]
                                        options=options)
    return {"model": model_sd, "optim": optim_sd}


def save_sharded(folder: str | Path, policy: object) -> None:
    """torch.distributed.checkpoint: every rank writes its own shard of the weights and of the
    optimizer state (``__<rank>_0.distcp``), rank 0 the metadata; nothing is gathered. A
    collective: every trainer rank calls it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(policy), checkpoint_id=str(folder))


def load_sharded(folder: str | Path, policy: object) -> None:
    """Load a :func:`save_sharded` checkpoint into ``policy`` whatever its rank count: a sharded
    policy reads the parts of the shards it now owns (resharding); an unsharded one (a single
    trainer) takes whole tensors. Sharded: a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    host = getattr(policy, "host", None)
    if not getattr(policy, "sharded", False) and (getattr(policy, "has_masters", False) or host is not None):
        # an unsharded policy keeping masters apart from the module's parameters
        _load_into_masters(folder, policy)
        return
    state = _dcp_state(policy)
    dcp.load(state, checkpoint_id=str(folder))
    # not strict: ``state`` is this model's own trained keys (dcp.load fails on any the
    # checkpoint lacks), and the frozen weights a two-expert model's root holds are not in it
    if host is not None:  # the optimizer's host shards were loaded in place
        set_model_state_dict(policy.model.transformer, state["model"],  # type: ignore[attr-defined,arg-type]
                             options=StateDictOptions(ignore_frozen_params=True, strict=False))
        host.refresh()
        return
    set_state_dict(policy.model.transformer, policy.optimizer,  # type: ignore[attr-defined]
                   model_state_dict=state["model"], optim_state_dict=state["optim"],  # type: ignore[arg-type]
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))


def whole_state(folder: str | Path) -> dict[str, Any]:
    """A :func:`save_sharded` checkpoint read whole in this process (no process group):
    ``{"model": {fqn: tensor}, "optim": {...}}``, the shards stitched back together."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(folder), str(whole))
        state: dict[str, Any] = torch.load(whole, map_location="cpu", weights_only=True)
    return state


def sync_keys_of(state: dict[str, Any], lora: bool) -> dict[str, str]:
    """Module parameter name -> the sync state's key (peft's LoRA keys drop the adapter name)."""
    return {fqn: (fqn.replace(".default", "") if lora else fqn) for fqn in state["model"]}


def _load_into_masters(folder: str | Path, policy: Any) -> None:
    """A single trainer with float32 masters apart from the module (a low-precision module, or
    model.offload = "optimizer"; rl/policy.py): the checkpoint's whole tensors become the
    masters (and their rounding the module), its optimizer state, keyed by parameter name,
    the masters' state. Buffers the checkpoint holds (positional tables) are loaded too; what
    it does not hold keeps its value."""
    state = whole_state(folder)
    to_key = sync_keys_of(state, bool(getattr(policy.model, "lora_rank", 0)))
    masters = policy._master_keys()  # sync key -> index in policy.masters
    missing = sorted(set(masters) - set(to_key.values()))
    if missing:
        raise ValueError(f"checkpoint {folder}: no tensor for {missing[:3]} ({len(missing)} in all)")
    sd = policy.state_dict_for_sync()
    sd.update({key: state["model"][fqn] for fqn, key in to_key.items() if key in sd})
    policy.load_sync_state(sd)
    index_of = {fqn: masters[key] for fqn, key in to_key.items() if key in masters}
    optim = state["optim"]
    # a trainer rank holding one of two experts (rl/experts.py) takes its expert's entries only
    policy.optimizer.load_state_dict({
        "state": {index_of[fqn]: s for fqn, s in optim["state"].items() if fqn in index_of},
        "param_groups": [{**g, "params": [index_of[fqn] for fqn in g["params"] if fqn in index_of]}
                         for g in optim["param_groups"]]})
