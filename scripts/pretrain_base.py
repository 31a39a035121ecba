"""Pretrain the shipped tiny SD3 base model on the procedural shapes world (rectified flow).

    nice -n 5 .venv/bin/python scripts/pretrain_base.py --steps 2600 --out digenrl/data/base-sd3-tiny

Training (one page, as the algorithm reads):

* data, generated on the fly: ``digenrl.data.shapes.make_batch`` with a seeded random.Random;
* ``x0 = encode_images(img)`` (pixel-unshuffled RGB in [-1, 1]), noise ``n ~ N(0, I)``;
* ``sigma = shift * t / (1 + (shift - 1) t)`` with ``t = sigmoid(N(0, 1))`` (logit-normal, then the
  sampler's shift 3, so training puts its effort on the noise levels the 8-step sampler visits);
* ``x_sigma = (1 - sigma) x0 + sigma n``, target velocity ``v = n - x0``, MSE loss;
* AdamW, linear warm-up then cosine decay to 5% of the peak lr; an EMA of the weights is what
  gets saved (sharper samples than the raw weights after a short run).

Checkpoints (EMA + optimizer) go to ``--ckpt-dir`` every ``--ckpt-every`` steps; ``--resume``
continues from the latest one. A continuation run can restart the schedule where it resumes:
``--restart-schedule`` counts warm-up and cosine from the resumed step (to ``--steps``, with the
given ``--lr``/``--warmup``), and ``--schedule-by-time`` measures the cosine's progress as
elapsed / ``--max-minutes`` instead of by steps, so the decay ends when the time budget does
(useful on a shared machine whose step time varies 3x). At the end the EMA transformer is written with
``save_pretrained`` into ``--out`` and a 4x4 sample grid (8 ODE steps, shift 3) to ``--grid``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from pathlib import Path

import torch
from PIL import Image

from digenrl.config import ModelConfig, SamplerConfig
from digenrl.data.shapes import all_prompts, make_batch
from digenrl.models import TINY_CONFIGS, build_model, encode_images

#: ``--wide``: twice the attention width of TINY_CONFIGS["sd3"] (2.3 M parameters instead of
#: 0.59 M, about 2.5x slower per step on CPU).
WIDE_SD3 = {"attention_head_dim": 32, "num_attention_heads": 4, "num_layers": 4,
            "caption_projection_dim": 128}


def sample_grid(model, prompts: list[str], *, sde_type: str = "ode", noise_level: float = 0.7,
                seed: int = 0, steps: int = 8, shift: float = 3.0) -> torch.Tensor:
    """uint8 images (B, 3, 32, 32) for ``prompts`` with the project's sampler."""
    from digenrl.rl.sampler import rollout, seeded_generators

    cfg = SamplerConfig(num_steps=steps, sde_type=sde_type, noise_level=noise_level, shift=shift)
    gens = seeded_generators([seed * 1000 + i for i in range(len(prompts))])
    x = None
    for rec in rollout(model, model.encode_prompts(prompts), generator=gens, sampler_cfg=cfg):
        x = rec.x_next
    return model.decode(x)


def save_grid(images: torch.Tensor, path: str | Path, cols: int = 4, scale: int = 4) -> None:
    """Tile uint8 (B, 3, H, W) into a PNG, each image upscaled ``scale``x (nearest)."""
    b, _, h, w = images.shape
    rows = math.ceil(b / cols)
    canvas = torch.full((3, rows * (h + 2), cols * (w + 2)), 255, dtype=torch.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, cols)
        canvas[:, r * (h + 2) + 1:r * (h + 2) + 1 + h, c * (w + 2) + 1:c * (w + 2) + 1 + w] = img
    pil = Image.fromarray(canvas.permute(1, 2, 0).numpy())
    pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST).save(path)


def lr_at(step: int, total: int, warmup: int, peak: float, progress: float | None = None) -> float:
    """Linear warm-up, then cosine to 5% of ``peak``; ``progress`` in [0, 1] overrides the step count."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if progress is None:
        progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2600)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--ema", type=float, default=0.998)
    ap.add_argument("--shift", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    # One thread: on a shared 2-core machine two threads were 3-6x *slower* (oversubscription).
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wide", action="store_true", help="WIDE_SD3 instead of TINY_CONFIGS['sd3']")
    ap.add_argument("--max-minutes", type=float, default=25.0, help="stop (and save) after this")
    ap.add_argument("--ckpt-dir", default="/tmp/digenrl-pretrain")
    ap.add_argument("--ckpt-every", type=int, default=250)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--restart-schedule", action="store_true",
                    help="on --resume: warm-up + cosine start at the resumed step (continuation)")
    ap.add_argument("--schedule-by-time", action="store_true",
                    help="cosine progress = elapsed / --max-minutes (decay ends with the budget)")
    ap.add_argument("--out", default="digenrl/data/base-sd3-tiny")
    ap.add_argument("--grid", default="docs/base-samples.png")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    overrides = WIDE_SD3 if args.wide else {}
    model = build_model(ModelConfig(family="sd3", path="random"), seed=args.seed, tiny_overrides=overrides)
    net = model.transformer.train()
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4, betas=(0.9, 0.99))
    channels = model.latent_shape[0]
    n_params = sum(p.numel() for p in net.parameters())
    print(f"sd3 config {dict(TINY_CONFIGS['sd3'], **overrides)}; {n_params:,} parameters", flush=True)

    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    start, log = 0, []
    if args.resume and (ckpt_dir / "last.pt").exists():
        state = torch.load(ckpt_dir / "last.pt")
        net.load_state_dict(state["net"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["opt"])
        start, log = state["step"], state["log"]
        print(f"resumed at step {start}", flush=True)

    data_rng = random.Random(args.seed * 7919 + start)  # a resumed run sees fresh scenes
    gen = torch.Generator().manual_seed(args.seed * 104729 + start)
    prompts_all = all_prompts()
    t0, window = time.monotonic(), []
    step = start
    sched0 = start if args.restart_schedule else 0
    for step in range(start, args.steps):
        images, prompts = make_batch(data_rng, args.batch, prompts_all)
        x0 = encode_images(images, channels)
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.sigmoid(torch.randn(x0.shape[0], generator=gen))
        sigma = args.shift * t / (1 + (args.shift - 1) * t)
        s = sigma.view(-1, 1, 1, 1)
        x_sigma = (1 - s) * x0 + s * noise
        pred = model.velocity(x_sigma, sigma, model.encode_prompts(prompts))
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        for group in opt.param_groups:
            progress = None
            if args.schedule_by_time and step - sched0 >= args.warmup:
                progress = (time.monotonic() - t0) / (args.max_minutes * 60)
            group["lr"] = lr_at(step - sched0, args.steps - sched0, args.warmup, args.lr, progress)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            decay = min(args.ema, (1 + step) / (10 + step))  # short memory early on
            for pe, p in zip(ema.parameters(), net.parameters()):
                pe.lerp_(p, 1 - decay)
        window.append(loss.item())
        if (step + 1) % args.log_every == 0:
            elapsed = time.monotonic() - t0
            log.append({"step": step + 1, "loss": sum(window) / len(window), "elapsed_s": round(elapsed, 1),
                        "lr": opt.param_groups[0]["lr"]})
            window = []
            print(json.dumps(log[-1]), flush=True)
        out_of_time = time.monotonic() - t0 > args.max_minutes * 60
        if (step + 1) % args.ckpt_every == 0 or out_of_time or step + 1 == args.steps:
            torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "step": step + 1, "log": log}, ckpt_dir / "last.pt.tmp")
            (ckpt_dir / "last.pt.tmp").replace(ckpt_dir / "last.pt")
        if out_of_time:
            print(f"time budget reached at step {step + 1}", flush=True)
            break

    out = Path(args.out)
    ema.save_pretrained(out)
    (ckpt_dir / "log.json").write_text(json.dumps(log))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"saved {out} ({size / 1e6:.2f} MB) after {step + 1} steps, "
          f"{time.monotonic() - t0:.0f} s this session", flush=True)

    # Look at what it generates: 16 varied prompts, ODE sampler (8 steps, shift 3).
    shipped = build_model(ModelConfig(family="sd3", path=str(out)))
    grid_prompts = random.Random(1).sample(prompts_all, 16)
    images = sample_grid(shipped, grid_prompts, shift=args.shift)
    Path(args.grid).parent.mkdir(parents=True, exist_ok=True)
    save_grid(images, args.grid)
    print(f"grid {args.grid} (row by row):\n" + "\n".join(grid_prompts), flush=True)


if __name__ == "__main__":
    main()
