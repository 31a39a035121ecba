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

Growing a trained model (``--init-from FOLDER --layers N``): the folder's blocks are kept in
order and ``N - L`` new joint blocks are interleaved before the last one (new block ``k`` after
old block ``k + 1``). A new block's adaptive-norm projections (``norm1``, ``norm1_context``)
start at zero, so its gates are zero and the block is the identity (DiT's adaLN-Zero): the grown
model computes exactly what the folder's model did, and training goes on from there instead of
from noise. ``--cpu-clock`` measures ``--max-minutes`` (and ``--schedule-by-time``) in this
process's CPU time, not wall time: on a shared machine the budget is then the core time spent.
Model guidance on the shape word (``--guidance g``, 0 < g < 1): classifier-free guidance
trained into the model instead of paid for at sampling time (the idea of "model guidance" /
guidance-free training). ``--drop-shape`` of the prompts lose their shape word and learn the
plain target (so ``v(x, c-)``, c- = the prompt without its shape, is the shape-marginal
velocity); the others learn ``(n - x0) + g * sg(v(x, c) - v(x, c-))`` (sg: no gradient). At the
fixed point ``v(c) = v(c-) + (v_true(c) - v(c-)) / (1 - g)``: sampling with one forward pass
gives CFG of scale ``1 / (1 - g)`` on the shape word (g = 0.75: scale 4). ``g`` ramps up from 0
over ``--guidance-ramp`` steps. One extra forward pass (no gradient) per step.
``--judge-every K`` samples 160 held-out prompts (ODE, fixed seeds) from the EMA every K steps
and logs the eval judge's shape / colour / all-correct rates (``digenrl.rl.rewards.judge``).
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


def grow_state(old: dict[str, torch.Tensor], old_layers: int, new_net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``new_net``'s state with ``old``'s blocks in order and zero-gated new blocks interleaved.

    New layout for L old and N new layers: old blocks 0..L-2 each followed, while new blocks
    remain (N - L of them), by one new block; then the old last block (``context_pre_only``)
    last. A new block keeps its random init but for ``norm1`` / ``norm1_context`` (zeros), so
    its gates are 0 and it passes both streams through unchanged.
    """
    new = {k: v.clone() for k, v in new_net.state_dict().items()}
    n_layers = new_net.config.num_layers
    extra = n_layers - old_layers
    if extra < 0:
        raise ValueError(f"--layers {n_layers} is fewer than the folder's {old_layers}")
    order: list[int | None] = []  # new index -> old index (None = a new block)
    for i in range(old_layers - 1):
        order.append(i)
        if extra:
            order.append(None)
            extra -= 1
    order += [None] * extra + [old_layers - 1]
    for k, v in old.items():
        if not k.startswith("transformer_blocks."):
            new[k] = v.clone()
    for j, src in enumerate(order):
        prefix = f"transformer_blocks.{j}."
        if src is None:
            for k in new:
                if k.startswith(prefix + "norm1.linear") or k.startswith(prefix + "norm1_context.linear"):
                    new[k].zero_()
            continue
        for k, v in old.items():
            if k.startswith(f"transformer_blocks.{src}."):
                new[prefix + k[len(f"transformer_blocks.{src}."):]] = v.clone()
    return new


@torch.no_grad()
def judge_samples(model, n: int = 160) -> dict[str, float]:
    """The eval judge's rates on ``n`` ODE samples of held-out prompts (seeds 10_000 + i)."""
    from digenrl.data.prompts import builtin_prompts
    from digenrl.rl.rewards.judge import attribute_correct
    from digenrl.rl.sampler import rollout, seeded_generators

    train = set(builtin_prompts())
    held = [p for p in all_prompts() if p not in train]
    prompts = [held[(i * 37) % len(held)] for i in range(n)]  # spread over every shape
    cfg = SamplerConfig(num_steps=8, sde_type="ode", shift=3.0)
    images = []
    for i in range(0, n, 80):
        chunk = prompts[i:i + 80]
        x = None
        for rec in rollout(model, model.encode_prompts(chunk), sampler_cfg=cfg,
                           generator=seeded_generators([10_000 + i + j for j in range(len(chunk))])):
            x = rec.x_next
        images.append(model.decode(x))
    ok = attribute_correct(torch.cat(images), prompts)
    return {k: round(v.mean().item(), 4) for k, v in ok.items()}


def without_shape(prompt: str) -> str:
    """The prompt with its shape word removed ("a red on a bluish background"): the condition
    that model guidance contrasts with (only the shape is guided; colours are already right)."""
    words = prompt.split()
    return " ".join(words[:2] + words[3:])


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
    ap.add_argument("--layers", type=int, default=0, help="num_layers (0 = the config's)")
    ap.add_argument("--init-from", default="", help="start from this transformer folder (grown to --layers)")
    ap.add_argument("--cpu-clock", action="store_true", help="--max-minutes counts this process's CPU time")
    ap.add_argument("--judge-every", type=int, default=0, help="log the eval judge's rates every K steps")
    ap.add_argument("--guidance", type=float, default=0.0,
                    help="model guidance g on the shape word (< 1; effective CFG scale 1 / (1 - g))")
    ap.add_argument("--drop-shape", type=float, default=0.15, help="with --guidance: share of shape-less prompts")
    ap.add_argument("--guidance-ramp", type=int, default=500, help="steps over which g rises from 0")
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
    overrides = dict(WIDE_SD3 if args.wide else {})
    if args.layers:
        overrides["num_layers"] = args.layers
    model = build_model(ModelConfig(family="sd3", path="random"), seed=args.seed, tiny_overrides=overrides)
    net = model.transformer.train()
    if args.init_from:
        src = build_model(ModelConfig(family="sd3", path=args.init_from)).transformer
        if any(src.config[k] != net.config[k] for k in TINY_CONFIGS["sd3"] if k != "num_layers"):
            raise SystemExit(f"--init-from {args.init_from}: config differs beyond num_layers")
        net.load_state_dict(grow_state(src.state_dict(), src.config.num_layers, net))
        print(f"grown from {args.init_from} ({src.config.num_layers} -> {net.config.num_layers} layers)", flush=True)
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
    clock = time.process_time if args.cpu_clock else time.monotonic
    t0, window = clock(), []
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
        target = noise - x0
        if args.guidance:
            # model guidance on the shape word (see the module docstring): a share of prompts
            # lose their shape word and learn the plain target; the rest learn the data target
            # plus g times the model's own shape direction v(c) - v(c without shape), detached
            drop = torch.rand(len(prompts), generator=gen) < args.drop_shape
            prompts = [without_shape(p) if d else p for p, d in zip(prompts, drop.tolist())]
        pred = model.velocity(x_sigma, sigma, model.encode_prompts(prompts))
        if args.guidance:
            keep = (~drop).nonzero().squeeze(1)
            g = args.guidance * min(1.0, (step - start + 1) / max(1, args.guidance_ramp))
            with torch.no_grad():
                v_u = model.velocity(x_sigma[keep], sigma[keep],
                                     model.encode_prompts([without_shape(prompts[i]) for i in keep.tolist()]))
            target = target.clone()
            target[keep] += g * (pred.detach()[keep] - v_u)
        loss = torch.nn.functional.mse_loss(pred, target)
        for group in opt.param_groups:
            progress = None
            if args.schedule_by_time and step - sched0 >= args.warmup:
                progress = (clock() - t0) / (args.max_minutes * 60)
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
            elapsed = clock() - t0
            log.append({"step": step + 1, "loss": sum(window) / len(window), "elapsed_s": round(elapsed, 1),
                        "lr": opt.param_groups[0]["lr"]})
            if args.judge_every and (step + 1) % args.judge_every == 0:
                model.transformer = ema
                log[-1]["judge"] = judge_samples(model)
                model.transformer = net
            window = []
            print(json.dumps(log[-1]), flush=True)
        out_of_time = clock() - t0 > args.max_minutes * 60
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
          f"{clock() - t0:.0f} s this session", flush=True)

    # Look at what it generates: 16 varied prompts, ODE sampler (8 steps, shift 3).
    shipped = build_model(ModelConfig(family="sd3", path=str(out)))
    grid_prompts = random.Random(1).sample(prompts_all, 16)
    images = sample_grid(shipped, grid_prompts, shift=args.shift)
    Path(args.grid).parent.mkdir(parents=True, exist_ok=True)
    save_grid(images, args.grid)
    print(f"grid {args.grid} (row by row):\n" + "\n".join(grid_prompts), flush=True)


if __name__ == "__main__":
    main()
