"""The diffusers adapters on tiny random configs of the real model classes (CPU, 1 thread).

Exactness (see tests/conftest.py): weights are compared bit for bit (what is saved, synced or
seeded must come back unchanged); outputs of two *different* module instances are compared with
:func:`assert_close_across_instances`, because identical weights at other addresses may take
other kernel paths; outputs of the *same* instance on the same input are compared exactly
(ratio == 1 on recompute, the adapter toggled off and on).
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from digenrl.config import ModelConfig, SamplerConfig
from digenrl.models import (
    TINY_CONFIGS,
    FlowModel,
    HashPromptEncoder,
    ModelFolderError,
    NoAdapterError,
    PixelDecoder,
    SyncStateError,
    build_model,
    encode_images,
)
from digenrl.rl.sampler import rollout, seeded_generators
from digenrl.rl.sde import sde_step
from tests.conftest import assert_close_across_instances, assert_same_weights

FAMILIES = ["sd3", "flux", "qwenimage", "wan", "hunyuanvideo", "flux2", "zimage"]
PROMPTS = ["a red circle", "a blue square", "a green triangle on the left", ""]
# The last block's text stream feeds nothing (its text output is dropped), so these may get no gradient.
#: Parameters a forward may leave without gradient: the last block's text stream, and Z-Image's
#: padding tokens (used only when a sequence is not a multiple of its 32-token blocks).
TEXT_STREAM = re.compile(r"add_|txt_|norm_added|x_pad_token|cap_pad_token")


def tiny(family: str, **kw) -> FlowModel:
    return build_model(ModelConfig(family=family, path="random", **kw), seed=0)


def latents(model: FlowModel, batch: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, *model.latent_shape, generator=torch.Generator().manual_seed(seed))


def perturb_lora(model: FlowModel, seed: int = 3) -> None:
    """LoRA starts with B = 0 (a no-op); give it weights so enabling it changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("family", FAMILIES)
def test_recomputed_log_probs_of_a_rollout_give_ratio_exactly_one(family):
    model = tiny(family)
    cond = model.encode_prompts(PROMPTS)
    cfg = SamplerConfig(num_steps=3, noise_level=0.7)
    records = list(rollout(model, cond, generator=seeded_generators([10, 11, 12, 13]), sampler_cfg=cfg))
    assert len(records) == 3
    sigma_max = records[1].sigma
    for rec in records:
        v = model.velocity(rec.x_t, torch.full((4,), rec.sigma), cond)  # grad enabled, as in training
        new = sde_step("sde", rec.x_t, v, rec.sigma, rec.sigma_next, noise_level=cfg.noise_level,
                       eta=cfg.eta, sigma_max=sigma_max, x_next=rec.x_next).log_prob
        assert torch.isfinite(new).all()
        assert new.requires_grad
        assert torch.equal(torch.exp(new - rec.log_prob), torch.ones(4))


@pytest.mark.parametrize("family", FAMILIES)
def test_backward_gives_finite_nonzero_gradients_on_trainable_parameters(family):
    model = tiny(family)
    v = model.velocity(latents(model, 2), torch.tensor([0.9, 0.4]), model.encode_prompts(PROMPTS[:2]))
    assert v.dtype == torch.float32 and v.shape == (2, *model.latent_shape)
    v.pow(2).mean().backward()
    params = dict(model.transformer.named_parameters())
    assert {id(p) for p in model.trainable_parameters()} == {id(p) for p in params.values()}
    silent = [n for n, p in params.items() if p.grad is None or not p.grad.any()]
    assert all(TEXT_STREAM.search(n) for n in silent), silent
    assert len(silent) < 0.2 * len(params)
    assert all(torch.isfinite(p.grad).all() for p in params.values() if p.grad is not None)


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_model_reloads_with_identical_velocity(family, tmp_path):
    model = tiny(family)
    x, cond = latents(model, 2), model.encode_prompts(PROMPTS[:2])
    model.save(tmp_path)
    assert (tmp_path / "config.json").exists()
    reloaded = build_model(ModelConfig(family=family, path=str(tmp_path)), seed=99)
    assert reloaded.latent_shape == model.latent_shape
    assert_same_weights(reloaded.transformer.state_dict(), model.transformer.state_dict())
    with torch.no_grad():
        assert_close_across_instances(reloaded.velocity(x, 0.6, cond), model.velocity(x, 0.6, cond))


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_trains_only_the_adapter_and_disabling_it_gives_the_base_model(family):
    base, lora = tiny(family), tiny(family, lora_rank=2)
    perturb_lora(lora)
    names = [n for n, p in lora.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert sum(1 for _ in lora.trainable_parameters()) == len(names)
    x, cond = latents(base, 2), base.encode_prompts(PROMPTS[:2])
    with torch.no_grad():
        v_base, v_lora = base.velocity(x, 0.5, cond), lora.velocity(x, 0.5, cond)
        with lora.adapter_disabled():
            v_ref = lora.velocity(x, 0.5, cond)
        assert torch.equal(lora.velocity(x, 0.5, cond), v_lora)  # re-enabled on exit: same instance, same input
    assert not torch.allclose(v_lora, v_base)
    assert_close_across_instances(v_ref, v_base)

    sd = lora.sync_state_dict()
    assert sd and all("lora_" in k for k in sd)
    peer = tiny(family, lora_rank=2)
    peer.load_sync_state_dict(sd)
    assert_same_weights(peer.sync_state_dict(), sd)
    with torch.no_grad():
        assert_close_across_instances(peer.velocity(x, 0.5, cond), v_lora)


def test_sync_state_dict_with_wrong_keys_is_rejected_naming_them():
    model = tiny("sd3", lora_rank=2)
    sd = model.sync_state_dict()
    missing = sorted(sd)[0]
    del sd[missing]
    with pytest.raises(SyncStateError, match=re.escape(missing)):
        model.load_sync_state_dict(sd)


def test_full_finetune_sync_state_dict_round_trips_all_parameters():
    src, dst = tiny("sd3"), build_model(ModelConfig(family="sd3", path="random"), seed=1)
    x, cond = latents(src, 2), src.encode_prompts(PROMPTS[:2])
    sd = src.sync_state_dict()
    assert set(sd) == set(src.transformer.state_dict())
    dst.load_sync_state_dict(sd)
    assert_same_weights(dst.sync_state_dict(), sd)
    with torch.no_grad():
        assert_close_across_instances(dst.velocity(x, 0.3, cond), src.velocity(x, 0.3, cond))


def test_adapter_disabled_without_lora_raises():
    with pytest.raises(NoAdapterError, match="lora_rank=0"), tiny("sd3").adapter_disabled():
        pass


def test_default_tiny_sd3_is_rgb_32x32_pixel_unshuffled():
    model = tiny("sd3")
    assert TINY_CONFIGS["sd3"]["in_channels"] == 12
    assert model.latent_shape == (12, 16, 16)
    img = model.decode(latents(model, 3))
    assert img.dtype == torch.uint8 and img.shape == (3, 3, 32, 32)


def test_random_init_depends_on_seed_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a = build_model(ModelConfig(family="sd3", path="random"), seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    b = build_model(ModelConfig(family="sd3", path="random"), seed=0)
    c = build_model(ModelConfig(family="sd3", path="random"), seed=1)
    wa, wb, wc = (m.transformer.proj_out.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)  # RNG bits: the same seed gives the same init everywhere


def test_gradient_checkpointing_gives_the_same_gradients():
    plain, ckpt = tiny("sd3"), tiny("sd3", gradient_checkpointing=True)
    x, cond = latents(plain, 2), plain.encode_prompts(PROMPTS[:2])
    for m in (plain, ckpt):
        m.transformer.train()
        m.velocity(x, 0.5, cond).pow(2).mean().backward()
    g1, g2 = plain.transformer.proj_out.weight.grad, ckpt.transformer.proj_out.weight.grad
    assert torch.allclose(g1, g2, atol=1e-6)


def test_bfloat16_model_returns_float32_velocity():
    model = tiny("sd3", dtype="bfloat16")
    assert model.transformer.dtype == torch.bfloat16
    v = model.velocity(latents(model, 2), 0.5, model.encode_prompts(PROMPTS[:2]))
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


def test_missing_builtin_folder_error_names_the_folder():
    with pytest.raises(ModelFolderError, match="base-flux-tiny"):
        build_model(ModelConfig(family="flux", path="builtin"))


def test_folder_without_a_config_is_rejected(tmp_path):
    with pytest.raises(ModelFolderError, match=r"config\.json"):
        build_model(ModelConfig(family="sd3", path=str(tmp_path)))


# -- prompts -------------------------------------------------------------------------------------
def test_hash_encoder_gives_different_words_different_embeddings():
    enc = HashPromptEncoder(dim=32, pooled_dim=32, max_tokens=8, seed=0)
    out = enc(["a red circle", "a blue circle", "a red square", "A  Red, circle!"])
    e, p = out["prompt_embeds"], out["pooled_embeds"]
    assert not torch.equal(e[0], e[1]) and not torch.equal(e[0], e[2])
    assert not torch.allclose(p[0], p[1]) and not torch.allclose(p[0], p[2])
    assert torch.equal(e[0], e[3]) and torch.equal(p[0], p[3])  # case and punctuation do not matter
    assert out["prompt_mask"][0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert not e[0, 3:].any()


def test_hash_encoder_is_deterministic_per_seed_and_truncates():
    a = HashPromptEncoder(16, 8, max_tokens=2, seed=0)(["one two three"])
    b = HashPromptEncoder(16, 8, max_tokens=2, seed=0)(["one two three"])
    c = HashPromptEncoder(16, 8, max_tokens=2, seed=1)(["one two three"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["prompt_embeds"], c["prompt_embeds"])
    assert a["prompt_embeds"].shape == (1, 2, 16) and a["prompt_mask"].tolist() == [[1, 1]]
    empty = HashPromptEncoder(16, 8)([""])
    assert not empty["prompt_embeds"].any() and not empty["prompt_mask"].any()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_prompt_changes_the_velocity(family):
    model = tiny(family)
    x = latents(model, 1).repeat(2, *(1,) * len(model.latent_shape))
    with torch.no_grad():
        v = model.velocity(x, 0.5, model.encode_prompts(["a red circle", "a blue square"]))
    assert not torch.allclose(v[0], v[1])


# -- pixels --------------------------------------------------------------------------------------
def test_pixel_decoder_inverts_encode_images_exactly():
    images = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    z = encode_images(images)
    assert z.shape == (3, 12, 16, 16) and z.min() >= -1 and z.max() <= 1
    assert torch.equal(PixelDecoder(12)(z), images)


def test_video_frames_are_tiled_left_to_right():
    frames = torch.randint(0, 256, (2, 2, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    z = torch.stack([encode_images(frames[:, f]) for f in range(2)], dim=2)  # (B, C, F, H, W)
    img = PixelDecoder(12)(z)
    assert img.shape == (2, 3, 16, 32)
    assert torch.equal(img[..., :16], frames[:, 0]) and torch.equal(img[..., 16:], frames[:, 1])


def test_latents_that_are_not_3rr_channels_decode_through_a_fixed_projection():
    z = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    da, db = PixelDecoder(16), PixelDecoder(16)
    assert torch.equal(da._proj, db._proj)  # RNG bits: the projection is fixed by its seed
    a, b = da(z), db(z)
    assert a.shape == (2, 3, 8, 8) and a.dtype == torch.uint8
    assert (a.int() - b.int()).abs().max() <= 1  # two instances: a matmul may round a pixel the other way
    with pytest.raises(ValueError, match="channels=16"):
        encode_images(a, channels=16)


# -- conventions against the diffusers pipelines ---------------------------------------------------
def pipeline_call(family: str, model: FlowModel, cond, x0):
    """(pipeline, its kwargs, output -> unpacked latents) for a 3-step latent-only run of ``family``."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    from digenrl.models.packing import pack_2x2, unpack_2x2

    sch, t = FlowMatchEulerDiscreteScheduler(shift=3.0), model.transformer
    no_text = dict(text_encoder=None, tokenizer=None, vae=None)
    if family == "sd3":
        pipe = diffusers.StableDiffusion3Pipeline(transformer=t, scheduler=sch, text_encoder_2=None, tokenizer_2=None,
                                                  text_encoder_3=None, tokenizer_3=None, **no_text)
        return pipe, dict(prompt_embeds=cond["prompt_embeds"], pooled_prompt_embeds=cond["pooled_embeds"],
                          latents=x0, height=128, width=128, guidance_scale=1.0), lambda out: out.images
    if family == "flux":
        pipe = diffusers.FluxPipeline(transformer=t, scheduler=sch, text_encoder_2=None, tokenizer_2=None, **no_text)
        return pipe, dict(prompt_embeds=cond["prompt_embeds"], pooled_prompt_embeds=cond["pooled_embeds"],
                          latents=pack_2x2(x0), height=128, width=128, guidance_scale=3.5), \
            lambda out: unpack_2x2(out.images, 16, 16)
    if family == "qwenimage":
        pipe = diffusers.QwenImagePipeline(transformer=t, scheduler=sch, **no_text)
        return pipe, dict(prompt_embeds=cond["prompt_embeds"], prompt_embeds_mask=cond["prompt_mask"],
                          latents=pack_2x2(x0), height=128, width=128, true_cfg_scale=1.0), \
            lambda out: unpack_2x2(out.images, 16, 16)
    if family == "wan":
        pipe = diffusers.WanPipeline(transformer=t, scheduler=sch, **no_text)
        return pipe, dict(prompt_embeds=cond["prompt_embeds"], latents=x0, height=64, width=64, num_frames=5,
                          guidance_scale=1.0), lambda out: out.frames
    if family == "flux2":  # dev's pipeline: klein's un-patchifies through the VAE even for latents
        c, h, w = model.latent_shape
        pipe = diffusers.Flux2Pipeline(transformer=t, scheduler=sch, **no_text)
        return pipe, dict(prompt_embeds=cond["prompt_embeds"], latents=x0, height=16 * h, width=16 * w,
                          guidance_scale=4.0), lambda out: out.images.transpose(1, 2).reshape(-1, c, h, w)
    if family == "zimage":
        rows = [e[m.bool()] for e, m in zip(cond["prompt_embeds"], cond["prompt_mask"], strict=True)]
        pipe = diffusers.ZImagePipeline(transformer=t, scheduler=sch, **no_text)
        return pipe, dict(prompt_embeds=rows, latents=x0, height=8 * x0.shape[-2], width=8 * x0.shape[-1],
                          guidance_scale=0.0), lambda out: out.images
    pipe = diffusers.HunyuanVideoPipeline(transformer=t, scheduler=sch, text_encoder_2=None, tokenizer_2=None, **no_text)
    return pipe, dict(prompt_embeds=cond["prompt_embeds"], pooled_prompt_embeds=cond["pooled_embeds"],
                      prompt_attention_mask=cond["prompt_mask"], latents=x0, height=64, width=64, num_frames=5,
                      guidance_scale=6.0), lambda out: out.frames


@pytest.mark.parametrize("family", FAMILIES)
def test_euler_steps_with_adapter_velocity_reproduce_the_diffusers_pipeline(family):
    """Timestep scaling, packing, ids, masks, guidance and the sign of v all match diffusers' own loop."""
    model = tiny(family)
    cond = model.encode_prompts(PROMPTS[:2])
    x0 = latents(model, 2, seed=7)
    pipe, kwargs, unpack = pipeline_call(family, model, cond, x0)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        expected = unpack(pipe(num_inference_steps=3, output_type="latent", **kwargs))
        sigmas = pipe.scheduler.sigmas.tolist()
        x = x0
        for s, s_next in itertools.pairwise(sigmas):
            x = x + (s_next - s) * model.velocity(x, s, cond)
    assert len(sigmas) == 4 and not torch.allclose(x, x0)
    # Two code paths (ours and diffusers' loop) may order float ops differently, so the last
    # bits may differ; a wrong convention (timestep scale, packing, ids, sign) is an O(1) error.
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


def test_z_image_gets_its_timestep_in_float32_in_a_bfloat16_model_as_its_pipeline_passes_it():
    """ZImagePipeline keeps latents and ``(1000 - t) / 1000`` in float32 and casts only the
    latents for the transformer; a bfloat16 timestep would be another model input."""
    model = tiny("zimage", dtype="bfloat16")
    x = latents(model, 2)
    cond = model.encode_prompts(PROMPTS[:2])
    sigma = 0.7624328136444092  # a shifted sigma bfloat16 cannot hold
    with torch.no_grad():
        v = model.velocity(x, sigma, cond)
        rows = [e[m.bool()].to(torch.bfloat16) for e, m in zip(cond["prompt_embeds"], cond["prompt_mask"], strict=True)]
        xs = list(x.to(torch.bfloat16).unsqueeze(2).unbind(0))
        t32 = 1 - torch.full((2,), sigma, dtype=torch.float32)
        expected = -torch.stack(model.transformer(xs, t32, rows, return_dict=False)[0]).squeeze(2).float()
        rounded = -torch.stack(model.transformer(xs, t32.bfloat16(), rows, return_dict=False)[0]).squeeze(2).float()
    assert not torch.equal(expected, rounded)  # the timestep's precision shows in the output
    assert torch.equal(v, expected)
