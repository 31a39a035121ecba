"""Model rewards on tiny random models in their real folder layouts (the real code path, no
downloads), and the OCR reward on the PP-OCR weights its PyPI package ships."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from reward_models import tiny_clip_folder, to_open_clip

from digenrl.config import RewardTerm
from digenrl.rl.rewards import RewardError, build_reward
from digenrl.rl.rewards.local import clip_pixels

# exact comparisons run on the CPU in float32 (device "auto" would take a GPU and bf16 there)
PROMPTS = ["a red square", "a blue circle on a green background", "a cat"]


def images(n: int = 3, size: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)


def reference_logits(model, folder, imgs, prompts) -> torch.Tensor:
    """transformers' own CLIPModel forward: logit_scale * cos on the diagonal."""
    from transformers import CLIPTokenizer
    tok = CLIPTokenizer.from_pretrained(str(folder))(prompts, padding="max_length", max_length=16,
                                                     truncation=True, return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"],
                    pixel_values=clip_pixels(imgs, 32, torch.device("cpu"), torch.float32))
    return out.logits_per_image.diagonal()


def test_pickscore_and_clipscore_equal_transformers_clip_forward(tmp_path):
    model = tiny_clip_folder(tmp_path / "clip")
    ref = reference_logits(model, tmp_path / "clip", images(), PROMPTS)
    pick = build_reward([RewardTerm(name="pickscore", args={"device": "cpu", "weights": str(tmp_path / "clip"), "batch_size": 2})])
    clip = build_reward([RewardTerm(name="clipscore", args={"device": "cpu", "weights": str(tmp_path / "clip")})])
    # same weights, same inputs, our batching (2 + 1) vs one forward: float32 rounding only
    torch.testing.assert_close(pick(images(), PROMPTS)[0], ref, rtol=1e-5, atol=1e-5)
    cos = ref / model.logit_scale.exp()
    torch.testing.assert_close(clip(images(), PROMPTS)[0], cos.clamp_min(0), rtol=1e-5, atol=1e-5)


def test_scores_depend_on_the_prompt(tmp_path):
    tiny_clip_folder(tmp_path / "clip", seed=3)
    pick = build_reward([RewardTerm(name="pickscore", args={"device": "cpu", "weights": str(tmp_path / "clip")})])
    a = pick(images(1).expand(2, -1, -1, -1).contiguous(), ["a red square", "two dogs running"])[0]
    assert a[0] != a[1]


def test_bf16_towers_stay_close_to_float32(tmp_path):
    tiny_clip_folder(tmp_path / "clip")
    args = {"device": "cpu", "weights": str(tmp_path / "clip")}
    f32 = build_reward([RewardTerm(name="clipscore", args=args)])(images(), PROMPTS)[0]
    b16 = build_reward([RewardTerm(name="clipscore", args={**args, "dtype": "bfloat16"})])(images(), PROMPTS)[0]
    assert b16.dtype == torch.float32
    # bf16 keeps 8 mantissa bits: cosines of unit vectors move by ~1e-2 at most in 2 layers
    torch.testing.assert_close(b16, f32, rtol=0, atol=5e-2)


def test_aesthetic_is_the_laion_mlp_on_the_normalised_image_embedding(tmp_path):
    model = tiny_clip_folder(tmp_path / "aes")
    torch.manual_seed(1)
    dims = [8, 1024, 128, 64, 16, 1]
    head = {}
    for idx, (i, o) in zip((0, 2, 4, 6, 7), itertools.pairwise(dims)):
        head[f"layers.{idx}.weight"], head[f"layers.{idx}.bias"] = torch.randn(o, i) / i ** 0.5, torch.randn(o)
    torch.save(head, tmp_path / "aes" / "sac+logos+ava1-l14-linearMSE_aesthetic.pth")
    got = build_reward([RewardTerm(name="aesthetic", args={"device": "cpu", "weights": str(tmp_path / "aes")})])(images(), PROMPTS)[0]
    with torch.no_grad():
        emb = model.visual_projection(model.vision_model(
            pixel_values=clip_pixels(images(), 32, torch.device("cpu"), torch.float32)).pooler_output)
        x = F.normalize(emb, dim=-1)
        for idx in (0, 2, 4, 6, 7):
            x = x @ head[f"layers.{idx}.weight"].t() + head[f"layers.{idx}.bias"]
    torch.testing.assert_close(got, x.squeeze(-1), rtol=1e-5, atol=1e-5)


def test_hpsv2_runs_an_open_clip_checkpoint_as_the_clip_it_is(tmp_path):
    model = tiny_clip_folder(tmp_path / "src")
    folder = tmp_path / "hps"
    from reward_models import tiny_clip_tokenizer
    tiny_clip_tokenizer(folder)
    torch.save({"state_dict": to_open_clip(model.state_dict())}, folder / "HPS_v2.1_compressed.pt")
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": {
        "embed_dim": 8, "vision_cfg": {"image_size": 32, "layers": 2, "width": 16, "head_width": 8,
                                       "patch_size": 8, "mlp_ratio": 2.0},
        "text_cfg": {"context_length": 16, "vocab_size": model.config.text_config.vocab_size,
                     "width": 16, "heads": 2, "layers": 2, "mlp_ratio": 2.0}}}))
    got = build_reward([RewardTerm(name="hpsv2", args={"device": "cpu", "weights": str(folder)})])(images(), PROMPTS)[0]
    ref = reference_logits(model, tmp_path / "src", images(), PROMPTS) / model.logit_scale.exp()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["pickscore", "clipscore", "aesthetic", "hpsv2", "imagereward", "ocr"])
def test_a_missing_weights_folder_is_one_line_naming_the_path_and_its_content(tmp_path, name):
    missing = tmp_path / "nope"
    with pytest.raises(RewardError) as info:
        build_reward([RewardTerm(name=name, args={"weights": str(missing)})])
    msg = str(info.value)
    assert "\n" not in msg and str(missing) in msg and "should hold" in msg, msg


def test_a_folder_without_the_model_says_what_belongs_there(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RewardError, match=r"pickscore: no vocab.json in .*empty.*CLIPModel"):
        build_reward([RewardTerm(name="pickscore", args={"weights": str(tmp_path / "empty")})])


def _text_image(text: str, size: tuple[int, int] = (192, 64)) -> torch.Tensor:
    from PIL import Image, ImageDraw, ImageFont
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((8, 10), text, fill="black", font=ImageFont.load_default(size=36))
    return torch.from_numpy(__import__("numpy").asarray(img).copy()).permute(2, 0, 1)


@pytest.fixture(scope="module")
def ocr_models():
    """The PP-OCR ONNX models the rapidocr_onnxruntime wheel ships (real weights, no download)."""
    from pathlib import Path

    import rapidocr_onnxruntime  # the rewards extra, which ./dev.sh test installs
    return str(Path(rapidocr_onnxruntime.__file__).parent / "models")


def test_ocr_scores_an_image_that_shows_the_quoted_text_near_one_and_a_blank_near_zero(ocr_models):
    reward = build_reward([RewardTerm(name="ocr", args={"weights": ocr_models, "device": "cpu"})])
    imgs = torch.stack([_text_image("OPEN"), _text_image("OPEN"), _text_image("")])
    total, _ = reward(imgs, ['a sign that says "open"', 'a sign that says "CLOSED"', 'a sign that says "OPEN"'],
                      [{}, {}, {}])
    assert total[0].item() == 1.0        # read "OPEN", target "open": case and spaces ignored
    assert total[1].item() < 0.5         # "OPEN" vs "CLOSED": distance 5 of 6 (4 with luck)
    assert total[2].item() == 0.0        # nothing read: distance = length


def test_ocr_target_comes_from_metadata_text_and_a_prompt_without_one_is_named(ocr_models):
    from digenrl.rl.rewards.ocr import ocr_score, target_text
    assert target_text("anything", {"text": "Hi There"}) == "Hi There"
    assert target_text('a mug reading "best dad" in red', {}) == "best dad"
    assert ocr_score("bestdad", "Best Dad") == 1.0 and ocr_score("bcst dad", "best dad") == pytest.approx(6 / 7)
    reward = build_reward([RewardTerm(name="ocr", args={"weights": ocr_models})])
    with pytest.raises(RewardError, match=r"ocr: prompt 'a cat' quotes no text"):
        reward(_text_image("x").unsqueeze(0), ["a cat"])


def test_imagereward_is_blips_grounded_cls_feature_through_the_mlp_standardised(tmp_path):
    from reward_models import tiny_imagereward_folder

    from digenrl.rl.rewards.imagereward import MEAN, STD
    tok, vision, text, mlp = tiny_imagereward_folder(tmp_path / "ir")
    got = build_reward([RewardTerm(name="imagereward", args={"device": "cpu", "weights": str(tmp_path / "ir"),
                                                             "batch_size": 2})])(images(), PROMPTS)[0]
    with torch.no_grad():  # the ImageReward package's score, step by step, on the same towers
        emb = vision(pixel_values=clip_pixels(images(), 32, torch.device("cpu"), torch.float32)).last_hidden_state
        t = tok(PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
        out = text(input_ids=t["input_ids"], attention_mask=t["attention_mask"], encoder_hidden_states=emb,
                   encoder_attention_mask=torch.ones(emb.shape[:-1], dtype=torch.long))
        ref = (mlp(out.last_hidden_state[:, 0, :]).squeeze(-1) - MEAN) / STD
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got[0] != got[2]
