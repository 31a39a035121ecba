"""What a model config describes, read without building the model: its per-sample latent shape.

The coordinator needs the latent shape (for the bytes a trajectory puts in flight) but must
never load a 12B checkpoint to learn it, and is often on a host without a GPU. Here the
shape comes from configuration only:

* ``path = "random"``: the tiny random config of the family (``TINY_CONFIGS``) over the
  diffusers class's own defaults;
* ``path = "builtin"`` or a local folder: the transformer's ``config.json`` (a transformer
  folder's own, or ``transformer/config.json`` of a pipeline folder), over the class defaults;
  no weights file is opened;
* ``path = "emulated"``: the cost model's recipe shape (:mod:`digenrl.models.emulated`).

The family's own :class:`~digenrl.models.catalog.Geometry` (built from the transformer's and,
for a pipeline folder, the VAE's ``config.json``) turns ``model.height`` / ``width`` /
``num_frames`` into the shape, exactly as :func:`~digenrl.models.registry.build_model` does, so
the two cannot disagree (``tests/test_model_meta.py`` checks it family by family). The same
files say whether a sequence-parallel degree divides the heads and the image/video tokens
(:func:`check_sequence_parallel_degree`: the launcher's check, and a rollout node's for ``--gpus``).

Nothing here imports diffusers (:mod:`digenrl.models.catalog` holds the class defaults the
geometry reads): the launcher checks a config and its coordinator sizes the byte window
without the seconds of CPU that import costs.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from digenrl.config import ConfigError, ModelConfig
from digenrl.models import catalog


class ModelConfigError(ConfigError):
    """A model folder without a readable transformer config; the message names the file."""


def _read_config(path: Path, defaults: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` (a class's, of the keys the geometry reads) updated with the JSON config at
    ``path``."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    # diffusers stores bookkeeping keys (_class_name, _diffusers_version) next to the kwargs
    return {**defaults, **{k: v for k, v in raw.items() if not k.startswith("_")}}


def _folder(model_cfg: ModelConfig) -> tuple[Path, bool]:
    from digenrl.models.registry import builtin_folder

    folder = builtin_folder(model_cfg.family) if model_cfg.path == "builtin" else Path(model_cfg.path)
    return folder, (folder / "model_index.json").exists() or (folder / "transformer").is_dir()


def transformer_config(model_cfg: ModelConfig) -> tuple[dict[str, Any], bool]:
    """(the transformer's constructor config as far as the geometry reads it, whether it
    comes from a pipeline folder)."""
    defaults = catalog.TRANSFORMER_DEFAULTS[model_cfg.family]
    if model_cfg.path == "random":
        return {**defaults, **catalog.TINY_CONFIGS[model_cfg.family]}, False
    folder, pipeline = _folder(model_cfg)
    path = folder / "transformer" / "config.json" if pipeline else folder / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"model.path {str(folder)!r}: {path} does not exist (expected a "
                               "diffusers transformer folder or pipeline folder)")
    return _read_config(path, defaults), pipeline


def vae_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """A pipeline folder's ``vae/config.json`` over its VAE class's defaults (of the keys the
    geometry reads)."""
    folder, _ = _folder(model_cfg)
    path = folder / "vae" / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"model.path {str(folder)!r}: {path} does not exist (a pipeline folder "
                               "holds its VAE in vae/)")
    return _read_config(path, catalog.VAE_DEFAULTS[catalog.VAE_CLASS[model_cfg.family]])


def latent_shape_of(model_cfg: ModelConfig) -> tuple[int, ...]:
    """The per-sample latent shape ``build_model(model_cfg)`` would have, without building it:
    the family's :class:`~digenrl.models.catalog.Geometry` from the transformer's and (pipeline
    folder) the VAE's ``config.json`` at ``model.height`` / ``width`` / ``num_frames``."""
    if model_cfg.path == "emulated":
        from digenrl.models.emulated import latent_shape

        return latent_shape(model_cfg)
    config, pipeline = transformer_config(model_cfg)
    vae = SimpleNamespace(config=SimpleNamespace(**vae_config(model_cfg))) if pipeline else None
    geometry = catalog.GEOMETRY[model_cfg.family](SimpleNamespace(**config), vae)
    return geometry.latent_shape(model_cfg.height, model_cfg.width, model_cfg.num_frames)


#: FLUX.2 transformer width (heads x head dim) -> the cost model's entry (digenrl/core/costmodel.py).
FLUX2_WIDTHS = {6144: "flux2", 3072: "flux2_klein_4b", 4096: "flux2_klein_9b"}


def cost_model_name(model_cfg: ModelConfig) -> str:
    """The cost model's entry for ``model_cfg``: its family, except FLUX.2, whose folder's
    transformer width tells dev (32 B, also what a folderless plan prices) from klein 4B and 9B,
    and Wan2.2, whose folder's model_index.json tells A14B (two experts) and TI2V-5B
    (``expand_timesteps``) from Wan2.1."""
    if model_cfg.path in ("random", "emulated"):
        return model_cfg.family
    if model_cfg.family == "wan":
        index = Path(model_cfg.path) / "model_index.json"
        try:
            meta = json.loads(index.read_text()) if index.is_file() else {}
        except (OSError, ValueError):
            meta = {}
        if isinstance(meta.get("transformer_2"), list) and None not in meta["transformer_2"]:
            return "wan22_a14b"
        return "wan22_ti2v_5b" if meta.get("expand_timesteps") else "wan"
    if model_cfg.family != "flux2":
        return model_cfg.family
    config, _ = transformer_config(model_cfg)
    width = int(config.get("num_attention_heads", 48)) * int(config.get("attention_head_dim", 128))
    return FLUX2_WIDTHS.get(width, "flux2")


def check_sequence_parallel_degree(model_cfg: ModelConfig, n: int, key: str) -> None:
    """Refuse (ConfigError naming ``key`` and ``n``) a sequence-parallel degree ``n`` the model
    cannot run: a family without a sequence-parallel forward, attention heads or image/video
    tokens ``n`` does not divide (the folder's config files; nothing is loaded)."""
    if model_cfg.family not in catalog.SEQUENCE_PARALLEL_FAMILIES:
        raise ConfigError(f"{key} = {n} with model.family = {model_cfg.family!r}: "
                          f"no sequence-parallel forward; expected one of "
                          f"{', '.join(catalog.SEQUENCE_PARALLEL_FAMILIES)}")
    config = transformer_config(model_cfg)[0]
    heads = int(config.get("n_heads" if model_cfg.family == "zimage" else "num_attention_heads", 0))
    if heads % n or not heads:
        raise ConfigError(f"{key} = {n}: the transformer has {heads} attention "
                          f"heads; expected a divisor of {heads}")
    if model_cfg.family == "zimage" and 32 % n:
        raise ConfigError(f"{key} = {n}: Z-Image pads its image and caption sequences to multiples of 32 "
                          f"tokens; expected a divisor of 32")
    shape = latent_shape_of(model_cfg)
    tokens = image_tokens(model_cfg.family, config, shape)
    if tokens % n:
        sizes = "model.height x model.width" + (" x model.num_frames" if len(shape) == 4 else "")
        raise ConfigError(f"{key} = {n}: {sizes} give {tokens} image/video tokens "
                          f"per sample; expected a multiple of {n} (there is no padding)")


def image_tokens(family: str, config: dict[str, Any], shape: tuple[int, ...]) -> int:
    """The transformer's image/video tokens per sample for a latent of ``shape`` (what the
    sequence-parallel forward splits; FLUX.1 Kontext's input-image tokens double it). FLUX.2's
    latent is patchified already (a token per latent cell); Z-Image pads its patches to a
    multiple of 32 tokens."""
    if family in ("wan", "hunyuanvideo"):
        _, f, h, w = shape
        if family == "wan":
            pt, ph, pw = config.get("patch_size", (1, 2, 2))
        else:
            pt, ph = int(config.get("patch_size_t", 1)), int(config.get("patch_size", 2))
            pw = ph
        return (f // int(pt)) * (h // int(ph)) * (w // int(pw))
    _, h, w = shape
    if family == "flux2":
        return h * w
    if family == "zimage":
        p = int(config.get("all_patch_size", (2,))[0])
        return -(-(h // p) * (w // p) // 32) * 32
    p = int(config.get("patch_size", 2)) if family == "sd3" else 2  # FLUX / Qwen-Image: 2x2 packing
    return (h // p) * (w // p)
