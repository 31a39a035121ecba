"""A rollout node over N processes (``cluster.rollout_gpus = N``, or ``digenrl-node --role rollout
--gpus N`` for one node): each trajectory's forward passes are split N ways by sequence
parallelism.

The node process is the group's leader: it keeps the sockets, the sampler, the rewards and
the weights, and samples through a :class:`~digenrl.models.spgroup.LeaderModel`. At start it
launches ``N - 1`` follower processes (``python -m digenrl.actors.rolloutgroup``), each of
which builds the same model (same config, same seed), joins the group's process group (gloo
on the CPU, NCCL on GPUs: the leader on its own device ``cuda:i``, follower ``r`` on
``cuda:i+r``, :func:`~digenrl.devices.group_devices`) and serves the leader's forward passes
and weight loads (:func:`~digenrl.models.spgroup.serve`) until the leader stops it.

A follower that dies fails the leader's next collective, and so the node (the launcher
restarts it with fresh followers). A leader that exits, however it exits (SIGKILL included),
takes its followers with it: on Linux each asks the kernel at start for SIGKILL when its
parent goes (``PR_SET_PDEATHSIG``, :func:`die_with_parent`); elsewhere a follower exits when
the group's connections close, which a follower still waiting to join does not see.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from digenrl.config import ConfigError, ResolvedConfig, read_resolved, to_toml


def with_group_size(cfg: ResolvedConfig, n: int, what: str) -> ResolvedConfig:
    """``cfg`` for a rollout node over ``n`` processes (``--gpus N`` overrides the run's
    ``cluster.rollout_gpus`` for this node alone): checked as the launcher checks that key
    (the config's own rules, then the model's heads and tokens); ConfigError naming ``what``."""
    import dataclasses

    from digenrl.models.meta import check_sequence_parallel_degree

    try:
        # read back, so the config's own rules see the new size (a mode fixes no part of it)
        out = read_resolved(to_toml(cfg.replace(cluster=dataclasses.replace(cfg.cluster, rollout_gpus=n))), "the run's config")
        if n > 1:
            check_sequence_parallel_degree(out.model, n, "cluster.rollout_gpus")
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None
    return out


class RolloutGroup:
    """The leader's side: the followers' processes and the model that drives them."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], devices: list[torch.device], init: str) -> None:
        self.procs = procs
        self.devices = devices
        self.init = init
        self.leader: Any = None
        """the :class:`~digenrl.models.spgroup.LeaderModel`, once :meth:`join` returned"""

    @classmethod
    def spawn(cls, cfg: ResolvedConfig, devices: list[torch.device], *, folder: Path,
              node_id: str) -> RolloutGroup:
        """Launch a follower for each of ``devices[1:]`` (the leader computes on ``devices[0]``:
        :func:`~digenrl.devices.group_devices`); ``folder`` gets their config and logs.

        Call it from the thread that lives as long as the node (its main thread): the
        followers' parent-death signal fires when the *thread* that started them ends."""
        from digenrl.transport.endpoints import free_port

        folder.mkdir(parents=True, exist_ok=True)
        config = folder / f"{node_id}-group.toml"
        config.write_text(to_toml(cfg))
        init = f"tcp://127.0.0.1:{free_port()}"
        n = len(devices)
        procs = []
        for r in range(1, n):
            log = open(folder / f"{node_id}-follower-{r}.stderr", "wb")  # noqa: SIM115 - the child owns it
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "digenrl.actors.rolloutgroup", str(config), str(r), str(n), init,
                 str(devices[r]), str(os.getpid())], stdout=log, stderr=log))
            log.close()
        return cls(procs, devices, init)

    def join(self, model: Any) -> Any:
        """Join the group as rank 0 with ``model`` (built on ``devices[0]``); blocks until every
        follower has joined; returns the :class:`~digenrl.models.spgroup.LeaderModel`."""
        import torch.distributed as dist

        from digenrl.devices import init_process_group
        from digenrl.models.spgroup import LeaderModel

        init_process_group(self.devices[0], init_method=self.init, rank=0, world_size=len(self.devices))
        world = dist.group.WORLD
        assert world is not None  # initialised just above
        self.leader = LeaderModel(model, world)
        return self.leader

    def close(self, timeout_s: float = 30.0) -> list[int]:
        """Stop the followers (they leave their serve loop) and the group; their exit codes."""
        import torch.distributed as dist

        if self.leader is not None:
            self.leader.stop()
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=timeout_s))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        if dist.is_initialized():
            dist.destroy_process_group()
        return codes


PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when its parent (thread) ends (linux/prctl.h)."""


def die_with_parent(parent: int) -> bool:
    """On Linux, have the kernel SIGKILL this process when ``parent`` (the leader, whose pid
    the follower was given) ends; a parent already gone exits now. False (nothing done)
    elsewhere, where a follower outlives a leader that was killed before its group formed."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent:  # it died before the call above: no signal will come
        print(f"follower: the leader (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)
    return True


def follow(config: Path, rank: int, world: int, init: str, device_name: str) -> int:
    """A follower's life: build the model, join the group, serve until the leader stops;
    returns the forward passes served."""
    import torch.distributed as dist

    from digenrl.devices import init_process_group
    from digenrl.models import build_model
    from digenrl.models.spgroup import serve

    cfg = read_resolved(config.read_text(), str(config))
    torch.set_num_threads(cfg.run.threads)
    device = torch.device(device_name)
    model = build_model(cfg.model, seed=cfg.run.seed, device=device,
                        embedded_guidance=cfg.sampler.embedded_guidance)
    print(f"follower {rank}: model built on {device}, joining the group", file=sys.stderr, flush=True)
    init_process_group(device, init_method=init, rank=rank, world_size=world)
    everyone = dist.group.WORLD
    assert everyone is not None  # initialised just above
    served = serve(model, everyone)
    dist.destroy_process_group()
    return served


if __name__ == "__main__":
    path, rank_, world_, init_, device_, leader_ = sys.argv[1:7]
    die_with_parent(int(leader_))
    n_served = follow(Path(path), int(rank_), int(world_), init_, device_)
    print(f"follower {rank_}: served {n_served} forward passes", file=sys.stderr)
