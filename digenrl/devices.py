"""Which device a process computes on, and the process-group backend that goes with it.

Every node (rollout, trainer rank, reward worker, colocated rank) takes its device from, in order:

1. ``--device`` (``cpu``, ``cuda``, ``cuda:N``), what ``digenrl launch`` passes each child;
2. ``LOCAL_RANK`` (torchrun, Slurm, Kubernetes launchers): ``cuda:LOCAL_RANK`` mod the GPUs
   this process sees;
3. the first visible GPU (``CUDA_VISIBLE_DEVICES`` narrows what is visible);
4. the CPU when no GPU is visible.

Process groups use NCCL on CUDA devices and gloo on the CPU. ``digenrl launch`` gives each
child a contiguous slice of the GPUs it sees (``CUDA_VISIBLE_DEVICES``, :func:`child_gpu_envs`)
in order, trainer ranks first (one GPU each), then rollouts (``cluster.rollout_gpus`` each), then
reward workers (one each), and wraps around when there are more processes than GPUs, so a
one-GPU machine runs every role on that GPU. By hand, give each ``digenrl-node`` its GPUs the
same way (or ``--device cuda:N``). A rollout node over N devices (``--gpus N`` or
``cluster.rollout_gpus = N``) computes on its own device ``cuda:i`` and its followers on the
next N - 1 it sees (:func:`group_devices`); on the CPU all N processes share the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
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


def _visible(env: Mapping[str, str], gpus: int) -> list[str]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` entries its children can be given."""
    from digenrl.telemetry.nvml import visible_devices

    listed = visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    return [str(d) for d in listed] if listed else [str(i) for i in range(gpus)]


def child_gpu_envs(widths: Sequence[int], env: Mapping[str, str] | None = None,
                   gpus: int | None = None) -> list[dict[str, str]]:
    """Environments for the children of a local launch, in the order they take GPUs, the
    ``i``-th computing on ``widths[i]`` devices: each a contiguous slice of the GPUs this
    process sees (``CUDA_VISIBLE_DEVICES``), starting where the previous child's ended and
    wrapping around the end of the list (more devices asked than there are: children share
    them), so that a child computes on its ``cuda:0`` (and a rollout group's followers on its
    ``cuda:1`` ...); ``{}`` each without GPUs. A child wider than the whole list is a
    ConfigError (its slice would name a GPU twice)."""
    env = os.environ if env is None else env
    gpus = cuda_count() if gpus is None else gpus
    if gpus == 0:
        return [{} for _ in widths]
    devices = _visible(env, gpus)
    widest = max(widths, default=1)
    if widest > len(devices):
        raise ConfigError(f"a node over {widest} devices: this launch sees {len(devices)} GPU(s) "
                          f"({','.join(devices)}); expected at most {len(devices)} per node")
    out, first = [], 0
    for w in widths:
        out.append({"CUDA_VISIBLE_DEVICES": ",".join(devices[(first + k) % len(devices)] for k in range(w))})
        first += w
    return out


def child_gpu_env(index: int, env: Mapping[str, str] | None = None, gpus: int | None = None) -> dict[str, str]:
    """Environment for the ``index``-th of a local launch's one-GPU children
    (:func:`child_gpu_envs` of widths 1)."""
    return child_gpu_envs([1] * (index + 1), env, gpus)[index]


def group_devices(leader: torch.device, n: int, what: str, gpus: int | None = None) -> list[torch.device]:
    """The devices of a rollout group of ``n`` processes whose leader computes on ``leader``,
    rank by rank: on the CPU, the CPU ``n`` times; on CUDA, ``cuda:i`` (the leader's) and the
    next ``n - 1`` devices this process sees (follower ``r`` on ``cuda:i+r``). ConfigError,
    naming ``what`` (``--gpus 2``, ``cluster.rollout_gpus = 2``) and the visible count, when
    this process does not see them."""
    if leader.type != "cuda":
        return [leader] * n
    gpus = cuda_count() if gpus is None else gpus
    i = leader.index or 0
    if i + n > gpus:
        where = f"cuda:{i}..cuda:{i + n - 1}" if n > 1 else f"cuda:{i}"
        raise ConfigError(f"{what}: this process sees {gpus} CUDA device(s); a rollout over {n} "
                          f"devices from its own (cuda:{i}) needs {where}")
    return [torch.device("cuda", i + r) for r in range(n)]


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
