"""FLUX.1 (``FluxTransformer2DModel``).

Conventions (``pipeline_flux.py``): latents ``(C, H, W)`` are packed 2x2 into ``H/2 * W/2``
tokens of ``4C`` features; ``img_ids`` are ``(tokens, 3)`` = ``[0, row, col]`` and ``txt_ids`` zeros
``(L, 3)``; the timestep passed is ``t / 1000 = sigma`` (the model scales by 1000 inside); a
guidance-distilled model (``guidance_embeds``) gets ``guidance`` (3.5 by default) per sample; the
output tokens, unpacked, are the velocity. Text: T5 sequence + CLIP pooled vector.
"""

from __future__ import annotations

import torch

from digenrl.models.adapter import DiffusersFlowModel
from digenrl.models.base import Cond
from digenrl.models.packing import pack_2x2, unpack_2x2

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
