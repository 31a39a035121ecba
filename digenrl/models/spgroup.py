"""One model over the N processes of a sequence-parallel group, driven by one of them.

A generating node (a rollout) calls a model as a :class:`~digenrl.models.base.FlowModel` from
one process. :class:`LeaderModel` is that model over an SP group: the *leader* (group rank 0)
holds it and calls it as usual; every transformer evaluation is first broadcast to the
*followers* (the other ranks, running :func:`serve`), then all ranks run the sharded forward
(:mod:`digenrl.models.seqpar`) together, each carrying ``1/N`` of the image/video tokens, and
every rank gets the whole velocity. Weight loads (:meth:`LeaderModel.load_sync_state_dict`)
and the adapter switch of a base-model tail (:meth:`LeaderModel.adapter_disabled`) reach the
followers the same way, so their weights and adapter state stay the leader's. Prompt
encoding and decoding run on the leader alone.

What goes over the group for each call: a header (``broadcast_object_list``: the operation,
tensor names, shapes, dtypes) and the tensors (``broadcast``), on the model's device (gloo on
CPU, NCCL on GPUs).

A rollout node with ``cluster.rollout_gpus > 1`` starts the followers and drives them
(:mod:`digenrl.actors.rolloutgroup`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from digenrl.models.base import Cond
from digenrl.models.seqpar import SequenceParallel, enable_sequence_parallel

VELOCITY, LOAD, STOP = "velocity", "load", "stop"


def _broadcast(op: str, flags: dict[str, Any], tensors: dict[str, torch.Tensor],
               group: dist.ProcessGroup, src: int) -> None:
    header: list[Any] = [op, flags, {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}]
    dist.broadcast_object_list(header, src=src, group=group)
    for k in sorted(tensors):
        dist.broadcast(tensors[k].contiguous(), src=src, group=group)


def _receive(group: dist.ProcessGroup, src: int,
             device: torch.device) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    header: list[Any] = [None, None, None]
    dist.broadcast_object_list(header, src=src, group=group)
    op, flags, specs = header
    tensors = {}
    for k in sorted(specs):
        shape, dtype = specs[k]
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=src, group=group)
        tensors[k] = t
    return op, flags, tensors


class LeaderModel:
    """``model`` (a :class:`~digenrl.models.adapter.DiffusersFlowModel`) run over ``group``,
    of which this process is rank 0; the other ranks run :func:`serve` on their own copy of
    the same model. Anything not overridden here is the model's own."""

    def __init__(self, model: Any, group: dist.ProcessGroup) -> None:
        if dist.get_rank(group) != 0:
            raise ValueError("LeaderModel: this process is not the group's rank 0 (run serve())")
        self.model = model
        self.group = group
        self.src = dist.get_global_rank(group, 0)
        self.sp: SequenceParallel = enable_sequence_parallel(model, group)
        self._adapter_off = False
        self.evaluations = 0
        """velocity calls the group has run"""

    def __getattr__(self, name: str) -> Any:  # family, latent_shape, encode_prompts, decode, ...
        return getattr(self.model, name)

    @property
    def transformer(self) -> torch.nn.Module:
        module: torch.nn.Module = self.model.transformer
        return module

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Cond) -> torch.Tensor:
        """The model's velocity, computed by the whole group (see the module doc); for
        generation: the followers keep no graph, so there is no backward through it."""
        if torch.is_grad_enabled():
            raise ValueError("LeaderModel.velocity: generation only; call it under torch.no_grad()")
        sigma_B = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(x.shape[0]).contiguous()
        _broadcast(VELOCITY, {"adapter_off": self._adapter_off},
                   {"x": x, "sigma": sigma_B, **{"cond." + k: v for k, v in cond.items()}},
                   self.group, self.src)
        with self.sp.active():
            out: torch.Tensor = self.model.velocity(x, sigma_B, cond)
        self.evaluations += 1
        return out

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """The base model (LoRA off) on every rank, for the calls inside the block."""
        with self.model.adapter_disabled():
            self._adapter_off = True
            try:
                yield
            finally:
                self._adapter_off = False

    def load_sync_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load new weights here and on every follower."""
        self.model.load_sync_state_dict(sd)  # checked here first: a bad state never reaches them
        _broadcast(LOAD, {}, {k: v.to(self.model.device) for k, v in sd.items()}, self.group, self.src)

    def stop(self) -> None:
        """Let the followers' :func:`serve` return."""
        _broadcast(STOP, {}, {}, self.group, self.src)


def serve(model: Any, group: dist.ProcessGroup) -> int:
    """A follower: mirror the group leader's :class:`LeaderModel` calls on ``model`` (the same
    model, built the same way) until it stops; returns the evaluations served."""
    sp = enable_sequence_parallel(model, group)
    src = dist.get_global_rank(group, 0)
    served = 0
    while True:
        op, flags, tensors = _receive(group, src, model.device)
        if op == STOP:
            return served
        if op == LOAD:
            model.load_sync_state_dict(tensors)
            continue
        if op != VELOCITY:
            raise ValueError(f"sequence-parallel follower: unknown operation {op!r} from the leader")
        cond = {k[len("cond."):]: v for k, v in tensors.items() if k.startswith("cond.")}
        off = model.adapter_disabled() if flags["adapter_off"] else contextlib.nullcontext()
        with torch.no_grad(), off, sp.active():
            model.velocity(tensors["x"], tensors["sigma"], cond)
        served += 1
