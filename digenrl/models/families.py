"""The per-family table: each family's diffusers transformer class, adapter and text dims,
over the diffusers-free part of the table (:mod:`digenrl.models.catalog`: geometry, VAE class
names, tiny configs; re-exported here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import diffusers

from digenrl.models import flux, flux2, qwenimage, sd3, video, zimage
from digenrl.models.adapter import DiffusersFlowModel
from digenrl.models.base import DiffusersTransformer
from digenrl.models.catalog import TINY_CONFIGS, Geometry

__all__ = ["SPECS", "TINY_CONFIGS", "FamilySpec", "Geometry", "transformer_class"]
"""Geometry and VAE class names are the catalog's (``catalog.GEOMETRY``, ``catalog.VAE_CLASS``)."""


@dataclass(frozen=True)
class FamilySpec:
    cls: type[DiffusersTransformer]
    adapter: type[DiffusersFlowModel]
    text_dims: Callable[[Any], tuple[int, int]]
    """transformer config -> (prompt token dim, pooled dim) for the hash encoder"""
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
    "sd3": FamilySpec(transformer_class(diffusers.SD3Transformer2DModel), sd3.SD3Model,
                      lambda cfg: (cfg.joint_attention_dim, cfg.pooled_projection_dim)),
    "flux": FamilySpec(transformer_class(diffusers.FluxTransformer2DModel), flux.FluxModel,
                       lambda cfg: (cfg.joint_attention_dim, cfg.pooled_projection_dim),
                       guidance=3.5),
    "flux_kontext": FamilySpec(transformer_class(diffusers.FluxTransformer2DModel), flux.FluxKontextModel,
                               lambda cfg: (cfg.joint_attention_dim, cfg.pooled_projection_dim),
                               guidance=3.5),
    "qwenimage": FamilySpec(transformer_class(diffusers.QwenImageTransformer2DModel), qwenimage.QwenImageModel,
                            lambda cfg: (cfg.joint_attention_dim, 0), guidance=1.0),
    "qwenimage_edit": FamilySpec(transformer_class(diffusers.QwenImageTransformer2DModel),
                                 qwenimage.QwenImageEditModel, lambda cfg: (cfg.joint_attention_dim, 0), guidance=1.0),
    "wan": FamilySpec(transformer_class(diffusers.WanTransformer3DModel), video.WanModel,
                      lambda cfg: (cfg.text_dim, 0)),
    "hunyuanvideo": FamilySpec(transformer_class(diffusers.HunyuanVideoTransformer3DModel), video.HunyuanVideoModel,
                               lambda cfg: (cfg.text_embed_dim, cfg.pooled_projection_dim),
                               guidance=6.0),
    "flux2": FamilySpec(transformer_class(diffusers.Flux2Transformer2DModel), flux2.Flux2Model,
                        lambda cfg: (cfg.joint_attention_dim, 0), guidance=4.0),
    "zimage": FamilySpec(transformer_class(diffusers.ZImageTransformer2DModel), zimage.ZImageModel,
                         lambda cfg: (cfg.cap_feat_dim, 0)),
}

