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


class HostMasters:
    """Float32 host copies of ``device_params`` (the model's trained tensors, any float dtype)
    for an optimizer to update, with pinned staging for the gradients; see the module
    docstring."""

    def __init__(self, device_params: Sequence[torch.Tensor]) -> None:
        self.device_params = list(device_params)
        self.pinned = any(p.is_cuda for p in self.device_params)
        with torch.no_grad():
            #: the float32 values the optimizer updates, in ``device_params``' order
            self.masters = [self._host_like(p).copy_(p.detach()) for p in self.device_params]
        self._staging = [self._host_like(p) for p in self.device_params]
        self._copied: torch.cuda.Event | None = None

    def _host_like(self, p: torch.Tensor) -> torch.Tensor:
        return torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=self.pinned)

    def wait(self) -> None:
        """Block until the last copy to the device has read the masters (before writing them)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def pull_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Each master's ``.grad`` := its device gradient (None stays None), via the staging
        buffers; returns once they are on the host."""
        self.wait()
        for master, buf, g in zip(self.masters, self._staging, grads, strict=True):
            if g is None:
                master.grad = None
                continue
            buf.copy_(g.detach(), non_blocking=self.pinned)
            master.grad = buf
        if self.pinned:
            torch.cuda.current_stream(self.device_params[0].device).synchronize()

    @torch.no_grad()
    def push(self) -> None:
        """Copy the masters into the device parameters (rounded to their dtype), not waited for."""
        for p, master in zip(self.device_params, self.masters, strict=True):
            p.copy_(master, non_blocking=self.pinned)
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device_params[0].device))
