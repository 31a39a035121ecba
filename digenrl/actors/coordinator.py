"""Coordinator: drives the sans-I/O scheduler with real sockets; records the run.

    nodes --Hello/Heartbeat/Commit/Consumed/VersionAnnounce/StepDone/Samples/TagOffer--> [ROUTER control]
    [ROUTER control] --Welcome/Assign/Revoke/VersionAnnounce/Shutdown--> nodes
    [PUB] --VersionAnnounce/Shutdown--> rollouts (small state only; re-sent on heartbeats)

| blocking call          | waits for                        | unblocked by                       |
|------------------------|----------------------------------|------------------------------------|
| control ``recv()``     | any node's message               | nodes                              |
| tick loop sleep        | the next lease/liveness check    | the clock (heartbeat_s / 2)        |
| ``wait_stopped()``     | the last step's version          | trainer rank 0's StepDone          |

Trainers are welcomed once all ``cluster.trainers`` ranks said Hello (they need the
torch.distributed rendezvous); rollouts once the trainers' data endpoints are known.

Failures (every one logged and counted in ``recovery``, reported in summary.json):

* a rollout exits or goes silent: the scheduler revokes its uncommitted attempts (the
  trainers drop their staged chunks), their slots are re-queued; a restarted rollout
  re-joins under the same node id as a new incarnation.
* a trainer rank exits, goes silent or says Hello again: torch.distributed cannot lose a
  rank, so :meth:`reset` rewinds the run to the last checkpoint. Every node is told to
  restart (the launcher's ``Children`` or the nodes' supervisor restarts them), the
  scheduler is rebuilt from the checkpoint with task ids moved past every id issued so
  far (late messages of dead processes are then fenced as zombies), and the trainers load
  the same checkpoint and re-announce its version, which is checked.
* the version announcement of a checkpointed version completes the checkpoint: the
  scheduler snapshot is taken right there, at the cut (:mod:`digenrl.actors.resume`, with
  the drain checkpoint after a stop on a signal).

Pieces that need no actor live apart: the identity gate every control message passes
(:mod:`digenrl.transport.identity`), metrics.jsonl's step rows
(:mod:`digenrl.telemetry.steprows`) and the stall watchdog (:mod:`digenrl.core.watchdog`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from digenrl.actors.base import Actor
from digenrl.actors.resume import CoordinatorResume
from digenrl.actors.weightsync import WeightSync
from digenrl.config import Config, to_toml
from digenrl.core.credits import CreditError
from digenrl.core.scheduler import AssignCmd, RevokeCmd, Scheduler, SchedulerError, ShutdownCmd
from digenrl.core.watchdog import StallWatchdog
from digenrl.faults import crash_point, signal_point
from digenrl.rl.checkpoint import Checkpoint, CheckpointError, latest_checkpoint
from digenrl.telemetry.steprows import StepRows
from digenrl.transport.endpoints import rendezvous_endpoint
from digenrl.transport.errors import PeerLost
from digenrl.transport.identity import IdentityGate
from digenrl.transport.protocol import (
    Assign,
    Commit,
    Consumed,
    Heartbeat,
    Hello,
    Revoke,
    Samples,
    Shutdown,
    StepDone,
    TagOffer,
    VersionAnnounce,
    WeightsHeld,
    Welcome,
)


class CoordinatorActor(Actor):
    role = "coordinator"

    def __init__(self, *, cfg: Config, scheduler: Scheduler, control: Any, pub: Any, prompts: list[str],
                 run_dir: Path, dist_endpoint: str, metrics: Any, progress: Any = None,
                 expected_trainers: int, scheduler_factory: Callable[[], Scheduler] | None = None,
                 max_resets: int = 3, metadata: list[dict[str, Any]] | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.cfg = cfg
        # each prompt's metadata record as JSON text, sent with its Assign (rewards read it)
        self.metadata = [json.dumps(m) for m in (metadata or [{"prompt": p} for p in prompts])]
        self.rewards: dict[str, dict[str, Any]] = {}  # reward workers: node_id -> {peer, endpoint}
        self.trainers_welcomed = False
        self.sched = scheduler
        self.control = control
        self.pub = pub
        self.prompts = prompts
        self.run_dir = run_dir
        self.dist_endpoint = dist_endpoint
        self.metrics = metrics
        self.rows = StepRows(metrics, progress)  # metrics.jsonl's step rows, in step order
        self.expected_trainers = expected_trainers
        self.nodes: dict[str, dict[str, Any]] = {}          # node_id -> {role, peer, pid, rank, endpoint}
        self.gate = IdentityGate(control)                   # node id <-> routing id, incarnation, key
        self.waiting_rollouts: list[tuple[bytes, Hello]] = []
        self.trainers: dict[int, dict[str, Any]] = {}
        self.latest_announce: VersionAnnounce | None = None
        self.staleness_hist: dict[str, int] = {}
        self.t0 = time.perf_counter()
        self.step_samples = 0
        self.rejected = 0
        self.tag_offers_early = 0
        self.t_first_assign: float | None = None
        self.t_last_step: float | None = None
        self.skipped = (0, 0)  # trainer rank 0's skipped_steps as last heard, steps skipped in a row
        self.watchdog = StallWatchdog(cfg.runtime.stall_timeout_s)  # monotonic clock
        self.scheduler_factory = scheduler_factory
        self.ticks = 0  # passes of the tick loop: liveness, failures and the run's end are checked there
        self.max_resets = max_resets
        self.recovery: dict[str, int] = {"trainer_resets": 0, "rollouts_lost": 0,
                                         "rolled_back_admitted": 0, "late_trained": 0,
                                         "ignored_announces": 0, "checkpoints": 0,
                                         "checkpoints_skipped": 0, "stalls": 0, "rejoins": 0,
                                         "final_weights_missing": 0, "nodes_broken": 0}
        # checkpoints: restore, the cut at each announced version, the drain after a signal
        self.resume = CoordinatorResume(cfg=cfg, run_dir=run_dir, recovery=self.recovery, started=self.t0,
                                        log=self.log)
        self.restart_requested = asyncio.Event()  # the launcher restarts every child on it
        self.weights = WeightSync(cfg.runtime.weights_fanout, self._send_node)
        self.finish_by: float | None = None  # done: waiting (until then) for rollouts to hold the last version

    # ------------------------------------------------------------------ recovery
    def restore_from(self, ckpt: Checkpoint | None) -> None:
        """Take the run's state from ``ckpt`` (None: the start of the run) into the scheduler."""
        self.staleness_hist = self.resume.restore(ckpt, self.sched)

    async def reset(self, reason: str) -> None:
        """A trainer rank is gone: rewind to the last checkpoint and have every node restart."""
        if self.stopping:
            return
        if self.recovery["trainer_resets"] >= self.max_resets or self.scheduler_factory is None:
            self.request_stop(f"failed: {reason} (no recovery left)")
            return
        self.recovery["trainer_resets"] += 1
        self.resume.rewind()  # the run goes back to its last checkpoint: a later boundary is gone
        self.watchdog.restart()  # restarted nodes load their models first: count from new work
        self.log.error("trainer lost: rewinding to the last checkpoint", reason=reason)
        await self._shutdown_all(f"restart: {reason}")
        self.flush_metrics()  # rows of the old schedule, as far as its ledger counted them
        old = self.sched
        try:
            ckpt = latest_checkpoint(self.run_dir)
        except CheckpointError as e:
            self.request_stop(f"failed: {reason}; checkpoint unusable: {e}")
            return
        for why in ckpt.skipped if ckpt else ():
            self.log.warning("checkpoint skipped", reason=why)
        self.sched = self.scheduler_factory()
        snap = ckpt.coordinator["scheduler"] if ckpt else self.sched.snapshot()
        # fence: ids of attempts made since the checkpoint are never reused
        snap = {**snap, "ledger": {**snap["ledger"],
                                   "next_task_id": old.snapshot()["ledger"]["next_task_id"]}}
        recovery = dict(self.recovery)
        if ckpt is not None:
            ckpt = dataclasses.replace(ckpt, coordinator={**ckpt.coordinator, "scheduler": snap})
        else:
            self.sched.restore(snap)
        admitted_before = old.statistics()["admitted"]
        self.staleness_hist = self.resume.restore(ckpt, self.sched, rewind=True)  # clock: since t0
        self.recovery.update(recovery)
        self.recovery["rolled_back_admitted"] += admitted_before - self.sched.statistics()["admitted"]
        self.nodes.clear()
        self.trainers.clear()
        self.rewards.clear()
        self.trainers_welcomed = False
        self.waiting_rollouts.clear()
        self.gate.unbind_all()  # every node restarts and binds anew; late messages are dropped
        self.weights.reset()
        self.latest_announce = None
        self.dist_endpoint = rendezvous_endpoint(self.cfg, self.run_dir)  # the old store died with rank 0
        self.restart_requested.set()

    async def node_exited(self, node_id: str, code: int | None, why: str = "") -> None:
        """The launcher saw a child exit: lose it now instead of after the heartbeat timeout.
        ``why``: the last line the child wrote to stderr, if any."""
        node = self.nodes.get(node_id)
        if node is None:
            return
        if node["role"] == "trainer":
            await self.reset(f"{node_id} exited with code {code}" + (f" ({why})" if why else ""))
            return
        if node["role"] == "reward":  # its fragments in flight time out (reward_timeout) at the rollouts
            self.recovery["reward_workers_lost"] = self.recovery.get("reward_workers_lost", 0) + 1
            self.log.warning("reward worker lost", node=node_id, code=code)
            del self.nodes[node_id]
            return
        self.recovery["rollouts_lost"] += 1
        self.log.warning("rollout lost", node=node_id, code=code)
        del self.nodes[node_id]
        await self.weights.leave(node_id)
        if node.get("ready"):
            await self._run(self.sched.node_lost(node_id, time.monotonic(), f"exited with code {code}"))

    def background(self) -> list[Any]:
        return [self._tick_loop, self._drain_pub]

    async def _drain_pub(self) -> None:
        await self.pub.drain_subscriptions()  # the PUB needs no inbound traffic: read and drop it

    async def main(self) -> None:
        while not self.stopping:
            got = await self.unless_stopped(self.control.recv_authenticated())
            if got is None:  # a stop: noticed at once, not at the next message
                break
            peer, user, msg = got
            why = self._gate(peer, msg, user)
            if why is not None:
                self.refuse(why, msg, peer=peer[:64])
                continue
            if isinstance(msg, Hello):  # the id's key, from its first admitted Hello on
                self.gate.admitted(msg, user)
            try:
                await self._handle(peer, msg)
            except (SchedulerError, CreditError) as e:  # a peer sent something impossible: count, log, go on
                self.rejected += 1
                self.log.error("message rejected by the scheduler", peer=peer, msg=type(msg).__name__,
                               error=str(e))
        # tell everyone, by both paths (PUB may drop for a slow joiner)
        await self._shutdown_all(self.stop_reason or "done")

    # ------------------------------------------------------------------ after a stop
    async def drain(self, *, wait_s: float) -> None:
        """After a stop on a signal: commit the drain checkpoint (:meth:`CoordinatorResume.drain`),
        reading what the nodes sent meanwhile."""
        await self.resume.drain(wait_s=wait_s, read_late=self._read_late)

    LATE = (Commit, Consumed, VersionAnnounce, StepDone)
    """What :meth:`_read_late` still handles: the messages that move the ledger or the version."""

    async def _read_late(self, quiet_s: float) -> float | None:
        """After a stop on a signal: handle what the nodes sent after the main loop stopped
        reading, until ``quiet_s`` pass without a message; returns when trainer rank 0 last
        sent one (``time.monotonic()``), or None.

        Trainer rank 0 may be announcing a version as the stop lands (its optimizer step
        done, the weights on their way); the drain checkpoint needs the cut of that version,
        and the ledger the commits and consumptions before it, in the order they were sent.
        ZeroMQ keeps a peer's unread messages after the peer leaves, so this also works once
        the nodes have exited. Nothing is sent: :meth:`_run` is quiet once stopping."""
        rank0_heard: float | None = None
        while True:
            try:
                async with asyncio.timeout(quiet_s):
                    peer, user, msg = await self.control.recv_authenticated()
            except TimeoutError:
                return rank0_heard
            if peer == self.trainers.get(0, {}).get("peer"):
                rank0_heard = time.monotonic()
            if isinstance(msg, self.LATE) and self._gate(peer, msg, user) is None:
                try:
                    await self._handle(peer, msg)
                except (SchedulerError, CreditError) as e:
                    self.rejected += 1
                    self.log.error("late message rejected by the scheduler", peer=peer,
                                   msg=type(msg).__name__, error=str(e))

    # ------------------------------------------------------------------ identity
    def _gate(self, peer: bytes, msg: Any, user: str | None = None) -> str | None:
        """Why ``msg`` from ``peer`` is dropped unseen, or None (:mod:`digenrl.transport.identity`)."""
        return self.gate.check(peer, msg, user, nodes=self.nodes, steps=self.cfg.run.steps,
                               version=self.sched.ledger.version)

    # ------------------------------------------------------------------ messages
    async def _handle(self, peer: bytes, msg: Any) -> None:
        now = time.monotonic()
        if isinstance(msg, Hello):
            await self._hello(peer, msg, now)
        elif isinstance(msg, Heartbeat):
            self.rows.node_stats(msg.node_id, msg.stats)
            if await self._ensure_joined(msg.node_id, now):
                await self._run(self.sched.heartbeat(msg.node_id, now))
            la = self.latest_announce
            if la is not None and msg.policy_version < la.version and self.nodes.get(msg.node_id, {}).get("role") == "rollout":
                await self._send(la, to=peer)  # a missed announcement, caught up
            else:  # an answer to every beat: the node's proof that the coordinator is alive
                await self._send(Heartbeat(node_id=self.node_id, incarnation=0,
                                           policy_version=la.version if la else 0, state="running",
                                           seq=msg.seq, gpu={}, stats={}), to=peer)
        elif isinstance(msg, Commit):
            crash_point("commit", msg.step)
            attempt = self.sched.ledger.attempt(msg.task_id)
            fresh = attempt is not None and not attempt.committed
            cmds = self.sched.fragment_committed(msg.task_id, msg.node_id, msg.policy_version,
                                                 msg.gen_seconds, now, step=msg.step,
                                                 fragment=msg.fragment)
            if fresh and attempt is not None and attempt.committed:  # the ledger took it
                key = str(attempt.step - msg.policy_version)
                self.staleness_hist[key] = self.staleness_hist.get(key, 0) + attempt.trajectories
            await self._run(cmds)
        elif isinstance(msg, Consumed):
            zombie = self.sched.ledger.attempt(msg.task_id) is None
            cmds = self.sched.fragment_consumed(msg.task_id, msg.rank, msg.trained, dict(msg.discarded),
                                                msg.train_seconds, now, step=msg.step,
                                                fragment=msg.fragment, gen_version=msg.policy_version)
            if zombie and msg.trained:  # trained after its revoke (counts checked by the ledger)
                self.recovery["late_trained"] += msg.trained
            await self._run(cmds)
            self._flush_rows()
        elif isinstance(msg, VersionAnnounce):
            if self.trainers.get(0, {}).get("peer") != peer:
                self.recovery["ignored_announces"] += 1  # a dead rank 0's late message
                return
            failed = self.resume.announced(msg.version)
            if failed is not None:
                self.request_stop(failed)
                return
            if self.latest_announce is None or msg.version > self.latest_announce.version:
                self.latest_announce = msg
                self.weights.published(msg.version, now)
                await self.pub.send(msg)
            cmds = self.sched.version_published(msg.version, now)
            self.resume.take_cut(msg, self.sched, self.staleness_hist)
            await self._run(cmds)
        elif isinstance(msg, StepDone):
            self._step_done(msg)
            signal_point("stepdone", msg.version)  # TEST-ONLY (digenrl/faults.py)
        elif isinstance(msg, Samples):  # a grid for the trackers (a train grid: a prompt a row)
            self.metrics.write_samples(msg.step, msg.kind, msg.grid, msg.caption,
                                       [self.prompts[i] for i in msg.prompt_ids if i < len(self.prompts)])
        elif isinstance(msg, WeightsHeld):
            self.weights.held(msg.node_id, msg.version, now)
            self._maybe_finish(now)
        elif isinstance(msg, TagOffer):
            if not await self._ensure_joined(msg.node_id, now):
                self.unexpected("control", msg, why=f"from {msg.node_id!r}, not a welcomed node")
                return
            ready = sum(1 for n in self.nodes.values() if n["role"] == "rollout" and n.get("ready"))
            if ready < self.cfg.cluster.rollouts:
                # still starting up: BTS would see no rollout capacity at all and hand the
                # trainer whole steps that the rollouts, about to join, do faster
                self.tag_offers_early += 1
                return
            await self._run(self.sched.tag_offer(msg.node_id, now))
        else:
            self.unexpected("control", msg)

    async def _ensure_joined(self, node_id: str, now: float) -> bool:
        """A welcomed node joins the schedule with its first sign of life (its model is built)."""
        node = self.nodes.get(node_id)
        if node is None or node["role"] == "reward" or self.sched.is_broken(node_id):
            return False  # reward workers are not scheduled; a broken node is not any more
        if not node.get("ready"):
            node["ready"] = True
            if node.get("joined_before"):
                self.recovery["rejoins"] += 1
                self.log.warning("node back after being lost: re-joined", node=node_id)
            node["joined_before"] = True
            await self._run(self.sched.node_joined(node_id, node["role"], node["gpu"], now,
                                                   rank=node.get("rank")))
            if node["role"] == "rollout":
                await self.weights.join(node_id, node.get("relay", ""))
        return True

    async def _hello(self, peer: bytes, msg: Hello, now: float) -> None:
        if msg.role == "reward":
            # welcomed at once (it needs no peer); the others wait until every worker is known,
            # since rollouts and TAG helpers connect to all of them (a restarted worker binds
            # its old address again: the launcher gives each worker a fixed one)
            self.gate.bind(peer, msg)
            self.rewards[msg.node_id] = {"peer": peer, "endpoint": msg.data_endpoint}
            self.nodes[msg.node_id] = {"role": "reward", "peer": peer, "gpu": msg.gpu, "pid": msg.pid}
            await self._send(self._welcome(msg.node_id, sorted(self.rewards).index(msg.node_id),
                                           self.cfg.cluster.rewards), to=peer)
            await self._release(now)
            return
        if msg.role == "trainer":
            if any(t["node_id"] == msg.node_id for t in self.trainers.values()) and \
                    len(self.trainers) == self.expected_trainers:
                await self.reset(f"{msg.node_id} said Hello again (restarted)")
                if self.stopping:
                    return
            self.gate.bind(peer, msg)  # after a reset, which forgets every binding
            rank = len(self.trainers)
            self.trainers[rank] = {"peer": peer, "node_id": msg.node_id, "gpu": msg.gpu,
                                   "data_endpoint": msg.data_endpoint,
                                   "weights_endpoint": msg.weights_endpoint}
            self.nodes[msg.node_id] = {"role": "trainer", "peer": peer, "rank": rank, "gpu": msg.gpu,
                                       "pid": msg.pid}
            await self._release(now)
        else:  # a rollout (the codec admits no other role)
            self.gate.bind(peer, msg)
            if not self.trainers_welcomed:
                self.waiting_rollouts.append((peer, msg))
                return
            await self.weights.leave(msg.node_id)  # a restarted rollout joins again when ready
            self.nodes[msg.node_id] = {"role": "rollout", "peer": peer, "gpu": msg.gpu,
                                       "relay": msg.weights_endpoint, "pid": msg.pid}
            await self._send(self._welcome(msg.node_id, 0, 0), to=peer)
            if self.latest_announce is not None:
                await self._send(self.latest_announce, to=peer)

    async def _release(self, now: float) -> None:
        """Welcome the trainers (then the waiting rollouts) once every trainer rank and every
        reward worker has said Hello: their Welcome lists the workers to send samples to."""
        if self.trainers_welcomed or len(self.trainers) < self.expected_trainers \
                or len(self.rewards) < self.cfg.cluster.rewards:
            return
        self.trainers_welcomed = True
        for r, t in self.trainers.items():
            await self._send(self._welcome(t["node_id"], r, self.expected_trainers), to=t["peer"])
        waiting, self.waiting_rollouts = self.waiting_rollouts, []
        for p, h in waiting:
            await self._hello(p, h, now)

    def _welcome(self, node_id: str, rank: int, world: int) -> Welcome:
        endpoints = {f"trainer/{r}": t["data_endpoint"] for r, t in self.trainers.items()}
        endpoints.update({f"reward/{n}": w["endpoint"] for n, w in self.rewards.items()})
        endpoints["dist"] = self.dist_endpoint
        endpoints["pub"] = self.pub.endpoint
        endpoints["weights"] = self.trainers[0]["weights_endpoint"] if self.trainers else ""
        return Welcome(node_id=node_id, run_id=self.run_dir.name, config_toml=to_toml(self.cfg),
                       endpoints=endpoints, rank=rank, world_size=world)

    async def _send(self, msg: Any, to: bytes) -> None:
        """Send to one node; a node that is gone is the launcher's or the heartbeats' news,
        so a failed send is counted and logged, never fatal to the coordinator."""
        try:
            await self.control.send(msg, to=to)
        except PeerLost:
            self.recovery["send_to_lost_peer"] = self.recovery.get("send_to_lost_peer", 0) + 1
            self.log.warning("send to a lost peer dropped", peer=to, msg=type(msg).__name__)

    # ------------------------------------------------------------------ scheduler commands
    async def _run(self, cmds: list[Any]) -> None:
        if self.stopping:  # the nodes were told to stop: nothing more to assign, revoke or rewind
            return
        for cmd in cmds:
            if isinstance(cmd, AssignCmd):
                if self.t_first_assign is None:
                    self.t_first_assign = time.perf_counter()
                self.watchdog.work_assigned(time.monotonic())
                node = self.nodes.get(cmd.node_id)
                if node is None:
                    continue
                await self._send(Assign(
                    task_id=cmd.task_id, step=cmd.step, fragment=cmd.fragment,
                    prompt_ids=list(cmd.prompt_ids), prompts=[self.prompts[i] for i in cmd.prompt_ids],
                    seeds=list(cmd.seeds), group_size=cmd.group_size, version_floor=cmd.version_floor,
                    lease_s=cmd.lease_s, sde_steps=list(cmd.sde_steps),
                    owners={str(t): r for t, r in zip(cmd.trained_steps, cmd.owners)},
                    metadata=[self.metadata[i] for i in cmd.prompt_ids]),
                    to=node["peer"])
            elif isinstance(cmd, RevokeCmd):
                node = self.nodes.get(cmd.node_id)
                if node is not None:
                    await self._send(Revoke(task_id=cmd.task_id, reason=cmd.reason), to=node["peer"])
                for t in self.trainers.values():  # trainers drop the attempt's staged chunks
                    await self._send(Revoke(task_id=cmd.task_id, reason=cmd.reason), to=t["peer"])
            elif isinstance(cmd, ShutdownCmd):
                if cmd.reason.startswith("trainer_lost"):
                    await self.reset(cmd.reason)
                elif cmd.reason == "done":
                    # every live rollout ends holding the final version (it is prefetching it)
                    rt = self.cfg.runtime
                    self.finish_by = time.monotonic() + 2 * rt.heartbeat_s * rt.heartbeat_misses
                    self._maybe_finish(time.monotonic())
                else:
                    self.request_stop(cmd.reason)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.runtime.heartbeat_s / 2)
            self.ticks += 1  # the service watchdog's sign of life (actors/cluster.py)
            now = time.monotonic()
            await self._run(self.sched.tick(now))
            self._fence_silent()
            for node_id in self.weights.members:  # lost by silence: out of the relay
                if not self.sched.is_live(node_id):
                    await self.weights.leave(node_id)
            self._maybe_finish(now)
            await self._check_stall(now)

    def _maybe_finish(self, now: float) -> None:
        """After the last step: stop once every live rollout holds the final version, or at
        the deadline (counted in recovery.final_weights_missing)."""
        if self.finish_by is None or self.stopping:
            return
        final = self.latest_announce.version if self.latest_announce else 0
        if self.weights.all_hold(final):
            self.request_stop("done")
        elif now >= self.finish_by:
            missing = sorted(set(self.weights.members) - self.weights.holders(final))
            self.recovery["final_weights_missing"] = len(missing)
            self.log.warning("rollouts without the final version at the end", version=final, nodes=missing)
            self.request_stop("done")

    async def _send_node(self, node_id: str, msg: Any) -> None:
        node = self.nodes.get(node_id)
        if node is not None:
            await self._send(msg, to=node["peer"])

    def _fence_silent(self) -> None:
        """Nodes the scheduler lost by silence (a SIGSTOP, a VM stall, a partition) are no
        longer joined here either: their attempts were revoked (late messages are fenced as
        zombies) and their next sign of life re-joins them as a new incarnation."""
        for node_id, node in self.nodes.items():
            if node.get("ready") and not self.sched.is_live(node_id):
                node["ready"] = False
                if why := self.sched.is_broken(node_id):
                    self.recovery["nodes_broken"] += 1
                    self.log.error("node broken: dropped, its work reassigned", node=node_id, why=why)
                    continue
                self.recovery["rollouts_lost"] += node["role"] == "rollout"
                self.log.warning("node silent: lost, will re-join on its next message", node=node_id)

    async def _check_stall(self, now: float) -> None:
        """A live run that no longer progresses is rewound like a lost trainer (core/watchdog.py)."""
        if self.stopping:
            return
        why = self.watchdog.check(now, rollouts_live=self.sched.live_count("rollout"),
                                  trainers_live=self.sched.live_count("trainer"),
                                  trainers_expected=self.expected_trainers)
        if why is not None:
            self.recovery["stalls"] += 1
            await self.reset(why)

    async def _shutdown_all(self, reason: str) -> None:
        await self.pub.send(Shutdown(reason=reason))
        for node in self.nodes.values():
            with contextlib.suppress(PeerLost):  # it already left (it heard the PUB)
                await self.control.send(Shutdown(reason=reason), to=node["peer"])

    # ------------------------------------------------------------------ metrics
    def traffic(self) -> tuple[float, float]:
        """(messages, frame bytes) the whole cluster sent so far: this actor's sockets now,
        each node's as of its latest heartbeat."""
        own = [s.statistics() for s in (self.control, self.pub) if hasattr(s, "statistics")]
        return self.rows.traffic((st.sent, st.bytes_sent) for st in own)

    def _step_done(self, msg: StepDone) -> None:
        now = time.perf_counter()
        self.t_last_step = now
        self.watchdog.step_done(time.monotonic())
        self.rows.step_done(msg.step, msg.version, msg.metrics, wall_time=now - self.t0,
                            traffic=self.traffic())
        self._flush_rows()
        self._count_skipped(msg.metrics.get("skipped_steps"))

    def _count_skipped(self, skipped: object) -> None:
        """Optimizer steps skipped for a non-finite loss or gradient, in a row: a trainer GPU
        computing NaN. Trainer ranks cannot be dropped, so ``run.node_fault_limit`` of them in
        a row stop the run (each rank's log names the step's fragments and where the loss was
        not finite). A restarted trainer counts from 0 again."""
        if not isinstance(skipped, int) or isinstance(skipped, bool):
            return
        seen, streak = self.skipped
        self.skipped = (skipped, streak + 1 if skipped > seen else 0)
        if self.skipped[1] >= self.cfg.run.node_fault_limit:
            self.request_stop(f"failed: the trainer ranks skipped {self.skipped[1]} optimizer steps "
                              "in a row for a non-finite loss or gradient (see logs/trainer-*.log)")

    def flush_metrics(self) -> None:
        """Write every step row still waiting (the run is over, or being rewound)."""
        self._flush_rows(final=True)

    def _flush_rows(self, *, final: bool = False) -> None:
        self.rows.flush(self.sched.ledger, self.cfg.runtime.fragments_per_step, final=final)

    def summary(self, *, wall_s: float, started_at: float,
                restarts: Mapping[str, int]) -> dict[str, Any]:
        """The run's summary.json (docs/metrics.md): throughput, slots, accounting, recovery.

        ``wall_s``: this process's run time; ``started_at``: its ``perf_counter`` when the
        coordinator began serving (start-up until the first assignment is reported apart as
        ``startup_s``); ``restarts``: child restarts by node id (the local launcher's).
        """
        cfg, stats = self.cfg, self.sched.statistics()
        F = cfg.runtime.fragments_per_step
        # a restored ledger keeps only slots of steps >= its version: the steps below were
        # consumed (each slot once, the ledger asserts it) before the checkpoint was taken
        base = self.resume.resumed_from[-1] if self.resume.resumed_from else 0
        consumed = base * F + sum(self.sched.ledger.is_consumed(s, f)
                                  for s in range(base, cfg.run.steps) for f in range(F))
        steps_done = stats["version"]
        # throughput from the first assignment to the last step: process start-up (imports,
        # model build) is reported apart as startup_s, as the colocated loop's figure excludes it
        t_a, t_b = self.t_first_assign, self.t_last_step
        train_wall = (t_b - t_a) if (t_a is not None and t_b is not None and t_b > t_a) else wall_s
        return {
            "mode": cfg.run.mode, "steps": steps_done, "wall_s": self.resume.wall_before + wall_s,
            "startup_s": (t_a - started_at) if t_a is not None else wall_s,
            "samples_per_s": cfg.batch_size * max(steps_done - base, 0) / train_wall,
            "slots": {"consumed": consumed, "expected": cfg.run.steps * F},
            "recovery": self.recovery, "resumed_from": self.resume.resumed_from,
            "refused": dict(self.refused),  # messages dropped by the identity gate, by reason
            "accounting": {k: stats[k] for k in ("admitted", "trained", "discarded", "in_flight")},
            "scheduler": {k: v for k, v in stats.items() if k not in ("nodes",)},
            "nodes": stats["nodes"],
            "staleness_hist": self.staleness_hist,
            "busy": self.rows.busy(),
            "batch_rows_per_forward": self.rows.batch_occupancy(),
            "traffic": dict(zip(("messages", "bytes"), self.traffic(), strict=True)),
            "weights": self.weights.summary(self.latest_announce.version if self.latest_announce else 0),
            "restarts": dict(restarts),
            "stop_reason": self.stop_reason,
            "unexpected_messages": dict(self.unexpected_messages),
        }

