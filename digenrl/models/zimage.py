"""Z-Image (``ZImageTransformer2DModel``, ``ZImagePipeline``: Z-Image and Z-Image-Turbo).

Conventions (``pipeline_z_image.py``, diffusers 0.42.1): latents ``(C, H, W)`` (the VAE's,
unpacked; the transformer patchifies 2x2 itself) go in as a *list* of per-sample ``(C, 1, H, W)``
tensors; the timestep passed is ``(1000 - t) / 1000 = 1 - sigma`` (0 is noise, 1 is data), in
float32 whatever the model's dtype (the pipeline's latents stay float32); text
is a list of per-sample embeddings holding only the prompt's real tokens (Qwen3's second-to-last
hidden state under its attention mask), so here ``prompt_embeds`` rows are cut at
``prompt_mask``. The model predicts the negative velocity: the velocity is ``-output``. Decoding
is FLUX's ``AutoencoderKL`` (``z / scaling_factor + shift_factor``).
"""

from __future__ import annotations

import torch

from digenrl.models.adapter import DiffusersFlowModel
from digenrl.models.base import Cond

#: Tiny Z-Image: latent 12x16x16 (RGB 32x32 unshuffled), 2x2 patches: 64 image tokens.
TINY_ZIMAGE = dict(
    in_channels=12, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
    axes_dims=[4, 6, 6], axes_lens=[256, 64, 64],
)


class ZImageModel(DiffusersFlowModel):
    """Z-Image adapter; see the module docstring for the conventions."""

    family = "zimage"
    pipeline_class = "ZImagePipeline"
    timestep_dtype = torch.float32  # the pipeline keeps latents and timesteps float32 in any dtype

    def _forward(self, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        mask = cond["prompt_mask"].bool().clone()
        # the pipeline's prompts always hold the chat template's tokens; an empty prompt through the
        # hash encoder has none, and keeps one (zero) token so the caption sequence is not empty
        mask[~mask.any(1), 0] = True
        captions = [e[m] for e, m in zip(cond["prompt_embeds"], mask, strict=True)]
        out = self.transformer(list(x.unsqueeze(2).unbind(0)), 1 - sigma_B, captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)
