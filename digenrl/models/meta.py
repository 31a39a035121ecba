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

The family's own ``latent_shape`` function (:mod:`digenrl.models.families`) turns the config
into the shape, exactly as :func:`~digenrl.models.registry.build_model` does, so the two cannot
disagree (``tests/test_models.py`` checks it family by family).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from digenrl.config import ModelConfig


class ModelConfigError(ValueError):
    """A model folder without a readable transformer config; the message names the file."""


def _class_defaults(cls: type) -> dict[str, Any]:
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    return {k: p.default for k, p in params.items()
            if k != "self" and p.default is not inspect.Parameter.empty}


def transformer_config(model_cfg: ModelConfig) -> tuple[dict[str, Any], bool]:
    """(the transformer's constructor config, whether it comes from a pipeline folder)."""
    from digenrl.models import families
    from digenrl.models.registry import builtin_folder

    spec = families.SPECS[model_cfg.family]
    defaults = _class_defaults(spec.cls)
    if model_cfg.path == "random":
        return {**defaults, **families.TINY_CONFIGS[model_cfg.family]}, False
    folder = builtin_folder(model_cfg.family) if model_cfg.path == "builtin" else Path(model_cfg.path)
    pipeline = (folder / "model_index.json").exists() or (folder / "transformer").is_dir()
    path = folder / "transformer" / "config.json" if pipeline else folder / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"model.path {str(folder)!r}: {path} does not exist (expected a "
                               "diffusers transformer folder or pipeline folder)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    # diffusers stores bookkeeping keys (_class_name, _diffusers_version) next to the kwargs
    return {**defaults, **{k: v for k, v in raw.items() if not k.startswith("_")}}, pipeline


def latent_shape_of(model_cfg: ModelConfig) -> tuple[int, ...]:
    """The per-sample latent shape ``build_model(model_cfg)`` would have, without building it."""
    if model_cfg.path == "emulated":
        from digenrl.models.emulated import latent_shape

        return latent_shape(model_cfg)
    from digenrl.models import families

    config, pipeline = transformer_config(model_cfg)
    return tuple(int(n) for n in families.SPECS[model_cfg.family].latent_shape(SimpleNamespace(**config), pipeline))
