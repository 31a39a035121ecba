"""Rollout at engine speed: a rollout node's generation vs the pipeline, batched vs one fragment.

    python bench/rollout.py [--only CASE ...] [--repeats 3] [--steps 4] [--compile] [--json]

Cases, each in this process with one torch thread (four fragments of one prompt x
``--group`` trajectories each, ``--steps`` denoising steps, all SDE, every step a trained
one whose chunk is staged for the wire):

- ``sd3``: the shipped tiny SD3 base (``digenrl/data/base-sd3-tiny``, its default size); a
  transformer folder only, so it has no pipeline to compare with;
- ``sd3pipe``: the tiny random SD3 pipeline folder of ``tests/pipelines.py`` at its default size;
- ``flux256``: the tiny random FLUX pipeline folder at 256 x 256 px with its 2x VAE (4096 image
  tokens a row, the token count of FLUX.1 at 1024 px);
- ``flux256v8``: the same with an 8x VAE (256 image tokens a row: FLUX.1's own geometry at 256 px).

Contenders, interleaved (A B C A B C ...), each figure the median over ``--repeats``:

- ``fragment``: a rollout node with ``sampler.max_batch = 0``: one fragment at a time through
  :class:`~digenrl.rl.fragment.FragmentJob` (encode, every step with its log-prob, decode),
  each step's chunk (x_t, x_next, log_prob in the wire dtype) staged into the node's pooled host
  buffers (:class:`~digenrl.transport.staging.DeviceToHost`) and released, as a sent chunk is;
- ``batched``: the four fragments through one :class:`~digenrl.rl.batching.StepBatcher`
  (``max_batch`` = all their rows), as a node's StepEngine runs them: they arrive together, so
  their prompts are encoded in one call, step together and finish together, so they are decoded
  in one call; chunks staged the same way; a fresh :class:`~digenrl.rl.batching.CondCache` per
  run, so each prompt is encoded once, as the one-at-a-time path does (no hits from earlier runs);
- ``pipeline``: the diffusers pipeline's own ``__call__`` on each fragment (same prompts, batch,
  steps, size and dtype; ``output_type="pt"``).
- ``--join``: afterwards, the four fragments arriving at once through a step batcher with
  ``sampler.join = "fits"`` and one with ``"pays"`` (each kept across runs, its first run
  untimed: the step curve "pays" judges by), interleaved: samples/s
  (``join_pays_over_fits``) and the seconds until the first fragment's last step
  (``join_first_fragment_pays_over_fits``: what a trainer waiting on the oldest fragment waits);
- ``--compile``: afterwards (the timers above removed: dynamo would trace them), ``batched``
  through an eager and an inductor-compiled denoiser (``sampler.compile``), interleaved:
  ``compiled_over_eager``; compiling (the first run) is timed apart as ``compile_s``.

Each contender's time (CPU seconds on a CPU, wall seconds on a GPU) is split (timers around
the transformer's and the VAE's forwards, the same for the rollout and the pipeline) into
``*_forward_s``, ``*_decode_s`` and ``*_own_s``: everything else (text encoders, noise, SDE
steps and log-probs, chunk staging, Python), per sample. ``forward_ms_by_rows``: one denoiser forward's milliseconds at 1, 2, 4
and 8 rows (median of interleaved repeats): the batching curve a step batcher lives on.

``cpu_time`` (CPU runs): the same samples/s and ratios by this process's CPU seconds
(``time.process_time``), which other tenants of a shared machine disturb less than wall time
(one torch thread: CPU seconds are the work done).

``--json``: per case ``rollout_over_pipeline`` = fragment samples/s / pipeline samples/s (target
>= 1.0), ``batched_over_fragment`` = batched / fragment (target >= 1.3),
``compiled_over_eager`` (``--compile``), each contender's samples/s and
the splits. ``measure()`` is what ``bench/gpu_check.py`` runs on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/pipelines.py: the tiny folders

from digenrl.config import detect_family, load_config
from digenrl.models.registry import build_model
from digenrl.rl.batching import CondCache, Denoiser, StepBatcher
from digenrl.rl.fragment import FragmentJob
from digenrl.transport.staging import DeviceToHost

PROMPTS = ["a red circle", "two blue squares", "a green triangle", "a yellow star"]
CASES = ("sd3", "sd3pipe", "flux256", "flux256v8")
ROWS = (1, 2, 4, 8)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Phases:
    """Seconds spent inside the wrapped modules' calls (instance-level wrappers on
    ``forward``/``decode``), by phase name: this process's CPU seconds on a CPU; on CUDA wall
    seconds, each wrapped call synchronising first and last so its time is the device's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.clock = time.process_time if device.type == "cpu" else time.perf_counter
        self.seconds: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, phase: str, obj: Any, method: str) -> None:
        if obj is None:
            return
        fn = getattr(obj, method)
        self.seconds.setdefault(phase, 0.0)

        def timed(*a: Any, **kw: Any) -> Any:
            _sync(self.device)
            t0 = self.clock()
            try:
                return fn(*a, **kw)
            finally:
                _sync(self.device)
                self.seconds[phase] += self.clock() - t0

        setattr(obj, method, timed)
        self._undo.append(lambda: delattr(obj, method))

    @contextlib.contextmanager
    def counting(self) -> Iterator[dict[str, float]]:
        for k in self.seconds:
            self.seconds[k] = 0.0
        yield self.seconds

    def close(self) -> None:
        for undo in self._undo:
            undo()


def _stage(stager: DeviceToHost, rec: Any, wire: torch.dtype) -> None:
    """What a rollout node does with a trained step: stage its chunk, send it (here: nothing to
    send, the buffer goes back at once)."""
    stager.stage([rec.x_t.to(wire), rec.x_next.to(wire), rec.log_prob]).release()


def run_fragments(model, cfg, frags, stager: DeviceToHost) -> int:
    wire = torch.bfloat16 if cfg.sampler.wire_dtype == "bfloat16" else torch.float32
    steps = list(range(cfg.sampler.num_steps))
    for prompts, seeds in frags:
        job = FragmentJob(model=model, cfg=cfg, prompts=prompts, seeds=seeds, sde_steps=steps,
                          trained_steps=steps, reward_fn=None)
        for rec in job.steps():
            _stage(stager, rec, wire)
        job.finish()
    _sync(model.device)
    return sum(len(s) for _, s in frags)


def run_batched(model, cfg, frags, stager: DeviceToHost, denoiser: Denoiser | None = None) -> int:
    """The fragments through one step batcher, as the node's StepEngine runs them: the prompts
    of fragments that arrive together encoded in one call, the fragments that finish at a step
    decoded in one call."""
    wire = torch.bfloat16 if cfg.sampler.wire_dtype == "bfloat16" else torch.float32
    g = cfg.train.group_size
    rows = sum(len(s) for _, s in frags)
    b = StepBatcher(model, cfg.sampler, max_batch=rows, cond_cache=CondCache(64 << 20), denoiser=denoiser)
    conds = b.encode_many([prompts for prompts, _ in frags], g)  # they arrive together: one call
    for n, ((_, seeds), cond) in enumerate(zip(frags, conds, strict=True)):
        b.add(n, cond, seeds, None)
    while len(b):
        finals = []
        for _, rec, last in b.step():
            _stage(stager, rec, wire)
            if last:
                finals.append(rec.x_next)
        if finals:  # the fragments that finished at this step: one decoder call
            b.decode_many(finals)
    _sync(model.device)
    return rows


def run_join(b: StepBatcher, cfg, frags, stager: DeviceToHost) -> tuple[int, float]:
    """The fragments through ``b`` (kept across runs: its step curve is what ``sampler.join =
    "pays"`` judges by), all arriving at once; returns the rows and the seconds until the
    first fragment's last step (what a trainer waiting for the oldest fragment waits)."""
    wire = torch.bfloat16 if cfg.sampler.wire_dtype == "bfloat16" else torch.float32
    clock = time.process_time if b.model.device.type == "cpu" else time.perf_counter
    t0, first = clock(), 0.0
    for n, cond in enumerate(b.encode_many([prompts for prompts, _ in frags], cfg.train.group_size)):
        b.add(n, cond, frags[n][1], None)
    while len(b):
        for _, rec, last in b.step():
            _stage(stager, rec, wire)
            if last:
                b.decode_many([rec.x_next])
                first = first or clock() - t0
    _sync(b.model.device)
    return sum(len(s) for _, s in frags), first


def _join_modes(model, cfg, frags, stager: DeviceToHost, repeats: int,
                log: Callable[[str], None]) -> dict[str, Any]:
    """``sampler.join`` "fits" against "pays", interleaved, one batcher each kept across runs
    (the first run, untimed, measures the curve): samples/s and seconds to the first fragment."""
    rows = sum(len(s) for _, s in frags)
    batchers = {j: StepBatcher(model, cfg.sampler, max_batch=rows, join=j) for j in ("fits", "pays")}
    clock = time.process_time if model.device.type == "cpu" else time.perf_counter
    sps: dict[str, list[float]] = {j: [] for j in batchers}
    first: dict[str, list[float]] = {j: [] for j in batchers}
    for b in batchers.values():
        run_join(b, cfg, frags, stager)
    for _ in range(repeats):
        for j, b in batchers.items():
            t0 = clock()
            n, f = run_join(b, cfg, frags, stager)
            sps[j].append(n / (clock() - t0))
            first[j].append(f)
        log(" ".join(f"join={j} {sps[j][-1]:.3g}/s first {first[j][-1]:.3g}s" for j in batchers))
    out: dict[str, Any] = {}
    for j in batchers:
        out[f"join_{j}_samples_per_s"] = statistics.median(sps[j])
        out[f"join_{j}_first_fragment_s"] = statistics.median(first[j])
    out["join_pays_over_fits"] = out["join_pays_samples_per_s"] / out["join_fits_samples_per_s"]
    out["join_first_fragment_pays_over_fits"] = out["join_pays_first_fragment_s"] / out["join_fits_first_fragment_s"]
    out["join_pays_refused"] = batchers["pays"].stats.joins_refused
    return out


def run_pipeline(pipe, cfg, frags, h: int, w: int, guidance: float) -> int:
    """``guidance``: the pipeline's ``guidance_scale``, the rollout's: FLUX's embedded guidance,
    SD3's classifier-free scale (1: no CFG, as ``sampler.guidance_scale`` defaults to)."""
    g = cfg.train.group_size
    for prompts, seeds in frags:
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        with torch.no_grad():
            pipe(prompt=prompts, num_images_per_prompt=g, num_inference_steps=cfg.sampler.num_steps,
                 height=h, width=w, generator=gens, output_type="pt", guidance_scale=guidance)
    _sync(pipe.device)
    return sum(len(s) for _, s in frags)


def forward_curve(model, repeats: int, rows: tuple[int, ...] = ROWS) -> dict[str, float]:
    """Milliseconds of one forward (``model.velocity``) at each row count, medians of
    interleaved repeats (one prompt's conditioning repeated); on a CPU by this process's CPU
    time, on a GPU by the wall clock around synchronised calls."""
    clock = time.process_time if model.device.type == "cpu" else time.perf_counter
    from digenrl.models.base import cond_repeat

    with torch.no_grad():
        one = model.encode_prompts([PROMPTS[0]])
    gen = torch.Generator().manual_seed(0)
    inputs = {r: (torch.randn(r, *model.latent_shape, generator=gen).to(model.device),
                  torch.full((r,), 0.6, device=model.device), cond_repeat(one, r)) for r in rows}
    times: dict[int, list[float]] = {r: [] for r in rows}
    with torch.no_grad():
        for r in rows:  # warm-up: first-call allocations
            model.velocity(*inputs[r])
        for _ in range(repeats):
            for r in rows:
                _sync(model.device)
                t0 = clock()
                model.velocity(*inputs[r])
                _sync(model.device)
                times[r].append(clock() - t0)
    return {str(r): 1e3 * statistics.median(v) for r, v in times.items()}


def _vae(model) -> Any:
    return getattr(model.decoder, "vae", None)


def measure(folder: Path, size: int | None, *, steps: int = 4, group: int = 2, repeats: int = 3,
            compile: bool = False, join: bool = False, device: str | torch.device = "cpu", dtype: str = "float32",
            log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """One case: ``folder`` (a transformer or pipeline folder) at ``size`` px (None: its
    default), on ``device`` in ``dtype``; the figures named in the module doc."""
    from tests.pipelines import load_pipeline

    device = torch.device(device)
    sets = [f"sampler.num_steps={steps}", "train.prompts_per_step=4", f"train.group_size={group}",
            "runtime.fragments_per_step=4", "sampler.base_tail=0", "model.lora_rank=0",
            f"model.dtype={json.dumps(dtype)}", f"model.path={json.dumps(str(folder))}",
            f"model.family={json.dumps(detect_family(str(folder)) or 'sd3')}"]
    if size:
        sets += [f"model.height={size}", f"model.width={size}"]
    cfg = load_config(None, sets)
    model = build_model(cfg.model, seed=0, device=device)
    with torch.no_grad():  # the image size the model decodes to
        h, w = model.decode(torch.zeros(1, *model.latent_shape, device=device)).shape[-2:]
    pipe = None
    if (folder / "model_index.json").is_file():
        pipe = load_pipeline(folder)
        pipe.set_progress_bar_config(disable=True)
        # the rollout's compute dtype; the pipeline casts latents to its VAE's dtype nowhere, so
        # its VAE is in that dtype too (the rollout decodes in float32: bfloat16 favours the pipeline)
        pipe.to(device, model.dtype)
    frags = [([p], [100 * n + j for j in range(group)]) for n, p in enumerate(PROMPTS)]
    stager = DeviceToHost(device)
    phases: dict[str, Phases] = {"rollout": Phases(device), "pipeline": Phases(device)}
    phases["rollout"].wrap("forward", model.transformer, "forward")
    phases["rollout"].wrap("decode", _vae(model), "decode")
    if pipe is not None:
        phases["pipeline"].wrap("forward", pipe.transformer, "forward")
        phases["pipeline"].wrap("decode", pipe.vae, "decode")
    contenders: dict[str, Callable[[], int]] = {
        "fragment": lambda: run_fragments(model, cfg, frags, stager),
        "batched": lambda: run_batched(model, cfg, frags, stager),
    }
    if pipe is not None:
        guidance = model.guidance if getattr(model.transformer.config, "guidance_embeds", False) \
            else cfg.sampler.guidance_scale
        contenders["pipeline"] = lambda: run_pipeline(pipe, cfg, frags, h, w, guidance)
    out: dict[str, Any] = {"pixels": float(h * w), "rows": float(len(frags) * group), "dtype": dtype,
                           "device": str(device)}
    for fn in contenders.values():  # warm-up: first-call allocations, lazy imports
        fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    cpu_times: dict[str, list[float]] = {k: [] for k in contenders}
    split: dict[str, dict[str, list[float]]] = {k: {"forward": [], "decode": [], "own": []} for k in contenders}
    for _ in range(repeats):
        for key, fn in contenders.items():
            ph = phases["pipeline" if key == "pipeline" else "rollout"]
            with ph.counting() as sec:
                t0, c0 = time.perf_counter(), time.process_time()
                n = fn()
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            times[key].append(n / dt)
            cpu_times[key].append(n / cpu)
            total = cpu if device.type == "cpu" else dt  # the clock the phases were timed by
            split[key]["forward"].append(sec.get("forward", 0.0) / n)
            split[key]["decode"].append(sec.get("decode", 0.0) / n)
            split[key]["own"].append((total - sec.get("forward", 0.0) - sec.get("decode", 0.0)) / n)
        log(" ".join(f"{k}={v[-1]:.3g}" for k, v in times.items()))
    for ph in phases.values():
        ph.close()
    if join:
        out.update(_join_modes(model, cfg, frags, stager, repeats, log))
    if compile:  # after the timers are gone: dynamo would trace them (a graph break each)
        out.update(_compiled_over_eager(model, cfg, frags, stager, repeats, log))
    sps = {k: statistics.median(v) for k, v in times.items()}
    out.update({f"{k}_samples_per_s": v for k, v in sps.items()})
    out.update({f"{k}_samples_per_s_repeats": v for k, v in times.items()})
    for k, parts in split.items():
        out.update({f"{k}_{p}_s": statistics.median(v) for p, v in parts.items()})
    if pipe is not None:
        out["rollout_over_pipeline"] = sps["fragment"] / sps["pipeline"]
    out["batched_over_fragment"] = sps["batched"] / sps["fragment"]
    if device.type == "cpu":  # the same ratios by this process's CPU seconds (other tenants' load apart)
        cps = {k: statistics.median(v) for k, v in cpu_times.items()}
        out["cpu_time"] = {f"{k}_samples_per_s": v for k, v in cps.items()}
        if pipe is not None:
            out["cpu_time"]["rollout_over_pipeline"] = cps["fragment"] / cps["pipeline"]
        out["cpu_time"]["batched_over_fragment"] = cps["batched"] / cps["fragment"]
    out["forward_ms_by_rows"] = forward_curve(model, repeats)
    return out


def _compiled_over_eager(model, cfg, frags, stager: DeviceToHost, repeats: int,
                         log: Callable[[str], None]) -> dict[str, Any]:
    """``batched`` through an eager and an inductor-compiled denoiser, interleaved; compiling
    (the first run: every row in flight, one shape) is timed apart as ``compile_s``."""
    rows = sum(len(s) for _, s in frags)
    den = Denoiser(model, compile=True, max_rows=rows, log=lambda ev, **kw: log(f"{ev} {kw}"))
    t0 = time.perf_counter()
    run_batched(model, cfg, frags, stager, den)
    out: dict[str, Any] = {"compile_s": time.perf_counter() - t0, "compile_fallback": den.fallback}
    wall: dict[str, list[float]] = {"eager": [], "compiled": []}
    cpu: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(repeats):
        for key, d in (("eager", None), ("compiled", den)):
            t0, c0 = time.perf_counter(), time.process_time()
            n = run_batched(model, cfg, frags, stager, d)
            wall[key].append(n / (time.perf_counter() - t0))
            cpu[key].append(n / (time.process_time() - c0))
        log(" ".join(f"{k}={v[-1]:.3g}" for k, v in wall.items()))
    out.update({f"{k}_batched_samples_per_s": statistics.median(v) for k, v in wall.items()})
    out["compiled_over_eager"] = statistics.median(wall["compiled"]) / statistics.median(wall["eager"])
    if model.device.type == "cpu":
        out["compiled_over_eager_cpu_time"] = statistics.median(cpu["compiled"]) / statistics.median(cpu["eager"])
    return out


def case_folder(name: str, tmp: Path) -> tuple[Path, int | None]:
    """The folder and size of a named case (pipeline folders written under ``tmp``)."""
    from digenrl.models.registry import builtin_folder
    from tests.pipelines import write_pipeline_folder

    if name == "sd3":
        return builtin_folder("sd3"), None
    if name == "sd3pipe":
        return write_pipeline_folder("sd3", tmp / "sd3"), None
    if name == "flux256":
        return write_pipeline_folder("flux", tmp / "flux"), 256
    if name == "flux256v8":
        return write_pipeline_folder("flux", tmp / "flux8", vae_factor=8), 256
    raise ValueError(f"case {name!r}: expected one of {', '.join(CASES)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--only", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--compile", action="store_true", help="also the compiled step batcher (inductor)")
    ap.add_argument("--join", action="store_true", help="also sampler.join 'fits' against 'pays'")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            folder, size = case_folder(name, Path(tmp))

            def log(line: str, name: str = name) -> None:
                print(f"[{name}] {line}", flush=True)

            res[name] = measure(folder, size, steps=args.steps, group=args.group, repeats=args.repeats,
                                compile=args.compile, join=args.join, log=log)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for name, figures in res.items():
            for k, v in figures.items():
                if isinstance(v, float):
                    print(f"{name:10s} {k:34s} {v:10.4g}")
                else:
                    print(f"{name:10s} {k:34s} {v}")


if __name__ == "__main__":
    main()
