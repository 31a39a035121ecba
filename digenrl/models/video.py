"""Video families: Wan2.1 and Wan2.2 (``WanTransformer3DModel``; A14B's two experts,
:class:`WanExperts`) and HunyuanVideo (``HunyuanVideoTransformer3DModel``). Latents are
``(C, F, H, W)``.

Wan (``pipeline_wan.py``): timestep ``sigma * 1000``, text ``encoder_hidden_states`` (umT5,
zero-padded, no mask, no pooled vector); output is the velocity.

HunyuanVideo (``pipeline_hunyuan_video.py``): timestep ``sigma * 1000``, text
``encoder_hidden_states`` + ``encoder_attention_mask`` (Llama) and ``pooled_projections`` (CLIP),
``guidance = guidance_scale * 1000`` (6.0 by default) for the guidance-distilled model.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from digenrl.models.adapter import DiffusersFlowModel
from digenrl.models.base import Cond

EXPERTS = ("transformer", "transformer_2")
"""Wan2.2 A14B's two experts, high-noise first: the order of their parameters in every policy."""

TRAINED_EXPERTS = {"both": EXPERTS, "high": ("transformer",), "low": ("transformer_2",)}
"""``model.train_experts`` -> the experts it names."""

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
    """Wan text-to-video adapter: Wan2.1, and Wan2.2 A14B's two experts (``transformer`` a
    :class:`WanExperts`)."""

    family = "wan"
    pipeline_class = "WanPipeline"
    expand_timesteps = False
    """Wan2.2 TI2V-5B (the folder's ``expand_timesteps``): the timestep goes to the transformer
    per token, ``(B, tokens)``, as WanPipeline passes it (every token at the step's timestep
    when no image is given)"""

    def expert_of(self, sigma: float) -> str | None:
        """The expert that denoises at ``sigma`` (two-expert folders), else None."""
        if isinstance(self.transformer, WanExperts):
            return self.transformer.expert_of(float(sigma) * 1000)
        return None

    def _forward(self, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        t = sigma_B * 1000
        if self.expand_timesteps:
            p_t, p_h, p_w = self.transformer.config.patch_size
            f, h, w = x.shape[-3:]
            t = t[:, None].expand(x.shape[0], (f // p_t) * (h // p_h) * (w // p_w))
        return self.transformer(hidden_states=x, timestep=t,
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


class WanExperts(torch.nn.Module):
    """Wan2.2 A14B's two experts as one module: ``transformer`` denoises the high-noise steps
    and ``transformer_2`` the low-noise ones, switching where ``WanPipeline`` does: a row whose
    timestep (``sigma * 1000``) is at least ``boundary_ratio * 1000`` goes to ``transformer``.

    ``trained`` names the experts this run trains (``model.train_experts``): only they get a
    LoRA (or have trainable weights), only their weights are synced to rollouts and saved.
    Their parameters are named ``transformer.*`` and ``transformer_2.*``, as the pipeline's
    components are, so optimizers, checkpoints and EMAs see one module.

    An expert may be *absent* (``None``): a trainer rank whose timesteps never reach it
    (rl/experts.py) does not load it. ``absent`` keeps its module built on the meta device
    (no storage; not a submodule, so no parameter of it is seen), whose config saves a
    gathered full fine-tune of it; a row routed to an absent expert is an error.
    """

    SUBFOLDER: ClassVar[dict[str, str]] = {"transformer": "", "transformer_2": "transformer_2"}
    """Where each expert's weights go in a saved folder (final/): the high-noise expert at the
    root, as a one-expert model's, the low-noise one in ``transformer_2/`` (diffusers' LoRA
    loader: ``load_lora_weights(final/transformer_2, load_into_transformer_2=True)``)."""

    def __init__(self, transformer: torch.nn.Module | None, transformer_2: torch.nn.Module | None,
                 boundary_ratio: float, trained: tuple[str, ...] = ("transformer", "transformer_2"),
                 absent: dict[str, torch.nn.Module] | None = None, lora_seed: int | None = None) -> None:
        super().__init__()
        if not 0.0 < boundary_ratio < 1.0:
            raise ValueError(f"boundary_ratio = {boundary_ratio}: expected a value in (0, 1)")
        self.transformer: Any = transformer
        self.transformer_2: Any = transformer_2
        self.absent: dict[str, Any] = dict(absent or {})
        if not self.experts():
            raise ValueError("WanExperts: neither expert is held")
        missing = [n for n in ("transformer", "transformer_2") if getattr(self, n) is None and n not in self.absent]
        if missing:
            raise ValueError(f"WanExperts: {missing[0]} is neither held nor given as absent (meta)")
        self.boundary = float(boundary_ratio) * 1000.0
        self.trained = tuple(trained)
        """The experts the run trains (held here or not; see :attr:`trained_parts`)."""
        self.lora_seed = lora_seed
        """Expert ``i``'s LoRA is initialised from seed ``lora_seed + i`` (None: drawn at
        :meth:`add_adapter` from the current generator)."""

    @property
    def config(self) -> Any:
        return next(iter(self.experts().values())).config

    def experts(self) -> dict[str, Any]:
        """The experts held here (loaded), by name."""
        return {n: m for n, m in (("transformer", self.transformer), ("transformer_2", self.transformer_2))
                if m is not None}

    @property
    def held(self) -> tuple[str, ...]:
        return tuple(self.experts())

    @property
    def trained_parts(self) -> dict[str, Any]:
        """Sync-key prefix -> expert, for the trained experts held here (models/adapter.py)."""
        return {f"{name}.": m for name, m in self.experts().items() if name in self.trained}

    @property
    def saved_parts(self) -> dict[str, Any]:
        """Sync-key prefix -> expert (its meta module if absent), for every trained expert: what
        a saved folder holds when the state given to it has that expert's weights."""
        every = {**self.absent, **self.experts()}
        return {f"{name}.": every[name] for name in ("transformer", "transformer_2") if name in self.trained}

    def expert_of(self, timestep: float) -> str:
        """Which expert denoises at ``timestep`` (``sigma * 1000``)."""
        return "transformer" if timestep >= self.boundary else "transformer_2"

    def _expert(self, name: str) -> Any:
        m = getattr(self, name)
        if m is None:
            raise RuntimeError(f"a timestep routed to {name}, which this process does not hold (held: "
                               f"{list(self.held)}); the trainer ranks' expert placement (rl/experts.py) "
                               "gives it no such timestep")
        return m

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, **kw: Any) -> tuple[torch.Tensor]:
        high = timestep.reshape(timestep.shape[0], -1)[:, 0] >= self.boundary
        if bool(high.all()) or not bool(high.any()):  # one expert for the whole batch
            expert = self._expert("transformer" if bool(high.all()) else "transformer_2")
            return expert(hidden_states=hidden_states, timestep=timestep, **kw)
        out = torch.empty_like(hidden_states)
        pairs = ((high, self._expert("transformer")), (~high, self._expert("transformer_2")))
        for rows, expert in pairs:
            sub = {k: v[rows] if torch.is_tensor(v) and v.shape[:1] == rows.shape else v for k, v in kw.items()}
            out[rows] = expert(hidden_states=hidden_states[rows], timestep=timestep[rows], **sub)[0]
        return (out,)

    # the part of diffusers' ModelMixin / PeftAdapterMixin the adapter uses, over the experts
    def add_adapter(self, config: Any) -> None:
        # each expert's LoRA from its own seed: the same initial LoRA whichever experts this
        # process holds (a trainer rank may hold one) and whatever loading them drew
        base = self.lora_seed if self.lora_seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        for i, name in enumerate(EXPERTS):
            m = getattr(self, name)
            if m is not None and name in self.trained:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(base + i)
                    m.add_adapter(config)

    def disable_adapters(self) -> None:
        for m in self.trained_parts.values():
            m.disable_adapters()

    def enable_adapters(self) -> None:
        for m in self.trained_parts.values():
            m.enable_adapters()

    @property
    def peft_config(self) -> Any:
        return next(iter(self.trained_parts.values())).peft_config

    def enable_gradient_checkpointing(self) -> None:
        for m in self.experts().values():
            m.enable_gradient_checkpointing()
