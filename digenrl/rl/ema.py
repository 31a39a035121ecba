"""An exponential moving average (EMA) of the trained weights, kept on the trainer ranks.

``train.ema_decay = d > 0``: after every optimizer step that was applied (a step skipped for a
non-finite loss or gradient leaves the EMA as it is, as it leaves the weights),

    ema <- d * ema + (1 - d) * weights

over the trained tensors (the LoRA adapter, or every trainable weight), in float32 (the
float32 masters where the model computes in bf16), starting from the initial weights. The
EMA is keyed like :meth:`Policy.state_dict_for_sync`, so it loads into the policy's model
for evaluation (:func:`ema_weights`), is saved in a checkpoint (``ema.safetensors``) and
written to ``final/ema/`` in the same formats as the policy's weights.

Sharded (FSDP) trainers do not keep an EMA: the config refuses ``train.ema_decay`` with
``model.fsdp``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch

EMA_FILE = "ema.safetensors"
"""The EMA's file in a checkpoint version folder (listed in trainer.json and the manifest)."""


class TrainedPolicy(Protocol):
    """What this module reads of :class:`digenrl.rl.policy.Policy` (which imports this one)."""

    model: Any
    masters: list[torch.Tensor]
    ema: EMA | None

    def _master_keys(self) -> dict[str, int]: ...

    def state_dict_for_sync(self, *, keep: bool = True) -> dict[str, torch.Tensor]: ...

    def load_sync_state(self, sd: Mapping[str, torch.Tensor]) -> None: ...


def live_weights(policy: TrainedPolicy) -> dict[str, torch.Tensor]:
    """The policy's trained weights under their sync keys, as the live tensors (no copy):
    the float32 masters where there are (on the host with model.offload = "optimizer"), else
    the model's own tensors."""
    model = policy.model
    if hasattr(model, "sync_state_dict"):
        live = dict(model.sync_state_dict())
    else:
        live = {k: p.detach() for k, p in model.transformer.named_parameters() if p.requires_grad}
    live.update({key: policy.masters[i].detach() for key, i in policy._master_keys().items()})
    return live


class EMA:
    """The float32 moving average of a policy's trained weights (see the module docstring)."""

    def __init__(self, decay: float, weights: Mapping[str, torch.Tensor]) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay = {decay}: expected 0 < decay < 1")
        self.decay = decay
        self.state: dict[str, torch.Tensor] = {
            k: (v.detach().float() if v.is_floating_point() else v.detach()).clone() for k, v in weights.items()}

    @classmethod
    def of(cls, policy: TrainedPolicy, decay: float) -> EMA:
        """An EMA starting at ``policy``'s current weights."""
        return cls(decay, live_weights(policy))

    @torch.no_grad()
    def update(self, weights: Mapping[str, torch.Tensor]) -> None:
        """One applied optimizer step: ``ema = d * ema + (1 - d) * weights`` on every float
        tensor (others are copied)."""
        if set(weights) != set(self.state):
            raise ValueError(f"EMA keys differ from the weights': missing {sorted(set(self.state) - set(weights))[:3]}, "
                             f"unexpected {sorted(set(weights) - set(self.state))[:3]}")
        floats = [k for k, v in self.state.items() if v.is_floating_point()]
        ema = [self.state[k] for k in floats]
        new = [weights[k].to(self.state[k].device, torch.float32) for k in floats]
        # lerp, ema + (1 - d) (w - ema): a tensor that did not move keeps its EMA exactly
        torch._foreach_lerp_(ema, new, 1.0 - self.decay)
        for k, v in self.state.items():
            if not v.is_floating_point():
                v.copy_(weights[k])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA weights as host (CPU) float32 copies, keyed like the policy's sync state."""
        from digenrl.devices import host
        return {k: host(v) for k, v in self.state.items()}

    def load_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Take a :meth:`state_dict` back exactly (a checkpoint's); ValueError on other keys or shapes."""
        if set(sd) != set(self.state):
            raise ValueError(f"EMA state keys differ: missing {sorted(set(self.state) - set(sd))[:3]}, "
                             f"unexpected {sorted(set(sd) - set(self.state))[:3]}")
        with torch.no_grad():
            for k, v in self.state.items():
                if sd[k].shape != v.shape:
                    raise ValueError(f"EMA state {k}: shape {tuple(sd[k].shape)}, expected {tuple(v.shape)}")
                v.copy_(sd[k])


@contextlib.contextmanager
def ema_weights(policy: TrainedPolicy) -> Iterator[None]:
    """Within the block the policy's model holds its EMA weights (no-grad use only: evaluation).

    The trained weights (and float32 masters) are put back exactly on exit; gradients and the
    optimizer state are not touched. ValueError if the policy keeps no EMA.
    """
    if policy.ema is None:
        raise ValueError("this policy keeps no EMA (train.ema_decay = 0)")
    current = policy.state_dict_for_sync()
    policy.load_sync_state(policy.ema.state_dict())
    try:
        yield
    finally:
        policy.load_sync_state(current)
