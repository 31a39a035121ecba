"""Qwen-Image (``QwenImageTransformer2DModel``).

Conventions (``pipeline_qwenimage.py``, diffusers 0.42.1): latents ``(C, H, W)`` packed 2x2 into
tokens of ``4C`` features as FLUX; ``img_shapes = [[(1, H/2, W/2)]] * B``; the timestep passed is
``sigma`` (``t / 1000``); text is ``encoder_hidden_states`` with ``encoder_hidden_states_mask``
(this diffusers version derives the text lengths from the mask; there is no ``txt_seq_lens``).
No pooled vector. The unpacked output is the velocity.

Qwen-Image-Edit and -Edit-Plus (:class:`QwenImageEditModel`, ``pipeline_qwenimage_edit*.py``)
are the same transformer with the input images' packed latents appended to the sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from digenrl.models.adapter import DiffusersFlowModel
from digenrl.models.base import Cond, cond_cat
from digenrl.models.packing import pack_2x2, unpack_2x2
from digenrl.models.pixels import image_to_tensor

#: Tiny Qwen-Image: latent 12x16x16 packed into 64 tokens of 48 features; 2 layers, because the
#: last block's text stream feeds nothing and a 1-layer model would never train its text path.
TINY_QWENIMAGE = dict(
    patch_size=2, in_channels=48, out_channels=12, num_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
)


class QwenImageModel(DiffusersFlowModel):
    """Qwen-Image adapter; see the module docstring for the conventions."""

    family = "qwenimage"
    pipeline_class = "QwenImagePipeline"
    guidance = 1.0  # only used by a guidance-embedding variant

    def _forward(self, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        b, _, h, w = x.shape
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance, device=x.device, dtype=x.dtype)
        out = self.transformer(
            hidden_states=pack_2x2(x), encoder_hidden_states=cond["prompt_embeds"],
            encoder_hidden_states_mask=cond["prompt_mask"], timestep=sigma_B,
            img_shapes=[[(1, h // 2, w // 2)]] * b, guidance=guidance, return_dict=False,
        )[0]
        return unpack_2x2(out, h, w)


def condition_size(area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of an input image of ``width`` x ``height`` resized to about ``area``
    pixels, its aspect kept and each side rounded to a multiple of 32 (at least 32): the edit
    pipelines' ``calculate_dimensions``."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return max(32, round(w / 32) * 32), max(32, round(h / 32) * 32)


#: QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE: the pixel area its text encoder sees each image at.
PLUS_VL_AREA = 384 * 384


class QwenImageEditModel(QwenImageModel):
    """Qwen-Image-Edit (``QwenImageEditPipeline``) and -Edit-Plus (``QwenImageEditPlusPipeline``,
    Qwen-Image-Edit-2509 and later): Qwen-Image with the input image(s) in the sequence.

    Each input image is resized to about ``condition_area`` pixels, its aspect kept (sides
    rounded to 32 px, :func:`condition_size`; 0: the output's area), VAE-encoded once per
    prompt (:meth:`encode_edits`; the VAE's mode, normalised by its ``latents_mean`` /
    ``latents_std``) and packed 2x2; a prompt's images' tokens, one after the other, ride in
    ``cond["image_latents"]`` ``(B, tokens, 4C)`` with each image's packed ``(h, w)`` in
    ``cond["image_shapes"]`` ``(B, images, 2)`` (zero rows pad a prompt with fewer images), in
    the fragment's conditioning, so a trainer re-encodes nothing. The text encoder sees the
    images through the pipeline's own ``encode_prompt`` (its VL template: Edit one image,
    Plus ``Picture i:`` before each) at ``condition_vl_area`` (0: the pipeline's, Edit the VAE's
    image, Plus 384 x 384). Each forward appends the image tokens to the noisy latent's with
    ``img_shapes = [(1, H/2, W/2), (1, h_1, w_1), ...]`` and keeps the output's first tokens
    (``pipeline_qwenimage_edit*.py``); rows whose images differ in size run as separate
    forwards (the transformer's rotary embedding takes one ``img_shapes`` for a batch).
    Without ``image_latents`` it is plain Qwen-Image.
    """

    family = "qwenimage_edit"
    pipeline_class = "QwenImageEditPlusPipeline"  # a folder's own class replaces it (registry)
    #: input images (B, 3, H, W) in [-1, 1] -> normalised latents (B, C, h, w); set by the registry
    image_encoder: Callable[[torch.Tensor], torch.Tensor] | None = None
    pixels_per_latent = 8
    """input-image pixels per latent cell (the VAE's downsampling; set by the registry)"""
    condition_area = 0
    """model.condition_area (0: the output's)"""
    condition_vl_area = 0
    """model.condition_vl_area (0: the pipeline's)"""

    @property
    def max_input_images(self) -> int:
        from digenrl.config import EDIT_FAMILIES, PIPELINE_IMAGE_LIMIT

        return PIPELINE_IMAGE_LIMIT.get(self.pipeline_class, EDIT_FAMILIES[self.family])

    @property
    def plus(self) -> bool:
        """Whether this is an Edit-Plus model (several images, ``Picture i:`` template)."""
        return self.pipeline_class != "QwenImageEditPipeline"

    def encode_edits(self, prompts: Sequence[str], images: Sequence[Sequence[str]]) -> Cond:
        """Conditioning of edit prompts: each prompt's text seen with its images, and the
        images' packed latents (see the class docstring)."""
        from PIL import Image

        from digenrl.data.prompts import load_image

        if self.image_encoder is None:
            raise ValueError(f"{self.family}: this model has no image encoder (a VAE) for input images")
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} input image lists")
        _, h, w = self.latent_shape
        s = self.pixels_per_latent
        area = self.condition_area or h * s * w * s
        encode_text = getattr(self.encoder, "encode_with_images", None)
        rows = []
        for prompt, paths in zip(prompts, images, strict=True):
            if not 1 <= len(paths) <= self.max_input_images:
                raise ValueError(f"{self.family} ({self.pipeline_class}) takes 1 to {self.max_input_images} "
                                 f"input images per prompt, got {len(paths)}")
            pictures = [load_image(p) for p in paths]
            latents, shapes, seen = [], [], []
            for im in pictures:
                cw, ch = condition_size(area, *im.size)
                z = self.image_encoder(image_to_tensor(im, ch, cw)[None].to(self.device))
                latents.append(pack_2x2(z.to(self.device, torch.float32)))
                shapes.append((z.shape[-2] // 2, z.shape[-1] // 2))
                vl_area = self.condition_vl_area or (PLUS_VL_AREA if self.plus else 0)
                vw, vh = condition_size(vl_area, *im.size) if vl_area else (cw, ch)
                seen.append(im.resize((vw, vh), resample=Image.Resampling.LANCZOS) if im.size != (vw, vh) else im)
            if encode_text is not None:  # the pipeline's VL encoder: the text sees the images
                text = encode_text(prompt, seen if self.plus else seen[0])
            else:  # the hash encoder of tiny models: text only
                text = self.encoder([prompt])
            row = {k: v.to(self.device) for k, v in text.items()}
            row["image_latents"] = torch.cat(latents, dim=1)
            row["image_shapes"] = torch.tensor([shapes], dtype=torch.long, device=self.device)
            rows.append(row)
        return cond_cat(rows)

    def _forward(self, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        image = cond.get("image_latents")
        if image is None:
            return super()._forward(x, sigma_B, cond)
        b, _, h, w = x.shape
        tokens = pack_2x2(x)
        n = tokens.shape[1]
        groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for i, row in enumerate(cond["image_shapes"].tolist()):
            groups.setdefault(tuple((a, c) for a, c in row if a > 0), []).append(i)
        outs, order = [], []
        for shapes, rows in groups.items():
            m = sum(a * c for a, c in shapes)
            pick = slice(None) if len(rows) == b else torch.tensor(rows, device=x.device)

            def sel(t: torch.Tensor, pick: slice | torch.Tensor = pick) -> torch.Tensor:
                return t[pick]

            guidance = None
            if self.transformer.config.guidance_embeds:
                guidance = torch.full((len(rows),), self.guidance, device=x.device, dtype=x.dtype)
            out = self.transformer(
                hidden_states=torch.cat([sel(tokens), sel(image)[:, :m]], dim=1),
                encoder_hidden_states=sel(cond["prompt_embeds"]), encoder_hidden_states_mask=sel(cond["prompt_mask"]),
                timestep=sel(sigma_B), img_shapes=[[(1, h // 2, w // 2), *((1, a, c) for a, c in shapes)]] * len(rows),
                guidance=guidance, return_dict=False,
            )[0]
            outs.append(out[:, :n])
            order.extend(rows)
        if len(outs) == 1:
            return unpack_2x2(outs[0], h, w)
        inverse = torch.argsort(torch.tensor(order, device=x.device))
        return unpack_2x2(torch.cat(outs).index_select(0, inverse), h, w)
