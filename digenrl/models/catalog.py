"""The families' table without diffusers: names, geometry, VAE classes, tiny configs.

What the launcher and the coordinator need to check a model config and learn its latent shape
(:mod:`digenrl.models.meta`), read without importing diffusers, whose import (with peft and
torch._dynamo) costs seconds of CPU in every process that does it: the launcher used to pay
them, serially, before it started any node. :mod:`digenrl.models.families` builds its table
(the diffusers classes and the adapters) on this one.

Geometry turns ``model.height`` / ``model.width`` / ``model.num_frames`` into the latent
shape the way each family's diffusers pipeline does (``prepare_latents``): pixels per latent
cell from the VAE (``2 ** (len(block_out_channels) - 1)`` for SD3/FLUX's ``AutoencoderKL``,
``2 ** len(temperal_downsample)`` for Qwen-Image, the config's ``scale_factor_*`` for Wan,
``*_compression_ratio`` for HunyuanVideo), latent frames ``(frames - 1) // t + 1``. Where a
pipeline would silently round a size down, a size that does not divide is refused instead,
naming the multiple it needs. Tiny models without a VAE decode pixel-unshuffled latents
(:mod:`digenrl.models.pixels`): ``r`` pixels per cell for ``3 r^2`` channels, one frame per
latent frame.

``TRANSFORMER_DEFAULTS`` and ``VAE_DEFAULTS`` are the diffusers classes' constructor defaults
of exactly the keys the geometry reads (a config file that leaves one out gets the class's
default, as ``from_pretrained`` would give it); tests/test_model_meta.py holds them to the
installed diffusers' signatures and the geometry to reading no other key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from digenrl.config import ConfigError
from digenrl.models import flux, flux2, qwenimage, sd3, video, zimage
from digenrl.models.pixels import shuffle_factor


@dataclass(frozen=True)
class Geometry:
    """How pixels map to latents for one transformer (+ VAE)."""

    family: str
    channels: int
    spatial: int
    """pixels per latent cell (VAE downsampling, or the pixel-shuffle factor)"""
    temporal: int
    """frames per latent frame (1 for images and for tiny videos)"""
    multiple: int
    """latent height and width must be multiples of this (the patch, or FLUX's 2x2 packing)"""
    default_hw: tuple[int, int]
    """pixels when model.height / model.width are 0"""
    default_frames: int
    """frames when model.num_frames is 0 (0 for image families)"""
    max_latent: int = 0
    """largest latent side (SD3's position-embedding grid x patch); 0 = unbounded"""

    @property
    def video(self) -> bool:
        return self.default_frames > 0

    def latent_shape(self, height: int = 0, width: int = 0, num_frames: int = 0) -> tuple[int, ...]:
        """(C, h, w) or (C, f, h, w) for an image of ``height`` x ``width`` (0 = default)."""
        h_px, w_px = height or self.default_hw[0], width or self.default_hw[1]
        step = self.spatial * self.multiple
        for key, px in (("model.height", h_px), ("model.width", w_px)):
            if px % step:
                raise ConfigError(f"{key} = {px}: {self.family} needs a multiple of {step} pixels "
                                  f"({self.spatial} per latent cell x {self.multiple} cells per patch)")
            if self.max_latent and px // self.spatial > self.max_latent:
                raise ConfigError(f"{key} = {px}: larger than this {self.family} transformer's position "
                                  f"grid allows ({self.max_latent * self.spatial} pixels)")
        h, w = h_px // self.spatial, w_px // self.spatial
        if not self.video:
            if num_frames > 1:
                raise ConfigError(f"model.num_frames = {num_frames}: {self.family} makes images")
            return (self.channels, h, w)
        frames = num_frames or self.default_frames
        if (frames - 1) % self.temporal:
            raise ConfigError(f"model.num_frames = {frames}: {self.family} needs 1 + a multiple of "
                              f"{self.temporal} frames (its VAE packs {self.temporal} frames per latent frame)")
        return (self.channels, (frames - 1) // self.temporal + 1, h, w)


def _pixels(channels: int) -> int:
    return shuffle_factor(channels) or 1


def _sd3(cfg: Any, vae: Any) -> Geometry:
    s = 2 ** (len(vae.config.block_out_channels) - 1) if vae is not None else _pixels(cfg.in_channels)
    return Geometry("sd3", cfg.in_channels, s, 1, cfg.patch_size, (cfg.sample_size * s,) * 2, 0,
                    max_latent=cfg.pos_embed_max_size * cfg.patch_size)


def _flux(cfg: Any, vae: Any) -> Geometry:
    c = cfg.in_channels // 4
    if vae is None:
        return Geometry("flux", c, _pixels(c), 1, 2, (16 * _pixels(c),) * 2, 0)
    s = 2 ** (len(vae.config.block_out_channels) - 1)
    return Geometry("flux", c, s, 1, 2, (128 * s,) * 2, 0)  # the pipeline's default_sample_size 128


def _flux_kontext(cfg: Any, vae: Any) -> Geometry:
    """FLUX.1 Kontext: FLUX's latents; the input image's tokens join the sequence (models/flux.py)."""
    g = _flux(cfg, vae)
    return dataclasses.replace(g, family="flux_kontext")


def _qwenimage(cfg: Any, vae: Any) -> Geometry:
    c = cfg.out_channels or cfg.in_channels // 4
    if vae is None:
        return Geometry("qwenimage", c, _pixels(c), 1, 2, (16 * _pixels(c),) * 2, 0)
    s = 2 ** len(vae.config.temperal_downsample)
    return Geometry("qwenimage", c, s, 1, 2, (128 * s,) * 2, 0)


def _qwenimage_edit(cfg: Any, vae: Any) -> Geometry:
    """Qwen-Image-Edit(-Plus): Qwen-Image's latents; the input images' tokens join the sequence
    (models/qwenimage.py)."""
    return dataclasses.replace(_qwenimage(cfg, vae), family="qwenimage_edit")


def _wan(cfg: Any, vae: Any) -> Geometry:
    c, patch = cfg.in_channels, cfg.patch_size[1]
    if vae is None:
        return Geometry("wan", c, _pixels(c), 1, patch, (8 * _pixels(c),) * 2, 2)
    return Geometry("wan", c, vae.config.scale_factor_spatial, vae.config.scale_factor_temporal, patch,
                    (480, 832), 81)


def _hunyuanvideo(cfg: Any, vae: Any) -> Geometry:
    c = cfg.in_channels
    if vae is None:
        return Geometry("hunyuanvideo", c, _pixels(c), 1, cfg.patch_size, (8 * _pixels(c),) * 2, 2)
    return Geometry("hunyuanvideo", c, vae.config.spatial_compression_ratio,
                    vae.config.temporal_compression_ratio, cfg.patch_size, (720, 1280), 129)


def _flux2(cfg: Any, vae: Any) -> Geometry:
    # the sampled latent is the VAE's patchified 2x2: in_channels channels at 1/(2 s) of the pixels
    c = cfg.in_channels
    if vae is None:
        return Geometry("flux2", c, _pixels(c), 1, 1, (16 * _pixels(c),) * 2, 0)
    s = 2 * 2 ** (len(vae.config.block_out_channels) - 1)
    return Geometry("flux2", c, s, 1, 1, (64 * s,) * 2, 0)  # the pipeline's 128 x VAE factor: 1024 px


def _zimage(cfg: Any, vae: Any) -> Geometry:
    c, patch = cfg.in_channels, cfg.all_patch_size[0]
    if vae is None:
        return Geometry("zimage", c, _pixels(c), 1, patch, (16 * _pixels(c),) * 2, 0)
    s = 2 ** (len(vae.config.block_out_channels) - 1)
    return Geometry("zimage", c, s, 1, patch, (1024, 1024), 0)


GEOMETRY: dict[str, Callable[[Any, Any], Geometry]] = {
    "sd3": _sd3, "flux": _flux, "qwenimage": _qwenimage, "wan": _wan, "hunyuanvideo": _hunyuanvideo,
    "flux2": _flux2, "zimage": _zimage, "flux_kontext": _flux_kontext, "qwenimage_edit": _qwenimage_edit,
}
"""family -> (transformer config, VAE or None) -> :class:`Geometry`"""

FAMILIES: tuple[str, ...] = tuple(GEOMETRY)

VAE_CLASS: dict[str, str] = {
    "sd3": "AutoencoderKL", "flux": "AutoencoderKL", "qwenimage": "AutoencoderKLQwenImage",
    "wan": "AutoencoderKLWan", "hunyuanvideo": "AutoencoderKLHunyuanVideo",
    "flux2": "AutoencoderKLFlux2", "zimage": "AutoencoderKL", "flux_kontext": "AutoencoderKL",
    "qwenimage_edit": "AutoencoderKLQwenImage",
}
"""family -> the diffusers class of its pipeline's VAE"""

TRANSFORMER_DEFAULTS: dict[str, dict[str, Any]] = {
    "sd3": {"in_channels": 16, "patch_size": 2, "sample_size": 128, "pos_embed_max_size": 96,
            "num_attention_heads": 18},
    "flux": {"in_channels": 64, "num_attention_heads": 24},
    "flux_kontext": {"in_channels": 64, "num_attention_heads": 24},
    "qwenimage": {"in_channels": 64, "out_channels": 16, "num_attention_heads": 24},
    "qwenimage_edit": {"in_channels": 64, "out_channels": 16, "num_attention_heads": 24},
    "wan": {"in_channels": 16, "patch_size": (1, 2, 2), "num_attention_heads": 40},
    "hunyuanvideo": {"in_channels": 16, "patch_size": 2, "num_attention_heads": 24},
    "flux2": {"in_channels": 128, "num_attention_heads": 48},
    "zimage": {"in_channels": 16, "all_patch_size": (2,), "n_heads": 30},
}
"""family -> its transformer class's defaults of the keys its geometry reads (and the attention
heads, which a sequence-parallel degree must divide)"""

SEQUENCE_PARALLEL_FAMILIES = ("sd3", "flux", "flux_kontext", "qwenimage", "wan", "hunyuanvideo", "flux2", "zimage")
"""Families with a sequence-parallel forward (:mod:`digenrl.models.seqpar`)"""

VAE_DEFAULTS: dict[str, dict[str, Any]] = {
    "AutoencoderKL": {"block_out_channels": (64,)},
    "AutoencoderKLQwenImage": {"temperal_downsample": [False, True, True]},
    "AutoencoderKLWan": {"scale_factor_spatial": 8, "scale_factor_temporal": 4},
    "AutoencoderKLHunyuanVideo": {"spatial_compression_ratio": 8, "temporal_compression_ratio": 4},
    "AutoencoderKLFlux2": {"block_out_channels": (128, 256, 512, 512)},
}
"""VAE class -> its defaults of the keys the geometry reads"""

#: Constructor kwargs of each family's tiny random model (the real diffusers class).
TINY_CONFIGS: dict[str, dict] = {
    "sd3": sd3.TINY_SD3,
    "flux": flux.TINY_FLUX,
    "flux_kontext": flux.TINY_FLUX,
    "qwenimage": qwenimage.TINY_QWENIMAGE,
    "qwenimage_edit": qwenimage.TINY_QWENIMAGE,
    "wan": video.TINY_WAN,
    "hunyuanvideo": video.TINY_HUNYUANVIDEO,
    "flux2": flux2.TINY_FLUX2,
    "zimage": zimage.TINY_ZIMAGE,
}

# -- the published models' shapes (``digenrl plan --memory`` builds them on the meta device) --------

#: SD3.5-medium's transformer/config.json (the Flow-GRPO base).
SD35_MEDIUM: dict[str, Any] = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")

REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "sd3": SD35_MEDIUM,
    "flux": {"guidance_embeds": True},            # FLUX.1-dev: the class defaults + guidance embedding
    "flux_kontext": {"guidance_embeds": True},
    "qwenimage": {},                              # Qwen-Image (20B): the class defaults
    "wan": {},                                    # Wan2.1-T2V-14B: the class defaults
    "hunyuanvideo": {},                           # HunyuanVideo (13B): the class defaults
    "flux2": {},                                  # FLUX.2-dev (32B): the class defaults
    "zimage": {},                                 # Z-Image (6B): the class defaults
}
"""family -> the published model's transformer constructor kwargs over its class defaults (what a
``model.path = "random"`` or ``"emulated"`` config is planned at, as the throughput plan prices it)"""

_KL_8X: dict[str, Any] = dict(
    in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305, shift_factor=0.0609)

REAL_VAES: dict[str, dict[str, Any]] = {
    "sd3": _KL_8X, "flux": _KL_8X, "flux_kontext": _KL_8X, "zimage": _KL_8X,
    "qwenimage": {}, "wan": {}, "hunyuanvideo": {}, "flux2": {},
}
"""family -> its pipeline VAE's constructor kwargs (class ``VAE_CLASS[family]``) over the class defaults"""

_CLIP_L = ("CLIPTextModel", "CLIPTextConfig", dict(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu"))
_T5_XXL: dict[str, Any] = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                               feed_forward_proj="gated-gelu")

REAL_TEXT_ENCODERS: dict[str, tuple[tuple[str, str, dict[str, Any]], ...]] = {
    "sd3": (("CLIPTextModelWithProjection", "CLIPTextConfig", {**_CLIP_L[2]}),
            ("CLIPTextModelWithProjection", "CLIPTextConfig", dict(
                vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")),
            ("T5EncoderModel", "T5Config", _T5_XXL)),
    "flux": (_CLIP_L, ("T5EncoderModel", "T5Config", _T5_XXL)),
    "flux_kontext": (_CLIP_L, ("T5EncoderModel", "T5Config", _T5_XXL)),
    "wan": (("UMT5EncoderModel", "UMT5Config", {**_T5_XXL, "vocab_size": 256384}),),
    "qwenimage": (("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", dict(text_config=dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4), vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420,
                                                   num_heads=16, out_hidden_size=3584))),),
    "hunyuanvideo": (("LlamaModel", "LlamaConfig", dict(
        vocab_size=128320, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8)), _CLIP_L),
    "flux2": (("Mistral3ForConditionalGeneration", "Mistral3Config", dict(text_config=dict(
        model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128), vision_config=dict(
        model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
        num_attention_heads=16, patch_size=14, image_size=1540))),),
    "zimage": (("Qwen3Model", "Qwen3Config", dict(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128)),),
}
"""family -> its pipeline's text encoders as (transformers model class, config class, config kwargs):
CLIP-L / CLIP-G / T5-XXL (SD3), CLIP-L + T5-XXL (FLUX), umT5-XXL (Wan), Qwen2.5-VL-7B (Qwen-Image),
LLaVA-Llama-3-8B's language model + CLIP-L (HunyuanVideo), Mistral Small 3.1 24B (FLUX.2-dev),
Qwen3-4B (Z-Image)"""

REAL_POOLED: dict[str, int] = {"sd3": 2048, "flux": 768, "flux_kontext": 768, "hunyuanvideo": 768}
"""family -> the pooled text embedding width of its pipeline (0 where there is none)"""
