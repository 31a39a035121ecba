"""The per-family table: diffusers class, adapter, tiny config, latent shape, text dims, VAE class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import diffusers

from digenrl.models import flux, qwenimage, sd3, video
from digenrl.models.adapter import DiffusersFlowModel


@dataclass(frozen=True)
class FamilySpec:
    cls: type
    adapter: type[DiffusersFlowModel]
    latent_shape: Callable[[object, bool], tuple[int, ...]]
    """(transformer config, loaded from a pipeline folder) -> per-sample latent shape."""
    text_dims: Callable[[object], tuple[int, int]]
    """transformer config -> (prompt token dim, pooled dim) for the hash encoder."""
    vae_class: str
    max_tokens: int = 16


SPECS: dict[str, FamilySpec] = {
    "sd3": FamilySpec(diffusers.SD3Transformer2DModel, sd3.SD3Model,
                      lambda cfg, real: sd3.sd3_latent_shape(cfg), sd3.sd3_text_dims, "AutoencoderKL"),
    "flux": FamilySpec(diffusers.FluxTransformer2DModel, flux.FluxModel, flux.flux_latent_shape,
                       lambda cfg: (cfg.joint_attention_dim, cfg.pooled_projection_dim), "AutoencoderKL"),
    "qwenimage": FamilySpec(diffusers.QwenImageTransformer2DModel, qwenimage.QwenImageModel,
                            qwenimage.qwenimage_latent_shape, lambda cfg: (cfg.joint_attention_dim, 0),
                            "AutoencoderKLQwenImage"),
    "wan": FamilySpec(diffusers.WanTransformer3DModel, video.WanModel, video.wan_latent_shape,
                      lambda cfg: (cfg.text_dim, 0), "AutoencoderKLWan"),
    "hunyuanvideo": FamilySpec(diffusers.HunyuanVideoTransformer3DModel, video.HunyuanVideoModel,
                               video.hunyuan_latent_shape,
                               lambda cfg: (cfg.text_embed_dim, cfg.pooled_projection_dim),
                               "AutoencoderKLHunyuanVideo"),
}

#: Constructor kwargs of each family's tiny random model (the real diffusers class).
TINY_CONFIGS: dict[str, dict] = {
    "sd3": sd3.TINY_SD3,
    "flux": flux.TINY_FLUX,
    "qwenimage": qwenimage.TINY_QWENIMAGE,
    "wan": video.TINY_WAN,
    "hunyuanvideo": video.TINY_HUNYUANVIDEO,
}
