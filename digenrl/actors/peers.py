"""A node's sockets and the behaviours rollouts and TAG helpers share.

``NodePeers`` owns a node's sockets (control DEALER to the coordinator, the announcement
SUB, one PUSH per trainer rank, the weights DEALER to trainer rank 0, and its weights ROUTER:
rank 0 serves every version from it, a rollout relays what it holds), the latest announced
policy version, the :class:`~digenrl.transport.weights.WeightStore` of versions it serves,
and three shared behaviours: heartbeats, catching up to a version at a trajectory boundary
(TCSS), and generating one fragment while streaming its chunks to the ranks that own their
timesteps (TSP).

Weights relay: :class:`~digenrl.actors.weightsfetch.WeightsRelay` (``NodePeers.fetcher``)
fetches each version along the relay tree and serves what the node holds; ``NodePeers``
decides when (prefetch, catch-up).

The actor <-> peers contract, both ways typed:

* the actor holds its ``NodePeers`` (given to its constructor by ``actors/node.py``) and
  calls it: ``heartbeat_loop`` / ``relay_loop`` / ``reward_loops`` (background loops),
  ``heard_from_coordinator`` and ``on_route`` (from its control loop), ``on_announce`` /
  ``prefetch`` / ``catch_up`` (rollouts: weights, TCSS), ``generate_and_stream`` (a
  rollout's fragment, a trainer's TAG fragment);
* ``NodePeers`` calls back only what :class:`PeerActor` declares (the compute thread, the
  trace, the log, stop requests, heartbeat stats, the revoked set) plus, for weight
  catch-up, :meth:`WeightSyncActor.load_weights`. :class:`~digenrl.actors.base.Actor`
  provides all of it but ``revoked``, ``policy_version`` and ``load_weights``, which
  ``RolloutActor``, ``TrainerActor`` and ``RewardActor`` define. No ``getattr`` probing: a
  new actor kind is checked by mypy against these protocols.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from digenrl.actors.base import Log, Loop
from digenrl.actors.weightsfetch import WeightsRelay, WeightsSuperseded
from digenrl.config import Config
from digenrl.core.plan import FORWARD_ALGORITHMS
from digenrl.faults import Slowdown, nan_point, poison
from digenrl.models.base import FlowModel
from digenrl.rl.fragment import FragmentJob, FragmentResult
from digenrl.rl.rewards import Reward
from digenrl.rl.sampler import WIRE_DTYPES
from digenrl.telemetry.nvml import GpuProbe
from digenrl.telemetry.trace import SpanRecorder
from digenrl.transport.protocol import (
    Assign,
    Chunk,
    CleanSample,
    Commit,
    Heartbeat,
    Score,
    Scored,
    VersionAnnounce,
    WeightsRoute,
)
from digenrl.transport.socketio import Socket
from digenrl.transport.staging import DeviceToHost, Staged
from digenrl.transport.weights import WeightStore

_EMPTY_IMAGES = torch.zeros(0, dtype=torch.uint8)


_Handed = tuple[str, int, int, tuple[int, float, float, Staged] | None]
"""(span name, start ns, end ns, (t index, sigma, sigma next, staged chunk) or None), from
the compute thread to the loop."""


class PeerActor(Protocol):
    """What :class:`NodePeers` needs of the actor it serves (heartbeats, generation)."""

    role: str
    log: Log
    recorder: SpanRecorder
    slowdown: Slowdown
    revoked: set[int]
    """Task ids the coordinator revoked: a fragment in generation stops at its next chunk."""

    @property
    def stopping(self) -> bool: ...
    @property
    def policy_version(self) -> int:
        """The weights version the actor generates (or trains) with, for heartbeats."""
        ...
    def request_stop(self, reason: str) -> None: ...
    def heartbeat_stats(self) -> dict[str, float]: ...
    def unexpected(self, socket: str, msg: object, why: str = ...) -> None: ...
    def working(self, name: str, **args: Any) -> AbstractContextManager[None]: ...
    def submit(self, name: str, fn: Callable[..., Any], *a: Any) -> asyncio.Future[Any]: ...
    async def in_thread(self, name: str, fn: Callable[..., Any], *a: Any, **args: Any) -> Any: ...


class WeightSyncActor(PeerActor, Protocol):
    """A :class:`PeerActor` that takes new weights at trajectory boundaries (a rollout)."""

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Load a verified weight set into the generating model (runs on the compute thread)."""
        ...


class NodePeers:
    """A node's sockets and the shared behaviours; see the module doc for the contract."""

    def __init__(self, *, node_id: str, incarnation: int, cfg: Config, control: Socket,
                 sub: Socket | None = None, pushes: dict[int, Socket] | None = None,
                 data: Socket | None = None, weights: Socket | None = None,
                 gpu_probe: GpuProbe | None = None, relay: Socket | None = None,
                 connect: Callable[[str], Socket] | None = None,
                 scorers: dict[str, Socket] | None = None) -> None:
        """``weights``: a rollout's DEALER to trainer rank 0 (a trainer's weights ROUTER);
        ``relay``: a rollout's own weights ROUTER; ``connect(endpoint)``: a new DEALER (to an
        upstream the coordinator names)."""
        self.node_id = node_id
        self.incarnation = incarnation
        self.cfg = cfg
        self.control = control
        self.sub = sub
        self.pushes = pushes or {}
        self.data = data
        self.weights = weights
        self.gpu = gpu_probe or GpuProbe()
        self.version = 0
        self.announced: VersionAnnounce | None = None
        self.announce_event = asyncio.Event()
        self._gpu_reading: dict[str, Any] = {}
        self._seq = itertools.count()
        self._ready: tuple[int, dict[str, torch.Tensor]] | None = None  # prefetched, verified
        self._prefetching: asyncio.Future[None] | None = None
        self._prefetch_failed = -1  # a version whose background fetch failed: not retried there
        self.unanswered = 0  # beats sent since the coordinator's last control message
        self._d2h: DeviceToHost | None = None  # chunk staging, made for the first model streamed
        # reward workers (cluster.rewards > 0): a DEALER each; answers resolve futures by task
        self.scorers = scorers or {}
        self._outstanding = dict.fromkeys(self.scorers, 0)
        self._scores: dict[int, tuple[str, asyncio.Future[Scored]]] = {}
        self._to_commit: asyncio.Queue[tuple[Assign, FragmentResult, int, float, float]] = asyncio.Queue()
        self.store = WeightStore()
        self.fetcher = WeightsRelay(node_id=node_id, cfg=cfg, control=control, weights=weights,
                                    store=self.store, relay=relay, connect=connect)
        self._superseded = -1  # newest version the upstream said it will never hold

    # ------------------------------------------------------------------ heartbeats
    def heartbeat_loop(self, actor: PeerActor) -> Loop:
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

    # ------------------------------------------------------------------ versions (TCSS)
    def heard_from_coordinator(self) -> None:
        """Any control message proves the coordinator alive (see :meth:`heartbeat_loop`)."""
        self.unanswered = 0

    def on_announce(self, msg: VersionAnnounce) -> None:
        if self.announced is None or msg.version > self.announced.version:
            self.announced = msg
            self.announce_event.set()

    async def catch_up(self, actor: WeightSyncActor, floor: int) -> None:
        """At a trajectory boundary: apply the newest version at hand; wait for ``floor``.

        The tensors usually arrived already: :meth:`prefetch` fetches and verifies each
        announced version in the background while the current trajectory is generated, so the
        boundary pays only the apply (TCSS: one version per trajectory all the same). Whatever
        prefetched version is newer than the current one is applied; the boundary blocks only
        while it is below ``floor``: on the fetch in flight, or on a foreground fetch if none
        runs (a newer version still on its way is applied at a later boundary).
        """
        while True:
            ann = self.announced
            if ann is not None and ann.version > self.version:
                self.prefetch(actor)  # toward the newest, if not already on its way
                ready, running = self._ready, self._prefetching
                if ready is not None and ready[0] > self.version:
                    await self._apply(actor, *ready)
                    continue
                if self.version < floor:
                    if running is not None and not running.done():
                        with actor.recorder.span("wait", waiting_for=f"weights {ann.version}"):
                            await asyncio.wait({running})
                    else:
                        try:
                            sd = await self.fetcher.fetch(actor, ann, span="weight_fetch")
                        except WeightsSuperseded:  # wait for the newer announcement, fetch that
                            if self.announced is ann:
                                self.announce_event.clear()
                                with actor.recorder.span("wait", waiting_for=f"version > {ann.version}"):
                                    await self.announce_event.wait()
                            continue
                        await self._apply(actor, ann.version, sd)
                    continue
            if self.version >= floor:
                return
            self.announce_event.clear()
            with actor.recorder.span("wait", waiting_for=f"version {floor}"):
                await self.announce_event.wait()

    async def _apply(self, actor: WeightSyncActor, version: int, sd: dict[str, torch.Tensor]) -> None:
        await actor.in_thread("weight_apply", actor.load_weights, sd, version=version)
        if self._ready is not None and self._ready[0] <= version:
            self._ready = None
        self.version = version

    def prefetch(self, actor: PeerActor) -> None:
        """Start fetching the newest announced version in the background (rollouts call this
        on every announcement); at most one fetch runs, a newer announcement waits for it."""
        ann = self.announced
        if ann is None or ann.version <= self.version or self.weights is None:
            return
        if self._ready is not None and self._ready[0] >= ann.version:
            return
        if self._prefetching is not None and not self._prefetching.done():
            return  # the running fetch ends by starting the next one if still behind
        if self._prefetch_failed == ann.version:
            return  # the boundary fetches it in the foreground, where a failure is fatal
        if self._superseded >= ann.version:
            return  # the upstream moved on: the newer announcement starts the next fetch
        self._prefetching = asyncio.ensure_future(self._prefetch(actor, ann))

    async def stop_prefetch(self) -> None:
        """Cancel a background fetch still running (the actor is stopping)."""
        task = self._prefetching
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _prefetch(self, actor: PeerActor, ann: VersionAnnounce) -> None:
        try:
            sd = await self.fetcher.fetch(actor, ann, span="weight_prefetch")
            if self._ready is None or self._ready[0] < ann.version:
                self._ready = (ann.version, sd)
        except asyncio.CancelledError:
            raise
        except WeightsSuperseded as e:  # the next announcement starts the next fetch
            actor.log.info("weights superseded upstream", version=e.version, newest=e.newest)
            self._superseded = max(self._superseded, e.version)
            return
        except Exception as e:  # the boundary fetches again, in the foreground
            actor.log.warning("weight prefetch failed; fetching at the boundary", version=ann.version,
                              error=repr(e))
            self._prefetch_failed = ann.version
            return
        self.prefetch(actor)  # a newer version may have been announced meanwhile

    # ------------------------------------------------------------------ weights relay
    def on_route(self, msg: WeightsRoute) -> None:
        """The coordinator moved this node in the relay tree (see :class:`WeightsRelay`)."""
        self.fetcher.on_route(msg)

    def relay_loop(self, actor: PeerActor) -> Loop:
        """The background loop serving this node's held versions to its downstream."""
        return self.fetcher.serve_loop(actor)

    # ------------------------------------------------------------------ generation (TSP)
    def _stager(self, model: Any) -> DeviceToHost:
        """The chunk stager for ``model``'s device (pinned buffers and a copy stream on CUDA)."""
        device = torch.device(getattr(model, "device", "cpu"))
        if self._d2h is None or self._d2h.device != device:
            self._d2h = DeviceToHost(device)
        return self._d2h

    async def generate_and_stream(self, actor: PeerActor, task: Assign, model: FlowModel,
                                  version: int, reward_fn: Reward | None, cfg: Config,
                                  span: str) -> bool:
        """Generate ``task``; each trained step goes to its owner the moment it exists.

        The whole trajectory is one job on the actor's compute thread: it hands each trained
        step's chunk to the event loop and denoises on, so sending never holds the sampler
        up (a GPU is not left idle while Python sends). The job's work is recorded as spans
        named ``span`` (one per pull: the denoising steps up to the next trained one) and
        ``reward``. Returns False (and commits nothing) if the task is revoked mid-way.

        Forward-process algorithms (nft, awm) stream nothing while denoising: the final
        latents go once to each rank that owns one of the task's draw slots, as a
        :class:`CleanSample`, before the commit.
        """
        forward = cfg.train.algorithm in FORWARD_ALGORITHMS
        trained = [] if forward else sorted(int(t) for t in task.owners)
        job = FragmentJob(model=model, cfg=cfg, prompts=list(task.prompts), seeds=list(task.seeds),
                          sde_steps=list(task.sde_steps), trained_steps=trained,
                          reward_fn=None if self.scorers else reward_fn,
                          metadata=[json.loads(m) for m in task.metadata])
        wire = WIRE_DTYPES[cfg.sampler.wire_dtype]
        slowdown = actor.slowdown
        nan = nan_point(self.node_id, task.step)  # TEST-ONLY (digenrl/faults.py): a GPU emitting NaN
        loop = asyncio.get_running_loop()
        handed: asyncio.Queue[_Handed | None] = asyncio.Queue()
        halt = threading.Event()  # set by the event loop: stop at the next pull
        clock = actor.recorder.now_ns

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
                        hand((span, t0, t1, None))
                        t0 = clock()
                        result = job.finish().to_host()  # on this thread, not the event loop
                        if forward:  # what a forward-process trainer trains on, in the wire dtype
                            result.final = result.final.to(wire).cpu()
                        hand(("reward", t0, clock(), None))
                        return result
                    # queued here, on the sampler's thread: a side-stream copy into a pooled
                    # pinned buffer (transport/staging.py); the sampler's stream never waits
                    staged = stager.stage([rec.x_t.to(wire), rec.x_next.to(wire), rec.log_prob])
                    hand((span, t0, t1, (rec.index, rec.sigma, rec.sigma_next, staged)))
                return None
            finally:
                hand(None)

        stager = self._stager(model)
        job_done = actor.submit(span, produce)
        t_start = time.perf_counter()
        sender = actor.recorder.named_lane(f"{actor.role}-chunk-sender")
        try:
            while (item := await handed.get()) is not None:
                name, t0, t1, chunk = item
                if name == "reward":
                    actor.recorder.record(name, t0, t1, task=task.task_id)
                else:
                    actor.recorder.record(name, t0, t1, step=task.step, task=task.task_id)
                if chunk is None:
                    continue
                index, sigma, sigma_next, staged = chunk
                if task.task_id in actor.revoked:
                    staged.release()
                    halt.set()
                    await job_done  # the compute thread stops at its next pull
                    return False
                tracker = None
                try:
                    with actor.working("send_chunk", tid=sender, t=index):
                        await staged.wait_ready()
                        x_t, x_next, log_prob = staged.tensors
                        tracker = await self.pushes[int(task.owners[str(index)])].send(Chunk(
                            task_id=task.task_id, step=task.step, fragment=task.fragment,
                            t_index=index, sigma=sigma, sigma_next=sigma_next,
                            policy_version=version, x_t=x_t, x_next=x_next, log_prob=log_prob),
                            track=True)
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
        if forward:
            for rank in sorted({int(r) for r in task.owners.values()}):
                with actor.working("send_chunk", tid=sender, t=-1):
                    await self.pushes[rank].send(CleanSample(
                        task_id=task.task_id, step=task.step, fragment=task.fragment,
                        policy_version=version, x0=result.final))
        if self.scorers:  # a reward worker scores; the commit goes when its answer comes
            await self._send_for_scoring(task, result, version, gen_seconds)
            return True
        await self.commit(task, result, version, gen_seconds, result.rewards, result.reward_terms, "")
        return True

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

    def reward_loops(self, actor: PeerActor) -> list[Loop]:
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
                        actor.unexpected(f"scorer {name}", msg, why="no fragment waits for it")
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
                if task.task_id in actor.revoked:
                    continue  # re-queued elsewhere: commit nothing
                if scored is None or scored.error:
                    discard = "reward_timeout" if scored is None else "reward_failed"
                    actor.log.error("fragment discarded: no rewards", task=task.task_id, worker=name,
                                    reason=discard, error=scored.error if scored else
                                    f"no answer within reward.worker_timeout_s = {limit:g}")
                    await self.commit(task, result, version, gen_seconds, [], {}, discard)
                else:
                    await self.commit(task, result, version, gen_seconds,  # generation only
                                      list(scored.rewards), dict(scored.reward_terms), "")

        return [*(receiver(n, s) for n, s in self.scorers.items()), commit_scored]
