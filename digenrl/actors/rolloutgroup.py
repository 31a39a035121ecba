"""A rollout node over N processes (``cluster.rollout_gpus = N``): each trajectory's forward
passes are split N ways by sequence parallelism.

The node process is the group's leader: it keeps the sockets, the sampler, the rewards and
the weights, and samples through a :class:`~digenrl.models.spgroup.LeaderModel`. At start it
launches ``N - 1`` follower processes (``python -m digenrl.actors.rolloutgroup``), each of
which builds the same model (same config, same seed), joins the group's process group (gloo
on the CPU, NCCL on GPUs: follower ``r`` on the node's ``cuda:r``) and serves the leader's
forward passes and weight loads (:func:`~digenrl.models.spgroup.serve`) until the leader
stops it. A follower that dies fails the leader's next collective, and so the node (the
launcher restarts it with fresh followers); a leader that dies closes the group's
connections, and its followers exit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from digenrl.config import ResolvedConfig, to_toml


class RolloutGroup:
    """The leader's side: the followers' processes and the model that drives them."""

    def __init__(self, leader: Any, procs: list[subprocess.Popen[bytes]]) -> None:
        self.leader = leader
        self.procs = procs

    @classmethod
    def start(cls, cfg: ResolvedConfig, model: Any, device: torch.device, *, folder: Path,
              node_id: str) -> RolloutGroup:
        """Launch the followers, join the group as rank 0; ``folder`` gets the followers'
        config and logs. Blocks until every follower has joined."""
        import torch.distributed as dist

        from digenrl.devices import init_process_group
        from digenrl.models.spgroup import LeaderModel
        from digenrl.transport.endpoints import free_port

        n = cfg.cluster.rollout_gpus
        if device.type == "cuda" and torch.cuda.device_count() < n:
            raise ValueError(f"cluster.rollout_gpus = {n}: this rollout node sees "
                             f"{torch.cuda.device_count()} CUDA device(s)")
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / f"{node_id}-group.toml"
        config.write_text(to_toml(cfg))
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = []
        for r in range(1, n):
            follower_device = f"cuda:{r}" if device.type == "cuda" else "cpu"
            log = open(folder / f"{node_id}-follower-{r}.stderr", "wb")  # noqa: SIM115 - the child owns it
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "digenrl.actors.rolloutgroup", str(config), str(r), str(n), init,
                 follower_device], stdout=log, stderr=log))
        init_process_group(device, init_method=init, rank=0, world_size=n)
        world = dist.group.WORLD
        assert world is not None  # initialised just above
        return cls(LeaderModel(model, world), procs)

    def close(self, timeout_s: float = 30.0) -> list[int]:
        """Stop the followers (they leave their serve loop) and the group; their exit codes."""
        import torch.distributed as dist

        self.leader.stop()
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=timeout_s))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        dist.destroy_process_group()
        return codes


def follow(config: Path, rank: int, world: int, init: str, device_name: str) -> int:
    """A follower's life: build the model, join the group, serve until the leader stops;
    returns the forward passes served."""
    import torch.distributed as dist

    from digenrl.config import read_resolved
    from digenrl.devices import init_process_group
    from digenrl.models import build_model
    from digenrl.models.spgroup import serve

    cfg = read_resolved(config.read_text(), str(config))
    torch.set_num_threads(cfg.run.threads)
    device = torch.device(device_name)
    model = build_model(cfg.model, seed=cfg.run.seed, device=device,
                        embedded_guidance=cfg.sampler.embedded_guidance)
    init_process_group(device, init_method=init, rank=rank, world_size=world)
    everyone = dist.group.WORLD
    assert everyone is not None  # initialised just above
    served = serve(model, everyone)
    dist.destroy_process_group()
    return served


if __name__ == "__main__":
    path, rank_, world_, init_, device_ = sys.argv[1:6]
    n_served = follow(Path(path), int(rank_), int(world_), init_, device_)
    print(f"follower {rank_}: served {n_served} forward passes", file=sys.stderr)
