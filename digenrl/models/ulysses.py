"""Ulysses sequence parallelism: the all-to-all exchanges around attention.

N ranks of one process group each hold 1/N of a sample's token sequence (sequence-sharded
outside attention). Before attention an all-to-all turns ``(B, S/N, H, D)`` into
``(B, S, H/N, D)`` (head-sharded, full sequence); every rank attends over the whole
sequence for its H/N heads; a second all-to-all turns the output back. The exchanges are
differentiable (an equal-split all-to-all is its own adjoint), so gradients flow through.

Joint text+image attention (SD3, FLUX, Qwen-Image) keeps the text tokens replicated on
every rank: each rank takes its head slice of the text's q, k, v (no exchange), puts it
before the gathered image tokens, and the text's output heads are all-gathered back.
Cross-attention to replicated text (Wan, HunyuanVideo) needs no exchange at all: the
sharded queries attend to the full text keys locally.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention over (B, S, H, D) tensors."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


class _AllToAll(torch.autograd.Function):
    """All-to-all over dim 0 (equal splits, one per rank); its backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _GatherHeads(torch.autograd.Function):
    """All-gather of head slices (B, T, H/N, D) -> (B, T, H, D) of a replicated tensor;
    each rank's loss is its share of the total, so the backward sums the ranks' gradients
    (a reduce-scatter over heads) and keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        n = dist.get_world_size(group)
        ctx.group, ctx.rank, ctx.hn = group, dist.get_rank(group), x.shape[2]
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, :, ctx.rank * ctx.hn:(ctx.rank + 1) * ctx.hn].contiguous(), None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(B, S/N, H, D) sequence shard -> (B, S, H/N, D) head shard (ranks' shards in rank order)."""
    n = dist.get_world_size(group)
    b, s, h, d = x.shape
    if h % n:
        raise ValueError(f"{h} attention heads: expected a multiple of the sequence-parallel degree {n}")
    parts = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4)
    got = _AllToAll.apply(parts, group)
    return got.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(B, S, H/N, D) head shard -> (B, S/N, H, D) sequence shard; inverse of :func:`seq_to_heads`."""
    n = dist.get_world_size(group)
    b, s, hn, d = y.shape
    parts = y.reshape(b, n, s // n, hn, d).permute(1, 0, 2, 3, 4)
    got = _AllToAll.apply(parts, group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * hn, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup | None = None, *,
                      text: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      attention: Attention = _sdpa) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of sequence-sharded ``q, k, v`` (B, S/N, H, D) over the whole sequence.

    ``text``: replicated (B, T, H, D) q, k, v of joint attention, placed before the image
    tokens. Returns this rank's (B, S/N, H, D) output and the replicated (B, T, H, D) text
    output (None without text)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    qh, kh, vh = (seq_to_heads(t, group) for t in (q, k, v))
    t_len = 0
    if text is not None:
        hn = q.shape[2] // n
        tq, tk, tv = (t[:, :, r * hn:(r + 1) * hn] for t in text)
        t_len = tq.shape[1]
        qh, kh, vh = torch.cat([tq, qh], 1), torch.cat([tk, kh], 1), torch.cat([tv, vh], 1)
    out = attention(qh, kh, vh)
    img = heads_to_seq(out[:, t_len:], group)
    txt = _GatherHeads.apply(out[:, :t_len], group) if text is not None else None
    return img, txt
