"""The one interface every generator adapter implements.

An adapter wraps a diffusers transformer (``SD3Transformer2DModel``, ``FluxTransformer2DModel``,
``WanTransformer3DModel``, ``QwenImageTransformer2DModel``, ``HunyuanVideoTransformer3DModel``)
and hides its input conventions (latent packing, position ids, timestep scaling, guidance
embedding) behind four operations the rest of DigenRL uses:

* ``encode_prompts(prompts) -> Cond``: conditioning tensors, batch-first.
* ``velocity(x, sigma, cond) -> v``: the flow-matching velocity, so that the Euler (ODE) step
  is ``x_next = x + (sigma_next - sigma) * v`` (diffusers' FlowMatchEulerDiscreteScheduler
  convention; sigma = 1 is pure noise, 0 is data).
* ``decode(x) -> uint8 images (B, 3, H, W)`` for rewards and sample grids (videos: frames
  tiled side by side into one image).
* ``latent_shape``: the per-sample latent shape (``x`` is ``(B, *latent_shape)``).

Conditioning (:data:`Cond`) is a plain ``dict[str, Tensor]`` whose tensors all have the batch
as their first dimension, so it can be sliced, concatenated and sent over the wire unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

Cond = dict[str, torch.Tensor]

if TYPE_CHECKING:  # diffusers is imported lazily at run time (an emulated node never loads it)
    # from the defining modules: ``diffusers.ModelMixin`` is a dummy class to a type checker
    from diffusers.configuration_utils import ConfigMixin
    from diffusers.loaders.peft import PeftAdapterMixin
    from diffusers.models.modeling_utils import ModelMixin

    class DiffusersTransformer(ModelMixin, ConfigMixin, PeftAdapterMixin):
        """What every diffusers transformer class is (``SD3Transformer2DModel`` ... share no
        single base): a module with a config and peft adapters. For type checking only;
        :func:`digenrl.models.families.transformer_class` checks a class at run time."""

        config: Any  # diffusers' FrozenDict, read by attribute (``config.guidance_embeds``)
        config_name: Any  # ModelMixin says "config.json", ConfigMixin declares None
        peft_config: dict[str, Any]  # set by add_adapter

    class DiffusersVae(ModelMixin, ConfigMixin):
        """A diffusers VAE (``AutoencoderKL``, ``AutoencoderKLWan``, ...). Type checking only."""

        config: Any
        config_name: Any

        def decode(self, z: torch.Tensor, return_dict: bool = True) -> Any: ...
else:
    DiffusersTransformer = DiffusersVae = torch.nn.Module


@runtime_checkable
class FlowModel(Protocol):
    family: str
    latent_shape: tuple[int, ...]
    @property
    def transformer(self) -> torch.nn.Module: ...

    def encode_prompts(self, prompts: Sequence[str]) -> Cond: ...

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor: ...

    def decode(self, x: torch.Tensor) -> torch.Tensor: ...

    def trainable_parameters(self) -> Iterator[torch.nn.Parameter]: ...


def encode_inputs(model: FlowModel, prompts: Sequence[str],
                  images: Sequence[Sequence[str]] | None = None) -> Cond:
    """Conditioning of ``prompts``, with each prompt's input image paths for an edit model
    (one whose adapter has ``encode_edits``); ``images`` None or all empty: text only."""
    if images is not None and any(images):
        encode_edits = getattr(model, "encode_edits", None)
        if encode_edits is None:
            raise ValueError(f"{model.family} is not an image-editing family, but its prompts carry "
                             "input images")
        return encode_edits(list(prompts), [list(p) for p in images])
    return model.encode_prompts(prompts)


def cond_select(cond: Cond, index: torch.Tensor | slice | Sequence[int]) -> Cond:
    """Rows ``index`` of every conditioning tensor."""
    if isinstance(index, slice):
        return {k: v[index] for k, v in cond.items()}
    idx = torch.as_tensor(index, dtype=torch.long)
    return {k: v.index_select(0, idx.to(v.device)) for k, v in cond.items()}


def cond_cat(conds: Sequence[Cond]) -> Cond:
    """Concatenate conditionings along the batch.

    Token sequences of different lengths (Qwen-Image pads each batch to its longest prompt)
    are zero-padded to the longest first: zero embeddings under a zero ``prompt_mask``, the
    padding the pipeline itself adds.
    """
    if not conds:
        raise ValueError("cond_cat needs at least one conditioning")
    keys = conds[0].keys()
    out = {}
    for k in keys:
        parts = [c[k] for c in conds]
        if parts[0].dim() >= 2 and len({p.shape[1] for p in parts}) > 1:
            n = max(p.shape[1] for p in parts)
            parts = [torch.cat([p, p.new_zeros(p.shape[0], n - p.shape[1], *p.shape[2:])], dim=1)
                     if p.shape[1] < n else p for p in parts]
        out[k] = torch.cat(parts, dim=0)
    return out


def cond_repeat(cond: Cond, times: int) -> Cond:
    """Each row repeated ``times`` times in place (prompt p -> rows p*times .. p*times+times-1)."""
    return {k: v.repeat_interleave(times, dim=0) for k, v in cond.items()}
