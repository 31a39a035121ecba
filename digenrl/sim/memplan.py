"""Device memory of a training step and of a rollout's work, traced from real module shapes.

The transformer (and, for the rollout, its VAE) is built on the ``meta`` device from its
config (shapes, no memory, no weights) and the work runs there under :class:`LiveBytes`, a
``TorchDispatchMode`` that adds up the bytes of every storage an op creates and takes them
off when the storage is freed: its peak is what the same ops allocate on a device, whatever
they are (saved activations, gradients of activations in flight, attention's backward
buffers, AdamW's temporaries, the gradient-checkpointing recompute). The trainer's step is
the trainer's own: the family adapter's velocity (LoRA on ``model.lora_targets``, gradient
checkpointing when asked), the loss head (the SDE step's Gaussian log-prob of ``x_next``), the
backward with :mod:`digenrl.rl.policy`'s float32 master-gradient hook, gradient clipping and
``torch.optim.AdamW`` (foreach on a GPU, as torch picks there; one tensor at a time on a CPU).
AdamW's state is made first, untraced, as its first step makes it; the step traced is then the
steady state.

Attention: on the meta device ``scaled_dot_product_attention`` would take the math path and
save the score matrix; a GPU's flash / memory-efficient / cuDNN kernels and the CPU's flash
kernel save the output and its log-sum-exp instead. :func:`flash_attention` routes it through
``aten._scaled_dot_product_flash_attention_for_cpu``, whose meta kernel allocates what those do
(``attention = "math"`` keeps the math path). ``tests/test_memplan.py`` measures the same step
of real tiny folders on the CPU with :class:`LiveBytes` over real tensors.

Sequence parallelism over ``N`` ranks (Ulysses) is planned as a forward over ``1/N`` of the
latent's tokens with the whole text: every rank holds its share of the image tokens and the
replicated prompt; its attention holds all tokens for ``1/N`` of the heads, the same bytes.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: (text tokens, text width, pooled width) of the families' real text encoders.
REAL_TEXT = {"sd3": (333, 4096, 2048), "flux": (512, 4096, 768)}


@contextmanager
def count_saved_bytes() -> Iterator[list[int]]:
    """Yields a one-item list that holds the bytes autograd saved inside the block, each
    storage once (a view counts its base, once); parameters saved by an op are weights, not
    activations, and are left out."""
    seen: dict[int, torch.Tensor] = {}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._is_view() and t._base is not None else t
        if isinstance(base, torch.nn.Parameter):
            return t  # a weight: counted with the parameters, not the activations
        if id(base) not in seen:
            seen[id(base)] = base  # held so that ids stay unique for the block
            total[0] += base.numel() * base.element_size()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield total
    finally:
        seen.clear()  # the block's tensors are the caller's again (freed with their graph)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create inside the block that are still alive, and their peak.

    Each new storage an op returns is counted once (views and in-place results share an input's
    storage and add nothing) and taken off when it is freed (a finalizer on the
    storage). ``mark(t, kind)`` files a tracked storage under ``kind`` ("grads", "activations"),
    so :attr:`at_peak` says what the peak was made of; the rest is "other". Works on real
    devices and on the meta device alike.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, tuple[int, str]] = {}
        self.by_kind: dict[str, int] = {}
        self.at_peak: dict[str, int] = {}

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._sizes:
            return
        n = storage.nbytes()
        self._sizes[key] = (n, "other")
        self.live += n
        self.by_kind["other"] = self.by_kind.get("other", 0) + n
        weakref.finalize(storage, self._free, key)
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = dict(self.by_kind)

    def _free(self, key: int) -> None:
        n, kind = self._sizes.pop(key, (0, "other"))
        self.live -= n
        self.by_kind[kind] = self.by_kind.get(kind, 0) - n

    def mark(self, t: torch.Tensor | None, kind: str) -> None:
        """File ``t``'s storage (if this block made it) under ``kind``."""
        if t is None:
            return
        key = id(t.untyped_storage())
        if key in self._sizes:
            n, old = self._sizes[key]
            self._sizes[key] = (n, kind)
            self.by_kind[old] -= n
            self.by_kind[kind] = self.by_kind.get(kind, 0) + n

    def mark_all(self, old: str, kind: str) -> None:
        """File every live storage under ``old`` under ``kind``."""
        for key, (n, k) in list(self._sizes.items()):
            if k == old:
                self._sizes[key] = (n, kind)
                self.by_kind[old] -= n
                self.by_kind[kind] = self.by_kind.get(kind, 0) + n

    def kinds(self) -> dict[str, int]:
        return {k: v for k, v in self.by_kind.items() if v}

    def reset_peak(self) -> None:
        self.peak, self.at_peak = self.live, dict(self.by_kind)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        # a view or an in-place / out= result is an input's storage: nothing new (even where the
        # input was made before the block: a weight's transpose is not an allocation)
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:
                self._add(t)
        return out


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _flash_sdpa(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        a = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
        q, k, v = a["query"], a["key"], a["value"]
        if q.dim() != 4 or a.get("dropout_p", 0.0):
            return original(*args, **kwargs)
        mask = a.get("attn_mask")
        if k.shape[1] != q.shape[1]:  # grouped-query attention: keys repeated per query head
            k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, bool(a.get("is_causal", False)), attn_mask=mask, scale=a.get("scale"))[0]
    return sdpa


@contextmanager
def flash_attention(on: bool = True) -> Iterator[None]:
    """Within the block ``torch.nn.functional.scaled_dot_product_attention`` keeps what a flash
    kernel keeps (the output and its log-sum-exp, no score matrix), on every device; ``on =
    False``: unchanged. The function is replaced for the whole process while the block runs (so
    a gradient-checkpointing recompute in the backward sees it too): a planning process's
    context, not one to run beside training."""
    if not on:
        yield
        return
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _flash_sdpa(original)
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


@contextmanager
def meta_masks() -> Iterator[None]:
    """Within the block a boolean-mask index on the meta device keeps every element (Z-Image
    cuts each prompt's rows by its mask): the plan's prompt masks are all ones, so that is
    exactly what a device would keep."""
    from torch.fx.experimental import _config

    prev = _config.meta_nonzero_assume_all_nonzero
    _config.meta_nonzero_assume_all_nonzero = True
    try:
        yield
    finally:
        _config.meta_nonzero_assume_all_nonzero = prev


# -- the model, built on the meta device --------------------------------------------------------


@dataclass
class MetaModel:
    """A family's adapter over a transformer on the meta device, and what the plan reads of it."""

    family: str
    adapter: Any
    transformer: torch.nn.Module
    latent_shape: tuple[int, ...]
    text: tuple[int, int, int]
    """(prompt tokens, text width, pooled width)"""
    patch: int
    """latent cells per token along height and width"""
    vae: torch.nn.Module | None = None
    text_encoders: list[torch.nn.Module] = field(default_factory=list)


def _meta_encoder(tokens: int, width: int, pooled: int, dtype: torch.dtype) -> Callable[[Any], dict[str, torch.Tensor]]:
    def encode(prompts: Any) -> dict[str, torch.Tensor]:
        b = len(prompts)
        dev = torch.device("meta")
        return {"prompt_embeds": torch.zeros(b, tokens, width, device=dev, dtype=dtype),
                "pooled_embeds": torch.zeros(b, pooled, device=dev, dtype=dtype),
                "prompt_mask": torch.ones(b, tokens, dtype=torch.long, device=dev)}
    return encode


def build_transformer(family: str, config: dict[str, Any], dtype: torch.dtype,
                      device: str | torch.device = "meta") -> torch.nn.Module:
    """The family's diffusers transformer of ``config`` on ``device`` in ``dtype`` (its
    ``_keep_in_fp32_modules`` in float32, as ``from_pretrained(torch_dtype=...)`` loads it)."""
    from digenrl.models import families
    from digenrl.models.registry import _cast

    cls = families.SPECS[family].cls
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # made in the compute dtype: no float32 copy first
        try:
            transformer: torch.nn.Module = cls.from_config(config)  # type: ignore[assignment]
        finally:
            torch.set_default_dtype(prev)
    _cast(transformer, dtype)
    return transformer


def adapt(family: str, transformer: torch.nn.Module, latent_shape: tuple[int, ...], text: tuple[int, int, int], *,
          lora_rank: int, lora_targets: list[str] | None = None, dtype: torch.dtype,
          gradient_checkpointing: bool = False) -> Any:
    """The family adapter over ``transformer`` with a conditioning of ``text``'s shapes."""
    from digenrl.models import families
    from digenrl.models.adapter import LORA_TARGETS

    spec = families.SPECS[family]
    model = spec.adapter(transformer, encoder=_meta_encoder(*text, dtype), decoder=lambda x: x,  # type: ignore[arg-type]
                         latent_shape=latent_shape, lora_rank=lora_rank,
                         lora_targets=lora_targets or LORA_TARGETS, dtype=dtype,
                         gradient_checkpointing=gradient_checkpointing)
    model.guidance = spec.guidance
    return model


def module_bytes(module: torch.nn.Module | None) -> int:
    """Parameter and buffer bytes of ``module`` (each tensor once)."""
    if module is None:
        return 0
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        seen.setdefault(id(t), t.numel() * t.element_size())
    return sum(seen.values())


def largest_block_bytes(transformer: torch.nn.Module) -> int:
    """Bytes of the transformer's largest repeated block (what FSDP gathers at once)."""
    best = 0
    for module in transformer.modules():
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                best = max(best, module_bytes(block))
    return best


def sp_latent_shape(shape: tuple[int, ...], patch: int, n: int) -> tuple[int, ...]:
    """The latent a sequence-parallel rank of ``n`` holds: ``1/n`` of the tokens (the height,
    in whole patches, rounded up)."""
    if n <= 1:
        return shape
    h = shape[-2]
    rows = -(-(h // patch) // n) * patch
    return (*shape[:-2], max(rows, patch), shape[-1])


# -- the traces ---------------------------------------------------------------------------------


@dataclass
class StepTrace:
    """Bytes a traced step allocated beyond what existed before it (weights, masters, AdamW state)."""

    peak: int
    """the step's peak of live bytes it allocated"""
    activations: int
    """live after the forward (saved tensors, checkpointed blocks' inputs, the output)"""
    saved: int
    """of those, what autograd saved for the backward (:func:`count_saved_bytes`)"""
    fb_peak: int = 0
    """the forward + backward's peak"""
    fb_at_peak: dict[str, int] = field(default_factory=dict)
    """that peak by kind: grads, activations (of the forward, still alive), other (workspace)"""
    opt_peak: int = 0
    """the optimizer step's peak (gradient clipping, AdamW, the masters' copy into the model)"""
    opt_at_peak: dict[str, int] = field(default_factory=dict)
    optimizer_state: int = 0
    masters: int = 0


def _loss(model: Any, x: torch.Tensor, x_next: torch.Tensor, cond: dict[str, torch.Tensor], sigma: float,
          guidance_scale: float, uncond: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """The GRPO loss head: the SDE step's Gaussian log-prob of ``x_next`` (latent-sized float32
    tensors) under the policy's guided velocity, times a per-row advantage."""
    from digenrl.rl.sampler import guided_velocity

    v = guided_velocity(model, x, sigma, cond, guidance_scale=guidance_scale, uncond=uncond)
    dt = -0.25
    mean = x.float() + (v + 0.5 * (x.float() + (1 - sigma) * v)) * dt
    logp = -((x_next - mean) ** 2).flatten(1).sum(1)
    return (torch.exp(logp - logp.detach()) * torch.ones_like(logp)).sum()


def trace_training_step(model: Any, rows: int, *, guidance_scale: float = 1.0, kl_beta: float = 0.0,
                        foreach: bool = True, attention: str = "flash", max_grad_norm: float = 1.0,
                        lr: float = 1e-5) -> StepTrace:
    """One trainer pass over ``rows`` latents (forward, backward into float32 masters, gradient
    clipping, AdamW) on ``model``'s device, after one untraced step; see the module doc."""
    from functools import partial

    from digenrl.rl.policy import _to_master

    dev = model.device
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    masters = params
    trace = LiveBytes()
    if any(p.dtype != torch.float32 for p in params):
        masters = [p.detach().float().requires_grad_(True) for p in params]
        for p, m in zip(params, masters):
            p.register_post_accumulate_grad_hook(partial(_to_master, m))
    for p, m in zip(params, masters):  # a gradient is filed as one as soon as it is made
        p.register_post_accumulate_grad_hook(lambda _p, m=m: trace.mark(m.grad, "grads"))
    opt = torch.optim.AdamW(masters, lr=lr, foreach=foreach)
    uncond = model.encode_prompts([""]) if guidance_scale != 1.0 else None
    shape = model.latent_shape
    phases: dict[str, tuple[int, dict[str, int]]] = {}

    def one_step(tracked: bool) -> tuple[int, int]:
        x = torch.zeros(rows, *shape, device=dev, dtype=torch.float32)
        x_next = torch.zeros(rows, *shape, device=dev, dtype=torch.float32)
        cond = model.encode_prompts(["p"] * rows)
        with count_saved_bytes() as saved, flash_attention(attention == "flash"):
            loss = _loss(model, x, x_next, cond, 0.5, guidance_scale, uncond)
        after_forward = trace.live
        if tracked:
            trace.mark_all("other", "activations")
        if kl_beta > 0:
            with torch.no_grad(), flash_attention(attention == "flash"):
                if getattr(model, "lora_rank", 0):
                    with model.adapter_disabled():
                        model.velocity(x, 0.5, cond)
                else:
                    model.velocity(x, 0.5, cond)  # the frozen copy runs the same shapes
        with flash_attention(attention == "flash"):
            loss.backward()
        del loss, x, x_next, cond
        phases["fb"] = (trace.peak, dict(trace.at_peak))
        trace.reset_peak()
        torch.nn.utils.clip_grad_norm_(masters, max_grad_norm, foreach=foreach and dev.type != "meta")
        opt.step()
        if masters is not params:
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
        phases["opt"] = (trace.peak, dict(trace.at_peak))
        opt.zero_grad(set_to_none=True)
        return after_forward, saved[0]

    for m in masters:  # AdamW's state as its first step makes it (the steady state is measured)
        m.grad = torch.zeros_like(m)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with trace, meta_masks():
        trace.reset_peak()
        activations, saved = one_step(True)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.device == dev)
    master_bytes = sum(m.numel() * m.element_size() for m in masters) if masters is not params else 0
    (fb, fb_at), (op, op_at) = phases["fb"], phases["opt"]
    return StepTrace(peak=max(fb, op), activations=activations, saved=saved, fb_peak=fb, fb_at_peak=fb_at,
                     opt_peak=op, opt_at_peak=op_at, optimizer_state=state, masters=master_bytes)


def trace_inference(model: Any, rows: int, *, guidance_scale: float = 1.0, attention: str = "flash") -> int:
    """Peak bytes one denoising forward over ``rows`` latents allocates (no grad; CFG runs the
    unconditional rows in the same forward)."""
    from digenrl.rl.sampler import guided_velocity

    uncond = model.encode_prompts([""]) if guidance_scale != 1.0 else None
    trace = LiveBytes()
    with trace, torch.no_grad(), flash_attention(attention == "flash"), meta_masks():
        x = torch.zeros(rows, *model.latent_shape, device=model.device, dtype=torch.float32)
        cond = model.encode_prompts(["p"] * rows)
        v = guided_velocity(model, x, 0.5, cond, guidance_scale=guidance_scale, uncond=uncond)
        del v
    return trace.peak


def trace_decode(vae: torch.nn.Module, family: str, rows: int, latent_shape: tuple[int, ...]) -> int:
    """Peak bytes :class:`~digenrl.models.pixels.VaeDecoder` allocates decoding ``rows`` latents."""
    from digenrl.models.pixels import VaeDecoder

    dev = next(vae.parameters()).device
    decoder = VaeDecoder(vae, family)  # type: ignore[arg-type]
    trace = LiveBytes()
    with trace, torch.no_grad():
        out = decoder(torch.zeros(rows, *latent_shape, device=dev, dtype=torch.float32))
        del out
    return trace.peak


def training_forward_saved_bytes(family: str, transformer_kwargs: dict[str, Any], px: int, batch: int,
                                 text: tuple[int, int, int], *, lora_rank: int, device: str | torch.device = "meta",
                                 dtype: torch.dtype = torch.float32, seed: int = 0, vae: Any = None,
                                 frames: int = 0, attention: str = "math") -> int:
    """Bytes a training forward (velocity of ``batch`` latents at ``px`` x ``px``, ``frames``
    frames for video, LoRA rank ``lora_rank`` on flow_grpo's targets) saves for its backward,
    for a transformer of ``transformer_kwargs`` of any family. ``device = "meta"`` builds and
    runs nothing real. ``vae``: an object with the VAE's ``config`` (its downsampling), None
    for a transformer alone. ``attention = "math"``: the math path's saved score matrices (the
    path the meta device takes); "flash": what a flash kernel saves."""
    from digenrl.models import catalog

    torch.manual_seed(seed)
    transformer = build_transformer(family, transformer_kwargs, dtype, device)
    shape = catalog.GEOMETRY[family](transformer.config, vae).latent_shape(px, px, frames)
    model = adapt(family, transformer, shape, text, lora_rank=lora_rank, dtype=dtype)
    if torch.device(device).type != "meta":
        model.encoder = _on(model.encoder, torch.device(device))
    cond = model.encode_prompts(["p"] * batch)
    x = torch.zeros(batch, *shape, device=device, dtype=dtype)
    with count_saved_bytes() as total, flash_attention(attention == "flash"), meta_masks():
        model.velocity(x, torch.full((batch,), 0.5, device=device), cond)
    return total[0]


def _on(encode: Callable[[Any], dict[str, torch.Tensor]], device: torch.device) -> Callable[[Any], dict[str, torch.Tensor]]:
    def moved(prompts: Any) -> dict[str, torch.Tensor]:
        return {k: torch.zeros(v.shape, dtype=v.dtype, device=device) if v.is_floating_point()
                else torch.ones(v.shape, dtype=v.dtype, device=device) for k, v in encode(prompts).items()}
    return moved


# -- measured: the trainer's own step on a real device ----------------------------------------


def resident_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages under ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(id(storage), storage.nbytes())
    return sum(seen.values())


def measure_trainer_step(cfg: Any, *, device: str | torch.device = "cpu") -> dict[str, int]:
    """``cfg``: a ResolvedConfig (``resolve_mode(cfg, "colocated")``, one trainer). Bytes the trainer's real step (:func:`~digenrl.rl.policy.build_policy`'s policy over the
    config's model: :meth:`~digenrl.rl.policy.Policy.fragment_loss_backward` on one fragment's
    rows at one trained timestep, then :meth:`~digenrl.rl.policy.Policy.optimizer_step`) holds at
    the peak of its second step on ``device``: the resident bytes (every parameter and buffer of
    the transformer, its KL reference copy, text encoders and VAE, the float32 masters)
    plus the peak of what the two steps allocated that is alive during the second (AdamW's state,
    the model's caches, the step's own tensors: :class:`LiveBytes` over real tensors)."""
    from digenrl.rl.policy import build_policy
    from digenrl.rl.sampler import StepRecord

    policy = build_policy(cfg, device=device)
    model: Any = policy.model
    t = cfg.train
    rows = t.prompts_per_step // cfg.runtime.fragments_per_step * t.group_size
    adv = torch.linspace(-1.0, 1.0, rows)
    keep = torch.ones(rows, dtype=torch.bool)

    with torch.no_grad():  # a trainer takes the conditioning with the fragment: encoded elsewhere
        cond = model.encode_prompts([f"prompt {i}" for i in range(rows)])

    def step() -> None:
        x = torch.randn(rows, *model.latent_shape, device=device)
        x_next = torch.randn(rows, *model.latent_shape, device=device)
        rec = StepRecord(0, 0.75, 0.5, x, x_next, torch.zeros(rows, device=device), True)
        policy.fragment_loss_backward({0: rec}, cond, adv, keep, batch_size_total=rows, n_trained_total=1,
                                      sigma_max=0.75)
        del rec, x, x_next
        policy.optimizer_step()

    modules: list[Any] = [model.transformer, getattr(model.decoder, "vae", None)]
    pipe = getattr(model.encoder, "pipe", None)
    if pipe is not None:  # the text encoders the pipeline object holds
        modules += [getattr(pipe, name, None) for name in ("text_encoder", "text_encoder_2", "text_encoder_3")]
    tensors = [t for m in modules if isinstance(m, torch.nn.Module) for t in [*m.parameters(), *m.buffers()]]
    if policy._ref is not None:
        tensors += [*policy._ref.transformer.parameters(), *policy._ref.transformer.buffers()]
    resident = resident_bytes(*tensors, *policy.params, *cond.values())
    trace = LiveBytes()
    with trace:  # what the first step leaves (AdamW's state, caches of the model) stays counted
        step()
        trace.reset_peak()
        step()
    return {"resident": resident, "step_peak": trace.peak, "peak": resident + trace.peak, "rows": rows}
