"""Sequence-parallel (Ulysses) forward of the families' transformers.

:func:`enable_sequence_parallel` fits a model's transformer for ``N`` ranks of one process
group, the *SP group*, that run the same sample together. Inside :meth:`SequenceParallel.active`
each rank carries ``1/N`` of the image/video tokens through the blocks (the text tokens are
replicated); outside it the transformer is untouched (generation, evaluation).

Where the tokens are split and joined, per family (forward hooks, so diffusers' own
``forward`` runs unchanged):

==============  ===============================================  ==========================
family          split (this rank's 1/N of the tokens)             rotary embeddings sliced
==============  ===============================================  ==========================
sd3             ``pos_embed``'s output (patch tokens)             none (absolute sin-cos)
flux, flux2     the transformer's ``hidden_states`` and           through the sliced ids
                ``img_ids`` inputs (packed tokens)
qwenimage       the transformer's ``hidden_states`` input         ``pos_embed``'s image part
wan             ``blocks.0``'s ``hidden_states`` input            ``rope``'s outputs
hunyuanvideo    ``x_embedder``'s output                           ``rope``'s outputs
zimage          ``noise_refiner.0``'s and ``layers.0``'s inputs    the blocks' ``freqs_cis``
                (the image tokens; the unified image+caption       inputs
                sequence, captions split too)
==============  ===============================================  ==========================

Every family's ``proj_out`` output (Z-Image: its final layer's) is all-gathered back into the
whole sequence (:class:`_GatherTokens`), so each rank returns the whole velocity and the loss code runs
unchanged on every rank of the group (the same value on each). The gather's backward keeps
this rank's slice of the gradient (not a sum over ranks): every rank holds the same loss, so
its gradient with respect to the whole output is the same everywhere, and each rank carries
its own tokens' part back. The parameter gradients of the group's ranks then add up to the
one-process gradient: a trainer sums gradients over ranks (``Learner.reduce_gradients``, FSDP's
reduce-scatter with divide factor 1), so the group's samples are counted once.

Attention goes through :func:`~digenrl.models.ulysses.ulysses_attention`: the processors of
the joint (text+image) attention modules and of Wan's self-attention are replaced by ours
(:class:`_Processor`), which fall back to the original processor outside ``active()``.
Wan's cross-attention to the replicated text needs no exchange (its original processor runs
on the rank's query tokens); Qwen-Image's and HunyuanVideo's text padding masks are kept.

Z-Image is single-stream: its blocks run one weight set over the unified ``[image; caption]``
sequence, so that whole sequence is split (the caption too), and attention keeps diffusers'
key mask of the batch padding (captions of different lengths). Its image-only refiner blocks
run split as well, and their output is all-gathered once (the unified sequence is built
whole on every rank, then split again): that gather's backward sums the ranks' gradients
before keeping this rank's slice (each rank's downstream gradient covers only its own slice of
the unified sequence). The caption refiner runs whole on every rank, as text does elsewhere.
Z-Image pads both sequences to multiples of 32 tokens, so ``N`` must divide 32.

The token count must divide by ``N`` (``ValueError`` naming the count; there is no padding of
ours), and so must the attention heads (:func:`check_heads`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from digenrl.models.catalog import SEQUENCE_PARALLEL_FAMILIES as FAMILIES
from digenrl.models.ulysses import ulysses_attention


def heads_of(transformer: torch.nn.Module) -> int:
    """The attention heads of a diffusers transformer (its config's ``num_attention_heads``;
    Z-Image's ``n_heads``)."""
    cfg: Any = transformer.config
    return int(cfg["n_heads"] if "n_heads" in cfg else cfg["num_attention_heads"])


def check_heads(heads: int, n: int) -> None:
    """ValueError unless ``n`` divides ``heads`` (Ulysses gives each rank ``heads / n`` heads)."""
    if heads % n:
        raise ValueError(f"train.sequence_parallel = {n}: the transformer has {heads} attention "
                         f"heads; expected a divisor of {heads}")


class _GatherTokens(torch.autograd.Function):
    """All-gather of the ranks' token slices along ``dim``; the backward keeps this rank's
    slice of the gradient: of the (replicated) gradient itself, or with ``summed`` of the sum of
    the ranks' gradients (each rank's covers only what it carried on), as the module doc
    explains."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup, summed: bool) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.size, ctx.group, ctx.summed = dim, dist.get_rank(group), x.shape[dim], group, summed
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.summed:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(ctx.dim, ctx.rank * ctx.size, ctx.size).contiguous(), None, None, None


class SequenceParallel:
    """A transformer fitted for an SP group (see the module doc); :meth:`active` turns it on."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.on = False
        self.text_len = 0
        """FLUX, FLUX.2: the text tokens leading each single-stream block's sequence (set per forward)"""

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block (a training forward and its backward) the transformer runs sharded;
        every rank of the group must run the same calls in the same order."""
        prev, self.on = self.on, True
        try:
            yield
        finally:
            self.on = prev

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous ``1/N`` of ``x`` along ``dim``."""
        n = x.shape[dim]
        if n % self.size:
            raise ValueError(f"sequence parallelism: {n} image/video tokens, not divisible by "
                             f"train.sequence_parallel = {self.size}")
        k = n // self.size
        return x.narrow(dim, self.rank * k, k)

    def gather(self, x: torch.Tensor, dim: int, summed: bool = False) -> torch.Tensor:
        """The whole sequence from the ranks' slices; ``summed``: the tensor's consumers run
        split again downstream, so the backward sums the ranks' gradients (the module doc)."""
        out: torch.Tensor = _GatherTokens.apply(x, dim, self.group, summed)
        return out

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               text: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               text_mask: torch.Tensor | None = None,
               key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Ulysses attention of this rank's (B, S/N, H, D) tokens, with the replicated text
        (B, T, H, D) first in the joint sequence; ``text_mask`` (B, T) drops padded text keys,
        ``key_mask`` (B, S) keys of the whole split sequence (True: attended)."""
        if text_mask is None and key_mask is None:
            return ulysses_attention(q, k, v, self.group, text=text)
        return ulysses_attention(q, k, v, self.group, text=text, attention=_masked_attention(text_mask, key_mask))


def _masked_attention(text_mask: torch.Tensor | None,
                      key_mask: torch.Tensor | None) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Attention over (B, L, H, D) whose first ``T`` keys are text masked by ``text_mask`` (B, T)
    and whose other keys are masked by ``key_mask`` (B, L - T); None: all attended."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, length = k.shape[:2]
        t = 0 if text_mask is None else text_mask.shape[1]
        rest = k.new_ones(b, length - t, dtype=torch.bool) if key_mask is None else key_mask.bool()
        keys = rest if text_mask is None else torch.cat([text_mask.bool(), rest], dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=keys[:, None, None, :])
        return out.transpose(1, 2)
    return attend


def _heads(x: torch.Tensor, attn: Any) -> torch.Tensor:
    """(B, L, H*D) -> (B, L, H, D)."""
    return x.unflatten(-1, (attn.heads, -1))


def _rotary(x: torch.Tensor, emb: Any) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` over the sequence dim of (B, L, H, D) ``x``."""
    from diffusers.models.embeddings import apply_rotary_emb

    out = apply_rotary_emb(x, emb, sequence_dim=1)
    assert isinstance(out, torch.Tensor)  # typed as a tensor or a pair; one tensor in, one out
    return out


def _rotary_qwen(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    out = apply_rotary_emb_qwen(x, freqs, use_real=False)
    assert isinstance(out, torch.Tensor)
    return out


def _no_fused(attn: Any) -> None:
    if getattr(attn, "fused_projections", False):
        raise ValueError("sequence parallelism: fused q/k/v projections are not supported")


# ------------------------------------------------------------------------ processors

class _Processor:
    """Base of our attention processors: the original one outside ``active()``."""

    def __init__(self, original: Any, sp: SequenceParallel) -> None:
        self.original, self.sp = original, sp


class _SD3Processor(_Processor):
    """SD3's joint attention (``JointAttnProcessor2_0``); SD3.5's image-only ``attn2`` too."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if not self.sp.on:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        _no_fused(attn)
        q, k, v = (_heads(f(hidden_states), attn) for f in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        text = None
        if encoder_hidden_states is not None:
            tq, tk, tv = (_heads(f(encoder_hidden_states), attn)
                          for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                tq = attn.norm_added_q(tq)
            if attn.norm_added_k is not None:
                tk = attn.norm_added_k(tk)
            text = (tq, tk, tv)
        img, txt = self.sp.attend(q, k, v, text)
        out = attn.to_out[1](attn.to_out[0](img.flatten(2, 3).to(q.dtype)))
        if encoder_hidden_states is None:
            return out
        assert txt is not None
        txt = txt.flatten(2, 3).to(q.dtype)
        return out, (txt if attn.context_pre_only else attn.to_add_out(txt))


class _FluxProcessor(_Processor):
    """FLUX's ``FluxAttnProcessor``: double-stream blocks pass the text apart; single-stream
    blocks pass ``[text; image]`` as one sequence (its text length: ``sp.text_len``)."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: Any = None) -> Any:
        if not self.sp.on:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if attention_mask is not None:
            raise ValueError("sequence parallelism: FLUX with an attention mask is not supported")
        _no_fused(attn)
        q, k, v = (_heads(f(hidden_states), attn) for f in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None:
            tq, tk, tv = (_heads(f(encoder_hidden_states), attn)
                          for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
            q, k, v = torch.cat([tq, q], 1), torch.cat([tk, k], 1), torch.cat([tv, v], 1)
        t = encoder_hidden_states.shape[1] if encoder_hidden_states is not None else self.sp.text_len
        if image_rotary_emb is not None:  # [text; this rank's tokens], as the sliced ids are
            q, k = _rotary(q, image_rotary_emb), _rotary(k, image_rotary_emb)
        img, txt = self.sp.attend(q[:, t:], k[:, t:], v[:, t:], (q[:, :t], k[:, :t], v[:, :t]))
        assert txt is not None
        if encoder_hidden_states is None:
            return torch.cat([txt, img], 1).flatten(2, 3).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](img.flatten(2, 3).to(q.dtype).contiguous()))
        return out, attn.to_add_out(txt.flatten(2, 3).to(q.dtype).contiguous())


class _Flux2SingleProcessor(_Processor):
    """FLUX.2's single-stream ``Flux2ParallelSelfAttnProcessor``: q, k, v and the MLP input come
    from one projection of ``[text; image]`` (its text length: ``sp.text_len``); the attention
    output and the MLP's go through one output projection."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: Any = None) -> Any:
        if not self.sp.on:
            return self.original(attn, hidden_states, attention_mask, image_rotary_emb)
        if attention_mask is not None:
            raise ValueError("sequence parallelism: FLUX.2 with an attention mask is not supported")
        h = attn.to_qkv_mlp_proj(hidden_states)
        qkv, mlp = h.split([3 * attn.inner_dim, h.shape[-1] - 3 * attn.inner_dim], dim=-1)
        q, k, v = (_heads(t, attn) for t in qkv.chunk(3, dim=-1))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:  # [text; this rank's tokens], as the sliced ids are
            q, k = _rotary(q, image_rotary_emb), _rotary(k, image_rotary_emb)
        t = self.sp.text_len
        img, txt = self.sp.attend(q[:, t:], k[:, t:], v[:, t:], (q[:, :t], k[:, :t], v[:, :t]))
        assert txt is not None
        out = torch.cat([txt, img], 1).flatten(2, 3).to(q.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


class _QwenProcessor(_Processor):
    """Qwen-Image's ``QwenDoubleStreamAttnProcessor2_0`` (text padding mask kept)."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 encoder_hidden_states_mask: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: Any = None) -> Any:
        if not self.sp.on:
            return self.original(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                 attention_mask, image_rotary_emb)

        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError("sequence parallelism: Qwen-Image attention expects the text stream "
                             "and no external attention mask")
        q, k, v = (_heads(f(hidden_states), attn) for f in (attn.to_q, attn.to_k, attn.to_v))
        tq, tk, tv = (_heads(f(encoder_hidden_states), attn)
                      for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if attn.norm_added_q is not None:
            tq = attn.norm_added_q(tq)
        if attn.norm_added_k is not None:
            tk = attn.norm_added_k(tk)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb  # img_freqs: this rank's slice (the hook's)
            q, k = _rotary_qwen(q, img_freqs), _rotary_qwen(k, img_freqs)
            tq, tk = _rotary_qwen(tq, txt_freqs), _rotary_qwen(tk, txt_freqs)
        img, txt = self.sp.attend(q, k, v, (tq, tk, tv), encoder_hidden_states_mask)
        assert txt is not None
        img_out = attn.to_out[0](img.flatten(2, 3).to(q.dtype).contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(txt.flatten(2, 3).to(q.dtype).contiguous())


class _WanProcessor(_Processor):
    """Wan's ``WanAttnProcessor``: self-attention goes through Ulysses; cross-attention to the
    replicated text runs the original processor on this rank's query tokens."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: Any = None) -> Any:
        if not self.sp.on or encoder_hidden_states is not None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        if attention_mask is not None:
            raise ValueError("sequence parallelism: Wan self-attention with a mask is not supported")
        _no_fused(attn)
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)  # over all heads of a token: per token
        q, k, v = _heads(q, attn), _heads(k, attn), _heads(v, attn)
        if rotary_emb is not None:  # this rank's slice (the rope hook's)
            q, k = _wan_rotary(q, *rotary_emb), _wan_rotary(k, *rotary_emb)
        img, _ = self.sp.attend(q, k, v)
        return attn.to_out[1](attn.to_out[0](img.flatten(2, 3).type_as(q)))


def _wan_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding of (B, L, H, D) ``x`` (pairs ``(2i, 2i+1)``)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


class _HunyuanProcessor(_Processor):
    """HunyuanVideo's ``HunyuanVideoAttnProcessor2_0``: rotary on the image tokens only, the
    text padding taken from the ``[image; text]`` mask's text columns."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: Any = None) -> Any:
        if not self.sp.on:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if encoder_hidden_states is None:
            raise ValueError("sequence parallelism: HunyuanVideo attention expects the text stream")
        t = encoder_hidden_states.shape[1]
        single = attn.add_q_proj is None  # single-stream: one projection for both
        proj = (attn.to_q, attn.to_k, attn.to_v) if single else (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        q, k, v = (_heads(f(hidden_states), attn) for f in (attn.to_q, attn.to_k, attn.to_v))
        tq, tk, tv = (_heads(f(encoder_hidden_states), attn) for f in proj)
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if single:
            if attn.norm_q is not None:
                tq = attn.norm_q(tq)
            if attn.norm_k is not None:
                tk = attn.norm_k(tk)
        else:
            if attn.norm_added_q is not None:
                tq = attn.norm_added_q(tq)
            if attn.norm_added_k is not None:
                tk = attn.norm_added_k(tk)
        if image_rotary_emb is not None:
            q, k = _rotary(q, image_rotary_emb), _rotary(k, image_rotary_emb)
        mask = None if attention_mask is None else attention_mask.reshape(attention_mask.shape[0], -1)[:, -t:]
        img, txt = self.sp.attend(q, k, v, (tq, tk, tv), mask)
        assert txt is not None
        img, txt = img.flatten(2, 3).to(q.dtype), txt.flatten(2, 3).to(q.dtype)
        if getattr(attn, "to_out", None) is not None:
            img = attn.to_out[1](attn.to_out[0](img))
        if getattr(attn, "to_add_out", None) is not None:
            txt = attn.to_add_out(txt)
        return img, txt


class _ZImageProcessor(_Processor):
    """Z-Image's ``ZSingleStreamAttnProcessor`` in the split blocks (the noise refiner and the
    main layers): complex rotary on this rank's tokens (the hook's slice of ``freqs_cis``), the
    batch-padding key mask over the whole sequence."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, freqs_cis: torch.Tensor | None = None) -> Any:
        if not self.sp.on:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)
        if encoder_hidden_states is not None:
            raise ValueError("sequence parallelism: Z-Image attention is self-attention only")
        _no_fused(attn)
        q, k, v = (_heads(f(hidden_states), attn) for f in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if freqs_cis is not None:
            q, k = _rotary_complex(q, freqs_cis), _rotary_complex(k, freqs_cis)
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"sequence parallelism: Z-Image attention mask of {attention_mask.dim()} dims; "
                             "expected a (batch, tokens) key mask")
        img, _ = self.sp.attend(q, k, v, key_mask=attention_mask)
        out = attn.to_out[0](img.flatten(2, 3).to(q.dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def _rotary_complex(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Z-Image's rotary embedding of (B, L, H, D) ``x``: pairs ``(2i, 2i+1)`` as complex numbers
    times the (B, L, D/2) complex ``freqs``, in float32."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * freqs.unsqueeze(2)).flatten(3).type_as(x)


# ------------------------------------------------------------------------ groups

def group_of(rank: int, world_size: int, n: int) -> dist.ProcessGroup:
    """This rank's SP group: ranks ``[g n, (g + 1) n)`` for ``g = rank // n`` (the layout
    :func:`~digenrl.core.plan.owners_for` plans over). A collective over the default group:
    every rank creates every group, in the same order."""
    if world_size % n:
        raise ValueError(f"{world_size} trainer ranks: expected a multiple of train.sequence_parallel = {n}")
    mine = None
    for g in range(world_size // n):
        group = dist.new_group(list(range(g * n, (g + 1) * n)))
        if g == rank // n:
            mine = group
    assert mine is not None
    return mine


def sharded(model: Any) -> contextlib.AbstractContextManager[None]:
    """``model.sp.active()`` for a model fitted by :func:`enable_sequence_parallel`, else a
    no-op: the training passes of a trainer rank run under it."""
    sp = getattr(model, "sp", None)
    return sp.active() if isinstance(sp, SequenceParallel) else contextlib.nullcontext()


# ------------------------------------------------------------------------ installing

_PROCESSORS: dict[str, dict[str, type[_Processor]]] = {
    # family -> {the original processor class's name: our processor that replaces it}
    "sd3": {"JointAttnProcessor2_0": _SD3Processor},
    "flux": {"FluxAttnProcessor": _FluxProcessor},
    "flux2": {"Flux2AttnProcessor": _FluxProcessor, "Flux2ParallelSelfAttnProcessor": _Flux2SingleProcessor},
    "qwenimage": {"QwenDoubleStreamAttnProcessor2_0": _QwenProcessor},
    "wan": {"WanAttnProcessor": _WanProcessor},
    "hunyuanvideo": {"HunyuanVideoAttnProcessor2_0": _HunyuanProcessor},
    "zimage": {"ZSingleStreamAttnProcessor": _ZImageProcessor},
}


def enable_sequence_parallel(model: Any, group: dist.ProcessGroup) -> SequenceParallel:
    """Fit ``model`` (a :class:`~digenrl.models.adapter.DiffusersFlowModel`) for the SP group
    ``group``; returns the switch (also ``model.sp``). Each of a two-expert model's experts is
    fitted. ValueError for a family without a sequence-parallel forward or heads that do not
    divide by the group's size."""
    family = "flux" if model.family == "flux_kontext" else model.family
    if family not in _PROCESSORS:
        raise ValueError(f"model.family = {model.family!r}: no sequence-parallel forward; expected one "
                         f"of {', '.join(FAMILIES)}")
    sp = SequenceParallel(group)
    if family == "zimage" and 32 % sp.size:
        raise ValueError(f"sequence parallelism over {sp.size} ranks: Z-Image pads its sequences to "
                         "multiples of 32 tokens; expected a divisor of 32")
    experts = getattr(model.transformer, "experts", None)
    for transformer in (experts().values() if callable(experts) else [model.transformer]):
        check_heads(heads_of(transformer), sp.size)
        _install(family, transformer, sp)
    model.sp = sp
    return sp


def _install(family: str, transformer: Any, sp: SequenceParallel) -> None:
    ours = _PROCESSORS[family]
    # Z-Image's caption refiner runs whole on every rank: only its split blocks' processors
    split = [transformer.noise_refiner, transformer.layers] if family == "zimage" else [transformer]
    replaced = 0
    for module in (m for part in split for m in part.modules()):
        proc = getattr(module, "processor", None)
        if proc is not None and type(proc).__name__ in ours:
            module.set_processor(ours[type(proc).__name__](proc, sp))
            replaced += 1
    if not replaced:
        raise ValueError(f"sequence parallelism: no {'/'.join(ours)} in {type(transformer).__name__}")

    def tokens_of(i: int, dim: int) -> Callable[..., Any]:
        """A forward hook that shards output ``i`` (all outputs: -1) along ``dim``."""
        def hook(_m: Any, _args: Any, out: Any) -> Any:
            if not sp.on:
                return out
            if isinstance(out, tuple):
                return tuple(sp.shard(o, dim) if i in (-1, j) else o for j, o in enumerate(out))
            return sp.shard(out, dim)
        return hook

    def gather(_m: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return sp.gather(out, 1) if sp.on else out

    if family == "zimage":
        _install_zimage(transformer, sp, gather)
        return
    transformer.proj_out.register_forward_hook(gather)
    if family == "sd3":
        transformer.pos_embed.register_forward_hook(tokens_of(-1, 1))
    elif family in ("flux", "flux2"):
        def flux_inputs(_m: Any, args: Any, kw: dict[str, Any]) -> Any:
            if not sp.on:
                return args, kw
            if args or "hidden_states" not in kw or "img_ids" not in kw:
                raise ValueError(f"sequence parallelism: call the {family.upper()} transformer with keyword arguments")
            sp.text_len = kw["encoder_hidden_states"].shape[1]
            ids = kw["img_ids"]
            return args, {**kw, "hidden_states": sp.shard(kw["hidden_states"], 1),
                          "img_ids": sp.shard(ids, ids.dim() - 2)}
        transformer.register_forward_pre_hook(flux_inputs, with_kwargs=True)
    elif family == "qwenimage":
        def qwen_inputs(_m: Any, args: Any, kw: dict[str, Any]) -> Any:
            if not sp.on:
                return args, kw
            if args or "hidden_states" not in kw:
                raise ValueError("sequence parallelism: call the Qwen-Image transformer with keyword arguments")
            return args, {**kw, "hidden_states": sp.shard(kw["hidden_states"], 1)}
        transformer.register_forward_pre_hook(qwen_inputs, with_kwargs=True)
        transformer.pos_embed.register_forward_hook(tokens_of(0, 0))
    elif family == "wan":
        def wan_timestep(_m: Any, args: Any, kw: dict[str, Any]) -> Any:
            t = kw.get("timestep")
            if sp.on and t is not None and t.dim() == 2:  # per-token timesteps (Wan2.2 TI2V)
                return args, {**kw, "timestep": sp.shard(t, 1)}
            return args, kw

        def wan_block(_m: Any, args: Any, kw: dict[str, Any]) -> Any:
            if not sp.on:
                return args, kw
            if args:
                return (sp.shard(args[0], 1), *args[1:]), kw
            return args, {**kw, "hidden_states": sp.shard(kw["hidden_states"], 1)}
        transformer.register_forward_pre_hook(wan_timestep, with_kwargs=True)
        transformer.rope.register_forward_hook(tokens_of(-1, 1))
        transformer.blocks[0].register_forward_pre_hook(wan_block, with_kwargs=True)
    elif family == "hunyuanvideo":
        transformer.x_embedder.register_forward_hook(tokens_of(-1, 1))
        transformer.rope.register_forward_hook(tokens_of(-1, 0))


def _install_zimage(transformer: Any, sp: SequenceParallel, gather: Callable[..., Any]) -> None:
    """Z-Image's hooks (the module doc): the first noise-refiner block and the first main block
    split their ``(x, attn_mask, freqs_cis, adaln_input, noise_mask, ...)`` inputs' tokens and
    rotary frequencies (the key mask stays whole), the last refiner block's output is gathered
    (summed backward), and so is the final layer's (the velocity tokens)."""
    def split(_m: Any, args: Any, kw: dict[str, Any]) -> Any:
        if not sp.on:
            return args, kw
        if kw or len(args) < 3:
            raise ValueError("sequence parallelism: Z-Image blocks called with keyword arguments")
        if len(args) > 4 and args[4] is not None:
            raise ValueError("sequence parallelism: Z-Image's omni mode (per-token noise masks) is not supported")
        x, mask, freqs = args[:3]
        return (sp.shard(x, 1), mask, None if freqs is None else sp.shard(freqs, 1), *args[3:]), kw

    def gather_summed(_m: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return sp.gather(out, 1, summed=True) if sp.on else out

    if len(transformer.noise_refiner):
        transformer.noise_refiner[0].register_forward_pre_hook(split, with_kwargs=True)
        transformer.noise_refiner[-1].register_forward_hook(gather_summed)
    transformer.layers[0].register_forward_pre_hook(split, with_kwargs=True)
    for final in transformer.all_final_layer.values():
        final.register_forward_hook(gather)
