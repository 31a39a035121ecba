"""Does a model draw what the prompt asks? Both shapes judges on held-out ODE samples.

    python bench/prompt_following.py [--model builtin | FOLDER] [--run RUN_DIR] [--n 960] [--grid PNG]

Samples ``--n`` held-out prompts of the shapes grammar (the 240 of the 280 that the built-in
training set ``digenrl/data/prompts.txt`` does not hold, cycled in a fixed order), one fixed
seed each (``10_000 + i``), deterministic ODE sampling with the config's steps and shift, and
scores them with the *eval* judge (per-attribute accuracy and all-correct rate, with their
binomial standard errors) and the reward judge (for agreement), plus the mean per-image pixel
standard deviation (collapse to flat colour fields shows as a falling std).

``--run RUN_DIR`` evaluates a launch's trained policy: the run's ``config.toml`` model on top
of which ``final/policy.safetensors`` is loaded (LoRA adapter or full weights). ``--json``
prints one JSON object instead of the table. :func:`follow_report` is what ``bench/learning.py``
calls before and after each launch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from digenrl.config import ModelConfig, SamplerConfig, load_config
from digenrl.data.prompts import builtin_prompts
from digenrl.data.shapes import all_prompts
from digenrl.models import build_model
from digenrl.rl.rewards.judge import ATTRIBUTES, attribute_correct, load_judge, prompt_labels
from digenrl.rl.sampler import rollout, seeded_generators

SEED0 = 10_000


def heldout_prompts() -> list[str]:
    """The grammar's prompts that the built-in training prompt set does not hold (240 of 280)."""
    train = set(builtin_prompts())
    return [p for p in all_prompts() if p not in train]


def eval_prompts(n: int) -> list[str]:
    """``n`` held-out prompts, cycling through them in order (every prompt equally often)."""
    held = heldout_prompts()
    return [held[i % len(held)] for i in range(n)]


def load_run_model(run_dir: Path):
    """The run's model with its ``final/policy.safetensors`` applied, and the run's sampler config."""
    from safetensors.torch import load_file

    cfg = load_config(run_dir / "config.toml", [])
    model = build_model(cfg.model, seed=cfg.run.seed)
    sd = load_file(str(run_dir / "final" / "policy.safetensors"))
    if cfg.model.lora_rank:
        model.load_sync_state_dict(sd)
    else:
        params = dict(model.transformer.named_parameters())
        if set(sd) != set(params):
            raise ValueError(f"{run_dir}/final: keys differ from the model's parameters")
        with torch.no_grad():
            for k, v in sd.items():
                params[k].copy_(v)
    return model, cfg.sampler


@torch.no_grad()
def sample(model, prompts: list[str], sampler: SamplerConfig, *, batch: int = 80) -> torch.Tensor:
    """uint8 ODE samples (N, 3, H, W), prompt i with seed ``SEED0 + i`` whatever the batching."""
    cfg = SamplerConfig(num_steps=sampler.num_steps, sde_type="ode", shift=sampler.shift,
                        guidance_scale=1.0, base_tail=sampler.base_tail)
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        gens = seeded_generators([SEED0 + i + j for j in range(len(chunk))])
        x = None
        for rec in rollout(model, model.encode_prompts(chunk), generator=gens, sampler_cfg=cfg):
            x = rec.x_next
        out.append(model.decode(x))
    return torch.cat(out)


def follow_report(images: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    """Eval-judge accuracies (+ SE), reward-judge accuracies, judge agreement, pixel std."""
    n = len(prompts)
    ev = attribute_correct(images, prompts, which="eval")
    rw = attribute_correct(images, prompts, which="reward")
    out: dict[str, float] = {"n": n}
    for k, v in ev.items():
        p = v.mean().item()
        out[f"eval_{k}"] = p
        out[f"eval_{k}_se"] = math.sqrt(max(p * (1 - p), 1e-12) / n)
    for k, v in rw.items():
        out[f"reward_{k}"] = v.mean().item()
    e_lp, r_lp = load_judge("eval").log_probs(images), load_judge("reward").log_probs(images)
    for name in ATTRIBUTES:  # do the judges name the same class (right or wrong)?
        out[f"agree_{name}"] = (e_lp[name].argmax(1) == r_lp[name].argmax(1)).float().mean().item()
    labels = prompt_labels(prompts)
    out["reward_logp"] = sum(r_lp[name].gather(1, labels[:, j:j + 1]).squeeze(1)
                             for j, name in enumerate(ATTRIBUTES)).mean().item()  # type: ignore[union-attr]
    out["pixel_std"] = images.float().flatten(1).std(dim=1).mean().item()
    return out


def print_report(title: str, r: dict[str, float]) -> None:
    print(f"{title}: n={int(r['n'])}  eval judge: shape {r['eval_shape']:.3f}±{r['eval_shape_se']:.3f}  "
          f"colour {r['eval_colour']:.3f}  background {r['eval_background']:.3f}  "
          f"all {r['eval_all']:.3f}±{r['eval_all_se']:.3f} | reward judge: shape {r['reward_shape']:.3f} "
          f"all {r['reward_all']:.3f} logp {r['reward_logp']:.3f} | agreement shape "
          f"{r['agree_shape']:.3f} colour {r['agree_colour']:.3f} background {r['agree_background']:.3f} "
          f"| pixel std {r['pixel_std']:.1f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin", help="'builtin' or a diffusers transformer folder (sd3)")
    ap.add_argument("--run", default=None, help="a launch's run dir: evaluate its final/ policy")
    ap.add_argument("--n", type=int, default=960)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--shift", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--grid", default=None, help="save the first 32 samples as a PNG grid")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.run:
        model, sampler = load_run_model(Path(args.run))
    else:
        model = build_model(ModelConfig(family="sd3", path=args.model))
        sampler = SamplerConfig(num_steps=args.steps, shift=args.shift)
    prompts = eval_prompts(args.n)
    images = sample(model, prompts, sampler)
    report = follow_report(images, prompts)
    if args.grid:
        from digenrl.images import save_grid
        save_grid(images[:32], Path(args.grid), nrow=8)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(args.run or args.model, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
