"""Per-rank activation memory of the families' sequence-parallel forward, measured on the CPU.

A training forward (the velocity of one sample, LoRA rank 4) of the tiny random FLUX, Wan,
FLUX.2 and Z-Image transformers (the real diffusers classes, ``model.path = "random"``) at a size where the
image/video tokens' activations dominate, once in one process (SP = 1) and over two gloo
ranks with :mod:`digenrl.models.seqpar` (SP = 2: each rank carries half the tokens, the text
replicated). The bytes autograd saves for the backward are counted by
:func:`digenrl.sim.memplan.count_saved_bytes` (each storage once, weights left out); the
ratio is rank 0's bytes at SP = 2 over the one-process bytes. ``<family>_sp_max_rel_dev``
is the largest deviation of the SP = 2 velocity from the one-process velocity, relative to
its largest magnitude.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/memory_sp_family.py --json

The counts are deterministic: one run.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: family -> model sizes, 1,024 image tokens each: FLUX and Z-Image 128 x 128 px, FLUX.2 64 x 64 px
#: (its tiny random VAE halves the pixels, a token per latent cell); Wan 5 frames at 64 x 64 px (1,280)
SIZES: dict[str, dict[str, int]] = {"flux": {"height": 128, "width": 128},
                                    "wan": {"height": 64, "width": 64, "num_frames": 5},
                                    "flux2": {"height": 64, "width": 64},
                                    "zimage": {"height": 128, "width": 128}}


def _forward(family: str, sp: bool) -> tuple[int, torch.Tensor, int]:
    """(saved bytes, velocity, image/video tokens this rank carried) of one training forward."""
    from contextlib import nullcontext

    from digenrl.config import ModelConfig
    from digenrl.models import build_model
    from digenrl.sim.memplan import count_saved_bytes

    model = build_model(ModelConfig(family=family, path="random", lora_rank=4, **SIZES[family]), seed=0)
    active: Any = nullcontext()
    if sp:
        from digenrl.models.seqpar import enable_sequence_parallel
        active = enable_sequence_parallel(model, dist.group.WORLD).active()
    x = torch.randn(1, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cond = model.encode_prompts(["a red cat on a mat"])
    tokens: list[int] = []
    # the tokens reaching the output projection (Z-Image: its final layer; image and caption)
    t = model.transformer
    out_proj = next(iter(t.all_final_layer.values())) if family == "zimage" else t.proj_out
    out_proj.register_forward_hook(lambda _m, a, _o: tokens.append(a[0].shape[1]))
    with active, count_saved_bytes() as total:
        v = model.velocity(x, 0.5, cond)
    return total[0], v.detach(), tokens[-1]


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    got = {family: _forward(family, sp=True) for family in SIZES}
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()


def measure() -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "sp2.pt")
        mp.spawn(_rank, args=(port, path), nprocs=2)
        sp2 = torch.load(path)
    out: dict[str, float] = {}
    for family in SIZES:
        b1, v1, t1 = _forward(family, sp=False)
        b2, v2, t2 = sp2[family]
        out[f"{family}_tokens"] = t1
        out[f"{family}_sp2_rank_tokens"] = t2
        out[f"{family}_sp1_saved_bytes"] = b1
        out[f"{family}_sp2_saved_bytes"] = b2
        out[f"{family}_sp2_activation_ratio"] = round(b2 / b1, 3)
        out[f"{family}_sp_max_rel_dev"] = float((v2 - v1).abs().max() / v1.abs().max())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args()
    torch.set_num_threads(1)
    result = measure()
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:32s} {v}")


if __name__ == "__main__":
    main()
