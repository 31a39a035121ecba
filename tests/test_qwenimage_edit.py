"""Qwen-Image-Edit (QwenImageEditPipeline) and -Edit-Plus (QwenImageEditPlusPipeline) folders,
tiny and random, saved by those pipelines: the family is read from model_index.json, the
adapter generates what the pipeline generates from the same prompts, input images and noise,
trains with LoRA and full weights, and final/ loads into the pipeline.

The pipelines hard-code the input images' sizes (Edit: 1024 x 1024 area; Plus: 1024 x 1024 for
the VAE, 384 x 384 for the text encoder), which at this VAE's 2x would be 262,144 image tokens;
the reference call here sets them, through the module attributes the pipelines read, to the
model.condition_area / model.condition_vl_area the model is given.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from PIL import Image

from digenrl.config import ModelConfig
from digenrl.models import build_model
from digenrl.models.base import encode_inputs
from tests.conftest import assert_close_across_instances, assert_same_weights
from tests.pipelines import SMALL, load_pipeline, one_step_final, write_pipeline_folder

CASES = ("qwenimage_edit", "qwenimage_edit-plus")
PROMPTS = ["make the circle blue", "add a square"]
#: condition_area: a 56x40 input becomes 64x32 px (16 x 8 packed tokens), a 48x48 one 64x64
AREA = 64 * 48
#: condition_vl_area (Plus): 32x32, which Qwen2-VL's processor raises to its 56x56 minimum
VL_AREA = 32 * 32


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwenimage_edit")
    gen = torch.Generator().manual_seed(1)
    paths = []
    for i, (w, h) in enumerate([(56, 40), (40, 56), (48, 48)]):  # three aspects: three token grids
        px = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8)
        Image.fromarray(px.numpy()).save(root / f"in{i}.png")
        paths.append(str(root / f"in{i}.png"))
    return {c: write_pipeline_folder(c, root / c) for c in CASES}, paths


def cfg(case, folders, **kw) -> ModelConfig:
    return ModelConfig(family="qwenimage_edit", path=str(folders[0][case]), height=SMALL["height"],
                       width=SMALL["width"], condition_area=AREA,
                       condition_vl_area=VL_AREA if case.endswith("plus") else 0, **kw)


def inputs(case, folders) -> list[list[str]]:
    """Each prompt's input images: Plus gives the first prompt two (of different sizes)."""
    p = folders[1]
    return [[p[0], p[2]], [p[1]]] if case.endswith("plus") else [[p[0]], [p[1]]]


@pytest.mark.parametrize("case", CASES)
def test_the_family_is_read_from_model_index(case, folders):
    from digenrl.config import detect_family

    assert detect_family(str(folders[0][case])) == "qwenimage_edit"
    assert ModelConfig(path=str(folders[0][case])).family == "qwenimage_edit"


def set_pipeline_sizes(monkeypatch) -> None:
    """The pipelines' hard-coded input-image areas set to AREA and VL_AREA (module docstring)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    size = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: size(AREA, ratio))
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", AREA)
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", VL_AREA)


def pipeline_images(pipe, case, images, x0) -> torch.Tensor:
    """The pipeline's own call, one prompt at a time (the Plus pipeline takes one), from the
    latents ``x0``: uint8 images as our decode gives them."""
    from digenrl.models.packing import pack_2x2
    from digenrl.models.text import template_prefix_tokens

    pipe.set_progress_bar_config(disable=True)
    # the system turn the pipeline crops: 64 tokens of the published tokenizer (hard-coded there),
    # measured by the model; this byte-level tokenizer spells it in more
    pipe.prompt_template_encode_start_idx = template_prefix_tokens(pipe.tokenizer, pipe.prompt_template_encode)
    out = []
    with torch.no_grad():
        for i in range(x0.shape[0]):
            pictures = [Image.open(p).convert("RGB") for p in images[i]]
            out.append(pipe(image=pictures if case.endswith("plus") else pictures[0], prompt=PROMPTS[i],
                            height=SMALL["height"], width=SMALL["width"], latents=pack_2x2(x0[i:i + 1]),
                            num_inference_steps=3, true_cfg_scale=1.0, output_type="pt").images)
    return (torch.cat(out) * 255).round().to(torch.uint8)


def our_images(model, cond, sigmas, x0) -> torch.Tensor:
    """The adapter's Euler steps over the pipeline's sigmas from ``x0``, decoded."""
    x = x0
    with torch.no_grad():
        for s, s_next in itertools.pairwise(sigmas):
            x = x + (s_next - s) * model.velocity(x, s, cond)
        return model.decode(x)


@pytest.mark.parametrize("case", CASES)
def test_generates_what_the_edit_pipeline_generates(case, folders, monkeypatch):
    """Prompts and input images through the folder's Qwen2.5-VL (the VL template, the images
    seen), the images VAE-encoded and packed after the noisy latent's tokens with their own
    img_shapes, the adapter's Euler steps and the VAE decode give the images the pipeline makes
    from the same folder, prompts, images and noise; the two prompts' images differ in size, so
    one batched velocity runs them as two forwards."""
    set_pipeline_sizes(monkeypatch)
    model = build_model(cfg(case, folders))
    pipe = load_pipeline(folders[0][case])
    assert type(pipe).__name__ == model.pipeline_class
    images = inputs(case, folders)
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(3))
    expected = pipeline_images(pipe, case, images, x0)
    with torch.no_grad():
        cond = encode_inputs(model, PROMPTS, images)
    grids = [[(a, b) for a, b in row if a] for row in cond["image_shapes"].tolist()]
    assert grids == ([[(8, 16), (16, 16)], [(16, 8)]] if case.endswith("plus") else [[(8, 16)], [(16, 8)]])
    got = our_images(model, cond, pipe.scheduler.sigmas.tolist(), x0)
    with torch.no_grad():  # the image is in the sequence: without its tokens the velocity differs
        text_only = {k: v for k, v in cond.items() if k not in ("image_latents", "image_shapes")}
        assert not torch.allclose(model.velocity(x0, 0.7, cond), model.velocity(x0, 0.7, text_only), atol=1e-4)
    assert got.shape == expected.shape == (2, 3, SMALL["height"], SMALL["width"])
    # round((x + 1) * 127.5) against round((x / 2 + 0.5) * 255): one level at most
    assert (got.int() - expected.int()).abs().max() <= 1


def test_the_text_encoder_sees_the_input_image(folders):
    """The same prompt with another input image of the same size: other prompt embeddings
    (Qwen2.5-VL read the image), the same image tokens' grid."""
    model = build_model(cfg("qwenimage_edit", folders))
    root = folders[0]["qwenimage_edit"].parent
    Image.new("RGB", (56, 40), (10, 200, 30)).save(root / "flat.png")
    with torch.no_grad():
        a = encode_inputs(model, PROMPTS[:1], [[folders[1][0]]])
        b = encode_inputs(model, PROMPTS[:1], [[str(root / "flat.png")]])
    assert torch.equal(a["image_shapes"], b["image_shapes"])
    assert a["prompt_embeds"].shape == b["prompt_embeds"].shape
    assert not torch.allclose(a["prompt_embeds"], b["prompt_embeds"], atol=1e-4)


def test_rows_with_images_of_other_sizes_get_their_own_forward(folders):
    """A batch whose rows' images differ in size (as the step batcher mixes fragments) gives each
    row the velocity it has alone, to the tolerance of two module calls."""
    from digenrl.models.base import cond_select

    model = build_model(cfg("qwenimage_edit-plus", folders))
    with torch.no_grad():
        cond = encode_inputs(model, PROMPTS, inputs("qwenimage_edit-plus", folders))
        x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
        both = model.velocity(x, 0.5, cond)
        alone = [model.velocity(x[i:i + 1], 0.5, cond_select(cond, [i])) for i in range(2)]
    assert_close_across_instances(both, torch.cat(alone))


@pytest.mark.parametrize(("case", "lora"), [("qwenimage_edit-plus", True), ("qwenimage_edit-plus", False),
                                            ("qwenimage_edit", True)], ids=["plus-lora", "plus-full", "edit-lora"])
def test_trains_and_final_loads_into_the_edit_pipeline(case, lora, folders, tmp_path, monkeypatch):
    """One GRPO step on a rollout of its own edit prompts: at K = 0 the first ratio is 1 within
    1e-6 (the trainer's forward uses the rollout's conditioning, image tokens included: nothing
    is re-encoded); final/ loads into the pipeline (LoRA: its load_lora_weights; full: the
    transformer class's from_pretrained) and gives the trained velocity, not the base one. With
    the LoRA loaded, the pipeline's own call makes other images than before, and the trained
    model's (to one uint8 level)."""
    from digenrl.models.families import SPECS

    model = build_model(cfg(case, folders, lora_rank=2 if lora else 0))
    cond = encode_inputs(model, PROMPTS, inputs(case, folders))
    x, v_base, final = one_step_final(model, cond, tmp_path)
    pipe = load_pipeline(folders[0][case])
    spec = SPECS["qwenimage_edit"]
    with torch.no_grad():
        if lora:
            set_pipeline_sizes(monkeypatch)
            x0 = torch.randn(1, *model.latent_shape, generator=torch.Generator().manual_seed(4))
            before = pipeline_images(pipe, case, inputs(case, folders), x0)
            v_pipe_base = spec.adapter(pipe.transformer, encoder=model.encoder, decoder=model.decoder,
                                       latent_shape=model.latent_shape).velocity(x, 0.6, cond)
            pipe.load_lora_weights(final)
            after = pipeline_images(pipe, case, inputs(case, folders), x0)
            ours = our_images(model, {k: v[:1] for k, v in cond.items()}, pipe.scheduler.sigmas.tolist(), x0)
            assert (after.int() - before.int()).abs().max() > 8  # the adapter changes the pipeline's images
            assert (after.int() - ours.int()).abs().max() <= 1
        else:
            pipe.transformer = spec.cls.from_pretrained(final, local_files_only=True)
        loaded = spec.adapter(pipe.transformer, encoder=model.encoder, decoder=model.decoder,
                              latent_shape=model.latent_shape)
        v_trained, v_loaded = model.velocity(x, 0.6, cond), loaded.velocity(x, 0.6, cond)
    assert not torch.allclose(v_trained, v_base, atol=1e-3)  # the training is in the file
    if lora:
        assert not torch.allclose(v_loaded, v_pipe_base, atol=1e-3)  # the adapter changes the pipeline
        loaded_sd = {k.replace(".default_0", ""): v for k, v in loaded.sync_state_dict().items() if "lora_" in k}
        assert_same_weights(loaded_sd, model.sync_state_dict())
    else:
        assert_same_weights(loaded.sync_state_dict(), model.sync_state_dict())
    assert_close_across_instances(v_loaded, v_trained)


# -- edit prompt files and the launch checks --------------------------------------------------------
def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_images_is_the_image_field_by_another_name(tmp_path):
    from digenrl.data.prompts import PromptError, load_prompt_set

    for name in ("a", "b"):
        Image.new("RGB", (8, 8)).save(tmp_path / f"{name}.png")
    ps = load_prompt_set(_jsonl(tmp_path / "e.jsonl", [{"prompt": "merge", "images": ["a.png", "b.png"]},
                                                       {"prompt": "one", "images": "a.png"}]))
    a, b = str((tmp_path / "a.png").resolve()), str((tmp_path / "b.png").resolve())
    assert ps.is_edit and ps.images == [[a, b], [a]]
    with pytest.raises(PromptError, match=r"e2\.jsonl' line 2: input image '.*gone\.png' does not exist"):
        load_prompt_set(_jsonl(tmp_path / "e2.jsonl", [{"prompt": "x", "images": ["a.png"]},
                                                       {"prompt": "y", "images": ["b.png", "gone.png"]}]))
    with pytest.raises(PromptError, match=r"line 1: both 'image' and 'images'"):
        load_prompt_set(_jsonl(tmp_path / "e3.jsonl", [{"prompt": "x", "image": "a.png", "images": ["b.png"]}]))
    with pytest.raises(PromptError, match=r"line 1: expected 'images' to be a path or a list of 1 to 8"):
        load_prompt_set(_jsonl(tmp_path / "e4.jsonl", [{"prompt": "x", "images": []}]))


def test_image_counts_are_checked_per_pipeline_before_anything_starts(folders, tmp_path):
    """Edit-Plus takes up to three input images a prompt, Qwen-Image-Edit one: a prompt file that
    gives more is refused at launch, naming the prompt."""
    from digenrl.config import load_config
    from digenrl.data.prompts import PromptError
    from digenrl.launch import _check_prompts

    for name in ("a", "b"):
        Image.new("RGB", (8, 8)).save(tmp_path / f"{name}.png")
    two = _jsonl(tmp_path / "two.jsonl", [{"prompt": "merge", "images": ["a.png", "b.png"]}])
    four = _jsonl(tmp_path / "four.jsonl", [{"prompt": "merge four", "images": ["a.png", "b.png"] * 2}])
    edit, plus = (f'model.path="{folders[0][c]}"' for c in CASES)
    family = 'model.family="qwenimage_edit"'
    _check_prompts(load_config(None, [family, plus, f'prompts.file="{two}"']))  # agrees: no error
    with pytest.raises(PromptError, match=r"prompt 'merge four' gives 4 input images; model.family = "
                                          r"'qwenimage_edit' takes at most 3"):
        _check_prompts(load_config(None, [family, plus, f'prompts.file="{four}"']))
    with pytest.raises(PromptError, match=r"prompt 'merge' gives 2 input images; model.family = 'qwenimage_edit' "
                                          r"\(the '.*qwenimage_edit' folder's pipeline\) takes at most 1"):
        _check_prompts(load_config(None, [family, edit, f'prompts.file="{two}"']))


def test_the_cost_model_counts_the_input_image_tokens():
    """qwenimage_edit's forward is Qwen-Image's two-term formula (fitted to the "qwenimage"
    entry) at 4,096 output + 4,096 input-image + 256 text + 196 VL-image tokens, to the 0.1 TF the
    entry is written to; without the input tokens it would be about 73 TF."""
    from digenrl.config import load_config
    from digenrl.core.costmodel import MODELS
    from digenrl.models.meta import cost_model_name

    quad = 4 * 60 * 3072  # 4 L d
    s0 = 1024 + 256  # the qwenimage entry's 512 px sequence
    lin = (MODELS["qwenimage"].fwd_tflop * 1e12 - quad * s0**2) / s0  # 2 P_tok
    s = 2 * 4096 + 256 + 196
    assert MODELS["qwenimage_edit"].fwd_tflop == pytest.approx((lin * s + quad * s**2) / 1e12, abs=0.2)
    assert MODELS["qwenimage_edit"].fwd_tflop > 2 * (lin * (s - 4096) + quad * (s - 4096) ** 2) / 1e12
    cfg_ = load_config(None, ['model.family="qwenimage_edit"', 'model.path="emulated"'])
    assert cost_model_name(cfg_.model) == "qwenimage_edit"


def test_the_tiny_random_model_edits_from_its_pixel_encoder(tmp_path):
    """model.path = "random": the tiny transformer with the hash text encoder and the pixel-shuffle
    image encoder; the input image's tokens condition the velocity."""
    Image.new("RGB", (40, 24), (220, 30, 30)).save(tmp_path / "red.png")
    Image.new("RGB", (40, 24), (30, 30, 220)).save(tmp_path / "blue.png")
    model = build_model(ModelConfig(family="qwenimage_edit", path="random", height=32, width=32))
    x = torch.randn(1, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        red = encode_inputs(model, ["make it green"], [[str(tmp_path / "red.png")]])
        blue = encode_inputs(model, ["make it green"], [[str(tmp_path / "blue.png")]])
        # 32 x 32 output area, a 5:3 input: 32 x 32 px after the 32 px rounding, 8 x 8 packed tokens
        assert red["image_shapes"].tolist() == [[[8, 8]]] and red["image_latents"].shape == (1, 64, 48)
        assert not torch.allclose(model.velocity(x, 0.5, red), model.velocity(x, 0.5, blue), atol=1e-4)


def test_step_batching_conditions_on_each_fragments_input_images(tmp_path):
    """sampler.max_batch > 0: fragments of edit prompts (other input images, other sizes) that
    share forwards at different timesteps give each trajectory its unbatched rollout (to the
    float32 batch-size rounding of tests/test_batching.py); the cond cache keys a row by its
    prompt and its images, so one prompt with two inputs is two rows."""
    from digenrl.config import load_config
    from digenrl.models.base import cond_repeat
    from digenrl.rl.batching import CondCache, StepBatcher
    from digenrl.rl.sampler import rollout, seeded_generators

    # 4:1 and 1:4 inputs at the 32 x 32 output's area: 64 x 32 and 32 x 64 px, two token grids
    for name, size, color in (("red", (64, 16), (220, 30, 30)), ("blue", (16, 64), (30, 30, 220))):
        Image.new("RGB", size, color).save(tmp_path / f"{name}.png")
    red, blue = [str(tmp_path / "red.png")], [str(tmp_path / "blue.png")]
    cfg = load_config(None, ['model.family="qwenimage_edit"', 'model.path="random"', "model.height=32",
                             "model.width=32", "sampler.num_steps=3", "train.group_size=2",
                             "train.timesteps=\"all\""])
    model = build_model(cfg.model)
    fragments = [(["make it green"], [red], [1, 2]), (["make it green"], [blue], [3, 4])]
    cache = CondCache(1 << 20)
    batcher = StepBatcher(model, cfg.sampler, max_batch=4, cond_cache=cache)
    got: dict[int, list] = {0: [], 1: []}
    batcher.add(0, batcher.encode(fragments[0][0], 2, fragments[0][1]), fragments[0][2], None)
    for tick in range(4):
        if tick == 1:  # the second fragment joins one step behind: other timesteps, other image grids
            batcher.add(1, batcher.encode(fragments[1][0], 2, fragments[1][1]), fragments[1][2], None)
        for key, rec, _ in batcher.step():
            got[key].append(rec)
    assert cache.misses == 2 and batcher.stats.forwards == 4
    assert batcher.encode(fragments[0][0], 1, fragments[0][1])["image_shapes"].tolist() == [[[8, 16]]]
    for n, (prompts, images, seeds) in enumerate(fragments):
        with torch.no_grad():
            cond = cond_repeat(encode_inputs(model, prompts, images), 2)
        ref = list(rollout(model, cond, generator=seeded_generators(seeds), sampler_cfg=cfg.sampler))
        assert len(got[n]) == len(ref) == 3
        for r, e in zip(got[n], ref, strict=True):
            torch.testing.assert_close(r.x_next, e.x_next, atol=1e-5, rtol=0)
            torch.testing.assert_close(r.log_prob, e.log_prob, atol=1e-5, rtol=0)
    assert not torch.allclose(got[0][-1].x_next, got[1][-1].x_next, atol=1e-3)


def test_a_qwen_image_edit_run_trains_end_to_end(tmp_path):
    """configs/edit-tiny.toml with model.family = "qwenimage_edit" (the tiny random transformer)
    through `digenrl launch`, the step batcher on: the input images' tokens and grids travel in
    each fragment's conditioning to the trainer, every admitted trajectory is trained, the
    first ratio is 1 within 1e-6, and final/ holds the LoRA."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "digenrl.cli", "launch", "--config", str(root / "configs" / "edit-tiny.toml"),
         "--steps", "2", "--run-dir", str(run_dir), "--set", 'model.family="qwenimage_edit"',
         "--set", "sampler.max_batch=8", "--set", "sampler.cond_cache_mb=4"],
        cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["steps"] == 2 and acc["trained"] == acc["admitted"] == 16 and acc["in_flight"] == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "ratio_max_dev" in r]
    assert steps[0]["policy_version"] == 1 and steps[0]["ratio_max_dev"] <= 1e-6
    assert (run_dir / "final" / "pytorch_lora_weights.safetensors").is_file()


def test_condition_sizes_on_another_family_and_a_missing_processor_are_one_line(folders, tmp_path):
    import shutil

    from digenrl.config import ConfigError, load_config
    from digenrl.models import ModelFolderError

    with pytest.raises(ConfigError, match=r"model.condition_area = 4096: sizes Qwen-Image-Edit's input images; "
                                          r"model.family = 'flux_kontext' does not read it"):
        load_config(None, ['model.family="flux_kontext"', 'model.path="random"', "model.condition_area=4096"])
    folder = shutil.copytree(folders[0]["qwenimage_edit"], tmp_path / "edit")
    shutil.rmtree(folder / "processor")
    with pytest.raises(ModelFolderError, match=r"processor/ is missing or empty: it should hold Qwen2\.5-VL's "
                                               r"Qwen2VLProcessor \(its tokenizer and image processor\)"):
        build_model(ModelConfig(family="qwenimage_edit", path=str(folder)))
