"""Shared machinery of the diffusers adapters: LoRA, reference model, weight sync, saving.

A family adapter subclasses :class:`DiffusersFlowModel` and implements only
:meth:`DiffusersFlowModel._forward` (how its transformer wants latents, timesteps and text).

Precision: the transformer's parameters are in the *compute* dtype (``model.dtype``;
bfloat16 on GPUs), LoRA matrices included, exactly as diffusers runs a pipeline loaded with
``torch_dtype=bfloat16``. The float32 master copy of the trained parameters and the
optimizer state live in :class:`~digenrl.rl.policy.Policy`, so a rollout holding only this
model computes bit-identically to the trainer (DESIGN.md's precision trap).

Saved outputs load with diffusers itself (:meth:`DiffusersFlowModel.save`): a full fine-tune
is a transformer folder (``config.json`` + ``diffusion_pytorch_model.safetensors``, what
``save_pretrained`` writes), a LoRA is ``pytorch_lora_weights.safetensors`` in diffusers' own
LoRA format (``transformer.``-prefixed keys, the peft config in its metadata) that the family
pipeline's ``load_lora_weights`` reads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from digenrl.config import ConfigError
from digenrl.models.base import Cond, DiffusersTransformer

#: flow_grpo's LoRA targets (train_sd3.py / train_flux.py): image and text attention projections.
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
LORA_FILE = "pytorch_lora_weights.safetensors"
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
    pipeline_class = ""
    """the diffusers pipeline this transformer belongs to (its LoRA loader reads our LoRA files)"""
    guidance = 0.0
    """embedded guidance for guidance-distilled transformers (set from sampler.embedded_guidance)"""
    timestep_dtype: torch.dtype | None = None
    """the dtype the pipeline passes timesteps in; None: the compute dtype"""

    def __init__(self, transformer: DiffusersTransformer, *, encoder: Callable[[Sequence[str]], Cond],
                 decoder: Callable[[torch.Tensor], torch.Tensor], latent_shape: tuple[int, ...],
                 lora_rank: int = 0, lora_alpha: float = 0.0, lora_targets: Sequence[str] = LORA_TARGETS,
                 gradient_checkpointing: bool = False, dtype: torch.dtype | None = None) -> None:
        self.transformer = transformer
        self.encoder, self.decoder = encoder, decoder
        self.latent_shape = tuple(latent_shape)
        self.lora_rank = lora_rank
        #: the compute dtype: every input is cast to it (FSDP's sharded masters may be float32)
        self.compute_dtype = dtype or next(transformer.parameters()).dtype
        self._sync_targets: dict[str, torch.Tensor] | None = None  # live tensors, by sync key
        self.lora_alpha = lora_alpha or 2.0 * lora_rank  # Flow-GRPO's default alpha = 2 * rank
        if lora_rank > 0:
            # peft here, not at the top: a node without a diffusers model (an emulated one)
            # imports this module too, and peft brings transformers (~2 s a process)
            from peft import LoraConfig

            transformer.requires_grad_(False)
            try:
                # peft annotates lora_alpha as int but scales by lora_alpha / r, a float
                transformer.add_adapter(LoraConfig(r=lora_rank, lora_alpha=self.lora_alpha,  # type: ignore[arg-type]
                                                   init_lora_weights="gaussian", target_modules=list(lora_targets)))
            except ValueError as e:  # peft: no module matched
                raise ConfigError(f"model.lora_targets = {list(lora_targets)}: no module of this "
                                  f"{type(transformer).__name__} matches ({str(e).splitlines()[0]})") from None
            for name, p in transformer.named_parameters():
                p.requires_grad_("lora_" in name)
                if "lora_" in name and p.dtype != self.compute_dtype:
                    p.data = p.data.to(self.compute_dtype)  # peft makes them float32
        if gradient_checkpointing:
            transformer.enable_gradient_checkpointing()

    # -- the FlowModel interface ---------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (inputs are cast to it; velocities come back float32)."""
        return self.compute_dtype

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
        return self._forward(x.to(self.dtype), sigma_B.to(self.timestep_dtype or self.dtype), cond).float()

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

    def parts(self) -> dict[str, torch.nn.Module]:
        """Sync-key prefix -> transformer module, for each one this model trains, syncs and
        saves: the transformer (no prefix), or the trained experts of a two-expert model
        (``transformer.``, ``transformer_2.``: :class:`~digenrl.models.video.WanExperts`)."""
        parts = getattr(self.transformer, "trained_parts", None)
        return dict(parts) if parts is not None else {"": self.transformer}

    def sync_state_dict(self) -> dict[str, torch.Tensor]:
        """What a rollout needs to match the trainer: LoRA weights, or all parameters (detached),
        of every trained part (an expert that is not trained is never sent)."""
        sd: dict[str, torch.Tensor] = {}
        for prefix, module in self.parts().items():
            if self.lora_rank:
                from peft.utils import get_peft_model_state_dict

                part = get_peft_model_state_dict(module)
            else:
                part = module.state_dict()
            sd.update({prefix + k: v.detach() for k, v in part.items()})
        return sd

    def load_sync_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Apply a :meth:`sync_state_dict` from a peer; raises :class:`SyncStateError` on key
        mismatch (and on a shape mismatch, naming the tensor). A rollout does this every step,
        so the full-weights path copies straight into the live tensors (no state_dict rebuild)."""
        parts = self._parts_in(sd)
        if self.lora_rank:
            expected = {k for k in self.sync_state_dict() if any(k.startswith(p) for p in parts)}
            self._check_sync_keys(set(sd), expected)
            from peft.utils import set_peft_model_state_dict

            with torch.no_grad():
                for prefix, module in parts.items():
                    set_peft_model_state_dict(module, _strip(sd, prefix))
            return
        if self._sync_targets is None:
            self._sync_targets = {prefix + k: t for prefix, module in self.parts().items()
                                  for k, t in module.state_dict(keep_vars=True).items()}
        targets = {k: t for k, t in self._sync_targets.items() if any(k.startswith(p) for p in parts)}
        self._check_sync_keys(set(sd), set(targets))
        for k, dst in targets.items():
            if sd[k].shape != dst.shape:
                raise SyncStateError(f"{self.family}: sync state {k}: shape {tuple(sd[k].shape)}, "
                                     f"expected {tuple(dst.shape)}")
        with torch.no_grad():
            if all(sd[k].device == t.device for k, t in targets.items()):  # one fused copy
                torch._foreach_copy_([t.data for t in targets.values()], [sd[k] for k in targets])
            else:  # host tensors off the wire into device weights: one upload each
                for k, t in targets.items():
                    t.data.copy_(sd[k])

    def _parts_in(self, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.nn.Module]:
        """The parts ``sd`` updates: every part, or, for a two-expert model, the experts it has
        keys of (a version carries only the experts its step changed and the receiver lacks: one
        no step trains keeps the folder's weights; each expert it does carry must be whole)."""
        parts = self.parts()
        if "" in parts or not sd:
            return parts
        return {p: m for p, m in parts.items() if any(k.startswith(p) for k in sd)} or parts

    def _check_sync_keys(self, got: set[str], expected: set[str]) -> None:
        if got != expected:
            missing, extra = sorted(expected - got)[:3], sorted(got - expected)[:3]
            raise SyncStateError(f"{self.family}: sync state dict keys differ: missing {missing}, unexpected {extra}")

    # -- persistence ---------------------------------------------------------------------------
    def save(self, folder: str | Path, state: Mapping[str, torch.Tensor] | None = None, *,
             dtype: torch.dtype | None = None, same_as: str | Path | None = None) -> Path:
        """Write what diffusers loads; returns the weights file.

        Full fine-tune: ``config.json`` + ``diffusion_pytorch_model.safetensors`` (load with
        ``<Transformer>.from_pretrained(folder)``). LoRA: ``pytorch_lora_weights.safetensors``
        (load with ``<Pipeline>.load_lora_weights(folder)``). ``state`` is a
        :meth:`sync_state_dict` to write instead of this model's own tensors (the float32
        masters, or a sharded model's gathered weights); ``dtype`` casts floating tensors
        (default: as they are). ``same_as``: a safetensors file already holding exactly
        ``state`` (a full fine-tune's sync keys are the transformer's own), hard-linked
        instead of written again.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        sd = dict(self.sync_state_dict() if state is None else state)
        sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().to("cpu").contiguous()
              for k, v in sd.items()}
        parts = self.parts()
        if len(parts) > 1 or "" not in parts:  # a two-expert model: each trained expert in its place
            subfolder = getattr(self.transformer, "SUBFOLDER", {})
            # every trained expert ``sd`` holds, also one gathered from another trainer rank
            saved = getattr(self.transformer, "saved_parts", parts)
            written = [self._save_part(module, folder / subfolder[prefix.rstrip(".")], _strip(sd, prefix))
                       for prefix, module in saved.items() if any(k.startswith(prefix) for k in sd)]
            return written[0]
        return self._save_part(self.transformer, folder, sd, same_as=same_as if dtype is None else None)

    def _save_part(self, module: torch.nn.Module, folder: Path, sd: dict[str, torch.Tensor], *,
                   same_as: str | Path | None = None) -> Path:
        """One transformer's weights or LoRA in ``folder`` (see :meth:`save`)."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        if not self.lora_rank:
            module.save_config(folder)  # type: ignore[operator]
            target = folder / BASE_WEIGHTS
            if same_as is not None:
                try:
                    os.link(same_as, target)
                    return target
                except OSError:  # another file system: write it
                    pass
            save_file(sd, str(target), metadata={"format": "pt"})
            return target
        import diffusers

        pipeline = getattr(diffusers, self.pipeline_class)
        pipeline.save_lora_weights(folder, transformer_lora_layers=sd, weight_name=LORA_FILE,
                                   transformer_lora_adapter_metadata=self.lora_config())
        return folder / LORA_FILE

    def lora_config(self) -> dict:
        """The peft LoraConfig of the adapter as a dict (what diffusers stores with a LoRA)."""
        cfg = self.transformer.peft_config["default"].to_dict()
        return {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.items()}


def _strip(sd: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of ``sd`` under ``prefix``, without it (all of them for ``""``)."""
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
