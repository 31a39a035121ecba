"""Latent <-> pixel conversion: the fixed decoders of tiny models and real VAEs.

Tiny models have no VAE. Their latent *is* the image, pixel-unshuffled: an RGB image
``(3, H*r, W*r)`` in [-1, 1] becomes a latent ``(3*r*r, H, W)`` (``torch.pixel_unshuffle``), and
decoding is ``pixel_shuffle(r)`` then ``uint8 = round((x + 1) * 127.5)``. This makes the tiny base
model trainable on real pictures (:func:`encode_images` is its data pipeline) and keeps the reward
meaningful. A latent whose channels are not ``3*r*r`` is mapped to RGB by a fixed linear projection
``W (3, C) = randn(3, C, generator=Generator().manual_seed(0)) / sqrt(C)``, at latent resolution.

Videos ``(C, F, H, W)`` are decoded frame by frame and the frames tiled left to right.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from digenrl.models.base import DiffusersVae


class Decoder(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def to_uint8(img: torch.Tensor) -> torch.Tensor:
    """[-1, 1] floats -> uint8 in [0, 255] (values outside are clamped)."""
    return ((img.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def from_uint8(img: torch.Tensor) -> torch.Tensor:
    """uint8 -> float32 in [-1, 1]."""
    if img.dtype != torch.uint8:
        raise ValueError(f"expected uint8 images, got dtype {img.dtype}")
    return img.float() / 127.5 - 1


def tile_frames(frames_BF3HW: torch.Tensor) -> torch.Tensor:
    """(B, F, 3, H, W) -> (B, 3, H, F*W): frames side by side."""
    b, f, c, h, w = frames_BF3HW.shape
    return frames_BF3HW.permute(0, 2, 3, 1, 4).reshape(b, c, h, f * w)


def _frames_first(x: torch.Tensor) -> torch.Tensor:
    """(B, C, F, H, W) -> (B*F, C, H, W)."""
    b, c, f, h, w = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)


def shuffle_factor(channels: int) -> int | None:
    """r with ``channels == 3*r*r``, or None."""
    r = round((channels / 3) ** 0.5)
    return r if r >= 1 and 3 * r * r == channels else None


class PixelDecoder:
    """The tiny models' fixed decoder: pixel shuffle (or a fixed projection) to uint8 RGB."""

    def __init__(self, channels: int) -> None:
        self.channels = channels
        self.r = shuffle_factor(channels)
        self._proj: torch.Tensor | None = None  # the projection when channels != 3*r*r
        if self.r is None:
            gen = torch.Generator().manual_seed(0)
            self._proj = torch.randn(3, channels, generator=gen) / channels**0.5

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 5:
            b, f = x.shape[0], x.shape[2]
            imgs = self._decode_2d(_frames_first(x))
            return tile_frames(imgs.reshape(b, f, *imgs.shape[1:]))
        return self._decode_2d(x)

    def _decode_2d(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.channels:
            raise ValueError(f"expected latents (B, {self.channels}, H, W), got shape {tuple(x.shape)}")
        x = x.float()
        if self.r is not None:
            return to_uint8(torch.pixel_shuffle(x, self.r))
        assert self._proj is not None, "made in __init__ whenever r is None"
        return to_uint8(torch.einsum("oc,bchw->bohw", self._proj.to(x.device), x))


def encode_images(images: torch.Tensor, channels: int = 12) -> torch.Tensor:
    """The inverse of :class:`PixelDecoder`: uint8 ``(B, 3, H, W)`` -> latents ``(B, 3*r*r, H/r, W/r)``.

    Only defined when ``channels == 3*r*r`` and ``H``, ``W`` are multiples of ``r``.
    """
    r = shuffle_factor(channels)
    if r is None:
        raise ValueError(f"encode_images needs channels = 3*r*r, got channels={channels}")
    if images.dim() != 4 or images.shape[1] != 3 or images.shape[2] % r or images.shape[3] % r:
        raise ValueError(f"expected uint8 images (B, 3, H, W) with H, W multiples of {r}, got {tuple(images.shape)}")
    return torch.pixel_unshuffle(from_uint8(images), r)


class VaeDecoder:
    """A pipeline folder's VAE with the pipeline's latent normalisation undone before decoding.

    SD3 / FLUX / Z-Image (``AutoencoderKL``): ``z / scaling_factor + shift_factor``; FLUX.2
    (``AutoencoderKLFlux2``): the patchified latent times the VAE's batch-norm std plus its mean,
    then un-patchified 2x2; Wan (``AutoencoderKLWan``)
    and Qwen-Image (``AutoencoderKLQwenImage``): ``z * latents_std + latents_mean`` per channel;
    HunyuanVideo (``AutoencoderKLHunyuanVideo``): ``z / scaling_factor``.
    """

    def __init__(self, vae: DiffusersVae, family: str) -> None:
        self.vae, self.family = vae.requires_grad_(False).eval(), family

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.vae.config
        # the first parameter's dtype: diffusers' ``vae.dtype`` walks every submodule (~5 ms a call)
        z = x.to(next(self.vae.parameters()).dtype)
        if self.family in ("sd3", "flux", "zimage", "flux_kontext"):
            z = z / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)
            return to_uint8(self.vae.decode(z).sample)
        if self.family == "flux2":
            bn = self.vae.bn
            std = torch.sqrt(bn.running_var + cfg.batch_norm_eps).to(z.dtype).view(1, -1, 1, 1)
            z = z * std + bn.running_mean.to(z.dtype).view(1, -1, 1, 1)
            b, c4, h, w = z.shape  # (B, 4C, h, w) -> (B, C, 2h, 2w): the pipeline's _unpatchify_latents
            z = z.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, 2 * h, 2 * w)
            return to_uint8(self.vae.decode(z).sample)
        if self.family in ("wan", "qwenimage", "qwenimage_edit"):
            shape = (1, -1) + (1,) * (z.dim() - 2)
            mean = torch.tensor(cfg.latents_mean, dtype=z.dtype, device=z.device).view(shape)
            std = torch.tensor(cfg.latents_std, dtype=z.dtype, device=z.device).view(shape)
            z = z * std + mean
        else:
            z = z / cfg.scaling_factor
        video = z.dim() == 5
        if not video:  # Qwen-Image's VAE is a video VAE: images are 1-frame videos
            z = z.unsqueeze(2)
        out = self.vae.decode(z).sample  # (B, 3, F, H, W)
        if not video:
            return to_uint8(out[:, :, 0])
        return tile_frames(to_uint8(out).permute(0, 2, 1, 3, 4))


def image_to_tensor(img: Any, height: int, width: int) -> torch.Tensor:
    """A PIL image resized to ``height`` x ``width`` (Lanczos, as diffusers' VaeImageProcessor
    resizes) -> float32 ``(3, H, W)`` in [-1, 1] (its ``preprocess`` normalisation)."""
    from PIL import Image

    im = img.convert("RGB")
    if im.size != (width, height):
        im = im.resize((width, height), resample=Image.Resampling.LANCZOS)
    t = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).reshape(height, width, 3)
    return from_uint8(t.permute(2, 0, 1).contiguous())


class VaeEncoder:
    """Input images -> normalised latents, as an edit pipeline encodes its conditioning image:
    the VAE's mode (``sample_mode="argmax"``), then ``(z - shift_factor) * scaling_factor``
    (``AutoencoderKL``: FLUX.1 Kontext) or ``(z - latents_mean) / latents_std`` per channel
    (``AutoencoderKLQwenImage``, a video VAE: the image is a 1-frame video; Qwen-Image-Edit)."""

    def __init__(self, vae: DiffusersVae) -> None:
        self.vae = vae.requires_grad_(False).eval()

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.vae.config
        x = images.to(self.vae.device, self.vae.dtype)
        if getattr(cfg, "latents_mean", None) is not None:
            z = self.vae.encode(x.unsqueeze(2)).latent_dist.mode()[:, :, 0]
            mean = torch.tensor(cfg.latents_mean, dtype=z.dtype, device=z.device).view(1, -1, 1, 1)
            std = torch.tensor(cfg.latents_std, dtype=z.dtype, device=z.device).view(1, -1, 1, 1)
            return (z - mean) / std
        z = self.vae.encode(x).latent_dist.mode()
        return (z - (getattr(cfg, "shift_factor", None) or 0.0)) * cfg.scaling_factor


class PixelEncoder:
    """The tiny models' fixed encoder, the inverse of :class:`PixelDecoder`'s pixel shuffle."""

    def __init__(self, channels: int) -> None:
        self.r = shuffle_factor(channels)
        if self.r is None:
            raise ValueError(f"{channels}-channel latents are no pixel shuffle of RGB: no fixed image encoder")

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        assert self.r is not None
        return torch.pixel_unshuffle(images.float(), self.r)
