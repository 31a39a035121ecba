"""Framework overhead: the colocated loop vs a plain straight-line Flow-GRPO loop, same model.

    python bench/overhead.py [--steps 6] [--repeats 3]

Both loops run in this process, alternating (A B A B ...), on the default config with one
torch thread; each prints samples/s, and the ratio colocated / plain is the figure of merit
(target >= 0.95). The plain loop is written out here on purpose: model forward, SDE step,
reward, advantages, clipped loss, backward, AdamW, nothing else.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from digenrl.colocated import run_colocated
from digenrl.config import load_config, resolve_mode
from digenrl.models import build_model
from digenrl.models.base import cond_repeat
from digenrl.prompts import load_prompts
from digenrl.rl.rewards import build_reward
from digenrl.rl.sde import sde_step, sigma_schedule


def plain_loop(cfg, steps: int) -> float:
    """Straight-line Flow-GRPO; returns samples/s."""
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, seed=cfg.run.seed)
    params = list(model.trainable_parameters())
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, betas=cfg.train.adam_betas,
                            weight_decay=cfg.train.weight_decay)
    reward = build_reward(cfg.reward.terms)
    prompts = load_prompts(cfg.prompts.file)
    P, G, T = cfg.train.prompts_per_step, cfg.train.group_size, cfg.sampler.num_steps
    s = cfg.sampler
    sig = sigma_schedule(T, s.shift).tolist()
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for step in range(steps):
        batch = [prompts[(step * P + i) % len(prompts)] for i in range(P)]
        cond = cond_repeat(model.encode_prompts(batch), G)
        x = torch.randn((P * G, *model.latent_shape), generator=gen)
        traj = []
        with torch.no_grad():
            for i in range(T):
                v = model.velocity(x, torch.full((P * G,), sig[i]), cond)
                out = sde_step(s.sde_type, x, v, sig[i], sig[i + 1], noise_level=s.noise_level,
                               eta=s.eta, sigma_max=sig[1], generator=gen)
                traj.append((x, out.x_next, out.log_prob, sig[i], sig[i + 1]))
                x = out.x_next
        r, _ = reward(model.decode(x), [p for p in batch for _ in range(G)])
        rg = r.view(P, G)
        adv = ((rg - rg.mean(1, keepdim=True)) / (rg.std(1, unbiased=False, keepdim=True) + 1e-4))
        adv = adv.clamp(-cfg.train.adv_clip, cfg.train.adv_clip).flatten()
        for x_t, x_next, logp_old, a, b in traj:
            v = model.velocity(x_t, torch.full((P * G,), a), cond)
            out = sde_step(s.sde_type, x_t, v, a, b, noise_level=s.noise_level, eta=s.eta,
                           sigma_max=sig[1], x_next=x_next)
            ratio = torch.exp(out.log_prob - logp_old)
            eps = cfg.train.clip_range
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)).mean() / T
            loss.backward()
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
    cfg = resolve_mode(load_config(args.config, [f"run.steps={args.steps}"]), "colocated")
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
