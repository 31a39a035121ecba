"""One fragment's way from the sampler to the trainer: generation, staging, chunk sends, commit, scoring.

:class:`FragmentStreamer` is held by a :class:`~digenrl.actors.rollout.RolloutActor` (its
fragments) and by a :class:`~digenrl.actors.trainer.TrainerActor` (TAG fragments).
:meth:`FragmentStreamer.generate_and_stream` runs a whole trajectory as one job on the
holder's compute thread; each trained step's chunk is staged in a pooled host buffer there
(``transport/staging.py``) and handed to the event loop, which sends it to the trainer rank
that owns its timestep (TSP) while the sampler denoises on. Then the fragment's Commit goes
to every rank and the coordinator, or, when reward workers score (``cluster.rewards > 0``),
its images go to the least busy worker and the commit follows its answer
(:meth:`FragmentStreamer.reward_loops`, background loops of the holder).

Everything comes in at construction: the sockets (a PUSH per trainer rank, the control
DEALER, a DEALER per reward worker), the trace and log, the holder's compute thread
(``submit``), the set of revoked task ids (the holder's control loop fills it) and where
unexpected messages are counted. The streamer calls nothing else of its holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from digenrl.actors.base import Log, Loop
from digenrl.actors.stepengine import StepEngine
from digenrl.config import Config
from digenrl.faults import NO_SLOWDOWN, Slowdown, nan_point, poison
from digenrl.models.base import FlowModel
from digenrl.rl.algorithm import Algorithm, algorithm_for
from digenrl.rl.fragment import FragmentJob, FragmentResult
from digenrl.rl.rewards import Reward
from digenrl.rl.sampler import WIRE_DTYPES
from digenrl.telemetry.trace import SpanRecorder
from digenrl.transport.protocol import Assign, Chunk, Commit, Score, Scored
from digenrl.transport.socketio import Socket
from digenrl.transport.staging import DeviceToHost, Staged

_EMPTY_IMAGES = torch.zeros(0, dtype=torch.uint8)


class _AllDone:
    """The trackers of one buffer's sends as one: done when ZeroMQ let go of every copy."""

    def __init__(self, trackers: list[Any]) -> None:
        self.trackers = trackers

    @property
    def done(self) -> bool:
        return all(t is None or t.done for t in self.trackers)


_Handed = tuple[str, int, int, tuple[int, float, float, Staged] | None, int]
"""(span name, start ns, end ns, (t index, sigma, sigma next, staged chunk) or None, rows), from
the compute thread to the loop; ``rows``: the trajectory rows a step batcher's step carried
(recorded in the span's args), 0 for a fragment's own steps."""


class FragmentStreamer:
    """Generates fragments and streams them to the trainer ranks; see the module doc.

    ``pushes``: a PUSH per trainer rank; ``control``: the DEALER to the coordinator (it gets
    each commit too); ``scorers``: a DEALER per reward worker (empty: ``reward_fn`` scores on
    the compute thread); ``span``: the name of the generation's spans in the trace
    (``denoise_step`` on a rollout, ``tag_generate`` on a trainer); ``lane``: the trace lane of
    the chunk sends; ``submit(name, fn)``: queues ``fn`` on the holder's compute thread;
    ``revoked``: task ids the coordinator revoked (a fragment in generation stops at its next
    chunk); ``unexpected(socket, msg, why)``: counts a message no loop expects; ``algorithm``:
    what a trajectory sends (default: the run's, ``algorithm_for(cfg.train)``).
    """

    def __init__(self, *, node_id: str, cfg: Config, pushes: dict[int, Socket], control: Socket,
                 reward_fn: Reward | None, span: str, lane: str, recorder: SpanRecorder, log: Log,
                 submit: Callable[..., asyncio.Future[Any]], revoked: set[int],
                 unexpected: Callable[..., None], scorers: dict[str, Socket] | None = None,
                 slowdown: Slowdown = NO_SLOWDOWN, algorithm: Algorithm | None = None) -> None:
        self.node_id = node_id
        self.cfg = cfg
        self.algorithm = algorithm or algorithm_for(cfg.train)
        self.pushes = pushes
        self.sp = cfg.train.sequence_parallel
        self.control = control
        self.reward_fn = reward_fn
        self.span = span
        self.lane = lane
        self.recorder = recorder
        self.log = log
        self.submit = submit
        self.revoked = revoked
        self.unexpected = unexpected
        self.slowdown = slowdown  # TEST-ONLY ([faults]): compute spans stretched
        self._d2h: DeviceToHost | None = None  # chunk staging, made for the first model streamed
        self.engine: StepEngine | None = None  # sampler.max_batch > 0: the node's step batcher
        # reward workers (cluster.rewards > 0): a DEALER each; answers resolve futures by task
        self.scorers = scorers or {}
        self._outstanding = dict.fromkeys(self.scorers, 0)
        self._scores: dict[int, tuple[str, asyncio.Future[Scored]]] = {}
        self._to_commit: asyncio.Queue[tuple[Assign, FragmentResult, int, float, float]] = asyncio.Queue()

    def _stager(self, model: Any) -> DeviceToHost:
        """The chunk stager for ``model``'s device (pinned buffers and a copy stream on CUDA)."""
        device = torch.device(getattr(model, "device", "cpu"))
        if self._d2h is None or self._d2h.device != device:
            self._d2h = DeviceToHost(device)
        return self._d2h

    def engine_for(self, model: FlowModel) -> StepEngine:
        """The step-level batcher of ``model`` (``sampler.max_batch > 0``; actors/stepengine.py)."""
        if self.engine is None or self.engine.model is not model:
            self.engine = StepEngine(model=model, cfg=self.cfg, submit=self.submit,
                                     stager=self._stager(model), clock=self.recorder.now_ns, span=self.span,
                                     log=self.log.warning)
        return self.engine

    async def generate_and_stream(self, task: Assign, model: FlowModel, version: int) -> bool:
        """Generate ``task``; each trained step goes to its owner the moment it exists.

        The whole trajectory is one job on the holder's compute thread: it hands each trained
        step's chunk to the event loop and denoises on, so sending never holds the sampler
        up (a GPU is not left idle while Python sends). The job's work is recorded as spans
        named ``self.span`` (one per pull: the denoising steps up to the next trained one) and
        ``reward``. Returns False (and commits nothing) if the task is revoked mid-way.

        What streams, and what follows the trajectory before its commit, is the run's
        algorithm's (``rl/algorithm.py``): the GRPO family streams a chunk per trained step;
        with ``sampler.max_batch > 0`` the fragment instead joins the node's step batcher
        (:meth:`engine_for`), which streams the same chunks in the same order;
        the forward-process algorithms stream nothing while denoising and send the final
        latents once to each rank that owns one of the task's draw slots.
        """
        cfg, span, algorithm = self.cfg, self.span, self.algorithm
        trained = algorithm.streamed_steps([int(t) for t in task.owners])
        job = FragmentJob(model=model, cfg=cfg, prompts=list(task.prompts), seeds=list(task.seeds),
                          sde_steps=list(task.sde_steps), trained_steps=trained,
                          reward_fn=None if self.scorers else self.reward_fn,
                          metadata=[json.loads(m) for m in task.metadata])
        wire = WIRE_DTYPES[cfg.sampler.wire_dtype]
        slowdown = self.slowdown
        nan = nan_point(self.node_id, task.step)  # TEST-ONLY (digenrl/faults.py): a GPU emitting NaN
        loop = asyncio.get_running_loop()
        handed: asyncio.Queue[_Handed | None] = asyncio.Queue()
        halt = threading.Event()  # set by the event loop: stop at the next pull
        clock = self.recorder.now_ns

        def hand(item: _Handed | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (the node is exiting)
                loop.call_soon_threadsafe(handed.put_nowait, item)

        def produce() -> FragmentResult | None:
            try:
                it = job.steps()
                while not halt.is_set():
                    t0 = clock()
                    rec = next(it, None)
                    if nan and rec is not None:
                        poison(rec)
                    t1 = clock()
                    extra = slowdown.extra_s(span, (t1 - t0) / 1e9)
                    if extra > 0:  # TEST-ONLY ([faults]): an emulated slower GPU
                        time.sleep(extra)
                    if rec is None:
                        hand((span, t0, t1, None, 0))
                        t0 = clock()
                        result = job.finish().to_host()  # on this thread, not the event loop
                        algorithm.finish_on_thread(result, wire)
                        hand(("reward", t0, clock(), None, 0))
                        return result
                    # queued here, on the sampler's thread: a side-stream copy into a pooled
                    # pinned buffer (transport/staging.py); the sampler's stream never waits
                    staged = stager.stage([rec.x_t.to(wire), rec.x_next.to(wire), rec.log_prob])
                    hand((span, t0, t1, (rec.index, rec.sigma, rec.sigma_next, staged), 0))
                return None
            finally:
                hand(None)

        stager = self._stager(model)
        job_done: asyncio.Future[FragmentResult | None]
        if cfg.sampler.max_batch:  # step-level batching: the fragment joins the node's batch
            def finish(j: FragmentJob, images: torch.Tensor) -> FragmentResult:
                result = j.finish(images).to_host()
                algorithm.finish_on_thread(result, wire)
                return result
            job_done = self.engine_for(model).join(task.task_id, job, hand=hand, halt=halt,
                                                   finish=finish, nan=nan)
        else:
            job_done = self.submit(span, produce)
        t_start = time.perf_counter()
        sender = self.recorder.named_lane(self.lane)
        try:
            while (item := await handed.get()) is not None:
                name, t0, t1, chunk, rows = item
                if name == "reward":
                    self.recorder.record(name, t0, t1, task=task.task_id)
                elif rows:  # a step batcher's step: the rows it carried
                    self.recorder.record(name, t0, t1, step=task.step, task=task.task_id, rows=rows)
                else:
                    self.recorder.record(name, t0, t1, step=task.step, task=task.task_id)
                if chunk is None:
                    continue
                index, sigma, sigma_next, staged = chunk
                if task.task_id in self.revoked:
                    staged.release()
                    halt.set()
                    await job_done  # the compute thread stops at its next pull
                    return False
                tracker = None
                try:
                    with self.recorder.span("send_chunk", tid=sender, t=index):
                        await staged.wait_ready()
                        x_t, x_next, log_prob = staged.tensors
                        sent = Chunk(
                            task_id=task.task_id, step=task.step, fragment=task.fragment,
                            t_index=index, sigma=sigma, sigma_next=sigma_next,
                            policy_version=version, x_t=x_t, x_next=x_next, log_prob=log_prob)
                        # the owner and, with sequence parallelism, its group's followers
                        tracker = _AllDone([])  # what was sent is tracked, even if a later send fails
                        for r in self._group_of(int(task.owners[str(index)])):
                            tracker.trackers.append(await self.pushes[r].send(sent, track=True))
                finally:
                    staged.release(tracker)  # reused once ZeroMQ has let go of it
            result = await job_done
        finally:
            halt.set()
            while not handed.empty():  # chunks not sent (revoked, failed): buffers back
                left = handed.get_nowait()
                if left is not None and left[3] is not None:
                    left[3][3].release()
        assert result is not None, "the job ends with a result unless halted"
        gen_seconds = time.perf_counter() - t_start
        for owner, msg in algorithm.after_trajectory(task, version, result):
            with self.recorder.span("send_chunk", tid=sender, t=-1):
                for rank in self._group_of(owner):
                    await self.pushes[rank].send(msg)
        if self.scorers:  # a reward worker scores; the commit goes when its answer comes
            await self._send_for_scoring(task, result, version, gen_seconds)
            return True
        await self.commit(task, result, version, gen_seconds, result.rewards, result.reward_terms, "")
        return True

    def _group_of(self, owner: int) -> range:
        """The trainer ranks a message for ``owner`` goes to: its sequence-parallel group (the
        owner, a group leader, and its followers; the owner alone without SP)."""
        return range(owner, owner + self.sp)

    async def commit(self, task: Assign, result: FragmentResult, version: int, gen_seconds: float,
                     rewards: list[float], reward_terms: dict[str, list[float]], discard: str) -> None:
        """The fragment's Commit to every trainer rank (rank 0 also gets the images) and the coordinator."""
        for rank, push in self.pushes.items():
            await push.send(Commit(
                task_id=task.task_id, step=task.step, fragment=task.fragment, node_id=self.node_id,
                policy_version=version, prompt_ids=list(task.prompt_ids), rewards=rewards,
                reward_terms=reward_terms, gen_seconds=gen_seconds,
                cond=result.cond,
                images=result.images if rank == 0 else _EMPTY_IMAGES, discard=discard))
        await self.control.send(Commit(
            task_id=task.task_id, step=task.step, fragment=task.fragment, node_id=self.node_id,
            policy_version=version, prompt_ids=list(task.prompt_ids), rewards=rewards,
            reward_terms=reward_terms, gen_seconds=gen_seconds, cond={}, images=_EMPTY_IMAGES,
            discard=discard))

    # ------------------------------------------------------------------ reward workers
    async def _send_for_scoring(self, task: Assign, result: FragmentResult, version: int,
                                gen_seconds: float) -> None:
        """Hand the fragment's images to the least busy reward worker and queue its commit; the
        caller goes on to its next fragment at once (it never waits for the scorer)."""
        g = result.images.shape[0] // max(len(task.prompts), 1)
        name = min(self.scorers, key=lambda n: self._outstanding[n])
        fut: asyncio.Future[Scored] = asyncio.get_running_loop().create_future()
        self._scores[task.task_id] = (name, fut)
        self._outstanding[name] += 1
        await self.scorers[name].send(Score(
            task_id=task.task_id, step=task.step, images=result.images,
            prompts=[p for p in task.prompts for _ in range(g)],
            metadata=[m for m in task.metadata for _ in range(g)]))
        self._to_commit.put_nowait((task, result, version, gen_seconds, time.monotonic()))

    def reward_loops(self) -> list[Loop]:
        """Background loops of a node whose rewards are scored by workers: one receiving each
        worker's answers, one committing fragments as their answers come (in order)."""
        if not self.scorers:
            return []

        def receiver(name: str, sock: Socket) -> Loop:
            async def receive_scores() -> None:
                while True:
                    _, msg = await sock.recv()
                    entry = self._scores.get(msg.task_id) if isinstance(msg, Scored) else None
                    if entry is None or not isinstance(msg, Scored):
                        self.unexpected(f"scorer {name}", msg, why="no fragment waits for it")
                    elif not entry[1].done():
                        entry[1].set_result(msg)
            return receive_scores

        async def commit_scored() -> None:
            limit = self.cfg.reward.worker_timeout_s
            while True:
                task, result, version, gen_seconds, t0 = await self._to_commit.get()
                name, fut = self._scores[task.task_id]
                try:
                    scored: Scored | None = await asyncio.wait_for(
                        asyncio.shield(fut), max(0.0, limit - (time.monotonic() - t0)))
                except TimeoutError:
                    scored = None
                del self._scores[task.task_id]
                self._outstanding[name] -= 1
                if task.task_id in self.revoked:
                    continue  # re-queued elsewhere: commit nothing
                if scored is None or scored.error:
                    discard = "reward_timeout" if scored is None else "reward_failed"
                    self.log.error("fragment discarded: no rewards", task=task.task_id, worker=name,
                                    reason=discard, error=scored.error if scored else
                                    f"no answer within reward.worker_timeout_s = {limit:g}")
                    await self.commit(task, result, version, gen_seconds, [], {}, discard)
                else:
                    await self.commit(task, result, version, gen_seconds,  # generation only
                                      list(scored.rewards), dict(scored.reward_terms), "")

        return [*(receiver(n, s) for n, s in self.scorers.items()), commit_scored]
