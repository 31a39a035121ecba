"""Qwen-Image (``QwenImageTransformer2DModel``).

Conventions (``pipeline_qwenimage.py``, diffusers 0.42.1): latents ``(C, H, W)`` packed 2x2 into
tokens of ``4C`` features as FLUX; ``img_shapes = [[(1, H/2, W/2)]] * B``; the timestep passed is
``sigma`` (``t / 1000``); text is ``encoder_hidden_states`` with ``encoder_hidden_states_mask``
(this diffusers version derives the text lengths from the mask; there is no ``txt_seq_lens``).
No pooled vector. The unpacked output is the velocity.
"""

from __future__ import annotations

import torch

from digenrl.models.adapter import DiffusersFlowModel
from digenrl.models.base import Cond
from digenrl.models.packing import pack_2x2, unpack_2x2

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
