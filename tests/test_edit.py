"""Image editing: edit prompt files (an input image per prompt, checked at load); FLUX.1 Kontext's
folder generates what its pipeline does, trains with LoRA and full weights, and its final/ loads."""

import itertools
import json

import pytest
import torch
from PIL import Image

from digenrl.config import ModelConfig, PromptConfig
from digenrl.data.prompts import PromptError, load_prompt_set, load_splits
from digenrl.models import build_model
from digenrl.models.base import encode_inputs
from tests.conftest import assert_close_across_instances
from tests.pipelines import (
    MAX_TEXT_TOKENS,
    SMALL,
    load_pipeline,
    one_step_final,
    write_pipeline_folder,
)


def _png(path, color=(200, 30, 30), size=(8, 8)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_edit_jsonl_resolves_images_relative_to_the_file_and_keeps_metadata(tmp_path, monkeypatch):
    _png(tmp_path / "data" / "img" / "a.png")
    _png(tmp_path / "data" / "img" / "b.png", (0, 0, 255))
    f = _jsonl(tmp_path / "data" / "edits.jsonl", [
        {"prompt": "make it blue", "image": "img/a.png", "tag": "color"},
        {"prompt": "merge them", "image": ["img/a.png", "img/b.png"]},
    ])
    monkeypatch.chdir(tmp_path)  # paths resolve against the file's folder, not the cwd
    ps = load_prompt_set(f)
    assert ps.prompts == ["make it blue", "merge them"]
    assert ps.is_edit
    a, b = str((tmp_path / "data/img/a.png").resolve()), str((tmp_path / "data/img/b.png").resolve())
    assert ps.images == [[a], [a, b]]
    assert ps.metadata[0] == {"prompt": "make it blue", "image": a, "tag": "color"}
    # the split keeps each prompt's image with it
    train, test = load_splits(PromptConfig(file=f, test_fraction=0.5, split_seed=0))
    assert test is not None and sorted(train.images + test.images) == sorted(ps.images)


def test_text_prompts_are_not_edits(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a cat\n")
    ps = load_prompt_set(str(f))
    assert not ps.is_edit and ps.images == [[]]


@pytest.mark.parametrize("make, image, message", [
    (lambda d: None, "gone.png", r"line 2: input image '.*gone\.png' does not exist"),
    (lambda d: (d / "x.png").write_bytes(b"not a png at all"), "x.png",
     r"line 2: input image '.*x\.png' is not an image"),
    (lambda d: (d / "t.png").write_bytes(_png(d / "full.png", size=(64, 64)).read_bytes()[:60]),
     "t.png", r"line 2: input image '.*t\.png' (is not a valid image|cannot be read)"),
    (lambda d: (d / "dir.png").mkdir(), "dir.png", r"line 2: input image '.*dir\.png' does not exist"),
    (lambda d: None, 3, r"line 2: expected 'image' to be a path or a list of 1 to 8 paths, got 3"),
    (lambda d: None, [], r"line 2: expected 'image' to be a path or a list"),
])
def test_bad_input_image_is_one_line_naming_the_file_and_the_line(tmp_path, make, image, message):
    _png(tmp_path / "ok.png")
    make(tmp_path)
    f = _jsonl(tmp_path / "e.jsonl", [{"prompt": "fine", "image": "ok.png"},
                                      {"prompt": "bad", "image": image}])
    with pytest.raises(PromptError, match=message) as e:
        load_prompt_set(f)
    assert "\n" not in str(e.value) and "e.jsonl" in str(e.value)


def test_unreadable_image_is_named(tmp_path):
    import os
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    p = _png(tmp_path / "locked.png")
    p.chmod(0)
    f = _jsonl(tmp_path / "e.jsonl", [{"prompt": "x", "image": "locked.png"}])
    with pytest.raises(PromptError, match=r"line 1: input image '.*locked\.png' cannot be read"):
        load_prompt_set(f)


def test_a_file_mixing_edit_and_text_prompts_is_refused(tmp_path):
    _png(tmp_path / "a.png")
    f = _jsonl(tmp_path / "e.jsonl", [{"prompt": "x", "image": "a.png"}, {"prompt": "y"}])
    with pytest.raises(PromptError, match=r"line 2: no 'image' field, but line 1 has one"):
        load_prompt_set(f)


# -- FLUX.1 Kontext -------------------------------------------------------------------------------
PROMPTS = ["make the circle blue", "add a square"]


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    root = tmp_path_factory.mktemp("kontext")
    folder = write_pipeline_folder("flux_kontext", root / "flux_kontext")
    gen = torch.Generator().manual_seed(1)
    paths = []
    for i in range(2):  # input images of another size than the output: resized to it
        px = torch.randint(0, 256, (40, 56, 3), generator=gen, dtype=torch.uint8)
        Image.fromarray(px.numpy()).save(root / f"in{i}.png")
        paths.append(str(root / f"in{i}.png"))
    return folder, paths


def kontext_cfg(folder, **kw) -> ModelConfig:
    return ModelConfig(family="flux_kontext", path=str(folder), max_text_tokens=MAX_TEXT_TOKENS,
                       height=SMALL["height"], width=SMALL["width"], **kw)


def test_kontext_folder_family_is_read_from_model_index(kontext):
    from digenrl.config import detect_family

    assert detect_family(str(kontext[0])) == "flux_kontext"


def test_kontext_generates_what_flux_kontext_pipeline_generates(kontext):
    """Prompts and input images through the folder's encoders, the adapter's Euler steps and the
    VAE decode give the images FluxKontextPipeline makes from the same folder, prompts, images
    and noise (its max_area set to the output's, no preferred-resolution snapping)."""
    from digenrl.models.packing import pack_2x2

    folder, paths = kontext
    model = build_model(kontext_cfg(folder))
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(3))
    pipe = load_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe).__name__ == model.pipeline_class == "FluxKontextPipeline"
    h, w = SMALL["height"], SMALL["width"]
    with torch.no_grad():
        expected = torch.cat([
            pipe(prompt=PROMPTS[i], image=Image.open(paths[i]).convert("RGB"), height=h, width=w,
                 max_area=h * w, _auto_resize=False, latents=pack_2x2(x0[i:i + 1]), num_inference_steps=3,
                 guidance_scale=3.5, output_type="pt", max_sequence_length=MAX_TEXT_TOKENS).images
            for i in range(2)])
        expected = (expected * 255).round().to(torch.uint8)
        cond = encode_inputs(model, PROMPTS, [[p] for p in paths])
        assert cond["image_latents"].shape[1] == pack_2x2(x0).shape[1]  # one token per output token
        x = x0
        for s, s_next in itertools.pairwise(pipe.scheduler.sigmas.tolist()):
            x = x + (s_next - s) * model.velocity(x, s, cond)
        images = model.decode(x)
        # the input image is in the sequence: without it the velocity differs
        text_only = {k: v for k, v in cond.items() if k != "image_latents"}
        assert not torch.allclose(model.velocity(x0, 0.7, cond), model.velocity(x0, 0.7, text_only), atol=1e-4)
    assert images.shape == expected.shape == (2, 3, h, w)
    # round((x + 1) * 127.5) against round((x / 2 + 0.5) * 255): one level at most
    assert (images.int() - expected.int()).abs().max() <= 1


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_kontext_trains_and_final_loads_into_the_pipeline(kontext, lora, tmp_path):
    """One GRPO step on a rollout of its own edit prompts: at K = 0 the first ratio is 1 within
    1e-6 (the trainer's forward uses the rollout's conditioning, image tokens included); final/
    loads into FluxKontextPipeline (LoRA: load_lora_weights; full: the transformer folder) and
    gives the trained velocity, not the base one."""
    from digenrl.models.families import SPECS

    folder, paths = kontext
    model = build_model(kontext_cfg(folder, lora_rank=2 if lora else 0))
    cond = encode_inputs(model, PROMPTS, [[p] for p in paths])
    x, v_base, final = one_step_final(model, cond, tmp_path)
    pipe = load_pipeline(folder)
    with torch.no_grad():
        if lora:
            pipe.load_lora_weights(final)
        else:
            pipe.transformer = SPECS["flux_kontext"].cls.from_pretrained(final, local_files_only=True)
        loaded = SPECS["flux_kontext"].adapter(pipe.transformer, encoder=model.encoder, decoder=model.decoder,
                                               latent_shape=model.latent_shape)
        loaded.guidance = model.guidance
        v_trained, v_loaded = model.velocity(x, 0.6, cond), loaded.velocity(x, 0.6, cond)
    assert not torch.allclose(v_trained, v_base, atol=1e-3)  # the training is in the file
    assert_close_across_instances(v_loaded, v_trained)


# -- edit rewards ---------------------------------------------------------------------------------
def _edit_meta(tmp_path, n=2, size=(48, 32)):
    """n edit-prompt records with real input images (of another size than the outputs)."""
    gen = torch.Generator().manual_seed(7)
    meta = []
    for i in range(n):
        px = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8)
        Image.fromarray(px.numpy()).save(tmp_path / f"r{i}.png")
        meta.append({"prompt": f"edit {i}", "image": str(tmp_path / f"r{i}.png")})
    return meta


def test_input_ssim_is_one_for_the_unchanged_input_and_falls_with_change(tmp_path):
    from digenrl.config import RewardTerm
    from digenrl.rl.rewards import build_reward
    from digenrl.rl.rewards.base import input_images

    meta = _edit_meta(tmp_path)
    inputs = input_images("t", meta, 16, 24)  # resized to the outputs' 16 x 24
    assert inputs.shape == (2, 3, 16, 24) and inputs.dtype == torch.uint8
    noisy = (inputs.int() + torch.randint(-60, 61, inputs.shape, generator=torch.Generator().manual_seed(0))
             ).clamp(0, 255).to(torch.uint8)
    flat = torch.full_like(inputs, 128)
    reward = build_reward([RewardTerm(name="input_ssim")])
    same, _ = reward(inputs, ["a", "b"], meta)
    # exact: SSIM of an image with itself is (2m^2+c1)(2v+c2) / ((2m^2+c1)(2v+c2)) in float64
    assert torch.allclose(same, torch.ones(2), atol=1e-6), same
    worse, _ = reward(noisy, ["a", "b"], meta)
    worst, _ = reward(flat, ["a", "b"], meta)
    assert (worse < 0.95).all() and (worst < worse).all(), (worse, worst)


def test_a_term_that_needs_input_images_on_text_prompts_is_a_reward_error():
    from digenrl.config import RewardTerm
    from digenrl.rl.rewards import RewardError, build_reward

    reward = build_reward([RewardTerm(name="input_ssim")])
    with pytest.raises(RewardError, match="takes input_images, but prompt 'a cat' has no input image"):
        reward(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), ["a cat"])


def test_existing_rewards_and_plugins_without_input_images_work_on_edit_prompts(tmp_path):
    from digenrl.config import RewardTerm
    from digenrl.rl.rewards import build_reward

    meta = _edit_meta(tmp_path)
    images = torch.randint(0, 256, (2, 3, 16, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    reward = build_reward([RewardTerm(name="brightness"), RewardTerm(name="input_ssim", weight=0.5)])
    total, parts = reward(images, ["a", "b"], meta)
    assert set(parts) == {"brightness", "input_ssim"}
    assert torch.allclose(total, parts["brightness"] + 0.5 * parts["input_ssim"])


def test_vlm_judge_sees_the_input_image_then_the_output_on_edit_prompts(tmp_path):
    import base64
    import io

    from reward_servers import chat_server

    from digenrl.config import RewardTerm
    from digenrl.rl.rewards import build_reward

    meta = _edit_meta(tmp_path, 1)
    with chat_server(lambda q: "8" if "edit" in q else "1") as server:
        reward = build_reward([RewardTerm(name="vlm_judge", args={"url": server.url + "/v1", "model": "m"})])
        out = torch.zeros(1, 3, 16, 24, dtype=torch.uint8)
        total, _ = reward(out, ["edit 0"], meta)
        text_total, _ = reward(out, ["a cat"])  # a text prompt: one image, the text template
    assert total.tolist() == pytest.approx([0.8]) and text_total.tolist() == pytest.approx([0.1])
    edit_req, text_req = server.requests
    shown = [c for c in edit_req["body"]["messages"][0]["content"] if c["type"] == "image_url"]
    assert len(shown) == 2
    assert len([c for c in text_req["body"]["messages"][0]["content"] if c["type"] == "image_url"]) == 1
    first = Image.open(io.BytesIO(base64.b64decode(shown[0]["image_url"]["url"].split(",", 1)[1])))
    second = Image.open(io.BytesIO(base64.b64decode(shown[1]["image_url"]["url"].split(",", 1)[1])))
    assert first.size == second.size == (24, 16)
    # the first image is the input (random pixels), the second the black output
    def luma(im):
        return torch.frombuffer(bytearray(im.convert("L").tobytes()), dtype=torch.uint8).float()

    assert luma(first).std() > 10, luma(first).std()
    assert luma(second).max() < 10
    q = next(c["text"] for c in edit_req["body"]["messages"][0]["content"] if c["type"] == "text")
    assert "first image is the input" in q and '"edit 0"' in q


def test_edit_family_and_prompt_kind_must_agree_before_anything_starts(tmp_path):
    from digenrl.config import load_config
    from digenrl.launch import _check_prompts

    _png(tmp_path / "a.png")
    _png(tmp_path / "b.png")
    edits = _jsonl(tmp_path / "e.jsonl", [{"prompt": f"edit {i}", "image": "a.png"} for i in range(4)])
    two = _jsonl(tmp_path / "two.jsonl", [{"prompt": "x", "image": ["a.png", "b.png"]}])
    text = tmp_path / "t.txt"
    text.write_text("a cat\na dog\n")
    kontext = ["model.family=\"flux_kontext\"", "model.path=\"random\""]
    _check_prompts(load_config(None, [*kontext, f"prompts.file=\"{edits}\""]))  # agrees: no error
    with pytest.raises(PromptError, match=r"model.family = 'flux_kontext' edits images; expected a .jsonl"):
        _check_prompts(load_config(None, [*kontext, f"prompts.file=\"{text}\""]))
    with pytest.raises(PromptError, match=r"gives 2 input images; model.family = 'flux_kontext' takes at most 1"):
        _check_prompts(load_config(None, [*kontext, f"prompts.file=\"{two}\""]))
    with pytest.raises(PromptError, match=r"holds edit prompts \(input images\), but model.family = 'sd3'"):
        _check_prompts(load_config(None, ["model.family=\"sd3\"", f"prompts.file=\"{edits}\""]))


# -- evaluation and the CPU demo ------------------------------------------------------------------
def test_evaluation_of_edits_generates_from_each_prompts_input_image(tmp_path):
    """The held-out prompts carry their input images: the same prompts and seeds with other
    input images give other samples, and the eval reward sees those inputs."""
    from digenrl.config import RewardTerm, load_config
    from digenrl.rl.evaluate import evaluate
    from digenrl.rl.rewards import build_reward

    _png(tmp_path / "red.png", (220, 30, 30), (32, 32))
    _png(tmp_path / "blue.png", (35, 70, 220), (32, 32))
    sets = {c: load_prompt_set(_jsonl(tmp_path / f"{c}.jsonl", [{"prompt": "make it green", "image": f"{c}.png"}]))
            for c in ("red", "blue")}
    cfg = load_config(None, ["model.family=\"flux_kontext\"", "model.path=\"random\"", "model.height=32",
                             "model.width=32", "sampler.num_steps=4", "eval.samples_per_prompt=2"])
    model = build_model(cfg.model)
    reward = build_reward([RewardTerm(name="input_ssim")])
    red = evaluate(model, cfg, sets["red"], reward, version=0, run_dir=tmp_path / "run")
    assert red["eval/samples"] == 2 and -1 <= red["eval/input_ssim"] <= 1
    rows = [json.loads(x) for x in (tmp_path / "run" / "eval" / "v0000.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["make it green"] * 2
    from digenrl.rl.evaluate import generate
    a, _ = generate(model, cfg, sets["red"])
    b, _ = generate(model, cfg, sets["blue"])
    assert not torch.equal(a, b)  # the input image conditions the samples


def test_the_edit_demo_config_runs_end_to_end(tmp_path):
    """configs/edit-tiny.toml through `digenrl launch` (rollout, trainer and coordinator
    processes; the input image tokens travel in each fragment's conditioning): every admitted
    trajectory trained, the first ratio 1 within 1e-6, evaluations of the held-out edits."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "digenrl.cli", "launch", "--config", str(root / "configs" / "edit-tiny.toml"),
         "--steps", "2", "--run-dir", str(run_dir), "--set", "run.eval_every=2"],
        cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["steps"] == 2 and acc["trained"] == acc["admitted"] == 16 and acc["in_flight"] == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "ratio_max_dev" in r]
    assert steps[0]["policy_version"] == 1 and steps[0]["ratio_max_dev"] <= 1e-6
    evals = [r for r in rows if "eval/input_ssim" in r]
    assert [r["policy_version"] for r in evals] == [0, 2]
    assert (run_dir / "eval" / "v0002.jsonl").is_file()
    assert (run_dir / "final" / "pytorch_lora_weights.safetensors").is_file()


def test_the_cost_model_counts_kontexts_input_image_tokens():
    """flux_kontext's forward is FLUX.1's two-term formula (fitted to the "flux" entry) at
    4,096 output + 4,096 input-image + 512 text tokens, to the 0.1 TF the entry is written to;
    without the input tokens it would be about 74 TF."""
    from digenrl.config import load_config
    from digenrl.core.costmodel import MODELS
    from digenrl.models.meta import cost_model_name

    quad = 4 * 57 * 3072  # 4 L d
    s0 = 2025 + 512  # the flux entry's 720 px sequence
    lin = (MODELS["flux"].fwd_tflop * 1e12 - quad * s0**2) / s0  # 2 P_tok
    s = 2 * 4096 + 512
    assert MODELS["flux_kontext"].fwd_tflop == pytest.approx((lin * s + quad * s**2) / 1e12, abs=0.1)
    assert MODELS["flux_kontext"].fwd_tflop > 2 * (lin * (s - 4096) + quad * (s - 4096) ** 2) / 1e12
    cfg = load_config(None, ["model.family=\"flux_kontext\"", "model.path=\"emulated\""])
    assert cost_model_name(cfg.model) == "flux_kontext"


def test_cfg_on_edits_keeps_the_input_image_in_the_unconditional_pass(tmp_path):
    """Kontext's true CFG: the empty prompt's pass still sees the input image."""
    from digenrl.models.base import cond_repeat
    from digenrl.rl.sampler import guided_velocity

    _png(tmp_path / "a.png", (220, 30, 30), (32, 32))
    model = build_model(ModelConfig(family="flux_kontext", path="random", height=32, width=32))
    cond = encode_inputs(model, ["make it blue"], [[str(tmp_path / "a.png")]])
    uncond = model.encode_prompts([""])
    x = torch.randn(1, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = guided_velocity(model, x, 0.5, cond, guidance_scale=3.0, uncond=uncond)
        v_c = model.velocity(x, 0.5, cond)
        v_u = model.velocity(x, 0.5, {**cond_repeat(uncond, 1), "image_latents": cond["image_latents"]})
    # one batched forward against two: the same math, float32 reductions may order differently
    torch.testing.assert_close(got, v_u + 3.0 * (v_c - v_u), rtol=1e-5, atol=1e-5)
