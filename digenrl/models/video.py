"""Video families: Wan2.1 / Wan2.2 (``WanTransformer3DModel``) and HunyuanVideo
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
    """Wan2.1 / Wan2.2 text-to-video adapter.

    Wan2.2 TI2V-5B (``expand_timesteps`` in the pipeline config): the timestep goes in per
    token, ``(B, F * H/2 * W/2)``, as ``WanPipeline`` builds it (its mask is all ones for
    text-to-video, so every token carries ``sigma * 1000``). Wan2.2 A14B (``transformer_2``
    and ``boundary_ratio``): a sample whose timestep ``sigma * num_train_timesteps`` is at
    least ``boundary_ratio * num_train_timesteps`` goes through ``transformer`` (the
    high-noise expert), the others through ``transformer_2``, the pipeline's own rule.
    """

    family = "wan"
    pipeline_class = "WanPipeline"
    expand_timesteps = False
    """per-token timesteps (Wan2.2 TI2V-5B's pipeline config)"""
    boundary_ratio: float | None = None
    """Wan2.2 A14B: where ``transformer_2`` takes over, a fraction of ``num_train_timesteps``"""
    num_train_timesteps = 1000

    def expert_of(self, sigma: float) -> str:
        """Which expert denoises at ``sigma``: "high" (``transformer``) or "low" (``transformer_2``)."""
        if self.transformer_2 is None or self.boundary_ratio is None:
            return "high"
        t = torch.tensor(sigma, dtype=torch.float32) * self.num_train_timesteps
        return "high" if bool(t >= self.boundary_ratio * self.num_train_timesteps) else "low"

    def _forward(self, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        if self.transformer_2 is None or self.boundary_ratio is None:
            return self._expert(self.transformer, x, sigma_B, cond["prompt_embeds"])
        # the pipeline compares its float32 scheduler timestep with the boundary
        high = sigma_B.float() * self.num_train_timesteps >= self.boundary_ratio * self.num_train_timesteps
        if bool(high.all()):
            return self._expert(self.transformer, x, sigma_B, cond["prompt_embeds"])
        if not bool(high.any()):
            return self._expert(self.transformer_2, x, sigma_B, cond["prompt_embeds"])
        out = torch.empty_like(x)
        for mask, expert in ((high, self.transformer), (~high, self.transformer_2)):
            out[mask] = self._expert(expert, x[mask], sigma_B[mask], cond["prompt_embeds"][mask])
        return out

    def _expert(self, transformer: torch.nn.Module, x: torch.Tensor, sigma_B: torch.Tensor,
                text: torch.Tensor) -> torch.Tensor:
        timestep = sigma_B * 1000
        if self.expand_timesteps:  # pipeline_wan.py: (mask[0][0][:, ::2, ::2] * t).flatten(), per sample
            f, h, w = x.shape[2], x.shape[3], x.shape[4]
            tokens = f * len(range(0, h, 2)) * len(range(0, w, 2))
            timestep = timestep[:, None].expand(-1, tokens)
        return transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]


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
