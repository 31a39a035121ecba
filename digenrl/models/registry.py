"""``build_model``: a :class:`~digenrl.models.base.FlowModel` from a :class:`ModelConfig`.

``model.path`` selects the weights:

* ``"random"``: a tiny random config of the real diffusers class (:data:`TINY_CONFIGS`), initialised
  from ``seed`` inside ``torch.random.fork_rng`` so the caller's global RNG is untouched;
* ``"builtin"``: the shipped tiny base model ``digenrl/data/base-<family>-tiny/`` (a transformer
  folder; its ``config.json`` is authoritative);
* a pipeline folder (``model_index.json``; :mod:`digenrl.models.folder`): its transformer, its
  VAE (latents decoded as the pipeline decodes them) and, with ``model.text_encoder`` "auto" or
  "pipeline", its own text encoders run through the pipeline's ``encode_prompt``;
* a transformer folder (``config.json`` + safetensors, what a full fine-tune's ``final/`` holds);
* ``"emulated"``: no weights at all, an accelerator emulated from the cost model
  (:mod:`digenrl.models.emulated`).

Tiny models use :class:`~digenrl.models.text.HashPromptEncoder` and the fixed
:class:`~digenrl.models.pixels.PixelDecoder`. That toy pair is never chosen silently for a real
transformer: a folder without text encoders is refused unless ``model.text_encoder = "hash"``,
except a pixel-space transformer (``3 r^2`` latent channels, what the builtin base model and the
tiny random ones are), whose pixel decoder is exact. Everything loads with
``local_files_only=True``: nothing is ever downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from digenrl.config import ModelConfig
from digenrl.models.folder import (
    TEXT_COMPONENTS,
    ModelFolderError,
    PipelineFolder,
    is_pipeline_folder,
)
from digenrl.models.pixels import (
    Decoder,
    PixelDecoder,
    PixelEncoder,
    VaeDecoder,
    VaeEncoder,
    shuffle_factor,
)
from digenrl.models.text import HashPromptEncoder, PipelinePromptEncoder

if TYPE_CHECKING:
    from collections.abc import Sequence

    from digenrl.models.adapter import DiffusersFlowModel

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Seed of the tiny models' word vectors: fixed, so a saved model and its prompts stay paired.
PROMPT_SEED = 0

__all__ = ["TINY_CONFIGS", "ModelFolderError", "build_model", "builtin_folder", "check_model_path"]  # noqa: F822 (TINY_CONFIGS: module __getattr__)


def __getattr__(name: str) -> Any:
    # TINY_CONFIGS is the catalog's (no diffusers); diffusers (and, through peft, transformers)
    # load only when a diffusers model is built: an emulated node never pays for them
    if name == "TINY_CONFIGS":
        from digenrl.models import catalog
        return catalog.TINY_CONFIGS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def builtin_folder(family: str) -> Path:
    """Where the shipped tiny base model of ``family`` lives."""
    return DATA_DIR / f"base-{family}-tiny"


def _folder(model_cfg: ModelConfig) -> Path:
    folder = builtin_folder(model_cfg.family) if model_cfg.path == "builtin" else Path(model_cfg.path)
    if not folder.is_dir():
        what = "the builtin base model folder" if model_cfg.path == "builtin" else "model.path"
        raise ModelFolderError(f"{what} {str(folder)!r} does not exist")
    return folder


def check_model_path(model_cfg: ModelConfig) -> None:
    """The cheap checks of ``build_model`` (no weights read): the folder exists, is a pipeline
    folder of ``model.family`` with its text encoders (unless the hash encoder is asked for)
    and VAE, or a transformer folder. Raises :class:`ModelFolderError` (a ConfigError). Does
    not import diffusers (:mod:`digenrl.models.catalog`)."""
    from digenrl.models import catalog

    if model_cfg.path == "emulated":  # no weights, no folder: models/emulated.py checks its knobs
        return
    if model_cfg.family not in catalog.FAMILIES:
        raise ModelFolderError(f"model.family = {model_cfg.family!r}: expected one of {sorted(catalog.FAMILIES)}")
    if model_cfg.path == "random":
        if model_cfg.text_encoder == "pipeline":
            raise ModelFolderError("model.text_encoder = 'pipeline' needs a pipeline folder; model.path = 'random' "
                                   "has no text encoders")
        _one_expert(model_cfg, "model.path = 'random'")
        return
    folder = _folder(model_cfg)
    if is_pipeline_folder(folder):
        pf = PipelineFolder(folder)
        pf.check_family(model_cfg.family)
        pf.require({"transformer": f"the {pf.pipeline_class}'s transformer",
                    "vae": f"the {pf.pipeline_class}'s VAE ({catalog.VAE_CLASS[pf.family]})"})
        if model_cfg.text_encoder != "hash":
            pf.require(TEXT_COMPONENTS[pf.family])
        if pf.entry("transformer_2") is not None:
            pf.require({"transformer_2": f"the {pf.pipeline_class}'s low-noise expert"})
            ratio = pf.index.get("boundary_ratio")
            if not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
                raise ModelFolderError(f"{folder / 'model_index.json'}: transformer_2 with boundary_ratio = "
                                       f"{ratio!r}; expected a number in (0, 1), where the experts switch")
            return
        _one_expert(model_cfg, str(folder))
        return
    if (folder / "transformer").is_dir():
        raise ModelFolderError(f"model.path {str(folder)!r} has transformer/ but no model_index.json: "
                               "point model.path at a whole pipeline folder (as diffusers saves one)")
    if not (folder / "config.json").is_file():
        raise ModelFolderError(f"model.path {str(folder)!r} has neither config.json (transformer folder) "
                               "nor model_index.json (pipeline folder)")
    if model_cfg.text_encoder == "pipeline":
        raise ModelFolderError(f"model.text_encoder = 'pipeline': {str(folder)!r} is a transformer folder, "
                               "it has no text encoders; point model.path at the pipeline folder")
    _one_expert(model_cfg, str(folder))


def _one_expert(model_cfg: ModelConfig, what: str) -> None:
    """``model.train_experts`` chooses among two experts: a one-transformer model has one."""
    if model_cfg.train_experts != "both":
        raise ModelFolderError(f"model.train_experts = {model_cfg.train_experts!r}: {what} has one "
                               "transformer (no transformer_2); leave it at 'both'")


def build_model(model_cfg: ModelConfig, *, seed: int = 0, device: str | torch.device = "cpu",
                tiny_overrides: dict | None = None, embedded_guidance: float = 0.0,
                gpu: str | None = None, in_trainer: bool = False,
                experts: tuple[Sequence[str], Sequence[str]] | None = None) -> DiffusersFlowModel:
    """The adapter for ``model_cfg`` (see the module docstring for ``path``), on ``device``.

    ``seed`` initialises random weights (path ``"random"``) and LoRA matrices; ``tiny_overrides``
    replaces entries of ``TINY_CONFIGS[family]`` for ``"random"``; ``embedded_guidance`` is
    ``sampler.embedded_guidance`` (0: the pipeline's default). The transformer and text
    encoders are in ``model.dtype``; the VAE decodes in float32 (as flow_grpo and the Wan
    model card do). ``gpu`` (the node's declared GPU type) and ``in_trainer`` matter only to
    ``path = "emulated"`` (:mod:`digenrl.models.emulated`), whose work takes that GPU's
    cost-model time. ``experts``: a two-expert folder's (held, trained) experts on a trainer
    rank (:mod:`digenrl.rl.experts`); None holds both.
    """
    if model_cfg.path == "emulated":
        from digenrl.models.emulated import build_emulated
        return build_emulated(model_cfg, seed=seed, gpu=gpu, in_trainer=in_trainer)  # type: ignore[return-value]
    from digenrl.models import catalog, families

    check_model_path(model_cfg)
    family = model_cfg.family
    spec = families.SPECS[family]
    dtype = DTYPES[model_cfg.dtype]
    device = torch.device(device)
    pf: PipelineFolder | None = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if model_cfg.path == "random":
            transformer = spec.cls(**{**families.TINY_CONFIGS[family], **(tiny_overrides or {})})
        else:
            folder = _folder(model_cfg)
            if is_pipeline_folder(folder):
                pf = PipelineFolder(folder)
                if pf.entry("transformer_2") is not None:
                    transformer = _two_experts(pf, dtype, model_cfg.train_experts, experts)
                else:
                    transformer = pf.load("transformer", dtype=dtype, frozen=False)
            else:
                transformer = spec.cls.from_pretrained(folder, local_files_only=True, torch_dtype=dtype)
        module: torch.nn.Module = transformer  # (diffusers wraps .to, which hides its signature)
        module.to(device=device)
        if model_cfg.path == "random":
            _cast(transformer, dtype)
        cfg = transformer.config
        vae = pf.load("vae", dtype=torch.float32, device=device) if pf is not None else None
        if vae is not None and model_cfg.vae_tiling:
            for switch in ("enable_tiling", "enable_slicing"):  # not every VAE class has both
                if hasattr(vae, switch):
                    getattr(vae, switch)()
        geometry = catalog.GEOMETRY[family](cfg, vae)
        latent_shape = geometry.latent_shape(model_cfg.height, model_cfg.width, model_cfg.num_frames)
        encoder = _encoder(model_cfg, pf, device, dtype, cfg)
        decoder: Decoder
        if vae is not None:
            decoder = VaeDecoder(vae, family)
        else:
            if shuffle_factor(latent_shape[0]) is None and model_cfg.text_encoder != "hash" and model_cfg.path != "random":
                raise ModelFolderError(
                    f"model.path {model_cfg.path!r} is a transformer folder of {latent_shape[0]}-channel latents "
                    "with no VAE or text encoders: point model.path at its pipeline folder, or set "
                    "model.text_encoder = 'hash' to train it on the toy encoder and a random linear decoder")
            decoder = PixelDecoder(latent_shape[0])
        model = spec.adapter(transformer, encoder=encoder, decoder=decoder, latent_shape=latent_shape,
                             lora_rank=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha,
                             lora_targets=model_cfg.lora_targets,
                             gradient_checkpointing=model_cfg.gradient_checkpointing, dtype=dtype)
        model.guidance = embedded_guidance or spec.guidance
        if hasattr(model, "encode_edits"):  # an image-editing family: its input-image encoder
            model.pixels_per_latent = geometry.spatial  # type: ignore[attr-defined]
            model.image_encoder = (VaeEncoder(vae) if vae is not None  # type: ignore[attr-defined]
                                   else PixelEncoder(latent_shape[0]))
        if hasattr(model, "condition_area"):  # qwenimage_edit: the input images' sizes
            model.condition_area = model_cfg.condition_area
            model.condition_vl_area = model_cfg.condition_vl_area  # type: ignore[attr-defined]
        if pf is not None:  # a family of several pipelines (FLUX.2-dev, -klein): the folder's own
            model.pipeline_class = pf.pipeline_class
            if pf.index.get("expand_timesteps"):  # Wan2.2 TI2V: per-token timesteps
                model.expand_timesteps = True  # type: ignore[attr-defined]
    return model


def _two_experts(pf: PipelineFolder, dtype: torch.dtype, train: str,
                 experts: tuple[Sequence[str], Sequence[str]] | None) -> Any:
    """Wan2.2 A14B's experts as one module (:class:`~digenrl.models.video.WanExperts`); the
    expert that is not trained is frozen. Experts of different shapes are refused, naming both.

    ``experts``: (held, trained) of a trainer rank (rl/experts.py): an expert not held is not
    loaded (its module is built on the meta device, for the shape check and its config); None
    holds both and trains what ``train`` names."""
    from digenrl.models.video import EXPERTS, TRAINED_EXPERTS, WanExperts

    held, trained = (EXPERTS, TRAINED_EXPERTS[train]) if experts is None else experts
    lora_seed = int(torch.randint(0, 2**62, (1,)).item())  # before any loading (build_model's seed)
    modules = {name: pf.load(name, dtype=dtype, frozen=False) if name in held else _meta_component(pf, name)
               for name in EXPERTS}
    a, b = modules["transformer"].state_dict(), modules["transformer_2"].state_dict()
    differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or a[k].shape != b[k].shape)
    if differ:
        k = differ[0]
        raise ModelFolderError(
            f"{pf.root}: transformer/ and transformer_2/ disagree in shape ({len(differ)} tensors, e.g. "
            f"{k}: {tuple(a[k].shape) if k in a else 'absent'} vs {tuple(b[k].shape) if k in b else 'absent'}); "
            "the two experts of a Wan2.2 folder have one architecture")
    for name, expert in modules.items():
        if name not in trained:
            expert.requires_grad_(False)
    high, low = (modules[n] if n in held else None for n in EXPERTS)
    return WanExperts(high, low, float(pf.index["boundary_ratio"]), trained=tuple(trained),
                      absent={n: m for n, m in modules.items() if n not in held}, lora_seed=lora_seed)


def _meta_component(pf: PipelineFolder, name: str) -> Any:
    """Component ``name`` built from its config on the meta device: shapes and config, no
    storage, nothing read but its config file."""
    import importlib

    entry = pf.entry(name)
    assert entry is not None  # check_model_path requires both experts
    cls = getattr(importlib.import_module(entry[0]), entry[1])
    with torch.device("meta"):
        module = cls.from_config(cls.load_config(pf.root / name))
    return module.requires_grad_(False).eval()


def _cast(transformer: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast to ``dtype`` as ``from_pretrained(torch_dtype=dtype)`` loads: the class's
    ``_keep_in_fp32_modules`` (Wan's norms and time embedding) stay float32."""
    keep = getattr(transformer, "_keep_in_fp32_modules", None) or []
    for name, t in [*transformer.named_parameters(), *transformer.named_buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(torch.float32 if any(k in name.split(".") for k in keep) else dtype)


def _encoder(model_cfg: ModelConfig, pf: PipelineFolder | None, device: torch.device, dtype: torch.dtype,
             cfg: object) -> HashPromptEncoder | PipelinePromptEncoder:
    from digenrl.models import families

    spec = families.SPECS[model_cfg.family]
    if pf is None or model_cfg.text_encoder == "hash":
        dim, pooled = spec.text_dims(cfg)
        return HashPromptEncoder(dim, pooled, max_tokens=spec.max_tokens, seed=PROMPT_SEED)
    import diffusers

    parts = {name: pf.load(name, dtype=dtype, device=device) for name in TEXT_COMPONENTS[pf.family]}
    pipe = getattr(diffusers, pf.pipeline_class)(transformer=None, vae=None, scheduler=None, **parts)
    return PipelinePromptEncoder(pipe, pf.family, device=device, max_tokens=model_cfg.max_text_tokens)
