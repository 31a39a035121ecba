"""Pipeline folders of all five families (tiny random real classes, standard layout): what a
user with a downloaded SD3.5 / FLUX.1 / Wan2.1 / Qwen-Image / HunyuanVideo folder gets.

Our model and the diffusers pipeline are different module instances, so their outputs are
compared with a tolerance (tests/conftest.py); weights read back are compared bit for bit.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch

from digenrl.config import ConfigError, ModelConfig
from digenrl.models import ModelFolderError, build_model
from tests.conftest import assert_close_across_instances, assert_same_weights
from tests.pipelines import (
    FAMILIES,
    MAX_TEXT_TOKENS,
    SMALL,
    load_pipeline,
    one_step_final,
    write_pipeline_folder,
)

VIDEO = ("wan", "hunyuanvideo")
PROMPTS = ["a red circle", "a blue square on the left"]
#: Every family's folder, and the second pipeline of a family (FLUX.2: klein is "flux2", dev "flux2-dev").
CASES = (*FAMILIES, "flux2-dev")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    return {f: write_pipeline_folder(f, root / f) for f in CASES}


def size(family: str) -> dict:
    return {k: v for k, v in SMALL.items() if k != "num_frames" or family in VIDEO}


def model_cfg(case: str, path, **kw) -> ModelConfig:
    family = case.split("-")[0]
    return ModelConfig(family=family, path=str(path), max_text_tokens=MAX_TEXT_TOKENS, **{**size(family), **kw})


def diffusers_call(family: str, pipe, x0: torch.Tensor):
    """The family pipeline's own call on our prompts and initial latents: kwargs, and its output
    images as uint8 laid out like our decode (video frames side by side)."""
    from digenrl.models.packing import pack_2x2

    # a copy: Z-Image's pipeline rewrites the prompt list it is given with its chat template
    kw = dict(prompt=list(PROMPTS), num_inference_steps=3, output_type="pt", max_sequence_length=MAX_TEXT_TOKENS,
              **size(family))
    kw["latents"] = pack_2x2(x0) if family in ("flux", "qwenimage") else x0
    kw.update({"sd3": dict(guidance_scale=1.0), "flux": dict(guidance_scale=3.5), "qwenimage": dict(true_cfg_scale=1.0),
               "wan": dict(guidance_scale=1.0), "hunyuanvideo": dict(guidance_scale=6.0),
               "flux2": dict(guidance_scale=1.0), "flux2-dev": dict(guidance_scale=4.0),
               "zimage": dict(guidance_scale=0.0)}[family])  # Z-Image: pos + g (pos - neg), so 0 is no CFG
    out = pipe(**kw)
    images = out.frames if family in VIDEO else out.images  # [0, 1]; videos (B, F, 3, H, W)
    if family in VIDEO:
        b, f, c, h, w = images.shape
        images = images.permute(0, 2, 3, 1, 4).reshape(b, c, h, f * w)
    return (images * 255).round().to(torch.uint8)


@pytest.mark.parametrize("family", CASES)
def test_a_pipeline_folder_generates_what_its_diffusers_pipeline_generates(family, folders):
    """Prompts through the folder's own text encoders, the adapter's Euler steps and the VAE
    decode give the images the diffusers pipeline makes from the same folder, prompts and
    noise: encode_prompt, timestep and guidance conventions and latent (de)normalisation."""

    model = build_model(model_cfg(family, folders[family]))
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(3))
    pipe = load_pipeline(folders[family])
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe).__name__ == model.pipeline_class
    with torch.no_grad():
        expected = diffusers_call(family, pipe, x0)
        cond = model.encode_prompts(PROMPTS)
        x = x0
        for s, s_next in itertools.pairwise(pipe.scheduler.sigmas.tolist()):
            x = x + (s_next - s) * model.velocity(x, s, cond)
        images = model.decode(x)
    assert images.shape == expected.shape and images.dtype == torch.uint8
    assert images.shape[-2] == SMALL["height"]
    # our uint8 is round((x + 1) * 127.5), the pipeline's round((x / 2 + 0.5) * 255): equal but for
    # float rounding at a .5 boundary, so one level at most
    assert (images.int() - expected.int()).abs().max() <= 1
    assert not torch.equal(images[0], images[1])  # the two prompts differ


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_comes_from_model_index_and_a_mismatch_is_one_line(family, folders):
    other = "flux" if family == "sd3" else "sd3"
    with pytest.raises(ConfigError, match=rf"model\.family = '{other}', but .*model_index\.json names "
                                          rf"\w+Pipeline \(family '{family}'\): set model\.family = '{family}'"):
        build_model(model_cfg(other, folders[family]))


def test_a_missing_tokenizer_names_the_path_and_what_belongs_there(folders, tmp_path):
    folder = shutil.copytree(folders["sd3"], tmp_path / "sd3")
    shutil.rmtree(folder / "tokenizer_3")
    with pytest.raises(ModelFolderError, match=r"tokenizer_3/ is missing or empty: it should hold T5's "
                                               r"T5TokenizerFast \(transformers\.T5Tokenizer"):
        build_model(model_cfg("sd3", folder))


def test_a_pipeline_folder_without_text_encoders_is_refused_unless_the_hash_encoder_is_asked_for(folders, tmp_path):
    folder = shutil.copytree(folders["wan"], tmp_path / "wan")
    shutil.rmtree(folder / "text_encoder")
    with pytest.raises(ModelFolderError, match=r"text_encoder/ is missing or empty: it should hold umT5-XXL"):
        build_model(model_cfg("wan", folder))
    model = build_model(model_cfg("wan", folder, text_encoder="hash"))
    assert type(model.encoder).__name__ == "HashPromptEncoder"


def test_a_real_transformer_folder_alone_is_refused_unless_the_hash_encoder_is_asked_for(folders):
    transformer = folders["flux"] / "transformer"  # 4-channel latents: not pixels
    with pytest.raises(ModelFolderError, match=r"no VAE or text encoders: point model\.path at its pipeline "
                                               r"folder, or set model\.text_encoder = 'hash'"):
        build_model(model_cfg("flux", transformer))
    # no VAE: one latent cell per pixel, decoded by the fixed projection
    assert build_model(model_cfg("flux", transformer, text_encoder="hash")).latent_shape == (4, 32, 48)


def test_a_transformer_subfolder_path_or_a_broken_index_is_named(folders, tmp_path):
    folder = shutil.copytree(folders["flux"], tmp_path / "flux")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ModelFolderError, match=r"names pipeline 'StableDiffusionPipeline'; DigenRL trains"):
        build_model(model_cfg("flux", folder))
    (folder / "model_index.json").unlink()
    with pytest.raises(ModelFolderError, match=r"has transformer/ but no model_index\.json"):
        build_model(model_cfg("flux", folder))


@pytest.mark.parametrize(("family", "sizes", "shape"), [
    ("sd3", {}, (4, 16, 16)),  # the default: transformer sample_size x VAE factor
    ("sd3", {"height": 64, "width": 32}, (4, 32, 16)),
    ("flux", {"height": 40, "width": 24}, (4, 20, 12)),
    ("qwenimage", {"height": 24, "width": 32}, (4, 12, 16)),
    ("wan", {"height": 32, "width": 32, "num_frames": 9}, (4, 5, 16, 16)),
    ("hunyuanvideo", {"height": 16, "width": 32, "num_frames": 9}, (4, 3, 8, 16)),
])
def test_resolution_and_frames_set_the_latent_shape(family, sizes, shape, folders):
    cfg = ModelConfig(family=family, path=str(folders[family]), text_encoder="hash", **sizes)
    assert build_model(cfg).latent_shape == shape


@pytest.mark.parametrize(("family", "sizes", "message"), [
    ("flux", {"height": 34}, r"model\.height = 34: flux needs a multiple of 4 pixels"),
    ("sd3", {"width": 30}, r"model\.width = 30: sd3 needs a multiple of 4 pixels"),
    ("sd3", {"width": 256}, r"model\.width = 256: larger than this sd3 transformer's position grid allows \(128"),
    ("wan", {"num_frames": 4}, r"model\.num_frames = 4: wan needs 1 \+ a multiple of 2 frames"),
    ("hunyuanvideo", {"num_frames": 7}, r"model\.num_frames = 7: hunyuanvideo needs 1 \+ a multiple of 4"),
    ("qwenimage", {"num_frames": 5}, r"model\.num_frames = 5: qwenimage makes images"),
])
def test_a_size_the_model_cannot_make_is_one_line_naming_the_multiple(family, sizes, message, folders):
    with pytest.raises(ConfigError, match=message):
        build_model(ModelConfig(family=family, path=str(folders[family]), text_encoder="hash", **sizes))


def test_lora_targets_default_to_flow_grpos_set_and_a_typo_is_named(folders):
    model = build_model(model_cfg("sd3", folders["sd3"], lora_rank=2, text_encoder="hash"))
    adapted = {n.split(".lora_A")[0].split(".")[-1] for n, _ in model.transformer.named_parameters() if "lora_A" in n}
    assert adapted == {"to_q", "to_k", "to_v", "0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"}
    assert any(".to_out.0.lora_A" in n for n, _ in model.transformer.named_parameters())
    only_q = build_model(model_cfg("sd3", folders["sd3"], lora_rank=2, lora_targets=["to_q"], text_encoder="hash"))
    assert {n for n, p in only_q.transformer.named_parameters() if p.requires_grad} == {
        n for n, _ in only_q.transformer.named_parameters() if ".to_q.lora_" in n}
    with pytest.raises(ConfigError, match=r"model\.lora_targets = \['to_qq'\]: no module of this SD3Transformer2DModel"):
        build_model(model_cfg("sd3", folders["sd3"], lora_rank=2, lora_targets=["to_qq"], text_encoder="hash"))


@pytest.mark.parametrize(("family", "default"), [("flux", 3.5), ("hunyuanvideo", 6.0)])
def test_embedded_guidance_defaults_to_the_pipelines_and_is_configurable(family, default, folders):
    cfg = model_cfg(family, folders[family], text_encoder="hash")
    base, other = build_model(cfg), build_model(cfg, embedded_guidance=default + 2.0)
    assert base.guidance == default and other.guidance == default + 2.0
    x = torch.randn(1, *base.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = base.encode_prompts(PROMPTS[:1])
    with torch.no_grad():
        assert not torch.allclose(base.velocity(x, 0.5, cond), other.velocity(x, 0.5, cond))


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("family", CASES)
def test_final_weights_load_into_the_diffusers_pipeline_and_give_the_trained_velocity(family, lora, folders, tmp_path):
    """One GRPO step on the folder's model (a rollout of its own, so at K = 0 the first ratio is 1
    to within 1e-6), then: a LoRA loads with the pipeline's own ``load_lora_weights`` (diffusers'
    format, its peft config kept), a full fine-tune with the transformer class's ``from_pretrained``."""

    from digenrl.models.families import SPECS

    model = build_model(model_cfg(family, folders[family], lora_rank=2 if lora else 0))
    cond = model.encode_prompts(PROMPTS)
    x, v_base, final = one_step_final(model, cond, tmp_path)
    pipe = load_pipeline(folders[family])
    with torch.no_grad():
        if lora:
            pipe.load_lora_weights(final)
            assert sorted(p.name for p in final.iterdir()) == ["policy.safetensors", "pytorch_lora_weights.safetensors"]
        else:
            pipe.transformer = SPECS[family.split("-")[0]].cls.from_pretrained(final, local_files_only=True)
            assert (final / "config.json").is_file()
            assert (final / "policy.safetensors").stat().st_ino == (final / "diffusion_pytorch_model.safetensors").stat().st_ino
        loaded = SPECS[family.split("-")[0]].adapter(pipe.transformer, encoder=model.encoder, decoder=model.decoder,
                                       latent_shape=model.latent_shape)
        loaded.guidance = model.guidance
        v_trained, v_loaded = model.velocity(x, 0.6, cond), loaded.velocity(x, 0.6, cond)
    assert not torch.allclose(v_trained, v_base, atol=1e-3)  # the training is in the file
    if lora:
        # diffusers names the loaded adapter default_0
        loaded_sd = {k.replace(".default_0", ""): v for k, v in loaded.sync_state_dict().items() if "lora_" in k}
        assert_same_weights(loaded_sd, model.sync_state_dict())
    else:
        assert_same_weights(loaded.sync_state_dict(), model.sync_state_dict())
    assert_close_across_instances(v_loaded, v_trained)


@pytest.mark.parametrize("family", CASES)
def test_a_left_out_family_is_read_from_model_index(family, folders, tmp_path):
    import tomllib

    from digenrl.config import load_config

    assert ModelConfig(path=str(folders[family])).family == family.split("-")[0]
    # a config file that names no family (as the shipped default does not): the folder set on the
    # command line is read, and the resolved config names the family
    shipped = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"
    assert "family" not in tomllib.loads(shipped.read_text())["model"]
    (tmp_path / "run.toml").write_text("[model]\npath = \"builtin\"\n")
    cfg = load_config(tmp_path / "run.toml", [f'model.path="{folders[family]}"'])
    assert cfg.model.family == family.split("-")[0]
    assert ModelConfig(path="builtin").family == ModelConfig(path="random").family == "sd3"  # as before


def test_a_pipeline_digenrl_does_not_train_is_one_line_naming_it_and_the_supported_ones(folders, tmp_path):
    from digenrl.config import PIPELINE_FAMILIES, load_config

    folder = shutil.copytree(folders["flux"], tmp_path / "flux")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    supported = r"DigenRL trains StableDiffusion3Pipeline, FluxPipeline, .*Flux2KleinPipeline, ZImagePipeline"
    with pytest.raises(ConfigError, match=rf"model_index\.json names pipeline 'StableDiffusionXLPipeline'; {supported}"):
        load_config(None, [f'model.path="{folder}"', 'model.family=""'])
    with pytest.raises(ModelFolderError, match=rf"names pipeline 'StableDiffusionXLPipeline'; {supported}"):
        build_model(model_cfg("flux", folder))  # with the family given: refused when the folder is read
    # a pipeline the table knows whose family is not registered in this version: named, no KeyError
    PIPELINE_FAMILIES_BEFORE = dict(PIPELINE_FAMILIES)
    try:
        PIPELINE_FAMILIES["FutureEditPipeline"] = "future_edit"
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "FutureEditPipeline"}))
        with pytest.raises(ConfigError, match=r"names pipeline 'FutureEditPipeline' \(family 'future_edit', not "
                                              r"trained by this version\); DigenRL trains StableDiffusion3Pipeline"):
            ModelConfig(path=str(folder))
    finally:
        PIPELINE_FAMILIES.clear()
        PIPELINE_FAMILIES.update(PIPELINE_FAMILIES_BEFORE)
    (folder / "model_index.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model_index\.json: not a readable model_index\.json"):
        ModelConfig(path=str(folder))


@pytest.mark.parametrize("family", ["sd3", "wan"])
def test_vae_tiling_switches_the_vae_to_tiled_sliced_decoding_and_decodes_the_same(family, folders):
    """model.vae_tiling turns on diffusers' tiled and sliced decoding. The tiny SD3 folder's VAE
    tile is smaller than its image, so that decode is tiled: tiles overlap and blend at their
    seams, the untiled image up to seam blending (mean |difference| under 8 of 255 levels). The
    tiny Wan frames fit in one tile, but slicing decodes each sample alone: the untiled image up
    to batch-size rounding, which some CPUs' kernels show as one uint8 level at a few pixels."""
    from digenrl.models import build_model

    plain = build_model(model_cfg(family, folders[family]), seed=0)
    tiled = build_model(model_cfg(family, folders[family], vae_tiling=True), seed=0)
    vae = tiled.decoder.vae
    assert vae.use_tiling and not plain.decoder.vae.use_tiling
    assert getattr(vae, "use_slicing", True)
    x = torch.randn(2, *plain.latent_shape, generator=torch.Generator().manual_seed(0))
    a, b = tiled.decode(x), plain.decode(x)
    diff = (a.float() - b.float()).abs().mean().item()
    assert a.shape == b.shape
    if family == "sd3":
        assert 0 < diff < 8
    else:
        assert (a.float() - b.float()).abs().max().item() <= 1 and diff < 1e-3
