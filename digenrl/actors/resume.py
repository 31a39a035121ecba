"""Stopping and resuming: checkpoint cuts, the drain checkpoint, the trainers' stop vote.

A checkpoint has two writers (:mod:`digenrl.rl.checkpoint`): trainer rank 0 writes its part
(weights, optimizer, RNG states) at a step boundary, before it announces the version; the
coordinator completes it with its *cut* of that version, the scheduler's snapshot taken as
the announcement arrives. Both sides of that story live here, as components the two actors hold
(``self.resume``: :class:`TrainerResume`, :class:`CoordinatorResume`):

    trainer rank 0                              coordinator
    ------------------------------------------  ------------------------------------------
    optimizer step -> version v                 (reads commits, consumptions, StepDone)
    due: write its part of v                    VersionAnnounce(v) -> cut of v
    not due: keep v's RNG states (boundary)     due: commit v; not due: keep the cut
      (TrainerResume.at_boundary)                 (CoordinatorResume.take_cut)
    VersionAnnounce(v)
    on a signal: write its part of the kept     on a signal: read what the nodes sent
      boundary (drain_checkpoint)                 before leaving (the coordinator's
                                                  read_late), then commit the kept cut
                                                  once rank 0's part is there (drain)

On a restart every rank loads the newest checkpoint that verifies; several ranks first agree
that they verified the same one (:meth:`TrainerResume.restore`), and the coordinator
restores its scheduler from the same checkpoint (:meth:`CoordinatorResume.restore`)
and never commits that version again (a slower rank may be verifying it).

Once a stop is asked no trainer rank takes another optimizer step, so the version the
coordinator last heard announced stays the trainers' and the kept cut matches rank 0's part.
Several ranks learn of a stop in a vote at the step's end, where a stopping rank joins
instead of leaving (one rank leaving alone would strand the others inside a collective):

* unsharded ranks vote in the step's gradient all-reduce, one element more
  (:meth:`Learner.reduce_gradients`);
* sharded (FSDP) ranks have collectives inside every pass, paired pass for pass only at the
  step's end (ranks train different timesteps, then pad with idle passes). A stopping rank
  therefore first pads to the step's pass count, then votes in a two-element all-reduce
  (:func:`sharded_vote`): the others' remaining passes pair with its idle ones. The vote
  also says whether a stop is a drain (a signal): then every rank writes its shard of the
  boundary's checkpoint together, since the write is a collective too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from digenrl.actors.base import Log
from digenrl.config import Config
from digenrl.core.scheduler import Scheduler
from digenrl.rl.checkpoint import (
    Checkpoint,
    capture_rng,
    checkpoint_due,
    commit_checkpoint,
    latest_checkpoint,
    load_trainer_state,
    save_trainer_state,
    trainer_part_ready,
)
from digenrl.rl.learner import Learner
from digenrl.rl.policy import Policy
from digenrl.telemetry import sdnotify
from digenrl.telemetry.trace import SpanRecorder
from digenrl.transport.protocol import VersionAnnounce

TRAINER_RANK_STOPPED = "a trainer rank stopped"
"""Stop reason of a rank whose peer voted to stop in a step's all-reduce while the run's own
stop never reached it (only that peer was stopped): the group cannot train on without it."""

DRAIN_SAVE_TIMEOUT_S = 300.0
"""How long sharded ranks' collective write of a drain checkpoint may take: a rank gone from it
(killed meanwhile) leaves the others waiting in it, in a thread nothing can interrupt; past
this the rank gives up on the drain checkpoint and its node exits hard (actors/node.py)."""

DRAIN_CHECKPOINT_WAIT_S = 60.0
"""How long a coordinator stopped by a signal waits for trainer rank 0's part of a drain
checkpoint (a launch's coordinator does not wait: its children have exited by then)."""


def drain_wait_s(cfg: Config, *, spawned_nodes: bool) -> float:
    """How long a coordinator stopped by a signal waits for the drain checkpoint's parts.

    A launch that spawned its nodes has waited for them to exit already: nothing is left to
    wait for. Nodes started by hand: sharded ranks first pad the step's passes, then write
    their shards together, bounded by :data:`DRAIN_SAVE_TIMEOUT_S`; an unsharded rank 0
    writes its part as it leaves (:data:`DRAIN_CHECKPOINT_WAIT_S`)."""
    if spawned_nodes:
        return 0.0
    return DRAIN_SAVE_TIMEOUT_S if cfg.model.fsdp else DRAIN_CHECKPOINT_WAIT_S


def sharded_vote(learner: Learner, all_reduce: Callable[[torch.Tensor], None], *, stop: bool,
                 drain: bool, pad_to: int) -> tuple[bool, bool]:
    """Compute thread, sharded ranks at a step's end: pad with idle passes to ``pad_to`` (the
    step's pass count on the busiest rank), then all-reduce [stop, drain]. Returns whether any
    rank voted to stop, and whether any of those stops is a drain; the same on every rank."""
    learner.pad(pad_to)
    # on the parameters' device (NCCL needs one); a plain tensor, not a sharded one's DTensor
    flags = torch.tensor([float(stop), float(drain)], device=learner.policy.params[0].device)
    flags = torch.cat([flags, learner.reports(flags)])  # two experts: what each rank used and holds
    all_reduce(flags)
    learner.take_reports(flags[2:])
    return bool(flags[0] > 0), bool(flags[1] > 0)


class CoordinatorResume:
    """The coordinator's side, held by the coordinator (``self.resume``): restoring from a
    checkpoint, cutting at each announced version, and the drain checkpoint after a stop on
    a signal.

    Inputs: the run's config and run dir, the coordinator's ``recovery`` counters (a
    checkpoint holds them and a restore takes them back, in that same dict), when the
    coordinator started (``started``, a ``perf_counter`` reading: a cut records the run's
    wall time) and a log. The scheduler and the staleness histogram are passed to each call:
    a rewind replaces the scheduler."""

    def __init__(self, *, cfg: Config, run_dir: Path, recovery: dict[str, int], started: float,
                 log: Log) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.recovery = recovery
        self.started = started
        self.log = log
        self.cut: tuple[int, dict[str, Any]] | None = None  # the last boundary kept since a checkpoint
        self.expect_version: int | None = None  # the version restored trainers must announce
        self.start_version = 0                  # the version the run (re)started from
        self.wall_before = 0.0                  # the run's wall time before the last resume
        self.resumed_from: list[int] = []       # the versions the run resumed from, in order

    def restore(self, ckpt: Checkpoint | None, sched: Scheduler, *, rewind: bool = False) -> dict[str, int]:
        """Take the run's state from ``ckpt`` (None: the start of the run) into the fresh
        scheduler ``sched``; returns the staleness histogram it held (empty at the start).
        ``rewind``: this process goes back to ``ckpt`` after losing a trainer rank; its own
        clock runs on since it started (the wall time before is kept)."""
        self.expect_version = ckpt.version if ckpt else 0
        self.start_version = self.expect_version
        if ckpt is None:
            return {}
        c = ckpt.coordinator
        sched.restore(c["scheduler"])
        if not rewind:
            self.wall_before = float(c.get("wall_s", 0.0))
        self.resumed_from = [*c.get("resumed_from", []), ckpt.version]
        for k, v in c.get("recovery", {}).items():
            self.recovery[k] = int(v)
        return {str(k): int(v) for k, v in c.get("staleness_hist", {}).items()}

    def rewind(self) -> None:
        """The run goes back to its last checkpoint: a boundary kept since then is gone."""
        self.cut = None

    def announced(self, version: int) -> str | None:
        """Trainer rank 0 announced ``version``: why the run must fail (restored trainers
        announced another version than the one restored), or None."""
        if self.expect_version is None:
            return None
        if version != self.expect_version:
            return (f"failed: trainer rank 0 announced version {version} "
                    f"after a restore to version {self.expect_version}")
        self.expect_version = None
        return None

    def take_cut(self, ann: VersionAnnounce, sched: Scheduler, staleness_hist: dict[str, int]) -> None:
        """The cut of the announced version: committed with trainer rank 0's part if a
        checkpoint is due, else kept for a drain."""
        v = ann.version
        if v <= self.start_version:
            # the version this run restored (or 0): its checkpoint is already on disk, and a
            # slower trainer rank may be verifying it right now; committing it again rewrote
            # scheduler.json and the manifests under that rank, which then saw a torn
            # checkpoint, restored an older one and waited for good for its step's work
            self.cut = None
            return
        snap = sched.snapshot()
        # a rank that consumed work of step v before rank 0 announced v: no consistent cut here
        consistent = not any(s >= v for s, _ in snap["ledger"]["consumed"])
        cut = {"scheduler": snap, "announce": dataclasses.asdict(ann),
               "staleness_hist": dict(staleness_hist), "resumed_from": list(self.resumed_from),
               "wall_s": self.wall_before + time.perf_counter() - self.started,
               "recovery": dict(self.recovery)}
        if not checkpoint_due(v, steps=self.cfg.run.steps, every=self.cfg.run.checkpoint_every):
            # kept for a drain: a stop on a signal commits it once the trainer wrote its part
            self.cut = (v, cut) if consistent else None
            return
        if not trainer_part_ready(self.run_dir, v) or not consistent:
            # the trainer's files are elsewhere (no shared run dir), or the cut is not consistent
            self.recovery["checkpoints_skipped"] += 1
            self.log.warning("checkpoint skipped", version=v)
            return
        self.cut = None
        self.recovery["checkpoints"] += 1
        cut["recovery"] = self.recovery
        commit_checkpoint(self.run_dir, v, cut)
        self.log.info("checkpoint written", version=v)

    def commit_drain_checkpoint(self) -> int | None:
        """After a stop on a signal: commit the last step boundary's cut if trainer rank 0 wrote
        its part of it (:meth:`TrainerResume.drain_checkpoint`); the version, or None (no cut
        kept since the last checkpoint, or no trainer part)."""
        if self.cut is None or not trainer_part_ready(self.run_dir, self.cut[0]):
            return None
        v, cut = self.cut
        self.cut = None
        self.recovery["checkpoints"] += 1
        cut["recovery"] = {**cut["recovery"], "checkpoints": self.recovery["checkpoints"]}
        commit_checkpoint(self.run_dir, v, cut)
        self.log.info("drain checkpoint committed", version=v)
        return v

    async def drain(self, *, wait_s: float, read_late: Callable[[float], Awaitable[float | None]]) -> None:
        """After a stop on a signal: commit the last step boundary's checkpoint once trainer
        rank 0 has written its part (nodes told to stop by a signal write it as they leave),
        reading late messages meanwhile; gives up after ``wait_s``, or at once when no
        boundary is kept and rank 0 has been silent for two heartbeats.

        ``read_late(quiet_s)`` is the coordinator handling what the nodes sent after its main
        loop stopped reading, until ``quiet_s`` pass without a message: an announcement sent as
        the stop landed holds the cut of the boundary the trainer kept. It returns when trainer
        rank 0 last sent one (``time.monotonic()``), or None."""
        deadline = time.monotonic() + wait_s
        silent_s = 2 * self.cfg.runtime.heartbeat_s
        rank0_heard = time.monotonic()
        while True:
            heard = await read_late(0.2)
            if heard is not None:
                rank0_heard = heard  # its heartbeats stop once it stops working
            if self.cut is not None and self.commit_drain_checkpoint() is not None:
                return
            now = time.monotonic()
            if now >= deadline:
                if self.cut is not None:
                    self.log.warning("no drain checkpoint: trainer rank 0 wrote no part of the last "
                                     "step boundary", version=self.cut[0])
                return
            if self.cut is None and now - rank0_heard > silent_s:
                return  # rank 0 stopped without announcing a boundary past the last checkpoint


class TrainerResume:
    """A trainer rank's side, held by the trainer (``self.resume``): restoring (ranks agreeing
    on the checkpoint first), its part of each due checkpoint and the boundary it keeps
    between them, the drain checkpoint (rank 0's part, or every sharded rank's shard), and
    the stop vote at a step's end.

    Inputs: the run's config and run dir, the rank's policy and learner, its rank in the
    trainers' torch.distributed ``group`` (None: the default group) of ``world_size`` ranks,
    and what it needs of the actor as explicit callables: ``in_thread`` (torch work on the
    compute thread, as a busy span), ``compute_init`` (what sets a thread up as the compute
    thread is), ``request_stop`` and ``wait_stopped`` (the actor's stop), ``step_passes``
    (a step's training passes on its busiest rank: sharded ranks pad to it)."""

    def __init__(self, *, cfg: Config, run_dir: Path, policy: Policy, learner: Learner, rank: int,
                 world_size: int, in_thread: Callable[..., Awaitable[Any]],
                 request_stop: Callable[[str], None], wait_stopped: Callable[[], Awaitable[None]],
                 step_passes: Callable[[int], int], recorder: SpanRecorder, log: Log,
                 compute_init: Callable[[], object] | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.policy = policy
        self.learner = learner
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.in_thread = in_thread
        self.request_stop = request_stop
        self.wait_stopped = wait_stopped
        self.step_passes = step_passes
        self.recorder = recorder
        self.log = log
        self.compute_init = compute_init
        self.votes = world_size > 1  # several ranks vote at each step's end whether to stop
        self.voted = False           # this rank's last collective was a vote to stop
        self.drain_voted = False     # sharded: a rank's stop in the last vote was a drain
        self.drain_stuck = False     # sharded: the drain checkpoint's collective write never finished
        # the last step boundary as a checkpoint would hold it: (version, RNG states, counters),
        # written by drain_checkpoint when a stop comes before the next due checkpoint
        self.boundary: tuple[int, dict[str, Any], dict[str, Any]] | None = None

    async def restore(self) -> dict[str, Any] | None:
        """Load the run's latest checkpoint, if any; returns the counters it held ({} when
        there is none). Several ranks first check that each verified the same checkpoint: one
        that restored another version would refuse its step's work as out of the window, and
        the run would wait for good. None (and a failed stop) if they differ."""
        ckpt = await asyncio.to_thread(latest_checkpoint, self.run_dir)
        if self.world_size > 1:
            versions = await self.in_thread("checkpoint_agree", self._gathered, ckpt.version if ckpt else 0)
            if len(set(versions)) > 1:
                self.log.error("trainer ranks verified different checkpoints", versions_by_rank=versions,
                               skipped=list(ckpt.skipped) if ckpt else [])
                self.request_stop(f"failed: trainer ranks verified different checkpoints (version by "
                                  f"rank: {versions}); see each rank's log for what it skipped")
                return None
        if ckpt is None:
            return {}
        counters: dict[str, Any] = await self.in_thread("checkpoint_load", load_trainer_state, ckpt, self.policy)
        self.log = self.log.bind(policy_version=self.policy.version)
        for why in ckpt.skipped:
            self.log.warning("checkpoint skipped", reason=why)
        self.log.info("resumed from checkpoint", version=ckpt.version, path=str(ckpt.path),
                      layout=ckpt.trainer.get("layout"), trainers=self.world_size)
        return counters

    def _gathered(self, value: int) -> list[int]:
        """Compute thread: ``value`` from every rank, by rank (a device tensor: NCCL needs one)."""
        device = self.policy.params[0].device
        mine = torch.tensor([value], dtype=torch.int64, device=device)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [int(t.item()) for t in out]

    async def at_boundary(self, version: int, counters: dict[str, Any]) -> None:
        """The step boundary ``version`` (rank 0, or every rank of a sharded policy or of
        experts placed over ranks: their writes are collectives): write this rank's part of a due checkpoint before the version is
        announced (the coordinator completes it on the announcement), else keep the boundary
        for a drain checkpoint."""
        if checkpoint_due(version, steps=self.cfg.run.steps, every=self.cfg.run.checkpoint_every):
            await self.in_thread("checkpoint_save", partial(
                save_trainer_state, self.run_dir, self.policy, counters, write=self.rank == 0))
        else:
            self.boundary = (version, capture_rng(), counters)

    async def drain_checkpoint(self, *, signalled: bool) -> int | None:
        """After the actor stopped: write this rank's part of a checkpoint of the last step
        boundary, if the stop was a drain and no checkpoint holds that boundary (the
        coordinator commits it with its cut of that version: :meth:`CoordinatorResume.drain`).
        The weights and the optimizer have not moved since the boundary (a step's gradients
        only accumulate until its optimizer step), and the RNG states are those the boundary
        saw. ``signalled``: this rank's own stop came from a signal. Returns the version
        written, or None.

        Unsharded: rank 0 alone writes, if its own stop came from a signal. Sharded: the write
        is a collective, so every rank writes its shard if any rank's stop in the step's vote
        was a drain; each decides alike (the vote's result, the boundary every rank keeps)."""
        b = self.boundary
        if b is None or b[0] != self.policy.version:
            return None
        if getattr(self.policy, "placement", None) is not None:
            # rank 0 lacks experts another rank holds, and the ranks stop at different moments
            if self.rank == 0 and signalled:
                self.log.warning("drain checkpoint not written: experts are placed over trainer ranks; "
                                 "a resume starts from the last due checkpoint", version=b[0])
            return None
        if self.policy.sharded:
            if not self.drain_voted:
                return None
        elif not signalled or trainer_part_ready(self.run_dir, b[0]):
            return None
        version, rng, counters = b
        timeout = DRAIN_SAVE_TIMEOUT_S if self.policy.sharded else None
        sdnotify.extend_timeout(timeout or 120)  # a large model's write may outlast the unit's stop timeout
        save = partial(save_trainer_state, self.run_dir, self.policy, counters, write=self.rank == 0, rng=rng)
        with self.recorder.span("checkpoint_save", version=version):
            # after the actor's run: its compute thread is gone, so on a thread set up alike
            try:  # a timeout abandons the thread (it cannot be interrupted): node.py exits hard
                await asyncio.wait_for(asyncio.to_thread(self._on_compute_device, save), timeout)
            except TimeoutError:  # sharded: a rank never joined the collective write
                self.drain_stuck = True
                self.log.error("drain checkpoint not written: a trainer rank never joined its write",
                               version=version, timeout_s=timeout)
                return None
            except RuntimeError as e:  # sharded: a rank gone from the collective write
                if not self.policy.sharded:
                    raise
                self.log.error("drain checkpoint not written: a trainer rank is gone", version=version,
                               error=str(e))
                return None
        self.log.info("drain checkpoint written", version=version, sharded=self.policy.sharded)
        return version

    def _on_compute_device(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on a thread set up as the compute thread is (its CUDA device: NCCL)."""
        if self.compute_init is not None:
            self.compute_init()
        return fn()

    def _all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    def step_unless_voted(self, stop: bool, pad_to: int, drain: bool = False) -> dict[str, float] | None:
        """Compute thread: the step's vote with this rank's stop (and, sharded, whether it is a
        drain), then the optimizer step; None (and no step on any rank) if a rank voted to stop."""
        if self.policy.sharded:
            stopped, self.drain_voted = sharded_vote(self.learner, self._all_reduce, stop=stop,
                                                     drain=drain, pad_to=pad_to)
            if stopped:
                return None
        elif not self.learner.reduce_gradients(self._all_reduce, stop=stop):
            return None
        return self.learner.finish_step(None, pad_to=pad_to)

    async def vote_stop(self, *, drain: bool) -> None:
        """Leaving on a stop before this step's vote: join it with a vote to stop, so a rank
        already waiting in it (or, sharded, in a pass this rank pads) takes no step and leaves
        too instead of waiting for good. ``drain``: the stop came from a signal."""
        try:
            if self.policy.sharded:
                _, self.drain_voted = await self.in_thread("stop_vote", partial(
                    sharded_vote, self.learner, self._all_reduce, stop=True, drain=drain,
                    pad_to=self.step_passes(self.policy.version)))
            else:
                await self.in_thread("stop_vote", partial(self.learner.reduce_gradients, self._all_reduce,
                                                          stop=True))
        except RuntimeError as e:  # a peer already gone (gloo: "Connection closed by peer")
            self.log.warning("stop vote not delivered: a trainer rank is gone", error=str(e))
        self.voted = True

    async def peer_voted_to_stop(self, step: int) -> None:
        """Another rank voted to stop in step ``step``'s all-reduce: this group trains no more.
        The run's stop usually reaches this rank a moment later (the same SIGTERM, the
        coordinator's Shutdown); if it does not (only that rank was stopped), leave anyway."""
        self.voted = True
        self.log.info("a trainer rank voted to stop: no optimizer step", step=step)
        rt = self.cfg.runtime
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wait_stopped(), rt.heartbeat_s * rt.heartbeat_misses)
        self.request_stop(TRAINER_RANK_STOPPED)  # a no-op when the run's stop came first


__all__ = ["DRAIN_CHECKPOINT_WAIT_S", "DRAIN_SAVE_TIMEOUT_S", "TRAINER_RANK_STOPPED", "CoordinatorResume",
           "TrainerResume", "drain_wait_s", "sharded_vote"]
