"""Adapters over diffusers transformers (SD3, FLUX, Wan, Qwen-Image, HunyuanVideo).

``build_model(model_cfg, seed=0, device="cpu")`` is the entry point; see :mod:`.registry`.
Names load on first use (PEP 562): importing the package, or :mod:`.base` for the interface,
does not import diffusers and peft, which an emulated node (:mod:`.emulated`) never needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from digenrl.models.adapter import DiffusersFlowModel, NoAdapterError, SyncStateError
    from digenrl.models.base import Cond, FlowModel, cond_cat, cond_repeat, cond_select
    from digenrl.models.folder import ModelFolderError, PipelineFolder
    from digenrl.models.pixels import PixelDecoder, encode_images
    from digenrl.models.registry import TINY_CONFIGS, build_model, builtin_folder, check_model_path
    from digenrl.models.text import HashPromptEncoder, PipelinePromptEncoder

_WHERE = {
    "DiffusersFlowModel": "adapter", "NoAdapterError": "adapter", "SyncStateError": "adapter",
    "Cond": "base", "FlowModel": "base", "cond_cat": "base", "cond_repeat": "base", "cond_select": "base",
    "ModelFolderError": "folder", "PipelineFolder": "folder",
    "PixelDecoder": "pixels", "encode_images": "pixels",
    "TINY_CONFIGS": "registry", "build_model": "registry", "builtin_folder": "registry",
    "check_model_path": "registry", "HashPromptEncoder": "text", "PipelinePromptEncoder": "text",
}

__all__ = [
    "TINY_CONFIGS", "Cond", "DiffusersFlowModel", "FlowModel", "HashPromptEncoder", "ModelFolderError",
    "NoAdapterError", "PipelineFolder", "PipelinePromptEncoder", "PixelDecoder", "SyncStateError",
    "build_model", "builtin_folder", "check_model_path", "cond_cat", "cond_repeat", "cond_select", "encode_images",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"digenrl.models.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
