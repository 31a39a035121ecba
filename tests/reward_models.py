"""Tiny random reward models saved in the real folder layouts, for tests (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def tiny_clip_tokenizer(folder: Path):
    """A CLIPTokenizer over a byte-level vocabulary (each byte alone and word-final) + specials."""
    from transformers import CLIPTokenizer

    # GPT-2's byte -> printable character table, which CLIP's BPE vocabulary is written in
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), pad_token="<|endoftext|>")
    tok.save_pretrained(str(folder))
    return tok


def tiny_clip_folder(folder: Path, *, seed: int = 0, projection_dim: int = 8):
    """A random tiny transformers CLIPModel with its tokenizer in ``folder``; returns the model."""
    from transformers import CLIPConfig, CLIPModel

    tok = tiny_clip_tokenizer(folder)
    cfg = CLIPConfig(
        projection_dim=projection_dim,
        text_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "vocab_size": len(tok), "max_position_embeddings": 16,
                     "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                     "pad_token_id": tok.pad_token_id, "hidden_act": "gelu"},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": 32, "patch_size": 8, "hidden_act": "gelu"})
    torch.manual_seed(seed)
    model = CLIPModel(cfg).eval()
    model.save_pretrained(str(folder))
    return model


def to_open_clip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers CLIPModel state dict -> open_clip's names (what an HPS checkpoint holds)."""
    out = {"visual.class_embedding": sd["vision_model.embeddings.class_embedding"],
           "visual.conv1.weight": sd["vision_model.embeddings.patch_embedding.weight"],
           "visual.positional_embedding": sd["vision_model.embeddings.position_embedding.weight"],
           "visual.ln_pre.weight": sd["vision_model.pre_layrnorm.weight"],
           "visual.ln_pre.bias": sd["vision_model.pre_layrnorm.bias"],
           "visual.ln_post.weight": sd["vision_model.post_layernorm.weight"],
           "visual.ln_post.bias": sd["vision_model.post_layernorm.bias"],
           "visual.proj": sd["visual_projection.weight"].t(),
           "token_embedding.weight": sd["text_model.embeddings.token_embedding.weight"],
           "positional_embedding": sd["text_model.embeddings.position_embedding.weight"],
           "ln_final.weight": sd["text_model.final_layer_norm.weight"],
           "ln_final.bias": sd["text_model.final_layer_norm.bias"],
           "text_projection": sd["text_projection.weight"].t(), "logit_scale": sd["logit_scale"]}
    for hf, oc in (("vision_model.encoder.layers.", "visual.transformer.resblocks."),
                   ("text_model.encoder.layers.", "transformer.resblocks.")):
        n = 1 + max(int(k[len(hf):].split(".")[0]) for k in sd if k.startswith(hf))
        for i in range(n):
            a, b = f"{hf}{i}.", f"{oc}{i}."
            for kind in ("weight", "bias"):
                out[f"{b}attn.in_proj_{kind}"] = torch.cat([sd[f"{a}self_attn.{p}_proj.{kind}"] for p in "qkv"])
                for h, o in (("self_attn.out_proj", "attn.out_proj"), ("layer_norm1", "ln_1"),
                             ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
                    out[f"{b}{o}.{kind}"] = sd[f"{a}{h}.{kind}"]
    return {k: v.clone().contiguous() for k, v in out.items()}


def tiny_imagereward_folder(folder: Path, seed: int = 0):
    """ImageReward.pt in the package's key layout from random tiny BLIP towers; returns them."""
    from transformers import BertTokenizer, BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    folder.mkdir(parents=True, exist_ok=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz", "a", "red", "cat",
             "square", "blue", "circle", "on", "green", "background", "[DEC]", "[ENC]"]
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(words)) + "\n")
    tok = BertTokenizer(str(folder / "vocab.txt"))
    tok.save_pretrained(str(folder))
    med = {"vocab_size": len(tok), "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 32, "max_position_embeddings": 40, "encoder_width": 24}
    vis = {"hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 48,
           "image_size": 32, "patch_size": 8}
    (folder / "med_config.json").write_text(json.dumps(med))
    (folder / "vision_config.json").write_text(json.dumps(vis))
    torch.manual_seed(seed)
    text = BlipTextModel(BlipTextConfig(vocab_size=med["vocab_size"], hidden_size=16, encoder_hidden_size=24,
                                        intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        max_position_embeddings=40, layer_norm_eps=1e-12),
                         add_pooling_layer=False).eval()
    vision = BlipVisionModel(BlipVisionConfig(**vis, layer_norm_eps=1e-6)).eval()
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
                              torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
                              torch.nn.Linear(64, 16), torch.nn.Linear(16, 1)).eval()
    sd = {f"blip.text_encoder.{k}": v for k, v in text.state_dict().items() if "position_ids" not in k}
    sd.update({f"mlp.layers.{k}": v for k, v in mlp.state_dict().items()})
    back = {"embeddings.class_embedding": "cls_token", "embeddings.position_embedding": "pos_embed",
            "embeddings.patch_embedding.weight": "patch_embed.proj.weight",
            "embeddings.patch_embedding.bias": "patch_embed.proj.bias",
            "post_layernorm.weight": "norm.weight", "post_layernorm.bias": "norm.bias"}
    parts = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.qkv": "attn.qkv",
             "self_attn.projection": "attn.proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    for k, v in vision.state_dict().items():
        if k.startswith("encoder.layers."):
            _, _, i, tail = k.split(".", 3)
            layer, _, kind = tail.rpartition(".")
            sd[f"blip.visual_encoder.blocks.{i}.{parts[layer]}.{kind}"] = v
        else:
            sd[f"blip.visual_encoder.{back[k]}"] = v
    torch.save({k: v.clone() for k, v in sd.items()}, folder / "ImageReward.pt")
    return tok, vision, text, mlp
