"""Framework overhead: the colocated loop vs a plain straight-line Flow-GRPO loop, same model.

    python bench/overhead.py [--steps 6] [--repeats 3]

Both loops run in this process, alternating (A B A B ...), on the default config with one
torch thread; each prints samples/s, and the ratio colocated / plain is the figure of merit
(target >= 0.95). The plain loop is written out here on purpose: model forward, SDE step,
reward, advantages, clipped loss, backward, AdamW, nothing else. It does the same work as
the framework: the same prompts and per-trajectory seeds (core.plan), the same trained
window and ODE/SDE steps (learner.plan_for_step), the base model's tail
(sampler.base_tail), the same loss normalisation. Held-out evaluation is off
(``run.eval_every=0``) in both: it is not training work, and the plain loop has none.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from digenrl.actors.colocated import run_colocated
from digenrl.config import load_config, resolve_mode
from digenrl.core.plan import plan_for_step, step_prompts, trajectory_seed
from digenrl.data.prompts import load_prompts
from digenrl.models import build_model
from digenrl.models.base import cond_repeat
from digenrl.rl.rewards import build_reward
from digenrl.rl.sde import sde_step, sigma_schedule


def plain_loop(cfg, steps: int) -> float:
    """Straight-line Flow-GRPO; returns samples/s."""
    model = build_model(cfg.model, seed=cfg.run.seed)
    params = list(model.trainable_parameters())
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, betas=cfg.train.adam_betas,
                            weight_decay=cfg.train.weight_decay)
    reward = build_reward(cfg.reward.terms)
    prompts = load_prompts(cfg.prompts.file)
    P, G, T = cfg.train.prompts_per_step, cfg.train.group_size, cfg.sampler.num_steps
    s = cfg.sampler
    sig = sigma_schedule(T, s.shift).tolist()
    eps = cfg.train.clip_range
    t0 = time.perf_counter()
    for step in range(steps):
        ids = step_prompts(cfg.run.seed, step, P, len(prompts))
        batch = [prompts[i] for i in ids]
        trained, sde = plan_for_step(cfg, step)
        gens = [torch.Generator().manual_seed(trajectory_seed(cfg.run.seed, step, q, g))
                for q in range(P) for g in range(G)]
        cond = cond_repeat(model.encode_prompts(batch), G)
        x = torch.stack([torch.randn(model.latent_shape, generator=g) for g in gens])
        traj = {}
        with torch.no_grad():
            for i in range(T):
                # the last sampler.base_tail steps are the base model's (the adapter off)
                with model.adapter_disabled() if i >= T - s.base_tail else contextlib.nullcontext():
                    v = model.velocity(x, torch.full((P * G,), sig[i]), cond)
                kind = s.sde_type if i in sde else "ode"
                out = sde_step(kind, x, v, sig[i], sig[i + 1], noise_level=s.noise_level,
                               eta=s.eta, sigma_max=sig[1], generator=gens)
                if i in trained:
                    traj[i] = (x, out.x_next, out.log_prob)
                x = out.x_next
        r, _ = reward(model.decode(x), [p for p in batch for _ in range(G)])
        rg = r.view(P, G).double()
        adv = ((rg - rg.mean(1, keepdim=True)) / (rg.std(1, unbiased=False, keepdim=True) + 1e-4))
        adv = adv.clamp(-cfg.train.adv_clip, cfg.train.adv_clip).flatten().float()
        for i, (x_t, x_next, logp_old) in traj.items():
            v = model.velocity(x_t, torch.full((P * G,), sig[i]), cond)
            out = sde_step(s.sde_type, x_t, v, sig[i], sig[i + 1], noise_level=s.noise_level,
                           eta=s.eta, sigma_max=sig[1], x_next=x_next)
            ratio = torch.exp(out.log_prob - logp_old)
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)).sum()
            (loss / (P * G * len(trained))).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * P * G / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    # no held-out evaluation: it is not part of a training step, and the plain loop has none
    # (the default evaluates 640 samples at the start and the end: 10x the training of 6 steps)
    cfg = resolve_mode(load_config(args.config, [f"run.steps={args.steps}", "run.eval_every=0"]),
                       "colocated")
    plain, ours = [], []
    for rep in range(args.repeats):
        plain.append(plain_loop(cfg, args.steps))
        with tempfile.TemporaryDirectory() as d:
            for sub in ("trace", "samples", "logs"):
                (Path(d) / sub).mkdir()
            ours.append(run_colocated(cfg, Path(d))["samples_per_s"])
        print(f"repeat {rep}: plain {plain[-1]:.2f} samples/s, colocated {ours[-1]:.2f} samples/s",
              flush=True)
    p, o = statistics.median(plain), statistics.median(ours)
    print(f"median plain {p:.2f} samples/s, colocated {o:.2f} samples/s, ratio {o / p:.3f} "
          f"(target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
