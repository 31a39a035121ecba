"""The per-family table: diffusers class, adapter, tiny config, latent shape, text dims, VAE class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import diffusers

from digenrl.models import sd3
from digenrl.models.adapter import DiffusersFlowModel


@dataclass(frozen=True)
class FamilySpec:
    cls: type
    adapter: type[DiffusersFlowModel]
    latent_shape: Callable[[object, bool], tuple[int, ...]]
    """(transformer config, loaded from a pipeline folder) -> per-sample latent shape."""
    text_dims: Callable[[object], tuple[int, int]]
    """transformer config -> (prompt token dim, pooled dim) for the hash encoder."""
    vae_class: str
    max_tokens: int = 16


SPECS: dict[str, FamilySpec] = {
    "sd3": FamilySpec(diffusers.SD3Transformer2DModel, sd3.SD3Model,
                      lambda cfg, real: sd3.sd3_latent_shape(cfg), sd3.sd3_text_dims, "AutoencoderKL"),
}

#: Constructor kwargs of each family's tiny random model (the real diffusers class).
TINY_CONFIGS: dict[str, dict] = {
    "sd3": sd3.TINY_SD3,
}
