"""Reward in-process vs on a reward worker, for a reward that costs as much as a denoising step.

    python bench/rewards.py [--steps 12] [--repeats 3] [--reward-s S] [--json] [--set key=value ...]

Two launches of the same config (the embedded default unless ``--set`` says otherwise) in
digenrl mode, interleaved ``--repeats`` times: ``in-process`` (the rollout scores each fragment
itself, then generates the next) and ``worker`` (``cluster.rewards = 1``: the rollout hands
the images to a reward worker and goes on). The reward is :class:`StepCost`: it takes ``S``
seconds per call without using a CPU -- a scorer on an accelerator of its own, which is what
a reward worker is for -- with ``S`` the measured time of one denoising step of one fragment
(the model's forward at the fragment's batch, median of 20) unless ``--reward-s`` is given.
Reported: samples/s of each (first assignment to last step, summary.json), medians over the
repeats, and their ratio ``worker / in-process`` (key ``worker_speedup`` with ``--json``).
The machine is shared: run it on a quiet one for the figure in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


class StepCost:
    """A reward that takes ``seconds`` of wall time per call and no CPU (an accelerator's work)."""

    def __init__(self, *, seconds: float) -> None:
        self.seconds = float(seconds)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        time.sleep(self.seconds)
        return images.float().mean(dim=(1, 2, 3)) / 255.0  # something that varies per sample


def denoise_step_s(cfg) -> float:
    """Median time of one velocity forward at one fragment's batch (one denoising step)."""
    from digenrl.models import build_model

    torch.set_num_threads(cfg.run.threads)
    model = build_model(cfg.model, seed=cfg.run.seed)
    n = cfg.train.prompts_per_step // cfg.runtime.fragments_per_step * cfg.train.group_size
    prompts = [f"a red square on a blue background {i}" for i in range(n)]
    with torch.no_grad():
        cond = model.encode_prompts(prompts)
        x = torch.randn(n, *model.latent_shape)
        sigma = torch.full((n,), 0.5)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            model.velocity(x, sigma, cond)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(name: str, overrides: list[str], tmp: Path) -> float:
    from digenrl.config import load_config, resolve_mode
    from digenrl.launch import launch, make_run_dir

    cfg = resolve_mode(load_config(None, overrides), "digenrl")
    summary = launch(cfg, make_run_dir(cfg, str(tmp / f"{name}-{time.monotonic_ns()}")))
    acc = summary["accounting"]
    if acc["in_flight"] or any(k.startswith("reward_") for k in acc["discarded"]):
        raise SystemExit(f"{name}: the run did not end clean: {acc}")
    return float(summary["samples_per_s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reward-s", type=float, default=None, help="reward seconds per call (default: measured)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from digenrl.config import load_config

    # the launch checks the reward in this process before it starts, and children import it
    # (bench.rewards:StepCost): the repo on both paths (a script's own is bench/)
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    base = [f"run.steps={args.steps}", "runtime.tag=\"never\"", "run.eval_every=0", *args.overrides]
    seconds = args.reward_s if args.reward_s is not None else denoise_step_s(load_config(None, base))
    term = f'reward.terms=[{{ name = "bench.rewards:StepCost", args = {{ seconds = {seconds!r} }} }}]'
    variants = {"in-process": [*base, term, "cluster.rewards=0"],
                "worker": [*base, term, "cluster.rewards=1"]}
    rates: dict[str, list[float]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.repeats):
            for name, ov in variants.items():
                rates[name].append(run(name, ov, Path(d)))
                print(f"repeat {r}: {name:<10} {rates[name][-1]:.3f} samples/s", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {"reward_s": seconds, "steps": args.steps, "repeats": args.repeats,
              "samples_per_s": med, "runs": rates, "worker_speedup": med["worker"] / med["in-process"]}
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "rewards.json").write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"reward {seconds * 1e3:.1f} ms per fragment (one denoising step); medians of {args.repeats}")
        print("| variant | samples/s |\n|---|---|")
        for k, v in med.items():
            print(f"| {k} | {v:.3f} |")
        print(f"worker / in-process: {result['worker_speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
