"""Adapters over diffusers transformers (SD3, FLUX, Wan, Qwen-Image, HunyuanVideo).

``build_model(model_cfg, seed=0, device="cpu")`` is the entry point; see :mod:`.registry`.
"""

from digenrl.models.adapter import DiffusersFlowModel, NoAdapterError, SyncStateError
from digenrl.models.base import Cond, FlowModel, cond_cat, cond_repeat, cond_select
from digenrl.models.folder import ModelFolderError, PipelineFolder
from digenrl.models.pixels import PixelDecoder, encode_images
from digenrl.models.registry import TINY_CONFIGS, build_model, builtin_folder, check_model_path
from digenrl.models.text import HashPromptEncoder, PipelinePromptEncoder

__all__ = [
    "TINY_CONFIGS", "Cond", "DiffusersFlowModel", "FlowModel", "HashPromptEncoder", "ModelFolderError",
    "NoAdapterError", "PipelineFolder", "PipelinePromptEncoder", "PixelDecoder", "SyncStateError",
    "build_model", "builtin_folder", "check_model_path", "cond_cat", "cond_repeat", "cond_select", "encode_images",
]
