"""Saved-activation bytes of a training forward, counted from real module shapes.

The transformer is built on the ``meta`` device (shapes, no memory) and its training forward
runs there under :func:`torch.autograd.graph.saved_tensors_hooks`: every tensor autograd saves
for the backward is counted once (a view counts its base). On the meta device attention runs
the math path, so the count is what a forward with ``SDPBackend.MATH`` saves on a real device
(``tests/test_memplan.py`` measures it on the CPU: equal bytes); flash / memory-efficient
attention saves less (no score matrix).

Covers SD3 and FLUX conditioning (prompt embeddings + pooled embeddings); the per-role plan
(``digenrl plan --memory``) built on it is not implemented (docs/limits.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

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

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def training_forward_saved_bytes(family: str, transformer_kwargs: dict[str, Any], px: int, batch: int,
                                 text: tuple[int, int, int], *, lora_rank: int, device: str | torch.device = "meta",
                                 dtype: torch.dtype = torch.float32, seed: int = 0, vae: Any = None) -> int:
    """Bytes a training forward (velocity of ``batch`` latents at ``px`` x ``px``, LoRA rank
    ``lora_rank`` on flow_grpo's targets) saves for its backward, for an SD3 / FLUX transformer
    of ``transformer_kwargs``. ``device = "meta"`` builds and runs nothing real. ``vae``: an
    object with the VAE's ``config`` (its downsampling), None for a transformer alone."""
    from digenrl.models import catalog, families
    from digenrl.models.adapter import LORA_TARGETS

    spec = families.SPECS[family]
    dev = torch.device(device)
    with dev:
        torch.manual_seed(seed)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            transformer = spec.cls(**transformer_kwargs)
        finally:
            torch.set_default_dtype(prev)
    tokens, width, pooled = text

    def encode(prompts: Any) -> dict[str, torch.Tensor]:
        b = len(prompts)
        return {"prompt_embeds": torch.zeros(b, tokens, width, device=dev, dtype=dtype),
                "pooled_embeds": torch.zeros(b, pooled, device=dev, dtype=dtype),
                "prompt_mask": torch.ones(b, tokens, dtype=torch.long, device=dev)}

    identity: Callable[[torch.Tensor], torch.Tensor] = lambda x: x  # noqa: E731
    shape = catalog.GEOMETRY[family](transformer.config, vae).latent_shape(px, px)
    model = spec.adapter(transformer, encoder=encode, decoder=identity, latent_shape=shape,
                         lora_rank=lora_rank, lora_targets=LORA_TARGETS, dtype=dtype)
    model.guidance = spec.guidance
    cond = model.encode_prompts(["p"] * batch)
    x = torch.zeros(batch, *shape, device=dev, dtype=dtype)
    with count_saved_bytes() as total:
        model.velocity(x, torch.full((batch,), 0.5, device=dev), cond)
    return total[0]
