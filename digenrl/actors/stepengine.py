"""A rollout node's step-level batching: one compute-thread job steps every fragment in flight.

With ``sampler.max_batch > 0`` a :class:`~digenrl.actors.streamer.FragmentStreamer` does not
run each fragment as its own whole-trajectory job; it :meth:`StepEngine.join`\\ s the fragment
here. While any fragment is in flight one job holds the holder's compute thread and loops:
take the fragments that arrived (they join at the next step), drop the halted ones, run one
:meth:`~digenrl.rl.batching.StepBatcher.step` (one denoiser forward for all of them), stage
each fragment's trained step as its chunk and hand it to that fragment's queue (with the rows
the step carried: the trace's ``denoise_step`` spans of a batched node say ``rows``, what
``digenrl plan --calibrate`` fits the batching curve to), and finish each fragment whose last
step it was (the fragments that finish at one step decoded in one call, then scored); the
fragments that arrive together have their prompts encoded in one call. When no fragment is
left the job ends; the next join starts a new one. Weights are loaded on the same thread, so they land only
between jobs, when nothing is in flight (TCSS: the actor waits for :meth:`wait_idle` before a
version change).

Each fragment's chunks come out per timestep, in denoising order, exactly as with one fragment
at a time: trainers (GAP, TSP) see no difference.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from digenrl.config import Config
from digenrl.faults import poison
from digenrl.models.base import FlowModel
from digenrl.rl.batching import BatcherStats, CondCache, Denoiser, StepBatcher
from digenrl.rl.fragment import FragmentJob, FragmentResult
from digenrl.transport.staging import DeviceToHost


@dataclass
class _Entry:
    key: int
    job: FragmentJob
    hand: Callable[[Any], None]
    halt: threading.Event
    finish: Callable[[FragmentJob, torch.Tensor], FragmentResult]
    nan: bool
    done: concurrent.futures.Future[FragmentResult | None]


class StepEngine:
    """Fragments in flight on one node, stepped together; see the module doc.

    ``submit(name, fn)`` queues ``fn`` on the holder's compute thread; ``stager`` stages a
    chunk's tensors in pooled host buffers; ``clock`` is the trace's ns clock; ``log`` is told
    of a compile fallback (``sampler.compile``).
    """

    def __init__(self, *, model: FlowModel, cfg: Config, submit: Callable[..., asyncio.Future[Any]],
                 stager: DeviceToHost, clock: Callable[[], int], span: str,
                 log: Callable[..., Any] | None = None) -> None:
        s = cfg.sampler
        cache = CondCache(s.cond_cache_mb << 20) if s.cond_cache_mb else None
        rows = s.max_batch * (2 if s.guidance_scale != 1.0 else 1)
        self.batcher = StepBatcher(model, s, max_batch=s.max_batch, cond_cache=cache, join=s.join,
                                   denoiser=Denoiser(model, compile=s.compile, max_rows=rows, log=log))
        self.cfg = cfg
        self.submit = submit
        self.stager = stager
        self.clock = clock
        self.span = span
        self.wire = torch.bfloat16 if s.wire_dtype == "bfloat16" else torch.float32
        self._lock = threading.Lock()
        self._incoming: list[_Entry] = []
        self._running = False
        self._job: asyncio.Future[Any] | None = None
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def model(self) -> FlowModel:
        return self.batcher.model

    @property
    def stats(self) -> BatcherStats:
        return self.batcher.stats

    @property
    def in_flight(self) -> int:
        """Fragments joined and not yet finished (event-loop side)."""
        return self._in_flight

    async def wait_idle(self) -> None:
        """Until no fragment is in flight (weights may change only then)."""
        await self._idle.wait()

    def join(self, key: int, job: FragmentJob, *, hand: Callable[[Any], None], halt: threading.Event,
             finish: Callable[[FragmentJob, torch.Tensor], FragmentResult],
             nan: bool) -> asyncio.Future[FragmentResult | None]:
        """Queue ``job`` (on the event loop); it joins the batch at the next step. The future
        resolves to its result after its last step (None if halted); ``hand`` gets its spans
        and chunks as :meth:`FragmentStreamer.generate_and_stream` expects, then None;
        ``finish(job, images)`` scores the job's decoded final latents."""
        done: concurrent.futures.Future[FragmentResult | None] = concurrent.futures.Future()
        entry = _Entry(key=key, job=job, hand=hand, halt=halt, finish=finish, nan=nan, done=done)
        self._in_flight += 1
        self._idle.clear()
        fut = asyncio.wrap_future(done)
        fut.add_done_callback(self._left)
        with self._lock:
            self._incoming.append(entry)
            if not self._running:
                self._running = True
                self._job = self.submit(self.span, self._run)
        return fut

    def _left(self, _: Any) -> None:
        self._in_flight -= 1
        if not self._in_flight:
            self._idle.set()

    # ------------------------------------------------------------------ compute thread
    def _join(self, arrived: list[_Entry], g: int) -> None:
        """The fragments that arrived join the batch: their prompts encoded in one call (an
        edit prompt set, whose conditioning carries its input images, on its own)."""
        text = [e for e in arrived if e.job.input_images() is None]
        conds = dict(zip([e.key for e in text],
                         self.batcher.encode_many([list(e.job.prompts) for e in text], g), strict=True))
        for e in arrived:
            cond = conds.get(e.key)
            if cond is None:  # rows cached per prompt and its images (sampler.cond_cache_mb)
                cond = self.batcher.encode(list(e.job.prompts), g, e.job.input_images())
            e.job.start_batched(cond)
            self.batcher.add(e.key, cond, list(e.job.seeds), set(e.job.sde_steps))

    def _run(self) -> None:
        entries: dict[Hashable, _Entry] = {}
        finished: list[tuple[_Entry, torch.Tensor]] = []
        g = self.cfg.train.group_size
        try:
            while True:
                with self._lock:
                    arrived, self._incoming = self._incoming, []
                    if not arrived and not entries:
                        self._running = False
                        return
                if arrived:
                    self._join(arrived, g)
                    entries.update((e.key, e) for e in arrived)
                for key, e in list(entries.items()):
                    if e.halt.is_set():
                        self.batcher.remove(key)
                        del entries[key]
                        e.done.set_result(None)
                        e.hand(None)
                if not entries:
                    continue
                t0 = self.clock()
                out = self.batcher.step()
                t1 = self.clock()
                rows = sum(rec.x_t.shape[0] for _, rec, _ in out)  # the trace's batching curve
                for key, rec, last in out:
                    e = entries[key]
                    if e.nan:
                        poison(rec)
                    if e.job.record_batched(rec):
                        staged = self.stager.stage([rec.x_t.to(self.wire), rec.x_next.to(self.wire),
                                                    rec.log_prob])
                        e.hand((self.span, t0, t1, (rec.index, rec.sigma, rec.sigma_next, staged), rows))
                    else:
                        e.hand((self.span, t0, t1, None, rows))
                    if last:
                        finished.append((entries.pop(key), rec.x_next))
                if finished:  # one decoder call for every fragment that finished at this step
                    f0 = self.clock()
                    images = self.batcher.decode_many([x for _, x in finished])
                    for img in images:
                        e, _ = finished[0]
                        result = e.finish(e.job, img)
                        finished.pop(0)
                        e.hand(("reward", f0, self.clock(), None, 0))
                        e.done.set_result(result)
                        e.hand(None)
        except BaseException as err:
            with self._lock:
                left = [*entries.values(), *(e for e, _ in finished), *self._incoming]
                self._incoming = []
                self._running = False
            for e in left:
                if not e.done.done():
                    e.done.set_exception(err)
                e.hand(None)
            raise
