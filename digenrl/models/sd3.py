"""Stable Diffusion 3 (``SD3Transformer2DModel``).

Conventions (``pipeline_stable_diffusion_3.py``): latents ``(C, H, W)`` go in unpacked, the
timestep is ``sigma * 1000``, and the output is the flow velocity itself. Text: a sequence
``encoder_hidden_states (B, L, joint_attention_dim)`` and ``pooled_projections (B, pooled_dim)``;
SD3 attends to padding too (no mask), as the pipeline does with padded T5 tokens.
"""

from __future__ import annotations

import torch

from digenrl.models.adapter import DiffusersFlowModel
from digenrl.models.base import Cond

#: The default tiny SD3: RGB 32x32 pixel-unshuffled by r=2 -> latent 12x16x16, 64 image tokens.
TINY_SD3 = dict(
    sample_size=16, patch_size=2, in_channels=12, out_channels=12, num_layers=4,
    attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
    caption_projection_dim=64, pooled_projection_dim=32, pos_embed_max_size=16,
)


class SD3Model(DiffusersFlowModel):
    """SD3 adapter; see the module docstring for the conventions."""

    family = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"

    def _forward(self, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        return self.transformer(
            hidden_states=x, encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_embeds"], timestep=sigma_B * 1000, return_dict=False,
        )[0]
