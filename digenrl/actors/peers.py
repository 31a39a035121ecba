"""A node's sockets and its heartbeats.

``NodePeers`` owns a node's sockets (control DEALER to the coordinator, the announcement SUB,
one PUSH per trainer rank, a trainer's data PULL, the weights DEALER to trainer rank 0 or a
trainer's weights ROUTER, a rollout's own weights ROUTER for the relay, a DEALER per reward
worker) and the heartbeat loop, which also tells the node when the coordinator is gone.

The work on those sockets belongs to the components the actors hold:
:class:`~digenrl.actors.streamer.FragmentStreamer` (generating a fragment and streaming its
chunks, commit, scoring) and :class:`~digenrl.actors.following.WeightFollower` (a rollout's
weight prefetch, catch-up and relay).

The heartbeat needs of its actor only what :class:`HeartbeatActor` declares;
:class:`~digenrl.actors.base.Actor` provides all of it but ``policy_version``, which
``RolloutActor``, ``TrainerActor`` and ``RewardActor`` define.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any, Protocol

from digenrl.actors.base import Log, Loop
from digenrl.config import Config
from digenrl.telemetry.nvml import GpuProbe
from digenrl.transport.protocol import Heartbeat
from digenrl.transport.socketio import Socket


class HeartbeatActor(Protocol):
    """What :meth:`NodePeers.heartbeat_loop` needs of the actor it beats for."""

    log: Log

    @property
    def stopping(self) -> bool: ...
    @property
    def policy_version(self) -> int:
        """The weights version the actor generates (or trains) with, for heartbeats."""
        ...
    def request_stop(self, reason: str) -> None: ...
    def heartbeat_stats(self) -> dict[str, float]: ...


class NodePeers:
    """A node's sockets and its heartbeats; see the module doc."""

    def __init__(self, *, node_id: str, incarnation: int, cfg: Config, control: Socket,
                 sub: Socket | None = None, pushes: dict[int, Socket] | None = None,
                 data: Socket | None = None, weights: Socket | None = None,
                 gpu_probe: GpuProbe | None = None, relay: Socket | None = None,
                 connect: Callable[[str], Socket] | None = None,
                 scorers: dict[str, Socket] | None = None) -> None:
        """``weights``: a rollout's DEALER to trainer rank 0 (a trainer's weights ROUTER);
        ``relay``: a rollout's own weights ROUTER; ``connect(endpoint)``: a new DEALER (to an
        upstream the coordinator names); ``scorers``: a DEALER per reward worker."""
        self.node_id = node_id
        self.incarnation = incarnation
        self.cfg = cfg
        self.control = control
        self.sub = sub
        self.pushes = pushes or {}
        self.data = data
        self.weights = weights
        self.relay = relay
        self.connect = connect
        self.scorers = scorers or {}
        self.gpu = gpu_probe or GpuProbe()
        self._gpu_reading: dict[str, Any] = {}
        self._seq = itertools.count()
        self.unanswered = 0  # beats sent since the coordinator's last control message

    # ------------------------------------------------------------------ heartbeats
    def heartbeat_loop(self, actor: HeartbeatActor) -> Loop:
        """Beat every ``heartbeat_s``; stop the node if the coordinator stops answering.

        The coordinator answers every beat, so ``heartbeat_misses`` beats in a row with no
        control message in between mean it is gone (crashed, partitioned): the node stops
        with reason ``coordinator_lost`` and exits non-zero, for its supervisor to restart it
        against the restarted coordinator, which resumes from its checkpoint. Counting
        unanswered *beats* rather than seconds means a node whose own loop was starved (a
        GIL-heavy forward in a worker thread) does not mistake its own delay for silence.
        """
        async def heartbeat() -> None:
            misses = self.cfg.runtime.heartbeat_misses
            self.unanswered = 0
            while True:
                if self.unanswered > misses and not actor.stopping:
                    actor.log.error("coordinator lost", unanswered_beats=self.unanswered)
                    actor.request_stop("coordinator_lost")  # a trainer's also wakes its main loop
                self._gpu_reading = await self.gpu.read_async()
                await self.control.send(Heartbeat(
                    node_id=self.node_id, incarnation=self.incarnation,
                    policy_version=actor.policy_version,
                    state="stopping" if actor.stopping else "running", seq=next(self._seq),
                    gpu=self._gpu_reading, stats=actor.heartbeat_stats()))
                self.unanswered += 1
                await asyncio.sleep(self.cfg.runtime.heartbeat_s)
        return heartbeat

    @property
    def gpu_reading(self) -> dict[str, Any]:
        """The GPU reading the last heartbeat carried (``GpuProbe.read()``; {} before the first)."""
        return self._gpu_reading

    def gpu_free_mb(self) -> float:
        gpus = self._gpu_reading.get("gpus", []) if self._gpu_reading else []
        free = [g.get("mem_free_mb", 0.0) for g in gpus if "mem_free_mb" in g]
        return float(min(free)) if free else -1.0

    def heard_from_coordinator(self) -> None:
        """Any control message proves the coordinator alive (see :meth:`heartbeat_loop`)."""
        self.unanswered = 0
