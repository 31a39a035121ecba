"""FLUX.2 (``Flux2Transformer2DModel``): FLUX.2-dev (``Flux2Pipeline``) and FLUX.2-klein
(``Flux2KleinPipeline``).

Conventions (``pipeline_flux2.py``, ``pipeline_flux2_klein.py``, diffusers 0.42.1): the VAE's
latents are patchified 2x2 *before* noise is drawn, so the sampled latent is already
``(4C, H/2s, W/2s)`` (``in_channels`` = 128 channels at 1/16 of the pixels) and packing is a
plain flatten into ``h * w`` tokens. Position ids are 4-D ``(t, h, w, l)``: image tokens
``(0, row, col, 0)``, text tokens ``(0, 0, 0, index)``. The timestep passed is ``t / 1000 =
sigma``; FLUX.2-dev embeds guidance (``guidance``, 4.0 by default), klein does not (a klein
base model does true CFG, which the sampler's ``guidance_scale`` does). Text: the stacked hidden
states of three layers of Mistral Small 3.1 (dev) or Qwen3 (klein), no mask, no pooled vector.
The output tokens, unflattened, are the velocity. Decoding undoes the VAE's batch-norm
statistics on the patchified latent, then the 2x2 patchify (:class:`~digenrl.models.pixels.VaeDecoder`).
"""

from __future__ import annotations

import torch

from digenrl.models.adapter import DiffusersFlowModel
from digenrl.models.base import Cond

#: Tiny FLUX.2: latent 12x16x16 (RGB 32x32 unshuffled), 256 tokens of 12 features.
TINY_FLUX2 = dict(
    patch_size=1, in_channels=12, num_layers=1, num_single_layers=1, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
)


def image_ids(b: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    """(b, h * w, 4) position ids ``(0, row, col, 0)`` of the flattened latent (the pipeline's
    ``_prepare_latent_ids``)."""
    ids = torch.zeros(h, w, 4, dtype=torch.long, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.reshape(1, h * w, 4).expand(b, -1, -1)


def text_ids(b: int, length: int, device: torch.device) -> torch.Tensor:
    """(b, length, 4) position ids ``(0, 0, 0, index)`` (the pipeline's ``_prepare_text_ids``)."""
    ids = torch.zeros(length, 4, dtype=torch.long, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids.reshape(1, length, 4).expand(b, -1, -1)


class Flux2Model(DiffusersFlowModel):
    """FLUX.2 adapter; ``guidance`` is the embedded guidance of a guidance-distilled transformer."""

    family = "flux2"
    pipeline_class = "Flux2Pipeline"  # klein's pipeline shares its LoRA loader (Flux2LoraLoaderMixin)
    guidance = 4.0

    def _forward(self, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        b, c, h, w = x.shape
        text = cond["prompt_embeds"]
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance, device=x.device, dtype=torch.float32)
        out = self.transformer(
            hidden_states=x.reshape(b, c, h * w).transpose(1, 2), encoder_hidden_states=text, timestep=sigma_B,
            img_ids=image_ids(b, h, w, x.device), txt_ids=text_ids(b, text.shape[1], x.device), guidance=guidance,
            return_dict=False,
        )[0]
        return out.transpose(1, 2).reshape(b, c, h, w)
