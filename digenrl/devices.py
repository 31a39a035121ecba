"""Which device a process computes on, and the process-group backend that goes with it.

Every node (rollout, trainer rank, reward worker, colocated rank) takes its device from, in order:

1. ``--device`` (``cpu``, ``cuda``, ``cuda:N``), what ``digenrl launch`` passes each child;
2. ``LOCAL_RANK`` (torchrun, Slurm, Kubernetes launchers): ``cuda:LOCAL_RANK`` mod the GPUs
   this process sees;
3. the first visible GPU (``CUDA_VISIBLE_DEVICES`` narrows what is visible);
4. the CPU when no GPU is visible.

Process groups use NCCL on CUDA devices and gloo on the CPU. ``digenrl launch`` gives each
child one GPU (``CUDA_VISIBLE_DEVICES``) in order, trainer ranks first, then rollouts, then reward
workers, and wraps around when there are more processes than GPUs, so a one-GPU machine runs every role on
that GPU. By hand, give each ``digenrl-node`` one GPU the same way (or ``--device cuda:N``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from digenrl.config import ConfigError


def cuda_count() -> int:
    """GPUs this process sees (0 without a CUDA build or driver)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(flag: str | None = None, env: Mapping[str, str] | None = None,
                   gpus: int | None = None) -> torch.device:
    """The device of this process (see the module doc); a bad ``--device`` is a ConfigError."""
    env = os.environ if env is None else env
    gpus = cuda_count() if gpus is None else gpus
    if flag:
        try:
            device = torch.device(flag)
        except RuntimeError:
            raise ConfigError(f"--device {flag!r}: expected cpu, cuda or cuda:N") from None
        if device.type == "cpu":
            return device
        if device.type != "cuda":
            raise ConfigError(f"--device {flag!r}: expected cpu, cuda or cuda:N")
        if gpus == 0:
            raise ConfigError(f"--device {flag!r}: this process sees no CUDA device "
                              f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})")
        index = 0 if device.index is None else device.index
        if index >= gpus:
            raise ConfigError(f"--device {flag!r}: this process sees {gpus} CUDA device(s) "
                              f"(cuda:0..cuda:{gpus - 1})")
        return torch.device("cuda", index)
    if gpus == 0:
        return torch.device("cpu")
    local = env.get("LOCAL_RANK", "")
    if local:
        try:
            return torch.device("cuda", int(local) % gpus)
        except ValueError:
            raise ConfigError(f"LOCAL_RANK={local!r}: expected an integer") from None
    return torch.device("cuda", 0)


def child_gpu_env(index: int, env: Mapping[str, str] | None = None, gpus: int | None = None) -> dict[str, str]:
    """Environment for the ``index``-th child process of a local launch: one GPU of those this
    process sees, round-robin (``CUDA_VISIBLE_DEVICES``), so the child computes on its
    ``cuda:0`` from every thread; ``{}`` without GPUs."""
    from digenrl.telemetry.nvml import visible_devices

    env = os.environ if env is None else env
    gpus = cuda_count() if gpus is None else gpus
    if gpus == 0:
        return {}
    listed = visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    devices = [str(d) for d in listed] if listed else [str(i) for i in range(gpus)]
    return {"CUDA_VISIBLE_DEVICES": devices[index % len(devices)]}


def backend_for(device: torch.device) -> str:
    """``nccl`` on CUDA devices, ``gloo`` on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (collectives and caches use it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def init_process_group(device: torch.device, *, init_method: str, rank: int, world_size: int) -> None:
    """The default process group over ``world_size`` ranks, NCCL or gloo by ``device``."""
    import torch.distributed as dist

    use_device(device)
    kw: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank,
                            world_size=world_size, **kw)


def host(t: torch.Tensor) -> torch.Tensor:
    """A host (CPU) copy of ``t``, detached; never the same storage, also on the CPU."""
    return t.detach().to("cpu", copy=True)
