"""Shared machinery of the diffusers adapters: LoRA, reference model, weight sync, saving.

A family adapter subclasses :class:`DiffusersFlowModel` and implements only
:meth:`DiffusersFlowModel._forward` (how its transformer wants latents, timesteps and text).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from digenrl.models.base import Cond

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
LORA_WEIGHTS = "digenrl_lora.safetensors"
LORA_META = "digenrl_lora.json"
BASE_WEIGHTS = "diffusion_pytorch_model.safetensors"


class NoAdapterError(ValueError):
    """Asked for the LoRA-disabled reference of a model trained without LoRA."""


class SyncStateError(ValueError):
    """A weight-sync state dict whose keys do not match this model."""


class DiffusersFlowModel:
    """A :class:`~digenrl.models.base.FlowModel` over one diffusers transformer.

    ``encoder`` turns prompts into the common conditioning keys of :mod:`digenrl.models.text`;
    ``decoder`` turns latents ``(B, *latent_shape)`` into uint8 RGB. ``velocity`` returns float32.
    """

    family = ""

    def __init__(self, transformer: torch.nn.Module, *, encoder: Callable[[Sequence[str]], Cond],
                 decoder: Callable[[torch.Tensor], torch.Tensor], latent_shape: tuple[int, ...],
                 lora_rank: int = 0, lora_alpha: float = 0.0, gradient_checkpointing: bool = False) -> None:
        self.transformer = transformer
        self.encoder, self.decoder = encoder, decoder
        self.latent_shape = tuple(latent_shape)
        self.lora_rank = lora_rank
        self._sync_targets: dict[str, torch.Tensor] | None = None  # live tensors, by sync key
        self.lora_alpha = lora_alpha or 2.0 * lora_rank  # Flow-GRPO's default alpha = 2 * rank
        if lora_rank > 0:
            transformer.requires_grad_(False)
            transformer.add_adapter(LoraConfig(r=lora_rank, lora_alpha=self.lora_alpha,
                                               init_lora_weights="gaussian", target_modules=LORA_TARGETS))
            for name, p in transformer.named_parameters():
                p.requires_grad_("lora_" in name)
        if gradient_checkpointing:
            transformer.enable_gradient_checkpointing()

    # -- the FlowModel interface ---------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    def encode_prompts(self, prompts: Sequence[str]) -> Cond:
        """Conditioning for ``prompts`` (batch-first tensors on the model's device)."""
        return {k: v.to(self.device) for k, v in self.encoder(list(prompts)).items()}

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Cond) -> torch.Tensor:
        """Flow velocity at ``(x, sigma)``: the Euler step is ``x + (sigma_next - sigma) * v``.

        ``x`` is ``(B, *latent_shape)``; ``sigma`` a scalar or ``(B,)`` in [0, 1]. Returns float32.
        """
        if tuple(x.shape[1:]) != self.latent_shape:
            raise ValueError(f"{self.family}: expected latents (B, {self.latent_shape}), got {tuple(x.shape)}")
        sigma_B = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(x.shape[0]).contiguous()
        cond = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in cond.items()}
        return self._forward(x.to(self.dtype), sigma_B.to(self.dtype), cond).float()

    def _forward(self, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 RGB ``(B, 3, H, W)``; videos have their frames tiled side by side."""
        return self.decoder(x)

    def trainable_parameters(self) -> Iterator[torch.nn.Parameter]:
        """Parameters the optimizer updates: LoRA weights only, or everything."""
        return (p for p in self.transformer.parameters() if p.requires_grad)

    # -- reference model and weight sync -------------------------------------------------------
    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """Within the block the model is the frozen base (the KL reference). LoRA models only."""
        if self.lora_rank == 0:
            raise NoAdapterError(f"{self.family}: lora_rank=0, so there is no adapter to disable; "
                                 "a full fine-tune needs a separate reference copy")
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

    def sync_state_dict(self) -> dict[str, torch.Tensor]:
        """What a rollout needs to match the trainer: LoRA weights, or all parameters (detached)."""
        if self.lora_rank:
            sd = get_peft_model_state_dict(self.transformer)
        else:
            sd = self.transformer.state_dict()
        return {k: v.detach() for k, v in sd.items()}

    def load_sync_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Apply a :meth:`sync_state_dict` from a peer; raises :class:`SyncStateError` on key
        mismatch (and on a shape mismatch, naming the tensor). A rollout does this every step,
        so the full-weights path copies straight into the live tensors (no state_dict rebuild)."""
        if self.lora_rank:
            expected = set(self.sync_state_dict())
            self._check_sync_keys(set(sd), expected)
            with torch.no_grad():
                set_peft_model_state_dict(self.transformer, sd)
            return
        if self._sync_targets is None:
            self._sync_targets = self.transformer.state_dict(keep_vars=True)
        targets = self._sync_targets
        self._check_sync_keys(set(sd), set(targets))
        for k, dst in targets.items():
            if sd[k].shape != dst.shape:
                raise SyncStateError(f"{self.family}: sync state {k}: shape {tuple(sd[k].shape)}, "
                                     f"expected {tuple(dst.shape)}")
        with torch.no_grad():  # one fused copy over every tensor
            torch._foreach_copy_([t.data for t in targets.values()], [sd[k] for k in targets])

    def _check_sync_keys(self, got: set[str], expected: set[str]) -> None:
        if got != expected:
            missing, extra = sorted(expected - got)[:3], sorted(got - expected)[:3]
            raise SyncStateError(f"{self.family}: sync state dict keys differ: missing {missing}, unexpected {extra}")

    # -- persistence ---------------------------------------------------------------------------
    def save(self, folder: str | Path) -> None:
        """A diffusers transformer folder (config.json + safetensors) that ``build_model`` loads.

        With LoRA the base weights are saved unmerged and the adapter next to them
        (``digenrl_lora.safetensors`` + ``digenrl_lora.json``), reloaded on top of the base.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if not self.lora_rank:
            self.transformer.save_pretrained(folder)
            return
        base = {}
        for k, v in self.transformer.state_dict().items():
            if "lora_" not in k:
                base[k.replace(".base_layer.", ".")] = v.detach().contiguous()
        self.transformer.save_config(folder)
        save_file(base, folder / BASE_WEIGHTS)
        save_file({k: v.contiguous() for k, v in self.sync_state_dict().items()}, folder / LORA_WEIGHTS)
        (folder / LORA_META).write_text(json.dumps({"rank": self.lora_rank, "alpha": self.lora_alpha}))

    def load_saved_adapter(self, folder: str | Path) -> bool:
        """Load ``digenrl_lora.safetensors`` from ``folder`` if present; True when loaded."""
        path = Path(folder) / LORA_WEIGHTS
        if not path.exists():
            return False
        meta = json.loads((Path(folder) / LORA_META).read_text())
        if not self.lora_rank or meta["rank"] != self.lora_rank:
            raise ValueError(f"{folder} holds a LoRA of rank {meta['rank']}, but model.lora_rank={self.lora_rank}")
        self.load_sync_state_dict({k: v.to(self.device) for k, v in load_file(path).items()})
        return True
