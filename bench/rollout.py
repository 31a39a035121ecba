"""Rollout at engine speed: a rollout node's generation vs the pipeline, batched vs one fragment.

    python bench/rollout.py [--repeats 3] [--steps 4] [--json]

Two cases, each in this process with one torch thread: the shipped tiny SD3 base
(``digenrl/data/base-sd3-tiny``, its default size) and a tiny random FLUX folder at 256 px
(``tests/pipelines.py``). Four fragments of one prompt x ``--group`` trajectories each. The
contenders run interleaved (A B C A B C ...), each figure is the median over ``--repeats``:

- ``fragment``: a rollout node today: one fragment at a time through
  :class:`~digenrl.rl.fragment.FragmentJob` (encode, every step with its log-prob, decode),
  each step's chunk (x_t, x_next, log_prob in the wire dtype) copied to a sink;
- ``batched``: the same four fragments through one :class:`~digenrl.rl.batching.StepBatcher`
  (``max_batch`` = all four, conditioning from a :class:`~digenrl.rl.batching.CondCache`),
  chunks to the same sink, then decoded per fragment;
- ``pipeline``: the diffusers pipeline's own ``__call__`` on each fragment (same prompts,
  batch, steps and size; ``output_type="pt"``). The shipped SD3 base is a transformer folder
  only (no pipeline to call), so only the FLUX case has this one.

``--json``: per case (``sd3``, ``flux256``) ``rollout_over_pipeline`` = fragment samples/s /
pipeline samples/s (target >= 1.0), ``batched_over_fragment`` = batched / fragment (target
>= 1.3), and each contender's samples/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from digenrl.config import load_config
from digenrl.models.registry import build_model
from digenrl.rl.batching import CondCache, StepBatcher
from digenrl.rl.fragment import FragmentJob

PROMPTS = ["a red circle", "two blue squares", "a green triangle", "a yellow star"]


def _sink(sink: list, rec, wire: torch.dtype) -> None:
    sink.append((rec.x_t.to(wire).clone(), rec.x_next.to(wire).clone(), rec.log_prob.clone()))


def run_fragments(model, cfg, frags) -> int:
    sink: list = []
    for prompts, seeds in frags:
        job = FragmentJob(model=model, cfg=cfg, prompts=prompts, seeds=seeds,
                          sde_steps=list(range(cfg.sampler.num_steps)),
                          trained_steps=list(range(cfg.sampler.num_steps)), reward_fn=None)
        for rec in job.steps():
            _sink(sink, rec, torch.float32)
        job.finish()
    return sum(len(s) for _, s in frags)


def run_batched(model, cfg, frags, cache: CondCache) -> int:
    sink: list = []
    g = cfg.train.group_size
    b = StepBatcher(model, cfg.sampler, max_batch=sum(len(s) for _, s in frags), cond_cache=cache)
    for n, (prompts, seeds) in enumerate(frags):
        b.add(n, b.encode(prompts, g), seeds, None)
    while len(b):
        for _, rec, last in b.step():
            _sink(sink, rec, torch.float32)
            if last:
                with torch.no_grad():
                    model.decode(rec.x_next)
    return sum(len(s) for _, s in frags)


def run_pipeline(pipe, cfg, frags, h: int, w: int) -> int:
    g = cfg.train.group_size
    for prompts, seeds in frags:
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        with torch.no_grad():
            pipe(prompt=prompts, num_images_per_prompt=g, num_inference_steps=cfg.sampler.num_steps,
                 height=h, width=w, generator=gens, output_type="pt")
    return sum(len(s) for _, s in frags)


def case(folder: Path, size: int | None, args) -> dict[str, float]:
    from tests.pipelines import load_pipeline

    sets = [f"sampler.num_steps={args.steps}", "train.prompts_per_step=4",
            f"train.group_size={args.group}", "runtime.fragments_per_step=4", "sampler.base_tail=0",
            "model.lora_rank=0", f"model.path={json.dumps(str(folder))}"]
    if size:
        sets += [f"model.height={size}", f"model.width={size}"]
    cfg = load_config(None, sets)
    model = build_model(cfg.model, seed=0)
    with torch.no_grad():  # the image size the model decodes to
        h, w = model.decode(torch.zeros(1, *model.latent_shape)).shape[-2:]
    pipe = load_pipeline(folder) if (folder / "model_index.json").is_file() else None
    if pipe is not None:
        pipe.set_progress_bar_config(disable=True)
    frags = [([p], [100 * n + j for j in range(args.group)]) for n, p in enumerate(PROMPTS)]
    cache = CondCache(256 << 20)
    run_batched(model, cfg, frags, cache)  # warm-up (and fills the cache, as a long run does)
    run_fragments(model, cfg, frags)
    times: dict[str, list[float]] = {"fragment": [], "batched": [], "pipeline": []}
    for _ in range(args.repeats):
        for key, fn in (("fragment", lambda: run_fragments(model, cfg, frags)),
                        ("batched", lambda: run_batched(model, cfg, frags, cache)),
                        ("pipeline", lambda: run_pipeline(pipe, cfg, frags, h, w))):
            if pipe is None and key == "pipeline":
                continue
            t0 = time.perf_counter()
            n = fn()
            times[key].append(n / (time.perf_counter() - t0))
    sps = {k: statistics.median(v) for k, v in times.items() if v}
    out: dict[str, float] = {f"{k}_samples_per_s": v for k, v in sps.items()}
    if pipe is not None:
        out["rollout_over_pipeline"] = sps["fragment"] / sps["pipeline"]
    out["batched_over_fragment"] = sps["batched"] / sps["fragment"]
    out["pixels"] = float(h * w)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--only", choices=["sd3", "flux"], default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from digenrl.models.registry import builtin_folder
    from tests.pipelines import write_pipeline_folder

    res: dict[str, dict[str, float]] = {}
    if args.only in (None, "sd3"):
        res["sd3"] = case(builtin_folder("sd3"), None, args)
    if args.only in (None, "flux"):
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_pipeline_folder("flux", Path(tmp) / "flux")
            res["flux256"] = case(folder, 256, args)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for name, figures in res.items():
            for k, v in figures.items():
                print(f"{name:8s} {k:32s} {v:10.3f}")


if __name__ == "__main__":
    main()
