"""Tiny random pipeline folders of the five families, laid out as downloaded ones are.

Each builder makes the *real* diffusers / transformers classes with tiny random configs
(transformer, VAE, text encoders, tokenizers, scheduler), assembles the family's diffusers
pipeline from them and writes it with ``save_pretrained``, so the folder has exactly the
standard layout (``model_index.json``, ``transformer/``, ``vae/``, ``text_encoder*/``,
``tokenizer*/``, ``scheduler/``). Nothing is downloaded: the tokenizers are built here from
character- or byte-level vocabularies (any prompt tokenizes, different prompts differ).

Shared by the model tests, the end-to-end launches and ``bench/gpu_check.py --cpu``.
Sizes: every transformer is 1-2 blocks of width 32, every encoder 1-3 layers of width 8-32,
so a folder builds in about a second and a forward pass at 32x48 px takes milliseconds.

Geometry (what ``model.height`` / ``model.width`` / ``model.num_frames`` must respect):

==============  =====================  =============================================
family          VAE downsampling       a valid small size
==============  =====================  =============================================
sd3             2x (2 blocks)          32 x 48 px (latent 16 x 24, patch 2)
flux            2x                     32 x 48 px (latent 16 x 24, packed 2x2)
qwenimage       2x                     32 x 48 px
wan             2x space, 2x time      5 frames of 32 x 48 px (latent 3 x 16 x 24)
hunyuanvideo    2x space, 4x time      5 frames of 32 x 48 px (latent 2 x 16 x 24)
flux2           2x, then 2x2 patchify  32 x 48 px (latent 16 x 8 x 12)
zimage          2x                     32 x 48 px (latent 4 x 16 x 24, patch 2)
flux_kontext    2x                     32 x 48 px (as flux; the input image too)
qwenimage_edit  2x                     32 x 48 px; input images at model.condition_area
==============  =====================  =============================================

``flux2`` is a FLUX.2-klein folder (``Flux2KleinPipeline``, Qwen3 text encoder);
``flux2-dev`` a FLUX.2-dev one (``Flux2Pipeline``, Mistral3 text encoder, PixtralProcessor);
``qwenimage_edit`` a Qwen-Image-Edit folder (``QwenImageEditPipeline``), ``qwenimage_edit-plus``
an Edit-Plus one (``QwenImageEditPlusPipeline``), both with a Qwen2.5-VL that sees images and
its ``Qwen2VLProcessor``.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

FAMILIES = ("sd3", "flux", "wan", "qwenimage", "hunyuanvideo", "flux2", "zimage")
#: A size every tiny folder accepts (height, width, frames for the video families).
SMALL = {"height": 32, "width": 48, "num_frames": 5}
#: Tiny text encoders are cheap, but the pipelines' default lengths (256-512 tokens) are not.
MAX_TEXT_TOKENS = 24


# -- tokenizers -----------------------------------------------------------------------------------
def clip_tokenizer(folder: Path):
    """CLIP BPE over single letters (one token per character; ``</w>`` ends a word)."""
    import json

    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in string.ascii_lowercase + string.digits:
        vocab[ch], vocab[ch + "</w>"] = len(vocab), len(vocab) + 1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=77)


def t5_tokenizer():
    """A T5 unigram tokenizer over single letters (also UMT5's: Wan's ``T5TokenizerFast``)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(ch, -3.0) for ch in string.ascii_lowercase + string.digits]
    pieces += [("\u2581" + ch, -2.5) for ch in string.ascii_lowercase]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def _byte_vocab() -> dict[str, int]:
    from tokenizers.pre_tokenizers import ByteLevel

    return {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}


def qwen_tokenizer():
    """Qwen2's byte-level BPE with no merges (one token per byte) and its chat markers."""
    from transformers import Qwen2Tokenizer

    tok = Qwen2Tokenizer(vocab=_byte_vocab(), merges=[])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


#: A ChatML template (Qwen's message markers) for the tiny Qwen tokenizers; the pipelines that
#: encode through ``apply_chat_template`` (FLUX.2-klein, Z-Image) need one.
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen3_tokenizer():
    """:func:`qwen_tokenizer` with a chat template (Qwen3's tokenizer is a Qwen2Tokenizer)."""
    tok = qwen_tokenizer()
    tok.chat_template = CHATML
    return tok


#: A Mistral-style template over system/user turns of typed content (what FLUX.2-dev sends).
MISTRAL_CHAT = ("{{ bos_token }}{% for m in messages %}"
                "{% if m.role == 'system' %}[SYSTEM_PROMPT]{% else %}[INST]{% endif %}"
                "{% for c in m.content %}{% if c.type == 'text' %}{{ c.text }}{% else %}[IMG]{% endif %}{% endfor %}"
                "{% if m.role == 'system' %}[/SYSTEM_PROMPT]{% else %}[/INST]{% endif %}{% endfor %}")
PIXTRAL_SPECIALS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"]


def pixtral_processor():
    """FLUX.2-dev's processor: a byte-level BPE with Mistral's markers and chat template, in a
    ``PixtralProcessor`` where torchvision is installed; without it, the text half DigenRL
    loads in its place (:func:`digenrl.models.folder.text_processor`), which
    :func:`write_pipeline_folder` then labels as the PixtralProcessor it stands for."""
    import transformers
    from transformers import LlamaTokenizerFast

    from digenrl.models.folder import text_processor_class

    vocab = _byte_vocab()
    for special in ("<s>", "</s>", "<unk>", "<pad>"):
        vocab[special] = len(vocab)
    tok = LlamaTokenizerFast(vocab=vocab, merges=[], bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                             pad_token="<pad>")
    # the pipeline's system message as one token: prompts survive MAX_TEXT_TOKENS after it
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    tok.add_special_tokens({"additional_special_tokens": [*PIXTRAL_SPECIALS, SYSTEM_MESSAGE]})
    if not getattr(transformers.PixtralProcessor, "is_dummy", False):
        return transformers.PixtralProcessor(image_processor=transformers.PixtralImageProcessor(patch_size=4),
                                             tokenizer=tok, patch_size=4, spatial_merge_size=2,
                                             chat_template=MISTRAL_CHAT)
    return text_processor_class()(tokenizer=tok, chat_template=MISTRAL_CHAT)


def mistral3_encoder(vocab: int, hidden: int = 8):
    """Mistral Small 3.1's class (``Mistral3ForConditionalGeneration``) with a tiny Pixtral
    tower; 30 text layers, as FLUX.2-dev reads hidden states 10, 20 and 30."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    cfg = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                         max_position_embeddings=2048),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, patch_size=4, image_size=32),
        image_token_index=vocab - len(PIXTRAL_SPECIALS) - 1, spatial_merge_size=2)
    return Mistral3ForConditionalGeneration(cfg)


def llama_tokenizer():
    """A Llama BPE with no merges over bytes, with Llama-3's header markers as special tokens."""
    from transformers import LlamaTokenizerFast

    vocab = _byte_vocab()
    for special in ("<|begin_of_text|>", "<|end_of_text|>"):
        vocab[special] = len(vocab)
    tok = LlamaTokenizerFast(vocab=vocab, merges=[], bos_token="<|begin_of_text|>",
                             eos_token="<|end_of_text|>", unk_token=None, pad_token="<|end_of_text|>")
    tok.add_special_tokens({"additional_special_tokens": [
        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    return tok


# -- text encoders --------------------------------------------------------------------------------
def clip_encoder(with_projection: bool, hidden: int = 8, projection: int = 8):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=2 + 2 * 36, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                         projection_dim=projection, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(cfg)


def t5_encoder(d_model: int = 32):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer()), d_model=d_model, d_kv=8, d_ff=32,
                                   num_layers=1, num_heads=2))


def umt5_encoder(d_model: int = 32):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(vocab_size=len(t5_tokenizer()), d_model=d_model, d_kv=8, d_ff=32,
                                       num_layers=1, num_heads=2))


def qwen_vl_encoder(hidden: int = 32, vocab: int = 260, tokens: dict[str, int] | None = None):
    """Qwen2.5-VL with a tiny vision tower; ``tokens``: the ids of its image markers (a text-only
    model's are all the last id)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokens or dict(image_token_id=vocab - 1, video_token_id=vocab - 1, vision_start_token_id=vocab - 1,
                         vision_end_token_id=vocab - 1)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2048, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [4, 2, 2]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=hidden, fullatt_block_indexes=[0]),
        **ids)
    return Qwen2_5_VLForConditionalGeneration(cfg)


QWEN_VL_MARKERS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def qwen_vl_processor():
    """Qwen-Image-Edit's ``processor``: :func:`qwen_tokenizer` with Qwen2-VL's image markers and
    a ``Qwen2VLImageProcessorPil`` (14 px patches merged 2x2, as Qwen2.5-VL's), in DigenRL's
    video-less ``Qwen2VLProcessor`` (:func:`digenrl.models.folder.vl_processor`), which
    :func:`write_pipeline_folder` labels as the Qwen2VLProcessor it stands for."""
    from transformers import Qwen2VLImageProcessorPil

    from digenrl.models.folder import vl_processor_class

    tok = qwen_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *QWEN_VL_MARKERS]})
    return vl_processor_class()(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tok)


def qwen3_encoder(causal_lm: bool, hidden: int = 8, layers: int = 2, vocab: int = 260):
    """Qwen3: ``Qwen3ForCausalLM`` (FLUX.2-klein reads hidden states 9, 18 and 27, so 27 layers)
    or ``Qwen3Model`` (Z-Image reads the second to last)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                      max_position_embeddings=2048)
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(cfg)


def llama_encoder(hidden: int = 32, vocab: int = 264):
    from transformers import LlamaConfig, LlamaModel

    # three layers: the pipeline reads the hidden state three from the end (it skips two)
    return LlamaModel(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                  num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=4096))


# -- VAEs -----------------------------------------------------------------------------------------
def kl_vae(latent_channels: int, *, scaling: float, shift: float | None, factor: int = 2):
    """SD3 / FLUX's ``AutoencoderKL`` downsampling ``factor`` x (2: two blocks; 16: five), no
    quant convs (as SD3/FLUX have)."""
    from diffusers import AutoencoderKL

    blocks = factor.bit_length()  # log2(factor) + 1
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                         block_out_channels=(4 if factor > 2 else 8,) * blocks,
                         down_block_types=("DownEncoderBlock2D",) * blocks, up_block_types=("UpDecoderBlock2D",) * blocks,
                         norm_num_groups=4, layers_per_block=1, scaling_factor=scaling, shift_factor=shift,
                         use_quant_conv=False, use_post_quant_conv=False)


def _mean_std(z_dim: int) -> tuple[list[float], list[float]]:
    gen = torch.Generator().manual_seed(11)
    return (torch.randn(z_dim, generator=gen).mul(0.5).tolist(),
            torch.rand(z_dim, generator=gen).add(0.5).tolist())


def wan_vae(z_dim: int = 4):
    from diffusers import AutoencoderKLWan

    mean, std = _mean_std(z_dim)
    return AutoencoderKLWan(base_dim=8, z_dim=z_dim, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                            latents_mean=mean, latents_std=std, scale_factor_temporal=2, scale_factor_spatial=2)


def qwen_vae(z_dim: int = 4):
    from diffusers import AutoencoderKLQwenImage

    mean, std = _mean_std(z_dim)
    return AutoencoderKLQwenImage(base_dim=8, z_dim=z_dim, dim_mult=[1, 2], num_res_blocks=1,
                                  temperal_downsample=[False], latents_mean=mean, latents_std=std)


def flux2_vae(latent_channels: int = 4):
    """FLUX.2's ``AutoencoderKLFlux2`` downsampling 2x, with batch-norm statistics on its
    patchified latent that are not the identity (so decoding must undo them)."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(latent_channels=latent_channels, block_out_channels=(8, 8),
                             down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             layers_per_block=1, norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False,
                             mid_block_add_attention=False)
    mean, std = _mean_std(4 * latent_channels)
    vae.bn.running_mean.copy_(torch.tensor(mean))
    vae.bn.running_var.copy_(torch.tensor(std) ** 2)
    return vae


def hunyuan_vae(latent_channels: int = 4):
    """HunyuanVideo's causal 3D VAE; it only supports 4x (or 8x) in time, so three blocks."""
    from diffusers import AutoencoderKLHunyuanVideo

    return AutoencoderKLHunyuanVideo(
        latent_channels=latent_channels, block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 3, up_block_types=("HunyuanVideoUpBlock3D",) * 3,
        spatial_compression_ratio=2, temporal_compression_ratio=4)


# -- the pipelines --------------------------------------------------------------------------------
def _sd3(folder: Path):
    import diffusers

    return diffusers.StableDiffusion3Pipeline(
        transformer=diffusers.SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16,
            pos_embed_max_size=32),
        vae=kl_vae(4, scaling=1.5305, shift=0.0609),
        text_encoder=clip_encoder(True), tokenizer=clip_tokenizer(folder / "_clip"),
        text_encoder_2=clip_encoder(True), tokenizer_2=clip_tokenizer(folder / "_clip"),
        text_encoder_3=t5_encoder(32), tokenizer_3=t5_tokenizer(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))


def _flux(folder: Path, vae_factor: int = 2, heads: int = 2):
    import diffusers

    return diffusers.FluxPipeline(
        transformer=diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=heads, joint_attention_dim=32, pooled_projection_dim=8, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6)),
        vae=kl_vae(4, scaling=0.3611, shift=0.1159, factor=vae_factor),
        text_encoder=clip_encoder(False), tokenizer=clip_tokenizer(folder / "_clip"),
        text_encoder_2=t5_encoder(32), tokenizer_2=t5_tokenizer(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True))


def _flux_kontext(folder: Path):
    """FLUX.1 Kontext: FLUX's classes (its transformer takes the input image's tokens too)."""
    import diffusers

    flux = _flux(folder)
    return diffusers.FluxKontextPipeline(**{k: v for k, v in flux.components.items()
                                            if k not in ("image_encoder", "feature_extractor")})


def _wan(folder: Path, heads: int = 2):
    import diffusers

    return diffusers.WanPipeline(
        transformer=diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
        vae=wan_vae(4), text_encoder=umt5_encoder(32), tokenizer=t5_tokenizer(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0))


def _wan22(folder: Path):
    """Wan2.2 T2V-A14B's layout: two experts of one architecture (different weights), switched
    at boundary_ratio 0.875 as the released folder does."""
    import diffusers

    def expert():
        return diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32)

    return diffusers.WanPipeline(
        transformer=expert(), transformer_2=expert(), boundary_ratio=0.875,
        vae=wan_vae(4), text_encoder=umt5_encoder(32), tokenizer=t5_tokenizer(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0))


def wan22_vae():
    """Wan2.2's VAE layout (``is_residual``, 2x2 patchify into 12 channels, 48 latent channels)
    at a tiny width: 4x spatial, 2x temporal compression."""
    from diffusers import AutoencoderKLWan

    mean, std = _mean_std(48)
    return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, in_channels=12, out_channels=12, z_dim=48,
                            dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[True], is_residual=True,
                            patch_size=2, latents_mean=mean, latents_std=std, scale_factor_temporal=2,
                            scale_factor_spatial=4)


def _wan22_ti2v(folder: Path):
    """Wan2.2 TI2V-5B's layout: one transformer on the 48-channel VAE, expand_timesteps."""
    import diffusers

    return diffusers.WanPipeline(
        transformer=diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=48, out_channels=48,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
        vae=wan22_vae(), text_encoder=umt5_encoder(32), tokenizer=t5_tokenizer(), expand_timesteps=True,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0))


def _qwenimage(folder: Path):
    import diffusers

    tok = qwen_tokenizer()
    return diffusers.QwenImagePipeline(
        transformer=diffusers.QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
        vae=qwen_vae(4), text_encoder=qwen_vl_encoder(32, vocab=len(tok) + 1), tokenizer=tok,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True))


def _qwenimage_edit(folder: Path, plus: bool = False):
    """Qwen-Image-Edit (or, ``plus``, -Edit-Plus): Qwen-Image's classes, a Qwen2.5-VL that sees
    images, and its processor."""
    import diffusers

    proc = qwen_vl_processor()
    tok = proc.tokenizer
    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                   tok.convert_tokens_to_ids(list(QWEN_VL_MARKERS)), strict=True))
    cls = diffusers.QwenImageEditPlusPipeline if plus else diffusers.QwenImageEditPipeline
    return cls(
        transformer=diffusers.QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
        vae=qwen_vae(4), text_encoder=qwen_vl_encoder(32, vocab=len(tok), tokens=ids), tokenizer=tok,
        processor=proc, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True))


def _qwenimage_edit_plus(folder: Path):
    return _qwenimage_edit(folder, plus=True)


def _hunyuanvideo(folder: Path):
    import diffusers

    tok = llama_tokenizer()
    return diffusers.HunyuanVideoPipeline(
        transformer=diffusers.HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
            text_embed_dim=32, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6)),
        vae=hunyuan_vae(4), text_encoder=llama_encoder(32, vocab=len(tok)), tokenizer=tok,
        text_encoder_2=clip_encoder(False), tokenizer_2=clip_tokenizer(folder / "_clip"),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))


def _flux2_transformer(text_dim: int, guidance: bool, heads: int = 2):
    import diffusers

    return diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=heads,
        joint_attention_dim=text_dim, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance)


def _flux2(folder: Path, heads: int = 2):
    """FLUX.2-klein (4B / 9B): Qwen3, no embedded guidance."""
    import diffusers

    tok = qwen3_tokenizer()
    return diffusers.Flux2KleinPipeline(
        transformer=_flux2_transformer(3 * 8, guidance=False, heads=heads), vae=flux2_vae(4),
        text_encoder=qwen3_encoder(True, hidden=8, layers=27, vocab=len(tok)), tokenizer=tok,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True))


def _flux2_dev(folder: Path, heads: int = 2):
    """FLUX.2-dev (32B): Mistral3 and its PixtralProcessor, embedded guidance."""
    import diffusers

    proc = pixtral_processor()
    return diffusers.Flux2Pipeline(
        transformer=_flux2_transformer(3 * 8, guidance=True, heads=heads), vae=flux2_vae(4),
        text_encoder=mistral3_encoder(len(proc.tokenizer), hidden=8), tokenizer=proc,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True))


def _zimage(folder: Path, heads: int = 2):
    import diffusers

    tok = qwen3_tokenizer()
    return diffusers.ZImagePipeline(
        transformer=diffusers.ZImageTransformer2DModel(  # 16 features a head (the rotary's 4 + 6 + 6)
            in_channels=4, dim=16 * heads, n_layers=1, n_refiner_layers=1, n_heads=heads, n_kv_heads=heads,
            cap_feat_dim=16,
            axes_dims=[4, 6, 6], axes_lens=[256, 64, 64]),
        vae=kl_vae(4, scaling=0.3611, shift=0.1159), text_encoder=qwen3_encoder(False, hidden=16, vocab=len(tok)),
        tokenizer=tok, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True))


_BUILDERS = {"sd3": _sd3, "flux": _flux, "wan": _wan, "wan22": _wan22, "wan22-ti2v": _wan22_ti2v,
             "qwenimage": _qwenimage, "hunyuanvideo": _hunyuanvideo,
             "flux2": _flux2, "flux2-dev": _flux2_dev, "zimage": _zimage,
             "flux_kontext": _flux_kontext, "qwenimage_edit": _qwenimage_edit,
             "qwenimage_edit-plus": _qwenimage_edit_plus}


def build_pipeline(family: str, folder: Path, *, seed: int = 0, **kw):
    """The tiny diffusers pipeline object of ``family`` (random weights from ``seed``); ``kw``:
    ``vae_factor=16`` gives FLUX a VAE that makes 1024 px images from a 64 x 64 latent;
    ``heads`` sets FLUX's, FLUX.2's, Wan's and Z-Image's attention heads (2 by default)."""
    import shutil

    folder = Path(folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe = _BUILDERS[family](folder, **kw)
    shutil.rmtree(folder / "_clip", ignore_errors=True)
    return pipe


def write_pipeline_folder(family: str, folder: Path, *, seed: int = 0, **kw) -> Path:
    """A tiny random pipeline folder of ``family`` at ``folder`` (created); returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_pipeline(family, folder / "_build", seed=seed, **kw).save_pretrained(folder)
    import shutil

    shutil.rmtree(folder / "_build", ignore_errors=True)
    index = json.loads((folder / "model_index.json").read_text())
    if index["tokenizer"][1] == "ChatTextProcessor":  # FLUX.2-dev without torchvision (pixtral_processor)
        index["tokenizer"] = ["transformers", "PixtralProcessor"]
        (folder / "model_index.json").write_text(json.dumps(index, indent=2))
        (folder / "tokenizer" / "processor_config.json").write_text(json.dumps(
            {"processor_class": "PixtralProcessor", "patch_size": 4, "spatial_merge_size": 2}, indent=2))
    if index.get("processor", [None, None])[1] == "Qwen2VLImageTextProcessor":  # Qwen-Image-Edit without torchvision
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
        (folder / "model_index.json").write_text(json.dumps(index, indent=2))
        config = json.loads((folder / "processor" / "processor_config.json").read_text())
        (folder / "processor" / "processor_config.json").write_text(json.dumps(
            {**config, "processor_class": "Qwen2VLProcessor"}, indent=2))
    return folder


def load_pipeline(folder: Path):
    """The folder's diffusers pipeline (``DiffusionPipeline.from_pretrained``, offline). Where
    transformers cannot build a component's class (FLUX.2-dev's PixtralProcessor without
    torchvision; diffusers then refuses the folder), the pipeline class is built from the
    folder's components as DigenRL loads them."""
    import diffusers
    import transformers

    from digenrl.models.folder import PipelineFolder

    pf = PipelineFolder(folder)
    tokenizer_class = getattr(transformers, (pf.entry("tokenizer") or ("", ""))[1], None)
    # transformers' stand-in for a missing backend, or a processor DigenRL stands in for
    if not getattr(tokenizer_class, "is_dummy", False) and not pf.substituted("processor"):
        return diffusers.DiffusionPipeline.from_pretrained(folder, local_files_only=True)
    parts = {name: pf.load(name, frozen=False) for name, value in pf.index.items()
             if not name.startswith("_") and isinstance(value, list)}
    return getattr(diffusers, pf.pipeline_class)(**parts)


def one_step_final(model, cond, out: Path) -> tuple[torch.Tensor, torch.Tensor, Path]:
    """One GRPO step of ``model`` on a 2-sample rollout of its own from ``cond``, at a large
    learning rate (one AdamW step moves every trained weight by about lr), its ``final/`` saved
    under ``out``. At K = 0 the trainer recomputes the rollout's own samples, so the first
    ratio is 1 to within 1e-6 (asserted). Returns a probe input ``x``, the base velocity at
    sigma 0.6 on it, and the ``final/`` folder."""
    from digenrl.config import load_config
    from digenrl.rl.learner import save_final
    from digenrl.rl.policy import Policy
    from digenrl.rl.sampler import rollout, seeded_generators

    cfg = load_config(None, ["sampler.num_steps=2", "train.timesteps=\"all\"", "train.lr=0.05"])
    policy = Policy(model, cfg.train, cfg.sampler)
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v_base = model.velocity(x, 0.6, cond)
        records = dict(enumerate(rollout(model, cond, generator=seeded_generators([5, 6]), sampler_cfg=cfg.sampler)))
    stats = policy.fragment_loss_backward(records, cond, torch.tensor([1.0, -1.0]), torch.ones(2, dtype=torch.bool),
                                          batch_size_total=2, n_trained_total=len(records))
    assert stats["n"] == 2 * len(records) and stats["ratio_max_dev"] <= 1e-6, stats
    policy.optimizer_step()
    save_final(policy, out)
    return x, v_base, out / "final"
