"""``digenrl-node --from-env``: where this process sits in a cluster job, from the launcher's variables.

A job started by Slurm (``srun``), torchrun or Kubernetes already says which task this is, how
many there are and which host comes first. :func:`read_env` reads that (first match wins):

* ``DIGENRL_RANK`` / ``DIGENRL_WORLD_SIZE`` / ``DIGENRL_LOCAL_RANK`` / ``DIGENRL_COORDINATOR``:
  explicit, for anything else (and to override one value of the others);
* Slurm: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
  ``SLURM_JOB_NUM_NODES``, ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST`` /
  ``SLURM_NODELIST``: its first host runs the coordinator), ``SLURM_STEP_TASKS_PER_NODE``;
* torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
  ``MASTER_ADDR``;
* Kubernetes: ``JOB_COMPLETION_INDEX`` (an Indexed Job or a JobSet's pod) or the ordinal of a
  StatefulSet pod's host name (``name-3``), with ``DIGENRL_WORLD_SIZE`` and
  ``DIGENRL_COORDINATOR`` (the coordinator's Service) from the manifest.

:func:`plan` turns that into the processes this task starts: one node per local GPU (each
with ``CUDA_VISIBLE_DEVICES`` naming its GPU), the role following from the global rank (the
first ``trainers`` ranks train, the rest generate, unless a role is given), and on global
rank 0 also the coordinator, bound on this host (see docs/deployment.md for where trainer
ranks must run). Nothing here imports beyond the standard
library; bad or missing variables raise :class:`EnvError`, one line naming the variable.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ROLES = ("trainer", "rollout", "reward")


class EnvError(ValueError):
    """A launcher variable is missing or malformed (the message names it)."""


@dataclass(frozen=True)
class ClusterEnv:
    """This task's place: ``rank`` of ``world`` tasks, ``local_rank`` of ``local_world`` on
    node ``node_rank``; ``coordinator_host``: the first host (or a given endpoint's host)."""

    source: str          # "digenrl", "slurm", "torchrun" or "kubernetes"
    rank: int
    world: int
    local_rank: int
    local_world: int
    node_rank: int
    coordinator_host: str
    coordinator: str = ""  # a whole endpoint when the environment names one


@dataclass(frozen=True)
class Launch:
    """One process to start: ``argv`` for ``digenrl-node`` and the environment it adds."""

    role: str
    rank: int            # global rank among the job's GPU processes (-1: the coordinator)
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]


def expand_hostlist(text: str) -> list[str]:
    """A Slurm host list (``gpu[01-03,07],login1``) as host names, in order."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?(?:,|$)", text.strip()):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise EnvError(f"Slurm host list {text!r}: range {item!r} is not N or N-M")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}")
    if not hosts:
        raise EnvError(f"Slurm host list {text!r}: no host in it")
    return hosts


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise EnvError(f"{name} is not set")
        return default
    first = raw.split("(")[0].split(",")[0]  # SLURM_STEP_TASKS_PER_NODE: "8(x2)" or "8,4"
    if not first.strip().isdigit():
        raise EnvError(f"{name} = {raw!r}: expected a non-negative integer")
    return int(first)


def read_env(env: Mapping[str, str], hostname: str | None = None) -> ClusterEnv:
    """This task's :class:`ClusterEnv` from ``env`` (EnvError if no launcher is recognised)."""
    hostname = hostname or socket.gethostname()
    if "SLURM_PROCID" in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodes:
            raise EnvError("SLURM_PROCID is set but SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is not")
        world = _int(env, "SLURM_NTASKS", _int(env, "SLURM_NPROCS", 1))
        n_nodes = _int(env, "SLURM_JOB_NUM_NODES", _int(env, "SLURM_NNODES", 1))
        found = ClusterEnv("slurm", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", 0),
                           _int(env, "SLURM_STEP_TASKS_PER_NODE", max(1, world // max(1, n_nodes))),
                           _int(env, "SLURM_NODEID", 0), expand_hostlist(nodes)[0])
    elif "RANK" in env and "WORLD_SIZE" in env:
        if not env.get("MASTER_ADDR"):
            raise EnvError("RANK and WORLD_SIZE are set (torchrun) but MASTER_ADDR is not")
        found = ClusterEnv("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK", 0),
                           _int(env, "LOCAL_WORLD_SIZE", 1), _int(env, "GROUP_RANK", 0), env["MASTER_ADDR"])
    elif "JOB_COMPLETION_INDEX" in env or "KUBERNETES_SERVICE_HOST" in env:
        if "JOB_COMPLETION_INDEX" in env:
            rank = _int(env, "JOB_COMPLETION_INDEX")
        else:
            m = re.search(r"-(\d+)$", hostname)
            if m is None:
                raise EnvError(f"host name {hostname!r} has no StatefulSet ordinal (-N) and "
                               "JOB_COMPLETION_INDEX is not set")
            rank = int(m.group(1))
        found = ClusterEnv("kubernetes", rank, _int(env, "DIGENRL_WORLD_SIZE", rank + 1), 0, 1, rank, "")
    elif "DIGENRL_RANK" in env:
        found = ClusterEnv("digenrl", _int(env, "DIGENRL_RANK"), _int(env, "DIGENRL_WORLD_SIZE"), 0, 1, 0, "")
    else:
        raise EnvError("--from-env: no launcher variables (SLURM_PROCID, torchrun's RANK/WORLD_SIZE/"
                       "MASTER_ADDR, Kubernetes' JOB_COMPLETION_INDEX, or DIGENRL_RANK/DIGENRL_WORLD_SIZE)")
    over = {k: _int(env, f"DIGENRL_{k.upper()}") for k in ("rank", "world_size", "local_rank")
            if env.get(f"DIGENRL_{k.upper()}")}
    found = ClusterEnv(found.source, over.get("rank", found.rank), over.get("world_size", found.world),
                       over.get("local_rank", found.local_rank), found.local_world, found.node_rank,
                       found.coordinator_host, env.get("DIGENRL_COORDINATOR", ""))
    if not 0 <= found.rank < found.world:
        raise EnvError(f"{found.source}: rank {found.rank} is not below the world size {found.world}")
    if not found.coordinator and not found.coordinator_host:
        raise EnvError("DIGENRL_COORDINATOR is not set (the coordinator's endpoint, e.g. "
                       "tcp://digenrl-coordinator:5555)")
    return found


def plan(ce: ClusterEnv, *, trainers: int, port: int, bind_host: str, gpus_per_node: int = 0,
         role: str | None = None, gpu: str = "cpu", coordinator_here: bool | None = None,
         visible: str | None = None, extra: tuple[str, ...] = ()) -> list[Launch]:
    """The processes this task starts.

    ``gpus_per_node`` > 1 with one task per node (``local_world == 1``) starts that many nodes
    here, global rank ``node_rank * gpus_per_node + i``; otherwise this task is one node of
    rank ``ce.rank`` on its local GPU ``ce.local_rank``. Roles: ``role`` if given, else rank
    < ``trainers`` trains and the rest generate. Global rank 0 of a job without a fixed
    ``role`` also starts the coordinator (``coordinator_here`` True/False forces it), bound on
    ``bind_host:port``, expecting ``trainers`` trainer ranks and the rest as rollouts (when
    there is no rest, the rollouts run elsewhere: ``cluster.rollouts`` then comes from
    ``extra``). Nodes dial ``ce.coordinator`` if given, else the first host. ``extra``: config arguments
    (``--config``/``--set``) every process gets. ``visible``: the task's own
    ``CUDA_VISIBLE_DEVICES`` (a launcher may have bound it): a node takes its entry of that list.
    """
    if role is not None and role not in ROLES:
        raise EnvError(f"role {role!r}: expected one of {', '.join(ROLES)}")
    per_task = gpus_per_node if gpus_per_node > 1 and ce.local_world == 1 else 1
    world = ce.world * per_task
    first = ce.rank * per_task
    if role is None and not 0 < trainers <= world:
        raise EnvError(f"--trainers {trainers}: expected 1..{world} of the job's {world} GPU processes "
                       "(the rest are rollouts)")
    endpoint = ce.coordinator or f"tcp://{ce.coordinator_host}:{port}"
    launches: list[Launch] = []
    here = (ce.rank == 0 and role is None) if coordinator_here is None else coordinator_here
    if here:
        # cluster.host: where the coordinator binds its PUB socket and the trainers' rendezvous
        counts: tuple[str, ...] = ("--set", f'cluster.host="{bind_host}"', "--set", f"cluster.trainers={trainers}")
        if world > trainers:  # else the rollouts are elsewhere: give cluster.rollouts in extra
            counts += ("--set", f"cluster.rollouts={world - trainers}")
        launches.append(Launch("coordinator", -1, ("--role", "coordinator", "--bind", f"tcp://{bind_host}:{port}",
                                                   *counts, *extra), ()))
    for i in range(per_task):
        rank = first + i
        local = i if per_task > 1 else ce.local_rank
        r = role or ("trainer" if rank < trainers else "rollout")
        devices = visible.split(",") if visible else []
        if len(devices) == 1 and per_task == 1:  # the launcher bound this task to its GPU
            local_gpu = devices[0]
        elif devices:
            if local >= len(devices):
                raise EnvError(f"CUDA_VISIBLE_DEVICES = {visible!r}: no GPU for local rank {local}")
            local_gpu = devices[local]
        else:
            local_gpu = str(local)
        env = (("CUDA_VISIBLE_DEVICES", local_gpu),) if gpu != "cpu" else ()
        launches.append(Launch(r, rank, ("--role", r, "--coordinator", endpoint, "--bind", f"tcp://{bind_host}:*",
                                         "--gpu", gpu, "--node-id", f"{r}-{rank}", "--rank", str(rank), *extra),
                               env))
    return launches


def bind_host(env: Mapping[str, str]) -> str:
    """The address this host's processes bind: ``DIGENRL_BIND_HOST`` or ``POD_IP`` if set, else
    what the host name resolves to (set ``DIGENRL_BIND_HOST`` where that is a loopback alias)."""
    given = env.get("DIGENRL_BIND_HOST") or env.get("POD_IP")
    if given:
        return given
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise EnvError(f"host name {socket.gethostname()!r} does not resolve ({e}); set DIGENRL_BIND_HOST") from None


def run(launches: Sequence[Launch], *, dry_run: bool = False) -> int:
    """Start every launch as ``python -m digenrl.cli node ARGV`` (the coordinator first), pass
    SIGTERM/SIGINT on to them (the nodes drain; a second Ctrl-C makes them leave) and wait for
    all; the first non-zero exit code, else 0.
    ``dry_run``: print one JSON line per launch instead (what the ops/ examples are tested with)."""
    if dry_run:
        for launch in launches:
            print(json.dumps({"role": launch.role, "rank": launch.rank, "argv": list(launch.argv),
                              "env": dict(launch.env)}), flush=True)
        return 0
    # each in a process group of its own: a terminal's Ctrl-C reaches them once, through
    # forward(), not also directly (two SIGINTs that the kernel does not merge into one would
    # be a second Ctrl-C, which makes a draining node leave at once)
    procs = [subprocess.Popen([sys.executable, "-m", "digenrl.cli", "node", *launch.argv],
                              env={**os.environ, **dict(launch.env)}, process_group=0)
             for launch in launches]

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return next((c for c in codes if c != 0), 0)


def run_from_env(*, role: str | None, trainers: int, coordinator_port: int, gpus_per_node: int = 0,
                 gpu: str | None = None, dry_run: bool = False, extra: Sequence[str] = ()) -> int:
    """``digenrl-node --from-env``: :func:`read_env`, :func:`plan`, :func:`run` for the node's
    flags (``role`` given: only that role; ``coordinator``: only the coordinator). ``extra``:
    the config arguments every process gets (``--config``, ``--set``, ``--run-dir``,
    ``--allow-plaintext``)."""
    env = os.environ
    launches = plan(read_env(env), trainers=trainers, port=coordinator_port, bind_host=bind_host(env),
                    gpus_per_node=gpus_per_node, role=None if role in (None, "coordinator") else role,
                    gpu=gpu or "cpu", coordinator_here=True if role == "coordinator" else None,
                    visible=env.get("CUDA_VISIBLE_DEVICES"), extra=tuple(extra))
    if role == "coordinator":  # a coordinator-only task (its own pod)
        launches = launches[:1]
    return run(launches, dry_run=dry_run)
