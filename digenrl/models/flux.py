"""FLUX.1 (``FluxTransformer2DModel``).

Conventions (``pipeline_flux.py``): latents ``(C, H, W)`` are packed 2x2 into ``H/2 * W/2``
tokens of ``4C`` features; ``img_ids`` are ``(tokens, 3)`` = ``[0, row, col]`` and ``txt_ids`` zeros
``(L, 3)``; the timestep passed is ``t / 1000 = sigma`` (the model scales by 1000 inside); a
guidance-distilled model (``guidance_embeds``) gets ``guidance`` (3.5 by default) per sample; the
output tokens, unpacked, are the velocity. Text: T5 sequence + CLIP pooled vector.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from digenrl.models.adapter import DiffusersFlowModel
from digenrl.models.base import Cond
from digenrl.models.packing import pack_2x2, unpack_2x2
from digenrl.models.pixels import image_to_tensor

#: Tiny FLUX: latent 12x16x16 (RGB 32x32 unshuffled) packed into 64 tokens of 48 features.
TINY_FLUX = dict(
    patch_size=1, in_channels=48, num_layers=1, num_single_layers=1, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)


def image_ids(h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(h/2 * w/2, 3) position ids ``[0, row, col]`` of the packed tokens."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(h // 2, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device, dtype=dtype)[None, :]
    return ids.reshape(-1, 3)


class FluxModel(DiffusersFlowModel):
    """FLUX adapter; ``guidance`` is the distilled guidance value (used when the model embeds it)."""

    family = "flux"
    pipeline_class = "FluxPipeline"
    guidance = 3.5

    def _forward(self, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        b, _, h, w = x.shape
        text = cond["prompt_embeds"]
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance, device=x.device, dtype=x.dtype)
        out = self.transformer(
            hidden_states=pack_2x2(x), encoder_hidden_states=text, pooled_projections=cond["pooled_embeds"],
            timestep=sigma_B, img_ids=image_ids(h, w, x.device, x.dtype),
            txt_ids=torch.zeros(text.shape[1], 3, device=x.device, dtype=x.dtype), guidance=guidance,
            return_dict=False,
        )[0]
        return unpack_2x2(out, h, w)


class FluxKontextModel(FluxModel):
    """FLUX.1 Kontext (``FluxKontextPipeline``): FLUX with the input image in the sequence.

    The conditioning image is resized to the output size (``model.height`` x ``model.width``;
    the pipeline's ``max_area`` and preferred-resolution snapping are not used), VAE-encoded
    once per prompt (:meth:`encode_edits`) and packed 2x2 into ``cond["image_latents"]``
    ``(B, tokens, 4C)``: it rides with the prompt embeddings in the fragment's conditioning, so
    a trainer re-encodes nothing. Each forward appends those tokens to the noisy latent's,
    with position ids ``[1, row, col]`` (the latent's are ``[0, row, col]``), and keeps the
    output's first ``tokens`` (``pipeline_flux_kontext.py``). Without ``image_latents`` it is
    plain FLUX, as the pipeline is without an image.
    """

    family = "flux_kontext"
    pipeline_class = "FluxKontextPipeline"
    guidance = 3.5
    max_input_images = 1
    #: input images (B, 3, H, W) in [-1, 1] -> normalised latents (B, C, h, w); set by the registry
    image_encoder: Callable[[torch.Tensor], torch.Tensor] | None = None
    pixels_per_latent = 8
    """input-image pixels per latent cell (the VAE's downsampling; set by the registry)"""

    def encode_edits(self, prompts: Sequence[str], images: Sequence[Sequence[str]]) -> Cond:
        """Conditioning of edit prompts: the text's and each prompt's packed input image."""
        from digenrl.data.prompts import load_image

        if self.image_encoder is None:
            raise ValueError(f"{self.family}: this model has no image encoder (a VAE) for input images")
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} input image lists")
        _, h, w = self.latent_shape
        s = self.pixels_per_latent
        pixels = []
        for paths in images:
            if len(paths) != self.max_input_images:
                raise ValueError(f"{self.family} takes {self.max_input_images} input image per prompt, "
                                 f"got {len(paths)}")
            pixels.append(image_to_tensor(load_image(paths[0]), h * s, w * s))
        z = self.image_encoder(torch.stack(pixels).to(self.device))
        cond = self.encode_prompts(prompts)
        cond["image_latents"] = pack_2x2(z.to(self.device, torch.float32))
        return cond

    def _forward(self, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        image = cond.get("image_latents")
        if image is None:
            return super()._forward(x, sigma_B, cond)
        b, _, h, w = x.shape
        text = cond["prompt_embeds"]
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance, device=x.device, dtype=x.dtype)
        tokens = pack_2x2(x)
        ids = image_ids(h, w, x.device, x.dtype)
        image_pos = ids.clone()
        image_pos[:, 0] = 1
        out = self.transformer(
            hidden_states=torch.cat([tokens, image], dim=1), encoder_hidden_states=text,
            pooled_projections=cond["pooled_embeds"], timestep=sigma_B,
            img_ids=torch.cat([ids, image_pos], dim=0),
            txt_ids=torch.zeros(text.shape[1], 3, device=x.device, dtype=x.dtype), guidance=guidance,
            return_dict=False,
        )[0]
        return unpack_2x2(out[:, : tokens.shape[1]], h, w)
