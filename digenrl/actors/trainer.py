"""Trainer rank: receives its timesteps' chunks, trains fragments as they commit, steps once per batch.

    rollouts --PUSH Chunk/Commit--> [PULL data]  trainer rank r  [DEALER control] <--> coordinator
                                       |  gloo/NCCL all-reduce with the other ranks
                                       +-- rank 0: [ROUTER weights] serves WeightsPart by version

| blocking call               | waits for                                | unblocked by                  |
|-----------------------------|------------------------------------------|-------------------------------|
| data ``recv()``             | a chunk or commit                        | a rollout (or TAG) sending    |
| ``in_thread(train)``        | one fragment's forward/backward          | torch                         |
| ``in_thread(all_reduce)``   | every rank finishing the step, or voting | the slowest rank              |
|                             | to stop (Learner.reduce_gradients)       |                               |
| control ``recv()``          | Welcome, Assign (TAG), Revoke, Shutdown  | the coordinator               |

Checkpoints, the drain after a stop and the stop vote in a step's all-reduce are a component
the trainer holds, ``self.resume`` (:class:`~digenrl.actors.resume.TrainerResume`): every rank
loads the newest checkpoint of its run dir before it judges any work, and rank 0 announces
the restored version, so rollouts re-sync through the normal VersionAnnounce/WeightsRequest
path. Rank 0 writes its part of a due checkpoint at the step boundary, before announcing the
version; the coordinator completes it.

Step discipline: fragments of step s train into the accumulated gradient as their commits
arrive (GAP); commits of later steps (K = 1 lets them exist) wait until step s's optimizer
step is done, so gradients of two steps never mix. A commit whose trajectory is more than K
versions behind is rejected and counted: the defence-in-depth oracle that must never fire.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from functools import partial
from typing import Any

from digenrl.actors.base import Actor, Loop, stopped_by_signal
from digenrl.actors.peers import NodePeers
from digenrl.actors.resume import TrainerResume
from digenrl.actors.spagree import DROP, WAIT, agree
from digenrl.actors.streamer import FragmentStreamer
from digenrl.config import Config
from digenrl.core.plan import owners_for, plan_for_step
from digenrl.faults import crash_point, hang_point
from digenrl.models.seqpar import SequenceParallel, sharded
from digenrl.rl.algorithm import Staged, algorithm_for
from digenrl.rl.evaluate import eval_due, evaluate_policy
from digenrl.rl.experts import split_by_expert
from digenrl.rl.finite import NONFINITE
from digenrl.rl.fragment import FragmentJob
from digenrl.rl.learner import Learner, save_final
from digenrl.rl.policy import Policy
from digenrl.rl.sde import sigma_schedule
from digenrl.rl.sharding import pass_count, step_passes
from digenrl.telemetry.images import grid_array, save_grid
from digenrl.telemetry.tracking import images_due
from digenrl.transport.protocol import (
    Assign,
    Chunk,
    CleanSample,
    Commit,
    Consumed,
    Heartbeat,
    Revoke,
    Samples,
    Shutdown,
    StepDone,
    TagOffer,
    VersionAnnounce,
)
from digenrl.transport.staging import HostToDevice, Landed
from digenrl.transport.weights import WeightStore, build_version, serve_weights


class TrainerActor(Actor):
    role = "trainer"

    def __init__(self, *, peers: NodePeers, cfg: Config, policy: Policy, rank: int, world_size: int,
                 run_dir: Any, reward_fn: Any, test_set: Any = None, eval_reward: Any = None,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.peers = peers
        self.cfg = cfg
        self.policy = policy
        self.learner = Learner(policy, cfg)
        self.rank = rank
        self.world_size = world_size
        #: sequence parallelism: this rank trains what its group's leader owns, with the group
        self.sp = cfg.train.sequence_parallel
        self.leader = rank - rank % self.sp
        self.run_dir = run_dir
        self.reward_fn = reward_fn
        self.test_set, self.eval_reward = test_set, eval_reward  # held-out evaluation (rank 0)
        self.pending_eval: dict[str, Any] = {}  # rides on the next StepDone to the coordinator
        self.sigma_max = float(sigma_schedule(cfg.sampler.num_steps, cfg.sampler.shift)[1])
        # what a rollout sends, this rank stages and trains, and the loss: the run's algorithm
        self.algorithm = algorithm_for(cfg.train)
        # task -> slot -> (a chunk, or a forward-process fragment's clean sample; its tensors on
        # their way to the training device); slots are the algorithm's (a chunk's timestep)
        self.staged: dict[int, dict[int, tuple[Chunk | CleanSample, Landed]]] = defaultdict(dict)
        self.h2d = HostToDevice(getattr(policy.model, "device", "cpu"))
        # staging is bounded: bytes charged to the byte window, attempts and commits per slot
        self.staged_bytes = 0
        self._staged_slot: dict[int, tuple[int, int]] = {}             # task -> (step, fragment)
        self.pending: dict[int, list[Commit]] = defaultdict(list)        # step -> commits
        self.consumed_slots: dict[int, set[int]] = defaultdict(set)      # step -> fragments
        self.rejected_stale = 0
        self.revoked: set[int] = set()
        # TAG: fragments this rank generates with its current weights (never its gradients)
        self.streamer = FragmentStreamer(
            node_id=self.node_id, cfg=cfg, pushes=peers.pushes, control=peers.control,
            scorers=peers.scorers, reward_fn=reward_fn, span="tag_generate",
            lane=f"{self.role}-chunk-sender", recorder=self.recorder, log=self.log,
            submit=self.submit, revoked=self.revoked, unexpected=self.unexpected,
            slowdown=self.slowdown, algorithm=self.algorithm)
        self.store = WeightStore()  # rank 0: the published versions its weights ROUTER serves
        self.tag_tasks: asyncio.Queue[Assign] = asyncio.Queue()
        self._offered = False
        self._step_t0 = time.perf_counter()
        self.wake = asyncio.Event()
        self._trained_steps: dict[int, list[int]] = {}  # step -> its plan's trained timesteps
        # set once the checkpoint (if any) is loaded: work is judged against the restored
        # version, not version 0 (rank 0 may announce, and rollouts send, before this rank
        # has restored; what they send waits in the socket)
        self.restored = asyncio.Event()
        # checkpoints, the drain after a stop, and the stop vote at each step's end
        self.resume = TrainerResume(cfg=cfg, run_dir=run_dir, policy=policy, learner=self.learner, rank=rank,
                                    world_size=world_size, in_thread=self.in_thread,
                                    request_stop=self.request_stop, wait_stopped=self.wait_stopped,
                                    step_passes=self._step_passes, recorder=self.recorder, log=self.log,
                                    compute_init=self.hooks.compute_init)

    @property
    def policy_version(self) -> int:
        """Optimizer steps this rank has taken (its heartbeats report it)."""
        return self.policy.version

    def request_stop(self, reason: str) -> None:
        super().request_stop(reason)
        self.wake.set()  # a rank waiting for work re-checks ``stopping``

    def drop_model(self) -> None:
        """Let go of the policy and learner (and the resume component holding them too): a
        sharded (FSDP) model holds the process group, which must be destroyed after the model,
        not by the interpreter's exit."""
        del self.learner, self.policy, self.resume

    async def restore(self) -> bool:
        """Load the run's latest checkpoint, if any (:meth:`TrainerResume.restore`), then let
        the data loop judge work; False (and a failed stop) if the ranks verified different
        checkpoints."""
        counters = await self.resume.restore()
        if counters is None:
            return False
        self.rejected_stale = int(counters.get("rejected_stale", 0))
        self.log = self.log.bind(policy_version=self.policy.version)
        self.restored.set()
        return True

    async def drain_checkpoint(self) -> int | None:
        """After the actor stopped: this rank's part of a drain checkpoint, if its stop calls for
        one (:meth:`TrainerResume.drain_checkpoint`); the version written, or None."""
        return await self.resume.drain_checkpoint(signalled=stopped_by_signal(self.stop_reason))

    # ---------------------------------------------------------------- loops
    def background(self) -> list[Loop]:
        loops = [self.peers.heartbeat_loop(self), self._control_loop, self._data_loop,
                 *self.streamer.reward_loops()]
        if self.rank == 0:
            loops.append(self._weights_loop)
        return loops

    async def main(self) -> None:
        if not await self.restore():
            return
        if self.rank == 0 or self.policy.collective:
            await self._publish(self.policy.version)
        await self._maybe_eval(self.policy.version)
        F = self.cfg.runtime.fragments_per_step
        # a sharded rank generating alone would leave the other ranks' collectives unmatched
        # (nor does a sequence-parallel rank: its group's passes pair up); a rank holding
        # one of two experts (rl/experts.py) cannot denoise a whole trajectory
        offers = (self.cfg.runtime.tag != "never" and not self.policy.sharded and self.sp == 1
                  and self._generates())
        while not self.stopping and self.policy.version < self.cfg.run.steps:
            self.wake.clear()  # before looking, so a wake set while we look (or send) is not lost
            step = self.policy.version
            ready = self._ready(step)
            if ready:
                self._offered = False  # worked: offer again next time we wait (offers are one-shot)
                await self._consume_ready(step, ready)
                # No optimizer step once a stop is asked: the version the coordinator last
                # heard announced stays the trainer's (a drain checkpoint is of that boundary).
                # Several ranks vote at the step's end (one rank leaving alone would strand
                # the others in a collective): actors/resume.py.
                if len(self.consumed_slots[step]) == F:
                    if self.resume.votes:
                        if not await self._finish_step(step):
                            break  # a rank voted to stop: no rank stepped
                    elif not self.stopping:  # one rank: nobody to vote with
                        await self._finish_step(step)
                continue
            if not self.tag_tasks.empty():
                await self._generate(self.tag_tasks.get_nowait())
                continue
            if not self._offered and offers:
                self._offered = True
                await self.peers.control.send(TagOffer(node_id=self.node_id, rank=self.rank,
                                                       free_mb=self.peers.gpu_free_mb()))
            with self.recorder.span("wait"):
                await self.wake.wait()
        if self.resume.votes and not self.resume.voted and self.policy.version < self.cfg.run.steps:
            # the step's all-reduce other ranks may be waiting in
            await self.resume.vote_stop(drain=stopped_by_signal(self.stop_reason))
        await self.wait_stopped()

    async def _consume_ready(self, step: int, ready: list[Commit]) -> None:
        """Consume ``ready`` (from :meth:`_ready`) in order; a sequence-parallel group's slot
        its ranks did not agree to close (actors/spagree.py) holds the later ones back."""
        for i, commit in enumerate(ready):
            await self._consume(commit)
            if self.sp > 1 and commit.fragment not in self.consumed_slots[step]:
                self.pending[step].extend(ready[i + 1:])
                return

    def _ready(self, step: int) -> list[Commit]:
        """The step's commits to consume now. Sequence-parallel ranks of one group must train
        the same fragments in the same order, whatever order their commits arrived in: they
        take them by fragment index, up to the first fragment not yet here (later ones wait)."""
        pending = self.pending.pop(step, [])
        if self.sp == 1:
            return pending
        done = set(self.consumed_slots[step])
        ready: list[Commit] = []
        for commit in sorted(pending, key=lambda c: c.fragment):
            nxt = min(set(range(self.cfg.runtime.fragments_per_step)) - done, default=None)
            if commit.fragment in done or commit.fragment == nxt:
                ready.append(commit)  # a second attempt of a slot: _consume reports it
                done.add(commit.fragment)
            else:
                self.pending[step].append(commit)
        return ready

    def _arrival_check(self, msg: Chunk | CleanSample | Commit) -> str | None:
        """Why ``msg`` cannot be work for this rank (None: it can). A slot outside the run
        (fragment >= F: the issue-20 ``fragment = 99`` commit finished a one-fragment step on
        its own), a step beyond what admission allows (v + K, plus one), a revoked attempt, or a chunk
        of a timestep another rank owns is refused before it is staged or counted."""
        F, K, v = self.cfg.runtime.fragments_per_step, self.cfg.runtime.staleness, self.policy.version
        if not 0 <= msg.fragment < F:
            return "bad_fragment"
        # v + K + 1: another rank's optimizer step (and so admission) may run a moment ahead
        # of this rank's version; anything further is never honest
        if not 0 <= msg.step < self.cfg.run.steps or msg.step > v + K + 1:
            return "step_out_of_window"
        if msg.task_id in self.revoked:
            return "revoked"
        if isinstance(msg, Commit):
            return None
        if msg.step < v:
            return "stale_chunk"  # its step is trained: nothing would ever consume it
        trained = self._trained_of(msg.step)
        per = self.cfg.train.prompts_per_step // F * self.cfg.train.group_size
        return self.algorithm.refusal(
            msg, trained=trained, owners=owners_for(trained, self.world_size, self.cfg.runtime.tsp,
                                                    msg.fragment, F, self.sp),
            rank=self.leader, fragment_shape=(per, *self.policy.model.latent_shape))

    def _stage(self, msg: Chunk | CleanSample) -> str | None:
        """Keep a chunk, or a forward-process fragment's clean sample, until its commit; why
        not, if it would overflow the bounds. Honest staging never exceeds the ledger's byte
        window (or one fragment when that is larger) and holds at most two attempts of a slot
        (a revoked one whose Revoke is still on its way, and its successor)."""
        slot = (msg.step, msg.fragment)
        task = msg.task_id
        if task not in self._staged_slot:
            if sum(1 for s in self._staged_slot.values() if s == slot) >= 2:
                return "too_many_attempts_of_a_slot"
        elif self._staged_slot[task] != slot:
            return "task_changed_slot"
        nbytes = self._nbytes(msg)
        slot_of = self.algorithm.slot(msg)
        old = self.staged.get(task, {}).get(slot_of)
        freed = self._nbytes(old[0]) if old is not None else 0
        # a whole fragment's chunks (or its one clean sample) on this rank
        fragment_bytes = nbytes * self.algorithm.staged_per_fragment(self._trained_of(msg.step))
        window = int(self.cfg.runtime.byte_window_mb * 2**20)
        if self.staged_bytes - freed + nbytes > window + fragment_bytes:
            return "staging_over_the_byte_window"
        self._staged_slot[task] = slot
        # on a GPU the copy starts now, on a side stream, while earlier work trains
        self.staged[task][slot_of] = (msg, self.h2d.stage(self.algorithm.tensors(msg)))
        self.staged_bytes += nbytes - freed
        return None

    def _unstage(self, task_id: int) -> Staged:
        """Take a task's staged messages out (for training, or to drop them)."""
        staged = self.staged.pop(task_id, {})
        self._staged_slot.pop(task_id, None)
        self.staged_bytes -= sum(self._nbytes(c) for c, _ in staged.values())
        return staged

    def _nbytes(self, msg: Chunk | CleanSample) -> int:
        return sum(t.nbytes for t in self.algorithm.tensors(msg))

    async def _data_loop(self) -> None:
        data = self.peers.data
        assert data is not None, "a trainer's peers hold its data PULL (actors/node.py)"
        await self.restored.wait()
        while True:
            _, msg = await data.recv()
            if not isinstance(msg, (self.algorithm.staged_type, Commit)):
                self.unexpected("data", msg)
                continue
            why = self._arrival_check(msg)
            if why == "revoked" and isinstance(msg, Commit):
                self._unstage(msg.task_id)  # a revoked attempt: its slot is re-queued elsewhere
                continue
            if why is not None:
                self.refuse(why, msg, task=msg.task_id, step=msg.step, fragment=msg.fragment)
                continue
            if not isinstance(msg, Commit):
                why = self._stage(msg)
                if why is not None:
                    self.refuse(why, msg, task=msg.task_id, step=msg.step, staged_bytes=self.staged_bytes)
            elif isinstance(msg, Commit):
                if msg.task_id in self.revoked:
                    self._unstage(msg.task_id)
                    continue  # a revoked attempt: its slot is re-queued elsewhere
                if msg.step < self.policy.version or msg.fragment in self.consumed_slots[msg.step]:
                    # A re-attempt of a slot this rank already trained (its first attempt was
                    # revoked after it reached us). Report it, or the scheduler waits forever.
                    self._unstage(msg.task_id)
                    self.log.warning("duplicate of a trained slot dropped", task=msg.task_id,
                                     step=msg.step, fragment=msg.fragment)
                    await self._report(msg, 0, {"duplicate_slot": len(msg.prompt_ids) * self.cfg.train.group_size}, 0.0)
                    continue
                if sum(1 for c in self.pending[msg.step] if c.fragment == msg.fragment) >= 2:
                    self.refuse("too_many_commits_of_a_slot", msg, task=msg.task_id, step=msg.step)
                    continue
                self.pending[msg.step].append(msg)
                self.wake.set()

    async def _control_loop(self) -> None:
        while True:
            _, msg = await self.peers.control.recv()
            self.peers.heard_from_coordinator()
            if isinstance(msg, Assign):
                self._offered = False
                self.tag_tasks.put_nowait(msg)
                self.wake.set()
            elif isinstance(msg, Revoke):
                # the attempt is dead: its slot is re-queued, so never train or report it
                self.revoked.add(msg.task_id)
                self._unstage(msg.task_id)
            elif isinstance(msg, Shutdown):
                self.request_stop(msg.reason)
            elif isinstance(msg, VersionAnnounce):
                pass  # ranks learn versions from their own optimizer steps
            elif not isinstance(msg, Heartbeat):  # a Heartbeat answers ours: proof of life
                self.unexpected("control", msg)

    async def _weights_loop(self) -> None:
        """Rank 0 serves the published versions (the first rollout of the relay, or all of
        them with runtime.weights_fanout = 0); a version no longer kept is answered missing."""
        assert self.peers.weights is not None
        await serve_weights(self.peers.weights, self.store, self.unexpected)

    # ---------------------------------------------------------------- training
    async def _consume(self, commit: Commit) -> None:
        step = commit.step
        if self.sp > 1 and commit.fragment not in self.consumed_slots[step]:
            # the group's ranks agree on the attempt they train (a Revoke may reach them apart)
            sp = getattr(self.policy.model, "sp", None)
            assert isinstance(sp, SequenceParallel), "actors/node.py fits a sequence-parallel rank's model"
            verdict = await self.in_thread("wait", agree, sp.group, commit.fragment, commit.task_id,
                                           commit.task_id in self.revoked, getattr(self.policy.model, "device", "cpu"),
                                           step=step, fragment=commit.fragment)
            if verdict == DROP:  # revoked here or on another rank of the group
                self.revoked.add(commit.task_id)
                self._unstage(commit.task_id)
                return
            if verdict == WAIT:  # another rank still holds an older attempt: the next round
                self.pending[step].append(commit)
                return
        if commit.task_id in self.revoked or commit.fragment in self.consumed_slots[step]:
            self._unstage(commit.task_id)
            if commit.task_id not in self.revoked:  # see _data_loop: report the duplicate
                await self._report(commit, 0, {"duplicate_slot": len(commit.prompt_ids) * self.cfg.train.group_size}, 0.0)
            return
        staged = self._unstage(commit.task_id)
        # a discarded fragment (its reward worker failed) carries no rewards: count its trajectories
        n = len(commit.prompt_ids) * self.cfg.train.group_size if commit.discard else len(commit.rewards)
        discarded: dict[str, int] = {}
        trained = 0
        t0 = time.perf_counter()
        trained_steps = self._trained_of(step)
        passes = pass_count(trained_steps, self.world_size, self.cfg.runtime.tsp, commit.fragment,
                            self.cfg.runtime.fragments_per_step, self.rank, self.sp)
        if commit.discard:  # named, never trained on made-up rewards
            discarded[commit.discard] = n
            self.learner.discard(n, commit.discard)
            if self.policy.sharded:  # the other ranks reach the same commit: keep passes paired
                await self.in_thread("fragment_train", self.learner.idle, passes, step=step)
            self.log.error("fragment discarded by its rollout", task=commit.task_id, step=step,
                           reason=commit.discard)
        elif not self.algorithm.within_staleness(self.policy.version, commit.policy_version,
                                                 self.cfg.runtime.staleness):
            self.rejected_stale += n
            discarded["stale"] = n
            self.learner.discard(n, "stale")
            if self.policy.sharded:  # the other ranks may train it: keep their passes paired
                await self.in_thread("fragment_train", self.learner.idle, passes, step=step)
            self.log.error("stale fragment rejected", task=commit.task_id, step=step,
                           gen_version=commit.policy_version, version=self.policy.version)
        else:
            owners = owners_for(trained_steps, self.world_size, self.cfg.runtime.tsp,
                                commit.fragment, self.cfg.runtime.fragments_per_step, self.sp)
            records = self.algorithm.to_train(staged, trained=trained_steps, owners=owners,
                                              rank=self.leader, task_id=commit.task_id)
            crash_point("trainer", step, once=self.run_dir / "logs" / f"crashed-{self.node_id}")
            before = self.learner.stats.trained
            discarded_before = dict(self.learner.stats.discarded)
            await self.in_thread("fragment_train", self._train, records, staged, commit,
                                 len(trained_steps), passes, step=step, fragment=commit.fragment)
            trained = self.learner.stats.trained - before
            for reason, count in self.learner.stats.discarded.items():
                if count - discarded_before.get(reason, 0):
                    discarded[reason] = count - discarded_before.get(reason, 0)
            if discarded.get(NONFINITE):
                self.log.error("non-finite trajectories discarded", node=commit.node_id,
                               task=commit.task_id, step=step, count=discarded[NONFINITE])
            if self.rank == 0 and (step == 0 or step == self.cfg.run.steps - 1) and commit.images.numel():
                # PNG compression of up to MAX_SIDE^2 pixels: not on the event loop (heartbeats)
                await asyncio.to_thread(
                    save_grid, commit.images, self.run_dir / "samples" / f"step_{step:04d}_f{commit.fragment}.png",
                    nrow=self.cfg.train.group_size)
            if self.rank == 0 and not self.consumed_slots[step] and commit.images.numel() \
                    and images_due(step, self.cfg):  # the step's first fragment, for the trackers
                grid = await asyncio.to_thread(grid_array, commit.images, self.cfg.train.group_size)
                await self.peers.control.send(Samples(step=step, kind="train", grid=grid, caption="",
                                                      prompt_ids=list(commit.prompt_ids)))
        self.consumed_slots[step].add(commit.fragment)
        await self._report(commit, trained, discarded, time.perf_counter() - t0)

    def _step_passes(self, step: int) -> int:
        """Training passes of ``step`` on its busiest rank (sharded ranks pad to it)."""
        return step_passes(self._trained_of(step), self.world_size, self.cfg.runtime.tsp,
                           self.cfg.runtime.fragments_per_step, self.sp)

    def _trained_of(self, step: int) -> list[int]:
        """The trained timesteps of ``step``'s plan, computed once per step (consuming each
        fragment, reporting it and the optimizer step all need them)."""
        trained = self._trained_steps.get(step)
        if trained is None:
            trained = self._trained_steps[step] = plan_for_step(self.cfg, step)[0]
        return trained

    async def _report(self, commit: Commit, trained: int, discarded: dict[str, int],
                      seconds: float) -> None:
        if self.rank not in owners_for(self._trained_of(commit.step), self.world_size,
                                       self.cfg.runtime.tsp, commit.fragment,
                                       self.cfg.runtime.fragments_per_step, self.sp):
            # this rank trains none of the fragment's timesteps, or is a follower of an
            # SP group (its leader reports the group's): nothing to report
            return
        await self.peers.control.send(Consumed(
            task_id=commit.task_id, step=commit.step, fragment=commit.fragment, rank=self.rank,
            policy_version=commit.policy_version, trained=trained, discarded=discarded,
            train_seconds=seconds))

    def _train(self, records: Staged, staged: Staged, commit: Commit, n_trained_total: int,
               passes: int) -> None:
        hang_point("trainer", commit.step, once=self.run_dir / "logs" / f"hung-{self.node_id}")  # TEST-ONLY
        # on the compute thread: its stream is the one that waits for the staged copies
        inputs = self.algorithm.landed(records, staged, cfg=self.cfg, step=commit.step,
                                       fragment=commit.fragment)
        with sharded(self.policy.model):  # sequence parallelism: the group's passes, together
            self.learner.train_fragment(
                records=inputs.records, cond=dict(commit.cond), rewards=commit.rewards,
                gen_version=commit.policy_version, n_trained_total=n_trained_total,
                sigma_max=self.sigma_max, reward_terms=commit.reward_terms, passes=passes,
                final=inputs.final, seeds=inputs.seeds,
                source=f"{commit.step}/{commit.fragment} task {commit.task_id} from {commit.node_id}")

    async def _finish_step(self, step: int) -> bool:
        """The step's optimizer step, then its report, checkpoint and publish; False if a rank
        voted to stop instead (then no rank stepped)."""
        pad_to = self._step_passes(step)
        if self.resume.votes:
            voted = await self.in_thread("optimizer_step", partial(
                self.resume.step_unless_voted, self.stopping, pad_to, stopped_by_signal(self.stop_reason)),
                step=step)
            if voted is None:
                await self.resume.peer_voted_to_stop(step)
                return False
            metrics = voted
        else:
            # one rank (several vote): nothing to all-reduce
            metrics = await self.in_thread("optimizer_step", partial(self.learner.finish_step, None,
                                                                     pad_to=pad_to), step=step)
        metrics["rejected_stale"] = self.rejected_stale
        if self.learner.last_skipped is not None:
            self.log.error("optimizer step skipped: non-finite loss or gradient, weights untouched",
                           step=step, fragments=self.learner.last_skipped[0],
                           nonfinite_loss=self.learner.last_skipped[1])
        dt = time.perf_counter() - self._step_t0
        self._step_t0 = time.perf_counter()
        metrics["step_seconds"] = dt
        metrics["samples_per_s"] = self.cfg.batch_size / dt
        self.consumed_slots.pop(step, None)
        for task in [t for t, (s, _) in self._staged_slot.items() if s <= step]:
            self._unstage(task)  # an attempt of a trained slot that never committed here
        for old in [s for s in self._trained_steps if s <= step]:
            del self._trained_steps[old]
        self.log = self.log.bind(policy_version=self.policy.version)
        version, rank0 = self.policy.version, self.rank == 0
        last = version == self.cfg.run.steps
        if last:  # the final evaluation rides on the last StepDone, after which the run stops
            await self._maybe_eval(version)
        if rank0:
            metrics.update(self.pending_eval)
            self.pending_eval = {}
            # metrics first: the coordinator may stop as soon as the last version is announced
            await self.peers.control.send(StepDone(step=step, version=version, metrics=metrics))
        if not (rank0 or self.policy.collective):
            return True
        # Rank 0 saves and publishes. A sharded policy's gathers are collectives, and so are
        # those of experts placed over ranks (rank 0 receives the experts it lacks), so then
        # every rank runs them, in this order, and only rank 0 writes.
        if version == self.cfg.run.steps:
            await asyncio.to_thread(partial(save_final, self.policy, self.run_dir, write=rank0))
        # before the announcement: the coordinator completes a due checkpoint on it
        await self.resume.at_boundary(version, {"rejected_stale": self.rejected_stale})
        await self._publish(version, self.learner.last_changed)
        if not last:  # after the publish: rollouts fetch the new version while we evaluate it
            await self._maybe_eval(version)
        return True

    async def _maybe_eval(self, version: int) -> None:
        """Held-out evaluation of ``version`` on rank 0 (a sharded policy's other ranks join its
        forward passes). Its ``eval/`` metrics go to the coordinator with the next StepDone."""
        if self.test_set is None or not eval_due(version, self.cfg):
            return
        if not (self.rank == 0 or self.policy.sharded):
            return
        rank0 = self.rank == 0
        grids: list[tuple[Any, Any, str]] = []  # (eval or eval_ema, grid, caption) for the trackers
        show = (lambda *g: grids.append(g)) if rank0 and self.cfg.tracking.backends else None
        row = await self.in_thread("evaluate", partial(
            evaluate_policy, self.policy, self.cfg, self.test_set, self.eval_reward if rank0 else None,
            version=version, run_dir=self.run_dir if rank0 else None, show=show), version=version)
        if rank0:
            self.pending_eval.update({**row, "eval/policy_version": version})
        for kind, grid, caption in grids:
            await self.peers.control.send(Samples(step=version, kind=kind, grid=grid, prompt_ids=[],
                                                  caption=caption))

    def _generates(self) -> bool:
        """Whether this rank's model can denoise whole trajectories (a two-expert model whose
        rank holds one expert cannot)."""
        held = getattr(self.policy.model.transformer, "held", None)
        return held is None or len(held) == 2

    async def _publish(self, version: int, changed: tuple[str, ...] | None = None) -> None:
        """Rank 0 serves ``version`` and announces it; sharded ranks all join the gather, and
        ranks of experts placed over ranks send rank 0 those it lacks.

        The version carries new bytes only of what its step ``changed`` (None: every part;
        two-expert models: the experts the step's update changed, so every rank gathers the
        same), and keeps the other experts' bytes of the version before (transport/weights.py).
        Version 0 carries nothing (every node loads it itself); a restored version everything."""
        with self.working("weight_publish", version=version):
            if version == 0:
                changed = ()
            if changed == ():
                full: dict[str, Any] = {}
            elif self.policy.placement is not None:  # the experts rank 0 lacks come from their holders
                full = await self.submit("weight_gather", partial(self.policy.whole_sync_state,
                                                                  keep=self.rank == 0, experts=changed))
            elif self.policy.sharded:  # ranks other than 0 join each gather and keep nothing
                full = await asyncio.to_thread(partial(self.policy.state_dict_for_sync, keep=self.rank == 0,
                                                       experts=changed))
            elif self.rank == 0:
                full = self.policy.state_dict_for_sync(experts=changed)
            if self.rank != 0:
                return
            # state_dict_for_sync already copied: only move (a no-op on CPU) and pack
            sd = {k: v.detach().to("cpu").contiguous() for k, v in full.items()}
            before = self.store.get(self.store.newest) if version > 0 else None
            # checksums once per version, off the event loop (not once per request)
            asm = await asyncio.to_thread(build_version, version, split_by_expert(sd), before)
            self.store.begin(asm)  # the newest three are kept
            self.log.info("weights published", version=version, checksum=asm.checksum, nparts=asm.nparts,
                          new_bytes=asm.new_bytes(),
                          segments={g.name or "all": g.since for g in asm.segments})
        await self.peers.control.send(asm.announce(step=version))

    # ---------------------------------------------------------------- TAG
    async def _generate(self, task: Assign) -> None:
        """Trainer-assisted generation with the current weights; never touches gradients."""
        await self.streamer.generate_and_stream(task, self.policy.model, self.policy.version)


__all__ = ["FragmentJob", "TrainerActor"]
