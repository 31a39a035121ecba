"""Train the two shipped shapes judges (``digenrl/data/judge-{reward,eval}.safetensors``).

    PYTHONPATH=. nice -n 10 .venv/bin/python scripts/train_judge.py --which both

Each judge (:class:`digenrl.rl.rewards.judge.ShapesJudge`) learns shape, shape colour and background
colour from ``digenrl.data.shapes`` renders (random scenes of the whole grammar, generated once
per run from the judge's seed). The two are trained *independently* -- different seeds, data,
architectures and augmentations -- so that the eval judge is a second opinion on a policy
trained against the reward judge, not the same function twice. The augmentations imitate what a
generated sample has and a render does not, so the judges are fair to samples:

* ``reward``: 4 convs 16-32-32-48 (3x3), average+max pooling; per-channel gain/offset jitter,
  Gaussian blur, blending with a 4x4-block average (token-sized blockiness), Gaussian pixel
  noise; label smoothing 0.1 (so its log-probabilities, the reward, do not saturate);
* ``eval``: 4 convs 12-24-40-40 (5x5 stem), average pooling, a hidden layer; contrast /
  brightness / per-channel offset jitter, small rotations and rescaling, bilinear down-up blur,
  per-4x4-token noise, a 2-pixel checkerboard (the texture RL drift produces), pixel noise.

Both flip left-right (every shape of the world is mirror-symmetric) and quantise to uint8
levels. Reported: accuracy per attribute on held-out *clean* renders (a fixed seed no training
set uses) and on renders with the other judge's augmentations. Saved as float16 safetensors
with the architecture, recipe and accuracies as metadata.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from digenrl.data.shapes import COLOURS, SHAPES, make_batch, parse_prompt
from digenrl.rl.rewards.judge import ATTRIBUTES, JUDGES, ShapesJudge, save_judge

RECIPES = {
    "reward": {"seed": 1, "arch": {"widths": [16, 32, 32, 48], "strides": [1, 2, 2, 2],
                                   "kernels": [3, 3, 3, 3], "pool": "avgmax", "hidden": 0},
               "label_smoothing": 0.1},
    "eval": {"seed": 2, "arch": {"widths": [12, 24, 40, 40], "strides": [1, 2, 2, 2],
                                 "kernels": [5, 3, 3, 3], "pool": "avg", "hidden": 32},
             "label_smoothing": 0.0},
}
TEST_SEED = 987_654_321  # the held-out clean renders: no training set is drawn from it


def labels_of(prompts: list[str]) -> torch.Tensor:
    rows = []
    for p in prompts:
        shape, colour, bg = parse_prompt(p)
        rows.append([SHAPES.index(shape), list(COLOURS).index(colour), list(COLOURS).index(bg)])
    return torch.tensor(rows, dtype=torch.long)


def dataset(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random scenes of the whole grammar: uint8 (n, 3, 32, 32), labels (n, 3)."""
    images, prompts = make_batch(random.Random(seed), n)
    return images, labels_of(prompts)


def _u(gen: torch.Generator, n: int, lo: float, hi: float) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=gen)


def _gaussian_blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Per-image Gaussian blur (5x5 kernel, std ``sigma`` (B,)), edges replicated."""
    r = torch.arange(-2, 3, dtype=torch.float32)
    k1 = torch.exp(-(r.view(1, -1) ** 2) / (2 * sigma.view(-1, 1).clamp_min(1e-3) ** 2))
    k1 = k1 / k1.sum(1, keepdim=True)  # (B, 5)
    b, c, h, w = x.shape
    xp = F.pad(x, (2, 2, 2, 2), mode="replicate").reshape(1, b * c, h + 4, w + 4)
    kb = k1.repeat_interleave(c, 0)  # (B*C, 5)
    x1 = F.conv2d(xp, kb.view(b * c, 1, 1, 5), groups=b * c)
    x2 = F.conv2d(x1, kb.view(b * c, 1, 5, 1), groups=b * c)
    return x2.reshape(b, c, h, w)


def _where(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.view(-1, 1, 1, 1), a, b)


def augment_reward(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The reward judge's augmentations of images in [-1, 1] (see the module docstring)."""
    b = x.shape[0]
    x = x * (1 + _u(gen, 3 * b, -0.08, 0.08).view(b, 3, 1, 1)) + _u(gen, 3 * b, -0.08, 0.08).view(b, 3, 1, 1)
    x = _where(torch.rand(b, generator=gen) < 0.5, _gaussian_blur(x, _u(gen, b, 0.3, 1.2)), x)
    blocky = F.interpolate(F.avg_pool2d(x, 4), scale_factor=4, mode="nearest")
    alpha = _u(gen, b, 0.0, 0.5) * (torch.rand(b, generator=gen) < 0.3)
    x = x + alpha.view(b, 1, 1, 1) * (blocky - x)
    return x + _u(gen, b, 0.0, 0.25).view(b, 1, 1, 1) * torch.randn(x.shape, generator=gen)


def augment_eval(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The eval judge's augmentations of images in [-1, 1] (see the module docstring)."""
    b = x.shape[0]
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    x = (x - mean) * _u(gen, b, 0.85, 1.15).view(b, 1, 1, 1) + mean + _u(gen, b, -0.1, 0.1).view(b, 1, 1, 1)
    x = x + _u(gen, 3 * b, -0.05, 0.05).view(b, 3, 1, 1)
    ang = _u(gen, b, -8, 8) * math.pi / 180
    scale = _u(gen, b, 0.92, 1.08)
    cos, sin = torch.cos(ang) / scale, torch.sin(ang) / scale
    theta = torch.stack([torch.stack([cos, -sin, torch.zeros(b)], 1),
                         torch.stack([sin, cos, torch.zeros(b)], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    x = _where(torch.rand(b, generator=gen) < 0.5,
               F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False), x)
    factor = float(_u(gen, 1, 0.5, 0.75))
    small = F.interpolate(x, scale_factor=factor, mode="bilinear", align_corners=False)
    soft = F.interpolate(small, size=x.shape[-2:], mode="bilinear", align_corners=False)
    x = _where(torch.rand(b, generator=gen) < 0.4, soft, x)
    token_noise = F.interpolate(torch.randn(b, 3, 8, 8, generator=gen), scale_factor=4, mode="nearest")
    x = x + _u(gen, b, 0.0, 0.15).view(b, 1, 1, 1) * token_noise
    yy, xx = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    checker = (((yy + xx) % 2) * 2 - 1).float()
    amp = _u(gen, b, 0.0, 0.15) * (torch.rand(b, generator=gen) < 0.2)
    x = x + amp.view(b, 1, 1, 1) * checker * torch.sign(torch.randn(b, 3, 1, 1, generator=gen))
    return x + _u(gen, b, 0.0, 0.3).view(b, 1, 1, 1) * torch.randn(x.shape, generator=gen)


AUGMENT = {"reward": augment_reward, "eval": augment_eval}


def finish(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random left-right flip, then clamp and quantise to uint8 levels (as a decoded sample is)."""
    flip = torch.rand(x.shape[0], generator=gen) < 0.5
    x = _where(flip, x.flip(-1), x)
    return ((x.clamp(-1, 1) + 1) * 127.5).round() / 127.5 - 1


def loss_of(judge: ShapesJudge, x: torch.Tensor, y: torch.Tensor, smoothing: float) -> torch.Tensor:
    logp = judge.split(judge(x))
    return sum(F.nll_loss(lp, y[:, j]) * (1 - smoothing) - smoothing * lp.mean(1).mean()
               for j, lp in enumerate(logp.values()))  # type: ignore[return-value]


@torch.no_grad()
def accuracy(judge: ShapesJudge, images: torch.Tensor, y: torch.Tensor,
             augment=None, seed: int = 0) -> dict[str, float]:
    """Per-attribute and all-correct accuracy on uint8 ``images`` (optionally augmented)."""
    judge.eval()
    gen = torch.Generator().manual_seed(seed)
    hits = {k: 0.0 for k in (*ATTRIBUTES, "all")}
    for i in range(0, images.shape[0], 500):
        x = images[i:i + 500].float() / 127.5 - 1
        if augment is not None:
            x = finish(augment(x, gen), gen)
        logp = judge.split(judge(x))
        ok = [(lp.argmax(1) == y[i:i + 500, j]) for j, lp in enumerate(logp.values())]
        for name, o in zip(ATTRIBUTES, ok):
            hits[name] += o.sum().item()
        hits["all"] += (ok[0] & ok[1] & ok[2]).sum().item()
    return {k: round(v / images.shape[0], 4) for k, v in hits.items()}


def train(which: str, args: argparse.Namespace, test: tuple[torch.Tensor, torch.Tensor]) -> None:
    recipe = RECIPES[which]
    seed = recipe["seed"] + args.seed_offset
    torch.manual_seed(seed)
    judge = ShapesJudge(recipe["arch"])
    n_params = sum(p.numel() for p in judge.parameters())
    t0 = time.monotonic()
    images, y = dataset(seed * 1_000_003, args.train_size)
    print(f"[{which}] {n_params:,} parameters; {args.train_size} training renders in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(judge.parameters(), lr=args.lr, weight_decay=5e-4)
    augment = AUGMENT[which]
    t0 = time.monotonic()
    for step in range(args.steps):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, images.shape[0], (args.batch,), generator=gen)
        x = finish(augment(images[idx].float() / 127.5 - 1, gen), gen)
        judge.train()
        loss = loss_of(judge, x, y[idx], recipe["label_smoothing"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % args.log_every == 0:
            print(json.dumps({"judge": which, "step": step + 1, "loss": round(loss.item(), 4),
                              "lr": round(lr, 6), "elapsed_s": round(time.monotonic() - t0, 1)}), flush=True)
    clean = accuracy(judge, *test)
    other = "eval" if which == "reward" else "reward"
    augmented = accuracy(judge, *test, augment=AUGMENT[other], seed=5)
    own = accuracy(judge, *test, augment=augment, seed=6)
    info = {"which": which, "seed": seed, "steps": args.steps, "batch": args.batch, "lr": args.lr,
            "train_size": args.train_size, "label_smoothing": recipe["label_smoothing"],
            "augment": augment.__name__, "test_seed": TEST_SEED, "test_size": test[0].shape[0],
            "accuracy_clean": clean, f"accuracy_{other}_augment": augmented,
            "accuracy_own_augment": own, "train_seconds": round(time.monotonic() - t0)}
    out = Path(args.out_dir) / JUDGES[which].name
    save_judge(judge, out, info)
    print(f"[{which}] saved {out} ({out.stat().st_size / 1e3:.1f} kB): {json.dumps(info)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--which", choices=["reward", "eval", "both"], default="both")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--train-size", type=int, default=60000)
    ap.add_argument("--test-size", type=int, default=4000)
    ap.add_argument("--seed-offset", type=int, default=0, help="added to each recipe's seed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--out-dir", default=str(JUDGES["reward"].parent))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    test = dataset(TEST_SEED, args.test_size)
    for which in (["reward", "eval"] if args.which == "both" else [args.which]):
        train(which, args, test)


if __name__ == "__main__":
    main()
