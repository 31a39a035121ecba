"""Reward plug-ins used by tests/test_rewards.py through the 'module:function' mechanism."""

from collections.abc import Sequence

import torch


def green_fraction(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """Fraction of pixels whose green channel exceeds both others (a well-behaved plug-in)."""
    x = images.int()
    return ((x[:, 1] > x[:, 0]) & (x[:, 1] > x[:, 2])).float().mean(dim=(1, 2))


def raises(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    raise RuntimeError("reward server unreachable")


def wrong_shape(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    return torch.zeros(images.shape[0], 1)


def integer_dtype(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    return torch.zeros(images.shape[0], dtype=torch.int64)


def returns_list(images: torch.Tensor, prompts: Sequence[str]) -> list[float]:
    return [0.0] * images.shape[0]


def nan_second(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    out = torch.zeros(images.shape[0])
    out[1] = float("nan")
    return out


NOT_A_FUNCTION = 3
