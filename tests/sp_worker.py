"""Worker of tests/test_sequence_parallel.py: N gloo ranks run Ulysses attention on their
sequence shards and rank 0 writes outputs and gradients (gathered) for the test to compare
with one-process attention. Run: python tests/sp_worker.py N PORT OUT.pt"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from digenrl.models.ulysses import _sdpa, ulysses_attention

B, S, T, H, D = 2, 8, 3, 4, 5


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = {"q": (B, S, H, D), "k": (B, S, H, D), "v": (B, S, H, D),
             "tq": (B, T, H, D), "tk": (B, T, H, D), "tv": (B, T, H, D),
             "w": (B, S, H, D), "wt": (B, T, H, D)}
    return {name: torch.randn(*s, generator=g, dtype=torch.float64) for name, s in shape.items()}


def reference() -> dict[str, torch.Tensor]:
    """Joint attention over [text; image] in one process and its gradients."""
    x = inputs()
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "tq", "tk", "tv")}
    q, k, v = (torch.cat([leaves["t" + n], leaves[n]], 1) for n in "qkv")
    out = _sdpa(q, k, v)
    loss = (out[:, T:] * x["w"]).sum() + (out[:, :T] * x["wt"]).sum()
    loss.backward()
    return {"img": out[:, T:].detach(), "txt": out[:, :T].detach(), "loss": loss.detach(),
            **{"g" + n: t.grad for n, t in leaves.items()}}


def _run(rank: int, n: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    x = inputs()
    sl = slice(rank * S // n, (rank + 1) * S // n)
    leaves = {n_: x[n_][:, sl].clone().requires_grad_() for n_ in ("q", "k", "v")}
    leaves |= {n_: x[n_].clone().requires_grad_() for n_ in ("tq", "tk", "tv")}
    img, txt = ulysses_attention(leaves["q"], leaves["k"], leaves["v"],
                                 text=(leaves["tq"], leaves["tk"], leaves["tv"]))
    assert txt is not None
    loss = (img * x["w"][:, sl]).sum() + (txt * x["wt"]).sum() / n
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    got: dict[str, torch.Tensor] = {"loss": total, "txt": txt.detach()}
    for name, t in (("img", img.detach()), *(("g" + k, leaves[k].grad) for k in "qkv")):
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous())
        got[name] = torch.cat(parts, 1)
    for k in ("tq", "tk", "tv"):
        g = leaves[k].grad.clone()
        dist.all_reduce(g)        # replicated inputs: their gradient is the ranks' sum
        got["g" + k] = g
    if rank == 0:
        torch.save(got, path)
    dist.destroy_process_group()


if __name__ == "__main__":
    n, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.spawn(_run, args=(n, port, path), nprocs=n)
