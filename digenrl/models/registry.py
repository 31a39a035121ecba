"""``build_model``: a :class:`~digenrl.models.base.FlowModel` from a :class:`ModelConfig`.

``model.path`` selects the weights:

* ``"random"``: a tiny random config of the real diffusers class (:data:`TINY_CONFIGS`), initialised
  from ``seed`` inside ``torch.random.fork_rng`` so the caller's global RNG is untouched;
* ``"builtin"``: the shipped tiny base model ``digenrl/data/base-<family>-tiny/`` (a transformer
  folder; its ``config.json`` is authoritative);
* anything else: a local diffusers folder, either a transformer folder (``config.json`` +
  safetensors) or a full pipeline folder (``model_index.json``, ``transformer/``, ``vae/``, text
  encoders). Everything loads with ``local_files_only=True``: nothing is ever downloaded.

Tiny models use :class:`~digenrl.models.text.HashPromptEncoder` and the fixed
:class:`~digenrl.models.pixels.PixelDecoder`; pipeline folders use their VAE and (SD3/FLUX) their
own CLIP/T5 encoders.
"""

from __future__ import annotations

from pathlib import Path

import torch

from digenrl.config import ModelConfig
from digenrl.models import families
from digenrl.models.adapter import DiffusersFlowModel
from digenrl.models.pixels import PixelDecoder, VaeDecoder
from digenrl.models.text import ClipT5PromptEncoder, HashPromptEncoder

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
TINY_CONFIGS = families.TINY_CONFIGS
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Seed of the tiny models' word vectors: fixed, so a saved model and its prompts stay paired.
PROMPT_SEED = 0


class ModelFolderError(ValueError):
    """A model path that is missing or is not a diffusers transformer / pipeline folder."""


def builtin_folder(family: str) -> Path:
    """Where the shipped tiny base model of ``family`` lives."""
    return DATA_DIR / f"base-{family}-tiny"


def build_model(model_cfg: ModelConfig, *, seed: int = 0, device: str | torch.device = "cpu",
                tiny_overrides: dict | None = None) -> DiffusersFlowModel:
    """The adapter for ``model_cfg`` (see the module docstring for ``path``).

    ``seed`` initialises random weights (path ``"random"``) and LoRA matrices; ``tiny_overrides``
    replaces entries of ``TINY_CONFIGS[family]`` for ``"random"``.
    """
    family = model_cfg.family
    if family not in families.SPECS:
        raise ValueError(f"model.family={family!r} is not one of {sorted(families.SPECS)}")
    spec = families.SPECS[family]
    dtype = DTYPES[model_cfg.dtype]
    vae = text_root = None
    adapter_folder = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if model_cfg.path == "random":
            transformer = spec.cls(**{**TINY_CONFIGS[family], **(tiny_overrides or {})})
        else:
            folder = builtin_folder(family) if model_cfg.path == "builtin" else Path(model_cfg.path)
            if not folder.is_dir():
                what = "the builtin base model folder" if model_cfg.path == "builtin" else "model.path"
                raise ModelFolderError(f"{what} {str(folder)!r} does not exist")
            if (folder / "model_index.json").exists() or (folder / "transformer").is_dir():
                transformer = spec.cls.from_pretrained(folder, subfolder="transformer", local_files_only=True)
                vae = _load_vae(folder, family)
                text_root = folder if (folder / "text_encoder").is_dir() else None
            elif (folder / "config.json").exists():
                transformer = spec.cls.from_pretrained(folder, local_files_only=True)
                adapter_folder = folder
            else:
                raise ModelFolderError(f"model.path {str(folder)!r} has neither config.json (transformer "
                                       "folder) nor model_index.json / transformer/ (pipeline folder)")
        transformer.to(device=device)
        if transformer.dtype != dtype:  # a no-op cast still makes diffusers warn about fp32 modules
            transformer.to(dtype=dtype)
        cfg = transformer.config
        latent_shape = spec.latent_shape(cfg, vae is not None)
        if text_root is not None:
            if family not in ("sd3", "flux"):
                raise NotImplementedError(f"{family}: loading the pipeline's own text encoders is not "
                                          f"implemented (only sd3 and flux); folder {str(text_root)!r}")
            encoder = ClipT5PromptEncoder(text_root, family, device=device, dtype=dtype)
        else:
            dim, pooled = spec.text_dims(cfg)
            encoder = HashPromptEncoder(dim, pooled, max_tokens=spec.max_tokens, seed=PROMPT_SEED)
        decoder = VaeDecoder(vae.to(device), family) if vae is not None else PixelDecoder(latent_shape[0])
        model = spec.adapter(transformer, encoder=encoder, decoder=decoder, latent_shape=latent_shape,
                             lora_rank=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha,
                             gradient_checkpointing=model_cfg.gradient_checkpointing)
        if adapter_folder is not None:
            model.load_saved_adapter(adapter_folder)
    return model


def _load_vae(folder: Path, family: str) -> torch.nn.Module:
    import diffusers

    name = families.SPECS[family].vae_class
    if not (folder / "vae").is_dir():
        raise ModelFolderError(f"pipeline folder {str(folder)!r} has no vae/ subfolder")
    return getattr(diffusers, name).from_pretrained(folder, subfolder="vae", local_files_only=True)
