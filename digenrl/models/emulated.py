"""Emulated accelerators: a model whose work takes the cost model's seconds without using the CPU.

``model.path = "emulated"`` (with the recipe's real ``model.family``) builds an
:class:`EmulatedModel` instead of loading weights. Everything around it is the production
code path: the sampler, the SDE log-probs, GRPO, the learner, FSDP, the optimizer, weight
sync, the scheduler, the actors and the transport never learn that no GPU is there. What is
emulated, per call, for the node's declared GPU type (``gpu``) and the same constants the
planner uses (:mod:`digenrl.core.costmodel`):

============================  ===========================================================
``velocity`` (no grad)        rows x ``forward_s``: a rollout's inference engine, or eager
                              generation inside a trainer process (TAG, colocated)
``velocity`` (with grad)      rows x ``forward_s(train)``; its backward rows x that x
                              ``backward_factor`` (activation checkpointing: 3, else 2)
KL reference forward          rows x ``forward_s(train)`` (adapter disabled, or a frozen copy)
``decode``                    rows x ``reward_s`` (decode + reward model of one sample)
``optimizer.step``            ``optimizer_s`` over this rank's shard + ``step_sync_s`` (the
                              step's gradient all-reduce), as the simulator charges them
============================  ===========================================================

The time is a sleep (``time.sleep`` releases the GIL: no CPU is used, so 32 emulated GPUs fit
on 2 cores), multiplied by ``model.emulate.time_scale``; a late wake-up is repaid by the next
wait, so the scheduler's latency on a loaded host does not accumulate.

Tensors have the recipe's true shapes: latents ``ModelSpec.latent_shape`` (e.g. FLUX 720 px:
16 x 90 x 90), the weight set the trainable bytes (full model or LoRA adapter, in
``model.dtype``), each optionally shrunk by ``model.emulate.latent_scale`` /
``weight_scale`` so that a 32-node cluster fits in 24 GiB. The frozen base of a LoRA model is
never trained or sent, so it is not allocated. The weights sit in one FSDP unit (the root):
a real model's per-block all-gathers overlap its compute, an emulated one's would only add
gloo round trips on loopback. The velocity is ``x (1 + s / 100) + c / 10`` with ``s`` a
function of the first elements of every weight tensor (so training moves the weights and
the next version differs) and ``c`` the prompt's hash embedding; the decoded image is an
8 x 8 average of the latent's first channels, so rewards are a cheap deterministic function
of the latents. The text encoder's conditioning is a 4-float hash per prompt, not the
recipe's T5 sequence (which would be on the rollout's own GPU anyway).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from digenrl.config import ModelConfig
from digenrl.core import costmodel as cm
from digenrl.models.base import Cond
from digenrl.models.pixels import to_uint8

PART_NUMEL_BYTES = 4 << 20
"""Weight tensors are at most this size, so a weight set splits into many parts on the wire."""
IMAGE_SIDE = 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EmulationError(ValueError):
    """An emulation that cannot be priced (a family or GPU without cost-model figures)."""


def _spec(model_cfg: ModelConfig) -> cm.ModelSpec:
    spec = cm.MODELS.get(model_cfg.family)
    if spec is None or spec.fwd_tflop <= 0 or not spec.latent_shape:
        priced = [m.name for m in cm.MODELS.values() if m.fwd_tflop > 0]
        raise EmulationError(f"model.family = {model_cfg.family!r} with model.path = 'emulated': the "
                             f"cost model prices only {', '.join(priced)} on accelerators")
    return spec


def latent_shape(model_cfg: ModelConfig) -> tuple[int, ...]:
    """The recipe's latent shape (cost model), spatial sides x sqrt(``latent_scale``)."""
    shape = _spec(model_cfg).latent_shape
    f = math.sqrt(model_cfg.emulate.latent_scale)
    return (*shape[:-2], *(max(1, round(n * f)) for n in shape[-2:]))


def weight_numel(model_cfg: ModelConfig) -> int:
    """Elements of the weight set: trainable bf16 bytes (full or LoRA) x ``weight_scale``, in
    elements of ``model.dtype`` (at least one)."""
    nbytes = cm.trainable_bytes(_spec(model_cfg), model_cfg.lora_rank) * model_cfg.emulate.weight_scale
    return max(1, int(nbytes // torch.tensor([], dtype=DTYPES[model_cfg.dtype]).element_size()))


class EmulatedClock:
    """Sleeps emulated seconds x ``scale``; an overshoot (late wake-up) is repaid by the next wait."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.debt = 0.0
        self.emulated_s = 0.0  # total emulated seconds waited (undilated), for tests and benches
        self._lock = threading.Lock()

    def wait(self, seconds: float) -> None:
        if seconds <= 0:
            return
        with self._lock:
            self.emulated_s += seconds
            want = seconds * self.scale
            sleep_for = max(0.0, want - self.debt)
            self.debt = max(0.0, self.debt - want)
        if sleep_for > 0:
            t0 = time.perf_counter()
            time.sleep(sleep_for)  # releases the GIL: an emulated GPU uses no CPU
            with self._lock:
                self.debt += time.perf_counter() - t0 - sleep_for


class _Timed(torch.autograd.Function):
    """Identity on a scalar whose forward and backward each take emulated seconds."""

    @staticmethod
    def forward(ctx: Any, s: torch.Tensor, clock: EmulatedClock, fwd_s: float, bwd_s: float) -> torch.Tensor:
        clock.wait(fwd_s)
        ctx.clock, ctx.bwd_s = clock, bwd_s
        return s.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.clock.wait(ctx.bwd_s)
        return grad, None, None, None


class EmulatedTransformer(torch.nn.Module):
    """The weight set as tensors of at most 4 MiB in one module (one FSDP unit)."""

    def __init__(self, numel: int, dtype: torch.dtype, *, lora: bool, seed: int) -> None:
        super().__init__()
        per = max(1, PART_NUMEL_BYTES // torch.tensor([], dtype=dtype).element_size())
        sizes = [per] * (numel // per) + ([numel % per] if numel % per else [])
        gen = torch.Generator().manual_seed(seed)
        params = [torch.nn.Parameter((torch.randn(n, generator=gen) * 0.02).to(dtype)) for n in sizes]
        # "lora_" in the names: what a sharded load of an adapter looks for (rl/policy.py)
        self.lora_weights = torch.nn.ParameterList(params) if lora else None
        self.weights = None if lora else torch.nn.ParameterList(params)

    def tensors(self) -> torch.nn.ParameterList:
        out = self.lora_weights if self.lora_weights is not None else self.weights
        assert out is not None
        return out

    def forward(self, clock: EmulatedClock, fwd_s: float, bwd_s: float, use_weights: bool) -> torch.Tensor:
        """A scalar from the weights (zero when they are off: the KL reference of an adapter)."""
        s = torch.zeros((), dtype=torch.float32)
        if use_weights:
            for w in self.tensors():
                s = s + torch.tanh(w[:4].float().sum())
        return _Timed.apply(s, clock, fwd_s, bwd_s)


_LIVE: weakref.WeakSet[EmulatedModel] = weakref.WeakSet()
_HOOK_LOCK = threading.Lock()
_hooked = False


def _local_numel(params: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    """Elements a rank holds (a DTensor shard's local part)."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global post-step hook: an emulated trainer model's optimizer step takes its emulated time.

    The optimizer updates the model's own (sharded) parameters or float32 masters of them
    (:class:`~digenrl.rl.policy.Policy`), so it is matched by identity, else by its size."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        return
    trainers = [m for m in list(_LIVE) if m.in_trainer]
    for model in trainers:
        if any(params[0] is p for p in model.transformer.parameters()):
            model.optimizer_wait()
            return
    numel = _local_numel(params)
    for model in trainers:
        if _local_numel(list(model.trainable_parameters())) == numel:
            model.optimizer_wait()
            return


def _install_hook() -> None:
    global _hooked
    with _HOOK_LOCK:
        if not _hooked:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            register_optimizer_step_post_hook(_after_optimizer_step)
            _hooked = True


class EmulatedModel:
    """A :class:`~digenrl.models.base.FlowModel` on an emulated ``gpu`` (see the module doc)."""

    def __init__(self, model_cfg: ModelConfig, *, gpu: str, in_trainer: bool, seed: int = 0) -> None:
        spec = _spec(model_cfg)
        if gpu not in cm.GPUS or gpu == "cpu":
            accel = [g for g in cm.GPUS if g != "cpu"]
            raise EmulationError(f"model.path = 'emulated' on gpu {gpu!r}: declare an accelerator "
                                 f"type the cost model knows ({', '.join(accel)}) with --gpu or "
                                 "cluster.gpu / rollout_gpu / trainer_gpu")
        self.cfg = model_cfg
        self.family = spec.name
        self.gpu = gpu
        self.in_trainer = in_trainer
        self.latent_shape = latent_shape(model_cfg)
        self.lora_rank = model_cfg.lora_rank
        self.clock = EmulatedClock(model_cfg.emulate.time_scale)
        self.transformer = EmulatedTransformer(weight_numel(model_cfg), DTYPES[model_cfg.dtype],
                                               lora=model_cfg.lora_rank > 0, seed=seed)
        self._adapter_off = False
        self._fwd = {w: cm.forward_s(gpu, spec.name, w) for w in cm.WHERE}
        self._reward_s = cm.reward_s(gpu, spec.name)
        _LIVE.add(self)
        _install_hook()

    # -- the FlowModel interface ---------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    def encode_prompts(self, prompts: Sequence[str]) -> Cond:
        """A 4-float embedding per prompt from its CRC-32 (deterministic, batch-first)."""
        rows = [torch.randn(4, generator=torch.Generator().manual_seed(zlib.crc32(p.encode())))
                for p in prompts]
        return {"prompt_embeds": torch.stack(rows) if rows else torch.zeros(0, 4)}

    def _training(self) -> bool:
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.transformer.parameters())

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Cond) -> torch.Tensor:
        if tuple(x.shape[1:]) != self.latent_shape:
            raise ValueError(f"emulated {self.family}: expected latents (B, {self.latent_shape}), "
                             f"got {tuple(x.shape)}")
        rows = x.shape[0]
        training = self._training()
        frozen = not any(p.requires_grad for p in self.transformer.parameters())
        if training or self._adapter_off or frozen:  # a training pass or its KL reference
            where = "train"
        else:
            where = "trainer_gen" if self.in_trainer else "rollout"
        fwd = rows * self._fwd[where]
        bwd = rows * self._fwd["train"] * cm.backward_factor(self.cfg.gradient_checkpointing) if training else 0.0
        s = self.transformer(self.clock, fwd, bwd, not self._adapter_off)
        c = cond["prompt_embeds"].float().mean(dim=1).to(x.device)
        c = c.reshape(rows, *([1] * (x.dim() - 1)))
        return x.float() * (1.0 + s / 100.0) + c / 10.0

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 (B, 3, 8, 8): an average of the first channels (frame 0 of a video)."""
        self.clock.wait(x.shape[0] * self._reward_s)
        img = x[:, :3] if x.dim() == 4 else x[:, :3, 0]
        if img.shape[1] < 3:
            img = img.repeat(1, 3, 1, 1)[:, :3]
        img = torch.nn.functional.adaptive_avg_pool2d(img.float(), IMAGE_SIDE)
        return to_uint8(torch.tanh(img))

    def trainable_parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for p in self.transformer.parameters() if p.requires_grad)

    # -- reference model and weight sync -------------------------------------------------------
    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """The KL reference of an adapter: the base model (emulated: the weights' term is off)."""
        if not self.lora_rank:
            raise ValueError(f"emulated {self.family}: lora_rank = 0, so there is no adapter to disable")
        self._adapter_off = True
        try:
            yield
        finally:
            self._adapter_off = False

    def sync_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable tensors (the adapter of a LoRA run): what a rollout fetches."""
        return {k: v.detach() for k, v in self.transformer.state_dict().items()}

    def load_sync_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        own = self.transformer.state_dict(keep_vars=True)
        if set(sd) != set(own):
            raise ValueError(f"emulated {self.family}: sync state keys differ: missing "
                             f"{sorted(set(own) - set(sd))[:3]}, unexpected {sorted(set(sd) - set(own))[:3]}")
        for k, dst in own.items():
            if sd[k].shape != dst.shape:
                raise ValueError(f"emulated {self.family}: sync state {k}: shape {tuple(sd[k].shape)}, "
                                 f"expected {tuple(dst.shape)}")
        with torch.no_grad():
            torch._foreach_copy_([t.data for t in own.values()], [sd[k] for k in own])

    # -- the optimizer step ----------------------------------------------------------------------
    def optimizer_seconds(self) -> float:
        """AdamW over this rank's shard + the step's gradient all-reduce, in emulated seconds."""
        import torch.distributed as dist

        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        shards = ranks if self.cfg.fsdp else 1
        net = cm.Network(link_gbs=self.cfg.emulate.link_gbs)
        return (cm.optimizer_s(self.family, self.lora_rank, shards)
                + cm.step_sync_s(self.family, self.lora_rank, [self.gpu] * ranks, net))

    def optimizer_wait(self) -> None:
        self.clock.wait(self.optimizer_seconds())


def build_emulated(model_cfg: ModelConfig, *, seed: int = 0, gpu: str | None = None,
                   in_trainer: bool = False) -> EmulatedModel:
    """An :class:`EmulatedModel` for ``model_cfg`` on the node's declared ``gpu``."""
    return EmulatedModel(model_cfg, gpu=gpu or "cpu", in_trainer=in_trainer, seed=seed)
