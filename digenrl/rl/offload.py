"""``model.offload = "optimizer"``: the optimizer's float32 masters and AdamW state on the host.

The trained parameters stay on the device in the model's compute dtype and so do their
gradients (float32: a bf16 model's gradients are accumulated into float32 device buffers, as
without offload). The host holds, per trained parameter, its float32 *master* (the value the
optimizer updates), AdamW's ``exp_avg`` and ``exp_avg_sq`` and a staging buffer for its
gradient. One step::

    device grads --copy (non_blocking, into pinned staging)--> host     # one stream sync
    AdamW.step() on the host masters                                     # CPU
    host masters --copy (non_blocking, from pinned memory)--> device params (cast to their dtype)

Device memory per trained parameter: the parameter (2 B in bf16, 4 B in float32) and its
float32 gradient (4 B), against 2 + 4 (master) + 4 (gradient) + 8 (AdamW) = 18 B in bf16
without offload. The masters and staging buffers cross PCIe every step and are pinned on a
GPU node; AdamW's moments never leave the host and stay in ordinary (pageable) memory.

The copies run on the current stream: the step cannot start before every gradient has
arrived, and the next forward needs every updated parameter, so a side stream would overlap
nothing. The copy back is not waited for; a host write to the masters (the next step, a
weight load) waits for it first (:meth:`HostMasters.wait`).

Sharded (``model.fsdp``): the module's float32 shards are the masters (the trained parameters
are float32 under FSDP2) and stay on the device with their gradients; the host holds a float32
copy of this rank's shards, the values AdamW updates, and AdamW's moments. Device memory per
trained parameter and rank: 8 B / W instead of 16 B / W. The sharded checkpoint writes the
host moments as DTensors in the layout of ``get_optimizer_state_dict`` (by parameter name), so
a checkpoint written with offload resumes without it and the other way round, on any rank
count (:meth:`~digenrl.rl.policy.Policy.sharded_host_state`).

On a CPU-only machine the same code runs with the CUDA parts off: the masters are separate
CPU tensors, nothing is pinned, and the copies are plain copies. There the step computes
what the step without offload computes, bit for bit: the same gradients, clipped by the same
kernels, then the same (CPU) AdamW kernels on the same float32 values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def grad_leaf(like: torch.Tensor) -> torch.Tensor:
    """A float32 leaf of ``like``'s shape on its device that only carries a ``.grad``: its
    values are one broadcast scalar (no storage beyond 4 bytes). It stands where a device
    float32 master would otherwise receive a bf16 parameter's gradient."""
    leaf = torch.zeros((), dtype=torch.float32, device=like.device).expand(like.shape)
    return leaf.requires_grad_(True)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (FSDP2), else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class HostMasters:
    """Float32 host copies of ``device_params`` (the model's trained tensors, any float dtype;
    of a sharded model, this rank's shards) for an optimizer to update, with pinned staging
    for the gradients; see the module docstring."""

    def __init__(self, device_params: Sequence[torch.Tensor]) -> None:
        self.device_params = list(device_params)
        with torch.no_grad():
            local = [_local(p.detach()) for p in self.device_params]
            self.device = local[0].device
            self.pinned = self.device.type == "cuda"
            #: the float32 values the optimizer updates, in ``device_params``' order
            self.masters = [self._host_like(t).copy_(t) for t in local]
        self._staging = [self._host_like(t) for t in local]
        self._copied: torch.cuda.Event | None = None

    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=torch.float32, device="cpu", pin_memory=self.pinned)

    def wait(self) -> None:
        """Block until the last copy to the device has read the masters (before writing them)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def pull_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Each master's ``.grad`` := its device gradient (None stays None), via the staging
        buffers; returns once they are on the host."""
        self.wait()
        with torch.no_grad():
            for master, buf, g in zip(self.masters, self._staging, grads, strict=True):
                if g is None:
                    master.grad = None
                    continue
                buf.copy_(_local(g.detach()), non_blocking=self.pinned)
                master.grad = buf
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()

    @torch.no_grad()
    def push(self) -> None:
        """Copy the masters into the device parameters (rounded to their dtype), not waited for."""
        for p, master in zip(self.device_params, self.masters, strict=True):
            _local(p).copy_(master, non_blocking=self.pinned)
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))

    @torch.no_grad()
    def refresh(self) -> None:
        """The masters := the device parameters (after weights were loaded into the model)."""
        self.wait()
        for p, master in zip(self.device_params, self.masters, strict=True):
            master.copy_(_local(p))

    def init_state(self, optimizer: torch.optim.Optimizer) -> None:
        """AdamW's state for every master that has none yet (zeros, step 0): what the first step
        would create, so that a checkpoint can be loaded into it in place."""
        for m in self.masters:
            if not optimizer.state[m]:
                optimizer.state[m] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m),
                                      "exp_avg_sq": torch.zeros_like(m)}
