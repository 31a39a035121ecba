"""ImageReward (THUDM): BLIP's image-grounded text encoder + an MLP head, on transformers' BLIP.

The score, as the ImageReward package computes it: the prompt (BERT tokens, at most 35) runs
through BLIP's text encoder with cross-attention on the ViT's image tokens; the [CLS] output
goes through the MLP (768 -> 1024 -> 128 -> 64 -> 16 -> 1) and is standardised with the
package's constants ``(r - 0.16717362830052426) / 1.0333394966054072``.

The ``image-reward`` package itself pins timm 0.6 and imports helpers transformers 5 removed,
so this module loads its checkpoint (``ImageReward.pt``: ``blip.visual_encoder.*``,
``blip.text_encoder.*``, ``mlp.layers.*``) into transformers' ``BlipVisionModel`` and
``BlipTextModel`` (the same layers; :func:`imagereward_to_transformers` renames the ViT's).

``args``: ``weights`` -- a folder with ``ImageReward.pt`` (or ``*.safetensors``), BERT's tokenizer
(``vocab.txt``, as BLIP uses it), and optionally ``med_config.json`` (BLIP's BERT config; default
BERT-base with cross-attention on a 1024-wide ViT-L/16 at 224 px); ``device``, ``dtype``,
``batch_size`` as for the CLIP rewards.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from digenrl.rl.rewards.base import RewardError
from digenrl.rl.rewards.clip import AestheticHead, load_state
from digenrl.rl.rewards.local import (
    batches,
    clip_pixels,
    pick_device,
    pick_dtype,
    weights_file,
    weights_folder,
)

MEAN, STD = 0.16717362830052426, 1.0333394966054072
MAX_TOKENS = 35
WHAT = ("ImageReward.pt (or *.safetensors), BERT's vocab.txt (+ tokenizer_config.json), "
        "optionally med_config.json and vision_config.json")
MED_BASE = {"vocab_size": 30524, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
            "intermediate_size": 3072, "max_position_embeddings": 512, "encoder_width": 1024,
            "layer_norm_eps": 1e-12, "hidden_act": "gelu"}
VIT_L_16 = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
            "intermediate_size": 4096, "image_size": 224, "patch_size": 16}


def imagereward_to_transformers(sd: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], ...]:
    """(vision, text, head) state dicts for BlipVisionModel, BlipTextModel and the MLP."""
    vision: dict[str, torch.Tensor] = {}
    text: dict[str, torch.Tensor] = {}
    head: dict[str, torch.Tensor] = {}
    names = {"cls_token": "embeddings.class_embedding", "pos_embed": "embeddings.position_embedding",
             "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
             "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
             "norm.weight": "post_layernorm.weight", "norm.bias": "post_layernorm.bias"}
    parts = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv",
             "attn.proj": "self_attn.projection", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    for k, v in sd.items():
        if k.startswith("blip.visual_encoder."):
            rest = k[len("blip.visual_encoder."):]
            if rest.startswith("blocks."):
                _, i, tail = rest.split(".", 2)
                layer, _, kind = tail.rpartition(".")
                vision[f"encoder.layers.{i}.{parts[layer]}.{kind}"] = v
            else:
                vision[names[rest]] = v
        elif k.startswith("blip.text_encoder."):
            text[k[len("blip.text_encoder."):]] = v
        elif k.startswith("mlp."):
            head[k[len("mlp."):]] = v
    return vision, text, head


class ImageReward:
    """ImageReward's standardised score of each (image, prompt)."""

    who = "imagereward"

    def __init__(self, *, weights: str, device: str = "auto", dtype: str = "auto", batch_size: int = 32) -> None:
        from transformers import BertTokenizer, BlipTextConfig, BlipVisionConfig
        from transformers.models.blip.modeling_blip import BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        folder = weights_folder(weights, self.who, WHAT)
        ckpt = weights_file(folder, ("ImageReward*.pt", "*.pt", "*.safetensors"), self.who, WHAT)
        weights_file(folder, ("vocab.txt",), self.who, WHAT)
        self.device = pick_device(device, self.who)
        self.dtype = pick_dtype(dtype, self.device, self.who)
        self.batch_size = batch_size
        med = {**MED_BASE, **_json(folder / "med_config.json")}
        vis = {**VIT_L_16, **_json(folder / "vision_config.json")}
        self.tokenizer = BertTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.text = BlipTextModel(BlipTextConfig(
            vocab_size=med["vocab_size"], hidden_size=med["hidden_size"],
            encoder_hidden_size=med["encoder_width"], intermediate_size=med["intermediate_size"],
            num_hidden_layers=med["num_hidden_layers"], num_attention_heads=med["num_attention_heads"],
            max_position_embeddings=med["max_position_embeddings"], layer_norm_eps=med["layer_norm_eps"],
            hidden_act=med["hidden_act"]), add_pooling_layer=False)
        self.vision = BlipVisionModel(BlipVisionConfig(**vis, layer_norm_eps=1e-6, hidden_act="gelu"))
        self.size = int(vis["image_size"])
        self.head = AestheticHead(int(med["hidden_size"]))  # the same MLP shape as LAION's
        try:
            v_sd, t_sd, h_sd = imagereward_to_transformers(load_state(ckpt, self.who))
        except KeyError as e:
            raise RewardError(f"{self.who}: {str(ckpt)!r} has an unexpected key {e}") from None
        for name, module, sd in (("vision", self.vision, v_sd), ("text", self.text, t_sd), ("mlp", self.head, h_sd)):
            missing, unexpected = module.load_state_dict(sd, strict=False)
            missing = [k for k in missing if not k.endswith("position_ids")]
            if missing or unexpected:
                raise RewardError(f"{self.who}: {str(ckpt)!r} does not fit the {name} tower: "
                                  f"missing {missing[:3]}, unexpected {list(unexpected)[:3]}")
        towers: tuple[torch.nn.Module, ...] = (self.vision, self.text)  # (transformers' .to wrapper confuses mypy)
        for m in towers:
            m.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.head.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def _score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        image_embeds = self.vision(pixel_values=clip_pixels(images, self.size, self.device, self.dtype)).last_hidden_state
        atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
        tok = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=MAX_TOKENS,
                             return_tensors="pt").to(self.device)
        out = self.text(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"],
                        encoder_hidden_states=image_embeds, encoder_attention_mask=atts)
        r = self.head(out.last_hidden_state[:, 0, :].float()).squeeze(-1)
        return (r - MEAN) / STD

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return torch.cat([self._score(images[s], prompts[s]) for s in batches(images.shape[0], self.batch_size)]).cpu()


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RewardError(f"imagereward: {str(path)!r} is not JSON: {e}") from None
    return {k: v for k, v in out.items() if not k.startswith("_") and k != "add_cross_attention"}
