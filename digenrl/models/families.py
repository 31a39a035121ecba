"""The per-family table: each family's diffusers transformer class, adapter and text dims,
over the diffusers-free part of the table (:mod:`digenrl.models.catalog`: geometry, VAE class
names, tiny configs; re-exported here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import diffusers

from digenrl.models import flux, qwenimage, sd3, video
from digenrl.models.adapter import DiffusersFlowModel
from digenrl.models.base import DiffusersTransformer
from digenrl.models.catalog import GEOMETRY, TINY_CONFIGS, VAE_CLASS, Geometry

__all__ = ["SPECS", "TINY_CONFIGS", "FamilySpec", "Geometry", "transformer_class"]


@dataclass(frozen=True)
class FamilySpec:
    cls: type[DiffusersTransformer]
    adapter: type[DiffusersFlowModel]
    geometry: Callable[[Any, Any], Geometry]
    """(transformer config, VAE or None) -> :class:`Geometry`"""
    text_dims: Callable[[Any], tuple[int, int]]
    """transformer config -> (prompt token dim, pooled dim) for the hash encoder"""
    vae_class: str
    guidance: float = 0.0
    """the pipeline's default embedded guidance (guidance-distilled transformers only)"""
    max_tokens: int = 16


def transformer_class(cls: type) -> type[DiffusersTransformer]:
    """``cls``, checked to be what every diffusers transformer class is (a model with a config
    and peft adapters: :class:`~digenrl.models.base.DiffusersTransformer`)."""
    from diffusers.configuration_utils import ConfigMixin
    from diffusers.loaders.peft import PeftAdapterMixin
    from diffusers.models.modeling_utils import ModelMixin

    if not all(issubclass(cls, base) for base in (ModelMixin, ConfigMixin, PeftAdapterMixin)):
        raise TypeError(f"{cls.__name__} is not a diffusers transformer with peft adapters")
    return cast("type[DiffusersTransformer]", cls)  # the check above is what the type says


SPECS: dict[str, FamilySpec] = {
    "sd3": FamilySpec(transformer_class(diffusers.SD3Transformer2DModel), sd3.SD3Model, GEOMETRY["sd3"],
                      lambda cfg: (cfg.joint_attention_dim, cfg.pooled_projection_dim), VAE_CLASS["sd3"]),
    "flux": FamilySpec(transformer_class(diffusers.FluxTransformer2DModel), flux.FluxModel, GEOMETRY["flux"],
                       lambda cfg: (cfg.joint_attention_dim, cfg.pooled_projection_dim), VAE_CLASS["flux"],
                       guidance=3.5),
    "qwenimage": FamilySpec(transformer_class(diffusers.QwenImageTransformer2DModel), qwenimage.QwenImageModel, GEOMETRY["qwenimage"],
                            lambda cfg: (cfg.joint_attention_dim, 0), VAE_CLASS["qwenimage"], guidance=1.0),
    "wan": FamilySpec(transformer_class(diffusers.WanTransformer3DModel), video.WanModel, GEOMETRY["wan"],
                      lambda cfg: (cfg.text_dim, 0), VAE_CLASS["wan"]),
    "hunyuanvideo": FamilySpec(transformer_class(diffusers.HunyuanVideoTransformer3DModel), video.HunyuanVideoModel, GEOMETRY["hunyuanvideo"],
                               lambda cfg: (cfg.text_embed_dim, cfg.pooled_projection_dim),
                               VAE_CLASS["hunyuanvideo"], guidance=6.0),
}

