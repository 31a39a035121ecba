"""Step-level (continuous) batching: several fragments' trajectories share one denoiser forward.

:class:`StepBatcher` holds the trajectories of every fragment in flight, each at its own
denoising step. :meth:`StepBatcher.step` runs **one** forward over all their rows (each row
with its own sigma: every adapter in ``models/`` passes a per-sample timestep to its
transformer), then takes each fragment's SDE/ODE update with that fragment's own generators,
and returns one :class:`~digenrl.rl.sampler.StepRecord` per fragment. A fragment that
arrives joins at the next step instead of waiting for the others to finish; fragments join
whole and in arrival order while their rows fit under ``max_batch``.

Numbers: every trajectory draws its noise from its own generator (``rl/sampler.py``), so a
batched trajectory is the unbatched one up to the model's own batch-size rounding (float32:
at most 2.4e-6 in latents and 1.2e-7 in log-probs on the tiny SD3 folder, see tests/test_batching.py). Records of one fragment come
out in denoising order, one per :meth:`step`, exactly as :func:`~digenrl.rl.sampler.rollout`
yields them.

:class:`CondCache` keeps each prompt's conditioning (one row; an edit prompt's with its input
images) across groups, fragments and steps, least recently used first out, bounded by bytes. Text encoders are frozen (only
the transformer trains), so a cached row stays valid across policy versions.

``sampler.compile``: the forward goes through ``torch.compile`` (:class:`Denoiser`), rows padded
to power-of-two buckets so a changing number of fragments in flight does not recompile every
step; any failure to compile is logged (``compile_fallback`` with the reason) and the batcher
runs eager.

When a waiting fragment joins (``sampler.join``): ``"fits"``, whenever its rows fit under
``max_batch``; ``"pays"`` (a rollout node's default), only when this batcher's own measured
step times (:class:`StepCurve`: seconds of one :meth:`StepBatcher.step` by rows in flight,
medians of the last few) say that carrying its rows costs at most ``JOIN_COST`` of what
stepping them alone would: ``t(r + a) - t(r) <= JOIN_COST * t(a)``. Where a device's time per
row is flat (a CPU, or a GPU already full), joining would only slow the fragments in flight,
whose commits the trainers may be waiting for, so the fragment waits its turn instead; where
a forward of few rows leaves the device idle, it joins. The rows in flight step alone until
their own time is measured (two steps: the first at a row count is discarded as warm-up); a
joint row count not measured yet is then tried, and a refused join is tried again every
``RETRY_REFUSED`` refusals, so a curve measured under a passing load does not stick.

Per-fragment fixed costs are shared too: :meth:`StepBatcher.encode_many` encodes the prompts of
every fragment that arrives at a step in one text-encoder call, :meth:`StepBatcher.decode_many`
decodes the fragments that finish at a step in one VAE call (images equal the per-fragment
decode's up to the decoder's batch-size rounding, at most 1 in 255 in a uint8 pixel).

Sans threads: the caller (a rollout's compute thread, a benchmark) drives :meth:`step`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from digenrl.config import SamplerConfig
from digenrl.models.base import Cond, FlowModel, cond_cat, cond_repeat, cond_select, encode_inputs
from digenrl.rl.sampler import (
    StepRecord,
    guided_velocity,
    initial_noise,
    resolve_wire_dtype,
    seeded_generators,
    step_grid,
)
from digenrl.rl.sde import dpm2_step, sde_step, sigma_schedule


def cond_bytes(cond: Cond) -> int:
    """Bytes held by a conditioning's tensors."""
    return sum(v.numel() * v.element_size() for v in cond.values())


class CondCache:
    """Per-prompt conditioning rows, least recently used evicted first past ``max_bytes``.

    :meth:`encode` returns the same conditioning as ``encode_inputs(model, prompts, images)``
    (rows in prompt order), encoding only the prompts it does not hold, in one call. An edit
    prompt's row is keyed by its text and its input images' paths together.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"cond cache of {max_bytes} bytes: expected >= 0")
        self.max_bytes = max_bytes
        self._rows: OrderedDict[tuple[str, ...], Cond] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def encode(self, model: FlowModel, prompts: Sequence[str],
               images: Sequence[Sequence[str]] | None = None) -> Cond:
        """``encode_inputs(model, prompts, images)`` with cached rows reused (one row per
        prompt and its input images)."""
        keys = [(p, *(images[i] if images is not None else ())) for i, p in enumerate(prompts)]
        missing = [k for k in dict.fromkeys(keys) if k not in self._rows]
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        fresh: dict[tuple[str, ...], Cond] = {}
        if missing:
            with torch.no_grad():
                enc = encode_inputs(model, [k[0] for k in missing], [list(k[1:]) for k in missing])
            for j, k in enumerate(missing):
                fresh[k] = {n: v.clone() for n, v in cond_select(enc, [j]).items()}
        out = cond_cat([self._rows[k] if k in self._rows else fresh[k] for k in keys])
        for k in keys:
            if k in self._rows:
                self._rows.move_to_end(k)
        for k, row in fresh.items():
            self._put(k, row)
        return out

    def _put(self, key: tuple[str, ...], row: Cond) -> None:
        size = cond_bytes(row)
        if size > self.max_bytes:
            return
        self._rows[key] = row
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._rows.popitem(last=False)
            self._bytes -= cond_bytes(old)
            self.evictions += 1

    def statistics(self) -> dict[str, int]:
        """Rows held, bytes held, hits, misses and evictions so far."""
        return {"rows": len(self._rows), "bytes": self._bytes, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}


def bucket(rows: int, cap: int) -> int:
    """The compiled forward's row count for ``rows``: the next power of two, at most ``cap``
    (and never below ``rows``), so a compiled forward sees at most log2(cap) + 2 shapes."""
    return max(rows, min(cap, 1 << (rows - 1).bit_length()))


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[0] == n else torch.cat([t, t[:1].expand(n - t.shape[0], *t.shape[1:])])


class Denoiser:
    """``model.velocity``, through ``torch.compile`` when ``compile`` (see the module doc).

    Compiled, each call's rows are padded (repeating the first row) to :func:`bucket` of
    ``max_rows`` and the padding's outputs dropped, so shapes repeat; on CUDA the forward runs
    under ``sdpa_kernel`` preferring flash, then cuDNN attention. A failure to compile (at
    ``torch.compile`` or at the first compiled call) leaves it eager for good: ``fallback``
    holds the reason, and ``log(event, reason=...)`` is told once.
    """

    def __init__(self, model: FlowModel, *, compile: bool, max_rows: int,
                 backend: str | Callable[..., Any] = "inductor",
                 log: Callable[..., Any] | None = None) -> None:
        self.model = model
        self.max_rows = max_rows
        self.log = log or structlog.get_logger("digenrl.rl.batching").warning
        self.fallback = ""
        self.compiled: Callable[..., torch.Tensor] | None = None
        if compile:
            try:
                self.compiled = torch.compile(model.velocity, backend=backend, dynamic=False)
            except Exception as err:  # an unknown backend, a torch without dynamo: run eager
                self._fall_back(err)

    def _fall_back(self, err: BaseException) -> None:
        self.compiled = None
        self.fallback = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        self.log("compile_fallback", reason=self.fallback, to="eager")

    def _kernels(self, x: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
        if x.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                            SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        if self.compiled is None:
            return self.model.velocity(x, sigma, cond)
        b = x.shape[0]
        n = bucket(b, max(self.max_rows, b))
        try:
            with self._kernels(x):
                v = self.compiled(_pad_rows(x, n), _pad_rows(sigma, n),
                                  {k: _pad_rows(c, n) for k, c in cond.items()})
        except Exception as err:  # the compile happens at the first call: fall back to eager
            self._fall_back(err)
            return self.model.velocity(x, sigma, cond)
        return v[:b]


#: ``sampler.join = "pays"``: a fragment joins when carrying its rows adds at most this share
#: of the time stepping them alone would take (a 15 % saving at the least)
JOIN_COST = 0.85
#: a join refused this many times in a row is tried again (the curve is re-measured)
RETRY_REFUSED = 32


class StepCurve:
    """Seconds of one batched step by rows in flight: the median of the last ``keep`` steps
    at each row count, the first step at a count left out (first-call allocations, kernel
    selection). Between measured counts the time is interpolated linearly; past the largest
    it is extrapolated along the last segment; below the smallest, or with nothing to draw
    the line through, it is unknown (None)."""

    def __init__(self, keep: int = 5) -> None:
        self.keep = keep
        self._seen: set[int] = set()
        self._times: dict[int, deque[float]] = {}

    def record(self, rows: int, seconds: float) -> None:
        if rows not in self._seen:  # warm-up
            self._seen.add(rows)
            return
        self._times.setdefault(rows, deque(maxlen=self.keep)).append(seconds)

    def points(self) -> dict[int, float]:
        """Rows -> median seconds, for every row count measured."""
        return {r: statistics.median(v) for r, v in sorted(self._times.items())}

    def seconds(self, rows: int) -> float | None:
        pts = self.points()
        if rows in pts:
            return pts[rows]
        below = [r for r in pts if r < rows]
        above = [r for r in pts if r > rows]
        if not below:
            return None
        lo = below[-1]
        if above:
            hi = above[0]
        elif len(below) >= 2:
            lo, hi = below[-2], below[-1]
        else:
            return None
        slope = (pts[hi] - pts[lo]) / (hi - lo)
        return pts[lo] + slope * (rows - lo)


@dataclass
class _Trajectories:
    """One fragment's rows in the batcher: where they are on the step grid."""

    key: Hashable
    x: torch.Tensor
    cond: Cond
    generators: list[torch.Generator]
    grid: list[tuple[int, int]]
    noisy: set[int]
    pos: int = 0
    prev: tuple[float, torch.Tensor] | None = None
    rows: int = field(init=False)

    def __post_init__(self) -> None:
        self.rows = self.x.shape[0]


@dataclass
class BatcherStats:
    """Occupancy so far: forwards run, rows they carried, fragments stepped."""

    forwards: int = 0
    rows: int = 0
    fragment_steps: int = 0
    #: steps at which a waiting fragment that fitted did not join (``sampler.join = "pays"``)
    joins_refused: int = 0

    @property
    def rows_per_forward(self) -> float:
        """rows / forwards (0 before the first forward)."""
        return self.rows / self.forwards if self.forwards else 0.0


class StepBatcher:
    """Fragments in flight, stepped together; see the module doc.

    ``max_batch``: the most trajectory rows one forward carries (CFG doubles the rows the
    transformer sees, not this count); ``cond_cache``: where prompts' conditioning comes from
    (None: encoded per fragment); ``join``: ``"fits"`` or ``"pays"`` (see the module doc).
    """

    def __init__(self, model: FlowModel, sampler_cfg: SamplerConfig, *, max_batch: int,
                 cond_cache: CondCache | None = None, denoiser: Denoiser | None = None,
                 join: str = "fits") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch = {max_batch}: expected at least 1 row")
        if join not in ("fits", "pays"):
            raise ValueError(f"join = {join!r}: expected 'fits' or 'pays'")
        self.join = join
        self.curve = StepCurve()
        self._refused = 0
        s = sampler_cfg
        if s.base_tail and not hasattr(model, "adapter_disabled"):
            raise ValueError(f"sampler.base_tail = {s.base_tail}: {type(model).__name__} has "
                             "no LoRA adapter to turn off")
        self.model = model
        self.cfg = s
        self.max_batch = max_batch
        self.cond_cache = cond_cache
        rows = max_batch * (2 if s.guidance_scale != 1.0 else 1)  # CFG: [uncond; cond]
        self.denoiser = denoiser or Denoiser(model, compile=s.compile, max_rows=rows)
        self.wire = resolve_wire_dtype(s.wire_dtype)
        self.sigmas = sigma_schedule(s.num_steps, s.shift).tolist()
        self.tail_from = s.num_steps - s.base_tail
        self.uncond: Cond | None = None
        if s.guidance_scale != 1.0:
            with torch.no_grad():
                self.uncond = model.encode_prompts([""])
        self.pending: list[_Trajectories] = []
        self.active: list[_Trajectories] = []
        self.stats = BatcherStats()

    # ------------------------------------------------------------------ admission
    def encode(self, prompts: Sequence[str], group_size: int,
               images: Sequence[Sequence[str]] | None = None) -> Cond:
        """The fragment's conditioning: each prompt's row (with its input images, for an edit
        model) repeated ``group_size`` times."""
        if self.cond_cache is not None:
            cond = self.cond_cache.encode(self.model, prompts, images)
        else:
            with torch.no_grad():
                cond = encode_inputs(self.model, list(prompts), images)
        return cond_repeat(cond, group_size)

    def encode_many(self, prompt_lists: Sequence[Sequence[str]], group_size: int) -> list[Cond]:
        """:meth:`encode` of several fragments in **one** text-encoder call (what arrives at a
        step joins together): each fragment's conditioning, its rows repeated ``group_size`` times."""
        flat = [p for prompts in prompt_lists for p in prompts]
        if not flat:
            return [{} for _ in prompt_lists]
        if self.cond_cache is not None:
            cond = self.cond_cache.encode(self.model, flat)
        else:
            with torch.no_grad():
                cond = self.model.encode_prompts(flat)
        out, start = [], 0
        for prompts in prompt_lists:
            out.append(cond_repeat(cond_select(cond, slice(start, start + len(prompts))), group_size))
            start += len(prompts)
        return out

    def add(self, key: Hashable, cond: Cond, seeds: Sequence[int], sde_steps: set[int] | None) -> None:
        """Queue a fragment of ``len(seeds)`` trajectories; it joins at the next :meth:`step`
        with room for all its rows. ``sde_steps`` as in :func:`~digenrl.rl.sampler.rollout`."""
        b = len(seeds)
        if b > self.max_batch:
            raise ValueError(f"fragment {key!r} of {b} trajectories: expected at most "
                             f"sampler.max_batch = {self.max_batch}")
        if any(k.key == key for k in (*self.pending, *self.active)):
            raise ValueError(f"fragment {key!r} is already in the batcher")
        s = self.cfg
        noisy = (set(range(s.num_steps)) if sde_steps is None else set(sde_steps)) \
            if s.sde_type != "ode" else set()
        if any(i >= self.tail_from for i in noisy):
            raise ValueError(f"sampler.base_tail = {s.base_tail}: SDE steps "
                             f"{sorted(i for i in noisy if i >= self.tail_from)} fall in the base model's tail")
        gens = seeded_generators(seeds)
        device = next(iter(cond.values())).device
        x = initial_noise((b, *self.model.latent_shape), gens, self.wire).to(device)
        self.pending.append(_Trajectories(key=key, x=x, cond=cond, generators=gens,
                                          grid=step_grid(s.num_steps, noisy, s.ode_compress), noisy=noisy))

    def remove(self, key: Hashable) -> None:
        """Drop a fragment (revoked), in flight or waiting; its rows free at the next step."""
        self.pending = [t for t in self.pending if t.key != key]
        self.active = [t for t in self.active if t.key != key]

    @property
    def rows_in_flight(self) -> int:
        return sum(t.rows for t in self.active)

    def __len__(self) -> int:
        """Fragments held, in flight or waiting to join."""
        return len(self.pending) + len(self.active)

    def _admit(self) -> None:
        rows = self.rows_in_flight
        while self.pending and rows + self.pending[0].rows <= self.max_batch:
            if rows and not self.pays(rows, self.pending[0].rows):
                self.stats.joins_refused += 1
                return
            t = self.pending.pop(0)
            self.active.append(t)
            rows += t.rows

    def pays(self, rows: int, joining: int) -> bool:
        """Whether ``joining`` rows join ``rows`` in flight now (always, with ``join = "fits"``)."""
        if self.join == "fits":
            return True
        c = self.curve
        both, now, alone = c.seconds(rows + joining), c.seconds(rows), c.seconds(joining)
        if now is None:  # the rows in flight step alone until their time is measured
            return False
        if both is None or alone is None or both - now <= JOIN_COST * alone:  # tried, so measured
            self._refused = 0
            return True
        self._refused += 1
        if self._refused >= RETRY_REFUSED:  # measure the curve there again
            self._refused = 0
            return True
        return False

    # ------------------------------------------------------------------ one step
    def step(self) -> list[tuple[Hashable, StepRecord, bool]]:
        """One denoising step of every fragment in flight: ``(key, record, last)`` per fragment,
        ``last`` when it was the fragment's final step (it has left the batcher)."""
        self._admit()
        if not self.active:
            return []
        t0 = time.perf_counter()
        rows_now = self.rows_in_flight
        s = self.cfg
        sigma_max = self.sigmas[1]
        # one forward per adapter state: rows in the base model's tail run without the adapter
        groups: dict[bool, list[_Trajectories]] = {}
        for t in self.active:
            groups.setdefault(t.grid[t.pos][0] >= self.tail_from, []).append(t)
        done: dict[int, tuple[Hashable, StepRecord, bool]] = {}
        for tail, trajs in groups.items():
            x = torch.cat([t.x for t in trajs]) if len(trajs) > 1 else trajs[0].x
            sig = torch.cat([torch.full((t.rows,), self.sigmas[t.grid[t.pos][0]], dtype=torch.float32)
                             for t in trajs]).to(x.device)
            cond = cond_cat([t.cond for t in trajs]) if len(trajs) > 1 else trajs[0].cond
            with torch.no_grad(), (self.model.adapter_disabled() if tail  # type: ignore[attr-defined]
                                   else contextlib.nullcontext()):
                v_all = guided_velocity(self.model, x, sig, cond, guidance_scale=s.guidance_scale,
                                        uncond=self.uncond, velocity=self.denoiser)
            self.stats.forwards += 1
            self.stats.rows += x.shape[0]
            for t, v in zip(trajs, v_all.split([t.rows for t in trajs]), strict=True):
                done[id(t)] = self._advance(t, v, sigma_max)
        out = [done[id(t)] for t in self.active]  # in the order the fragments joined
        if self.join == "pays":  # the curve the next admissions are judged by
            if rows_now and next(iter(self.active)).x.device.type == "cuda":
                torch.cuda.synchronize()  # the step's kernels done: its time is the device's
            self.curve.record(rows_now, time.perf_counter() - t0)
        self.stats.fragment_steps += len(out)
        self.active = [t for t in self.active if t.pos < len(t.grid)]
        return out

    def decode_many(self, finals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Images of several fragments' final latents in **one** decoder call (fragments that
        finished at the same step), split back per fragment."""
        if len(finals) == 1:
            return [self.model.decode(finals[0])]
        images = self.model.decode(torch.cat(list(finals)))
        return list(images.split([f.shape[0] for f in finals]))

    def _advance(self, t: _Trajectories, v: torch.Tensor, sigma_max: float) -> tuple[Hashable, StepRecord, bool]:
        s = self.cfg
        i, i_next = t.grid[t.pos]
        sigma, sigma_next = self.sigmas[i], self.sigmas[i_next]
        noisy = i in t.noisy
        with torch.no_grad():
            if noisy or s.ode_solver == "euler":
                res = sde_step(s.sde_type if noisy else "ode", t.x, v, sigma, sigma_next,
                               noise_level=s.noise_level, eta=s.eta, sigma_max=sigma_max,
                               generator=t.generators, wire_dtype=self.wire)
            else:
                res = dpm2_step(t.x, v, sigma, sigma_next, prev=t.prev, wire_dtype=self.wire)
            t.prev = (sigma, t.x.float() - sigma * v.float())
        rec = StepRecord(index=i, sigma=sigma, sigma_next=sigma_next, x_t=t.x, x_next=res.x_next,
                         log_prob=res.log_prob, sde=noisy)
        t.x = res.x_next
        t.pos += 1
        return t.key, rec, t.pos == len(t.grid)
