"""The coordinator learns the latent shape from configuration alone, never from a built model.

Checked against ``build_model`` family by family (the two must agree), on folders whose
weights file was removed (only ``config.json`` is read), and through ``make_scheduler``
with ``build_model`` made to fail, so a model build anywhere on that path is caught.
"""

from __future__ import annotations

import dataclasses
import json
from math import prod
from pathlib import Path

import pytest

from digenrl.config import ModelConfig, load_config
from digenrl.models import build_model
from digenrl.models.meta import ModelConfigError, latent_shape_of

FAMILIES = ["sd3", "flux", "qwenimage", "wan", "hunyuanvideo", "flux2", "zimage", "qwenimage_edit"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_shape_from_the_config_is_the_built_models_shape(family: str) -> None:
    cfg = ModelConfig(family=family, path="random")
    assert latent_shape_of(cfg) == build_model(cfg).latent_shape


def _weightless_transformer_folder(tmp_path: Path, family: str) -> Path:
    folder = tmp_path / f"{family}-transformer"
    build_model(ModelConfig(family=family, path="random")).save(folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    assert (folder / "config.json").is_file() and not list(folder.glob("*.safetensors"))
    return folder


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_a_transformer_folder_without_its_weights_file_gives_the_shape(tmp_path: Path, family: str) -> None:
    folder = _weightless_transformer_folder(tmp_path, family)
    cfg = ModelConfig(family=family, path=str(folder))
    assert latent_shape_of(cfg) == build_model(ModelConfig(family=family, path="random")).latent_shape
    with pytest.raises(OSError):  # the folder really has no weights: a build could not succeed
        build_model(cfg)


def test_a_pipeline_folder_without_weights_gives_the_pipeline_shape(tmp_path: Path) -> None:
    # a pipeline folder (model_index.json + transformer/ and vae/ config.json) of FLUX.1: the
    # packed latent is in_channels / 4 channels, 1024 px by default over the VAE's 8x
    for sub in ("transformer", "vae"):
        (tmp_path / sub).mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "FluxTransformer2DModel", "in_channels": 64, "num_layers": 19}))
    (tmp_path / "vae" / "config.json").write_text(json.dumps(
        {"_class_name": "AutoencoderKL", "latent_channels": 16, "block_out_channels": [128, 256, 512, 512]}))
    assert latent_shape_of(ModelConfig(family="flux", path=str(tmp_path))) == (16, 128, 128)
    assert latent_shape_of(ModelConfig(family="flux", path=str(tmp_path), height=512, width=768)) == (16, 64, 96)
    (tmp_path / "vae" / "config.json").unlink()
    with pytest.raises(ModelConfigError, match=r"vae/config\.json does not exist"):
        latent_shape_of(ModelConfig(family="flux", path=str(tmp_path)))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_shape_of_a_pipeline_folder_at_a_configured_size_is_the_built_models(tmp_path: Path, family: str) -> None:
    from tests.pipelines import SMALL, write_pipeline_folder

    sizes = {k: v for k, v in SMALL.items() if k != "num_frames" or family in ("wan", "hunyuanvideo")}
    cfg = ModelConfig(family=family, path=str(write_pipeline_folder(family, tmp_path / family)),
                      text_encoder="hash", **sizes)
    assert latent_shape_of(cfg) == build_model(cfg).latent_shape


def test_a_folder_without_a_config_is_named_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"config\.json does not exist"):
        latent_shape_of(ModelConfig(family="flux", path=str(tmp_path)))


def test_make_scheduler_sizes_trajectories_without_building_a_model(tmp_path: Path, monkeypatch) -> None:
    import digenrl.models as models
    import digenrl.models.registry as registry
    from digenrl.actors.cluster import bytes_per_trajectory, make_scheduler

    folder = _weightless_transformer_folder(tmp_path, "sd3")
    cfg = load_config(None, [f"model.path=\"{folder}\""])

    def refuse(*a, **k):
        raise AssertionError("the coordinator built a model")

    monkeypatch.setattr(registry, "build_model", refuse)
    monkeypatch.setattr(models, "build_model", refuse)
    sched = make_scheduler(cfg, prompt_count=8)
    numel = prod(latent_shape_of(cfg.model))
    assert sched.params.bytes_per_trajectory == bytes_per_trajectory(cfg, numel) > 0


# ---------------------------------------------------------------- the catalog: no diffusers

def _signature_defaults(cls: type, keys) -> dict:
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return {k: params[k].default for k in keys}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_catalogs_defaults_are_the_installed_diffusers_classes_defaults(family: str) -> None:
    """The catalog copies the few constructor defaults the geometry reads, so that the launcher
    need not import diffusers: a diffusers release that changes one fails here, not silently."""
    import diffusers

    from digenrl.models import catalog, families

    spec = families.SPECS[family]
    wanted = catalog.TRANSFORMER_DEFAULTS[family]
    assert _signature_defaults(spec.cls, wanted) == wanted
    vae_class = catalog.VAE_CLASS[family]
    vae_wanted = catalog.VAE_DEFAULTS[vae_class]
    assert _signature_defaults(getattr(diffusers, vae_class), vae_wanted) == vae_wanted


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("with_vae", [False, True])
def test_the_geometry_reads_no_key_the_catalog_lacks(family: str, with_vae: bool) -> None:
    # a namespace holding only the catalog's keys: reading any other raises AttributeError
    from types import SimpleNamespace

    from digenrl.models import catalog

    cfg = SimpleNamespace(**catalog.TRANSFORMER_DEFAULTS[family])
    vae = SimpleNamespace(config=SimpleNamespace(**catalog.VAE_DEFAULTS[catalog.VAE_CLASS[family]])) \
        if with_vae else None
    assert catalog.GEOMETRY[family](cfg, vae).family == family


def test_the_launchers_checks_and_scheduler_import_neither_diffusers_nor_peft(tmp_path: Path) -> None:
    """The launcher checks a config and sizes the byte window before it starts any node; with
    diffusers imported there (~4 s of CPU with peft and torch._dynamo) every launch started its
    nodes ~4 s later. A random model and a pipeline folder, each checked in a fresh process."""
    from tests.conftest import heavy_imports_after
    from tests.pipelines import write_pipeline_folder

    folder = write_pipeline_folder("flux", tmp_path / "flux")
    for path in ("random", str(folder)):
        code = (
            "from digenrl.config import load_config\n"
            "from digenrl.launch import check_before_start\n"
            "from digenrl.actors.cluster import make_scheduler\n"
            f"cfg = load_config(None, ['model.family=\"flux\"', 'model.path=\"{path}\"', "
            "'model.text_encoder=\"hash\"'])\n"
            "check_before_start(cfg)\n"
            "assert make_scheduler(cfg, prompt_count=8).params.bytes_per_trajectory > 0\n")
        assert heavy_imports_after(code) == [], path


@pytest.mark.parametrize(("heads", "entry"), [(48, "flux2"), (24, "flux2_klein_4b"), (32, "flux2_klein_9b")])
def test_a_flux2_folder_is_priced_as_the_model_its_transformer_is(tmp_path: Path, heads: int, entry: str) -> None:
    """FLUX.2-dev (32 B) and klein (4 B, 9 B) share a family; the planner prices the one the
    folder holds, told by the transformer's width, from config.json alone."""
    from digenrl.core import costmodel as cm
    from digenrl.sim.simulator import workload_from_config

    for sub in ("transformer", "vae"):
        (tmp_path / sub).mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "Flux2Transformer2DModel", "num_attention_heads": heads, "attention_head_dim": 128}))
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLFlux2"}))
    cfg = load_config("configs/models/flux.toml", ['model.family=""', f'model.path="{tmp_path}"'])
    assert cfg.model.family == "flux2"
    assert workload_from_config(cfg).model == entry
    assert latent_shape_of(cfg.model) == cm.MODELS[entry].latent_shape == (128, 64, 64)  # 1024 px by default


def test_flux2_and_zimage_are_priced_at_their_published_sizes() -> None:
    from digenrl.core import costmodel as cm
    from digenrl.sim.simulator import workload_from_config

    assert {m: cm.MODELS[m].params_b for m in ("flux2", "flux2_klein_4b", "flux2_klein_9b", "zimage")} == {
        "flux2": 32.0, "flux2_klein_4b": 4.0, "flux2_klein_9b": 9.0, "zimage": 6.0}
    for family in ("flux2", "zimage"):  # a plan with no folder prices the family's flagship
        cfg = load_config("configs/models/flux.toml", [f'model.family="{family}"'])
        assert workload_from_config(cfg).model == family
    wl = workload_from_config(load_config("configs/models/flux.toml", ['model.family="flux2"']))
    gen = {m: cm.node_costs("H100", dataclasses.replace(wl, model=m)).gen_step_s
           for m in ("flux", "flux2", "flux2_klein_4b", "flux2_klein_9b", "zimage")}
    # a forward's FLOPs grow with the size at one resolution: klein 4B < Z-Image < klein 9B < FLUX.2-dev
    assert gen["flux2_klein_4b"] < gen["zimage"] < gen["flux2_klein_9b"] < gen["flux2"]
    assert cm.trainable_bytes(cm.MODELS["flux2"], 0) == 64e9  # bf16 full weights: 2 B x 32 B


def test_a_lora_rank_above_z_images_width_is_refused() -> None:
    from digenrl.config import ConfigError
    from digenrl.models.footprint import check_footprint, transformer_width

    cfg = load_config(None, ['model.family="zimage"', 'model.path="random"', "model.lora_rank=33"])
    assert transformer_width(cfg) == 32  # the tiny Z-Image's dim (it has no attention_head_dim)
    with pytest.raises(ConfigError, match=r"model\.lora_rank = 33: more than the transformer's width 32 \(zimage"):
        check_footprint(cfg, latent_shape_of(cfg.model), available=0)
