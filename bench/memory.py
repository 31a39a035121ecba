"""Device memory: ``digenrl plan --memory`` against measured peaks, and Ulysses sequence
parallelism's per-rank activations, on the CPU.

``plan_error_max``: for several family pipeline folders (tiny random weights, the real diffusers
classes) and settings (LoRA and full fine-tune, float32 and bfloat16, activation checkpointing,
two sizes), the trainer's plan (:class:`digenrl.sim.memory.MemoryPlanner`, traced on the meta
device) against the trainer's own step measured on the CPU
(:func:`digenrl.sim.memplan.measure_trainer_step`: resident bytes plus the peak of tracked
allocations of the second step); the largest ``|plan / measured - 1|``. Deterministic (byte
counts), so one run each.

Sequence parallelism: one transformer block (qkv projection, attention, output projection, MLP) runs over a
sequence whose activations dominate the weights, once in one process (SP = 1) and over two
gloo ranks (SP = 2, each rank holding half the tokens, Ulysses attention between). The
bytes of the distinct tensors autograd saves for backward are counted with
``torch.autograd.graph.saved_tensors_hooks``; the ratio is rank 0's bytes at SP = 2 over
the one-process bytes. ``sp_max_rel_dev`` is the largest relative deviation of the SP = 2
block output from the one-process output.

    python bench/memory.py --json

``measure()`` returns the sequence-parallel figures for other benchmarks to join;
``plan_errors()`` the plan's.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from digenrl.models.ulysses import _sdpa, ulysses_attention

S, W, H = 1024, 64, 4           # tokens, width, heads: activations >> 4 * 16 * W * W weights


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"qkv": torch.randn(3 * W, W, generator=g) / W ** 0.5,
            "o": torch.randn(W, W, generator=g) / W ** 0.5,
            "up": torch.randn(4 * W, W, generator=g) / W ** 0.5,
            "down": torch.randn(W, 4 * W, generator=g) / (4 * W) ** 0.5,
            "x": torch.randn(1, S, W, generator=g)}


def _block(x: torch.Tensor, w: dict[str, torch.Tensor], sp: bool) -> torch.Tensor:
    b, s, _ = x.shape
    q, k, v = torch.nn.functional.linear(x, w["qkv"]).reshape(b, s, 3, H, W // H).unbind(2)
    a = ulysses_attention(q, k, v)[0] if sp else _sdpa(q, k, v)
    x = x + torch.nn.functional.linear(a.reshape(b, s, W), w["o"])
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w["up"]))
    return x + torch.nn.functional.linear(h, w["down"])


def _saved_bytes(x: torch.Tensor, w: dict[str, torch.Tensor], sp: bool) -> tuple[int, torch.Tensor]:
    seen: dict[int, int] = {}         # storage address -> bytes: views of one storage count once
    ws = {k: v.clone().requires_grad_() for k, v in w.items() if k != "x"}
    params = {t.untyped_storage().data_ptr() for t in ws.values()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:               # weights are not activations
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _block(x.clone().requires_grad_(), ws, sp)
    return sum(seen.values()), out.detach()


def _rank(rank: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    w = _weights()
    x = w["x"][:, rank * S // 2:(rank + 1) * S // 2]
    nbytes, out = _saved_bytes(x, w, sp=True)
    parts = [torch.empty_like(out) for _ in range(2)]
    dist.all_gather(parts, out)
    if rank == 0:
        torch.save({"bytes": nbytes, "out": torch.cat(parts, 1)}, path)
    dist.destroy_process_group()


def measure(json: bool = True) -> dict[str, float]:
    """``{"sp2_activation_ratio", "sp_max_rel_dev", "sp1_saved_bytes", "sp2_saved_bytes"}``."""
    torch.set_num_threads(1)
    w = _weights()
    one_bytes, one_out = _saved_bytes(w["x"], w, sp=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "sp2.pt")
        mp.spawn(_rank, args=(port, path), nprocs=2)
        two = torch.load(path)
    dev = ((two["out"] - one_out).abs().max() / one_out.abs().max()).item()
    return {"sp2_activation_ratio": two["bytes"] / one_bytes, "sp_max_rel_dev": dev,
            "sp1_saved_bytes": float(one_bytes), "sp2_saved_bytes": float(two["bytes"])}


#: (family, settings) the plan is checked on; each also at a second size (more rows, larger image)
PLAN_CASES = [("sd3", []), ("sd3", ["model.lora_rank=0"]), ("flux", ['model.dtype="bfloat16"']),
              ("qwenimage", ["model.gradient_checkpointing=true"]), ("wan", []), ("wan", ["model.lora_rank=0"]),
              ("hunyuanvideo", ["model.gradient_checkpointing=true"]), ("flux2", ['model.dtype="bfloat16"']),
              ("zimage", ["model.lora_rank=0"])]
SIZES = {"small": ["model.height=32", "model.width=48", "train.group_size=2"],
         "large": ["model.height=64", "model.width=64", "train.group_size=4"]}


def plan_errors() -> dict[str, float]:
    """``{"family[settings]@size": plan / measured - 1}`` over :data:`PLAN_CASES` x :data:`SIZES`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from pipelines import MAX_TEXT_TOKENS, write_pipeline_folder

    from digenrl.config import load_config, resolve_mode
    from digenrl.sim.memory import MemoryPlanner
    from digenrl.sim.memplan import measure_trainer_step

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        for family, extra in PLAN_CASES:
            folder = Path(d) / family
            if not folder.exists():
                write_pipeline_folder(family, folder)
            for size, sets in SIZES.items():
                cfg = load_config(None, [f'model.family="{family}"', f'model.path="{folder}"',
                                         f"model.max_text_tokens={MAX_TEXT_TOKENS}", "model.lora_rank=4",
                                         "train.prompts_per_step=2", "sampler.base_tail=0", *sets,
                                         *(["model.num_frames=5"] if family in ("wan", "hunyuanvideo") else []),
                                         *extra])
                planner = MemoryPlanner(cfg, trainer_gpu="cpu", rollout_gpu="cpu")
                planned = planner.trainer(planner.setting()).total
                measured = measure_trainer_step(resolve_mode(cfg, "colocated"))["peak"]
                out[f"{family}[{','.join(extra)}]@{size}"] = planned / measured - 1
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    errors = plan_errors()
    got = {**measure(), "plan_error_max": max(abs(e) for e in errors.values()), "plan_errors": errors}
    if args.json:
        print(json.dumps(got))
    else:
        for k, v in got.items():
            print(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}")
