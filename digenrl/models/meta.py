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

The family's own :class:`~digenrl.models.families.Geometry` (built from the transformer's and,
for a pipeline folder, the VAE's ``config.json``) turns ``model.height`` / ``width`` /
``num_frames`` into the shape, exactly as :func:`~digenrl.models.registry.build_model` does, so
the two cannot disagree (``tests/test_model_meta.py`` checks it family by family).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from digenrl.config import ConfigError, ModelConfig


class ModelConfigError(ConfigError):
    """A model folder without a readable transformer config; the message names the file."""


def _class_defaults(cls: type) -> dict[str, Any]:
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    return {k: p.default for k, p in params.items()
            if k != "self" and p.default is not inspect.Parameter.empty}


def _read_config(path: Path, cls: type) -> dict[str, Any]:
    """``cls``'s constructor defaults updated with the JSON config at ``path``."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    # diffusers stores bookkeeping keys (_class_name, _diffusers_version) next to the kwargs
    return {**_class_defaults(cls), **{k: v for k, v in raw.items() if not k.startswith("_")}}


def _folder(model_cfg: ModelConfig) -> tuple[Path, bool]:
    from digenrl.models.registry import builtin_folder

    folder = builtin_folder(model_cfg.family) if model_cfg.path == "builtin" else Path(model_cfg.path)
    return folder, (folder / "model_index.json").exists() or (folder / "transformer").is_dir()


def transformer_config(model_cfg: ModelConfig) -> tuple[dict[str, Any], bool]:
    """(the transformer's constructor config, whether it comes from a pipeline folder)."""
    from digenrl.models import families

    spec = families.SPECS[model_cfg.family]
    if model_cfg.path == "random":
        return {**_class_defaults(spec.cls), **families.TINY_CONFIGS[model_cfg.family]}, False
    folder, pipeline = _folder(model_cfg)
    path = folder / "transformer" / "config.json" if pipeline else folder / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"model.path {str(folder)!r}: {path} does not exist (expected a "
                               "diffusers transformer folder or pipeline folder)")
    return _read_config(path, spec.cls), pipeline


def vae_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """A pipeline folder's ``vae/config.json`` over its VAE class's defaults."""
    import diffusers

    from digenrl.models import families

    folder, _ = _folder(model_cfg)
    path = folder / "vae" / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"model.path {str(folder)!r}: {path} does not exist (a pipeline folder "
                               "holds its VAE in vae/)")
    return _read_config(path, getattr(diffusers, families.SPECS[model_cfg.family].vae_class))


def latent_shape_of(model_cfg: ModelConfig) -> tuple[int, ...]:
    """The per-sample latent shape ``build_model(model_cfg)`` would have, without building it:
    the family's :class:`~digenrl.models.families.Geometry` from the transformer's and (pipeline
    folder) the VAE's ``config.json`` at ``model.height`` / ``width`` / ``num_frames``."""
    if model_cfg.path == "emulated":
        from digenrl.models.emulated import latent_shape

        return latent_shape(model_cfg)
    from digenrl.models import families

    config, pipeline = transformer_config(model_cfg)
    vae = SimpleNamespace(config=SimpleNamespace(**vae_config(model_cfg))) if pipeline else None
    geometry = families.SPECS[model_cfg.family].geometry(SimpleNamespace(**config), vae)
    return geometry.latent_shape(model_cfg.height, model_cfg.width, model_cfg.num_frames)
