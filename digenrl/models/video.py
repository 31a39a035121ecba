"""Video families: Wan2.1 (``WanTransformer3DModel``) and HunyuanVideo
(``HunyuanVideoTransformer3DModel``). Latents are ``(C, F, H, W)``.

Wan (``pipeline_wan.py``): timestep ``sigma * 1000``, text ``encoder_hidden_states`` (umT5,
zero-padded, no mask, no pooled vector); output is the velocity.

HunyuanVideo (``pipeline_hunyuan_video.py``): timestep ``sigma * 1000``, text
``encoder_hidden_states`` + ``encoder_attention_mask`` (Llama) and ``pooled_projections`` (CLIP),
``guidance = guidance_scale * 1000`` (6.0 by default) for the guidance-distilled model.
"""

from __future__ import annotations

import torch

from digenrl.models.adapter import DiffusersFlowModel
from digenrl.models.base import Cond

#: Tiny Wan: latent 12x2x8x8 (two RGB 16x16 frames unshuffled), 32 tokens.
TINY_WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=12, out_channels=12,
    text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1, rope_max_seq_len=32,
)

#: Tiny HunyuanVideo: latent 12x2x8x8, 32 tokens.
TINY_HUNYUANVIDEO = dict(
    in_channels=12, out_channels=12, num_attention_heads=2, attention_head_dim=16, num_layers=1,
    num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
    text_embed_dim=32, pooled_projection_dim=32, rope_axes_dim=(4, 6, 6),
)


class WanModel(DiffusersFlowModel):
    """Wan2.1 text-to-video adapter."""

    family = "wan"
    pipeline_class = "WanPipeline"

    def _forward(self, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        return self.transformer(hidden_states=x, timestep=sigma_B * 1000,
                                encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]


class HunyuanVideoModel(DiffusersFlowModel):
    """HunyuanVideo adapter; ``guidance`` is the distilled guidance scale."""

    family = "hunyuanvideo"
    pipeline_class = "HunyuanVideoPipeline"
    guidance = 6.0

    def _forward(self, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        mask = cond["prompt_mask"].clone()
        # The token refiner averages over masked tokens; an empty prompt keeps one (zero) token so
        # that average is defined rather than 0/0.
        mask[:, 0] = 1
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((x.shape[0],), self.guidance * 1000, device=x.device, dtype=x.dtype)
        return self.transformer(
            hidden_states=x, timestep=sigma_B * 1000, encoder_hidden_states=cond["prompt_embeds"],
            encoder_attention_mask=mask, pooled_projections=cond["pooled_embeds"], guidance=guidance,
            return_dict=False,
        )[0]
