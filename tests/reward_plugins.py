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


def prompt_length(images: torch.Tensor, prompts: Sequence[str], metadata, *, scale: float = 1.0) -> torch.Tensor:
    """Reads metadata: ``scale * metadata[i]["count"]`` (a plug-in with args and metadata)."""
    return torch.tensor([scale * float(m["count"]) for m in metadata])


class Threshold:
    """A class term: built once with its args, then called (as model rewards are)."""

    built = 0

    def __init__(self, *, level: int) -> None:
        Threshold.built += 1
        self.level = level

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return (images.float().mean(dim=(1, 2, 3)) > self.level).float()


def attributes(images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
    """Several values per image, as a judge returns them."""
    b = images.shape[0]
    return {"shape": torch.ones(b), "all": torch.full((b,), 0.5)}


def fails_when_flagged(images: torch.Tensor, prompts: Sequence[str], metadata) -> torch.Tensor:
    """Raises for a batch holding a prompt whose metadata says ``fail``; else the mean pixel."""
    if any(m.get("fail") for m in metadata):
        raise RuntimeError("a flagged prompt")
    return images.float().mean(dim=(1, 2, 3)) / 255.0


class MissingWeights:
    """A model reward whose weights are not there: its constructor fails in every node."""

    def __init__(self, *, folder: str = "/nonexistent/reward-model") -> None:
        from digenrl.rl.rewards import RewardError

        raise RewardError(f"reward 'MissingWeights': weights folder {folder!r} does not exist")

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        raise AssertionError("never built")


class ClipDynamics:
    """A video reward model's shape (docs/rewards.md, VideoAlign-style): built once with its
    args, called with the videos (``frames``: uint8 (B, T, H, W, 3)), several scores back."""

    def __init__(self, scale: float = 1.0, device: str = "cpu") -> None:
        self.scale, self.device = scale, device
        self.seen: list[tuple[int, ...]] = []

    def __call__(self, frames: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        self.seen.append(tuple(frames.shape))
        x = frames.float() / 255
        motion = (x[:, 1:] - x[:, :-1]).abs().mean(dim=(1, 2, 3, 4)) if frames.shape[1] > 1 \
            else torch.zeros(frames.shape[0])
        visual = x.mean(dim=(1, 2, 3, 4))
        return {"visual": visual, "motion": motion, "overall": self.scale * (visual - motion)}
