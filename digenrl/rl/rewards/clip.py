"""CLIP-family rewards on transformers' CLIP classes: PickScore, CLIPScore, aesthetic, HPSv2.1.

Each is a class built once from ``args``: ``weights`` (a local folder, required), ``device``
(``auto``), ``dtype`` (``auto``: bf16 on CUDA, fp32 on CPU), ``batch_size`` (32). The image
and text towers run in ``dtype``; projections' outputs, similarities and heads in float32.
Images are preprocessed in torch (:func:`~digenrl.rl.rewards.local.clip_pixels`).

=============  ===================================================================  ==========================================
term           score                                                                the ``weights`` folder holds
=============  ===================================================================  ==========================================
``pickscore``  ``logit_scale * cos(image, text)`` (about 18-23; flow_grpo divides   a transformers CLIPModel folder (PickScore_v1:
               by 26: use weight 1/26)                                              config.json + weights) and its CLIP tokenizer
``clipscore``  ``max(cos(image, text), 0)`` (torchmetrics' CLIPScore / 100)          a CLIPModel folder (e.g. clip-vit-large-patch14) + tokenizer
``aesthetic``  LAION aesthetic predictor v2: an MLP (in -> 1024 -> 128 -> 64 -> 16   a CLIPModel folder (ViT-L/14) + the head file
               -> 1) on the normalised image embedding (about 1-10)                 (``*aesthetic*.pth``/``.safetensors``, keys ``layers.N.*``)
``hpsv2``      HPSv2.1: ``cos(image, text)`` of its fine-tuned ViT-H-14             the open_clip checkpoint (``HPS_v2*.pt``), optional
                                                                                    ``open_clip_config.json``, a CLIP tokenizer
=============  ===================================================================  ==========================================

HPSv2.1 ships as an open_clip checkpoint; the ``hpsv2``/``hpsv2x`` packages pin pytest 7 and old
pyarrow, and open_clip needs torchvision, which has no build for the CPU torch this project
pins. :func:`open_clip_to_transformers` maps the checkpoint onto transformers' CLIPModel (the
same architecture: pre-LN ViT and causal text transformer, GELU, a class token and EOT
pooling), which then runs it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from digenrl.rl.rewards.base import RewardError
from digenrl.rl.rewards.local import (
    batches,
    clip_pixels,
    pick_device,
    pick_dtype,
    weights_file,
    weights_folder,
)

_TOKENIZER = "a CLIP tokenizer (vocab.json, merges.txt, tokenizer_config.json)"


def _load_tokenizer(folder: Path, who: str, what: str) -> Any:
    from transformers import CLIPTokenizer
    weights_file(folder, ("vocab.json",), who, what)
    return CLIPTokenizer.from_pretrained(str(folder), local_files_only=True)


class _CLIP:
    """A CLIPModel on a device with its tokenizer; normalised float32 embeddings in batches."""

    who = "clip"
    what = f"a transformers CLIPModel (config.json + model.safetensors) and {_TOKENIZER}"

    def __init__(self, *, weights: str, device: str = "auto", dtype: str = "auto", batch_size: int = 32) -> None:
        folder = weights_folder(weights, self.who, self.what)
        self.device = pick_device(device, self.who)
        self.dtype = pick_dtype(dtype, self.device, self.who)
        if batch_size < 1:
            raise RewardError(f"{self.who}: args.batch_size = {batch_size}: expected >= 1")
        self.batch_size = batch_size
        self.tokenizer = _load_tokenizer(folder, self.who, self.what)
        self.model = self._load_model(folder).to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.size = int(self.model.config.vision_config.image_size)
        self.context = int(self.model.config.text_config.max_position_embeddings)

    def _load_model(self, folder: Path) -> Any:
        from transformers import CLIPModel
        weights_file(folder, ("config.json",), self.who, self.what)
        return CLIPModel.from_pretrained(str(folder), local_files_only=True)

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        x = clip_pixels(images, self.size, self.device, self.dtype)
        pooled = self.model.vision_model(pixel_values=x).pooler_output
        return F.normalize(self.model.visual_projection(pooled).float(), dim=-1)

    @torch.no_grad()
    def text_embeds(self, prompts: Sequence[str]) -> torch.Tensor:
        tok = self.tokenizer(list(prompts), padding="max_length", truncation=True,
                             max_length=self.context, return_tensors="pt").to(self.device)
        pooled = self.model.text_model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]).pooler_output
        return F.normalize(self.model.text_projection(pooled).float(), dim=-1)

    def cosine(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        out = [(self.image_embeds(images[s]) * self.text_embeds(prompts[s])).sum(-1)
               for s in batches(images.shape[0], self.batch_size)]
        return torch.cat(out).cpu()


class PickScore(_CLIP):
    """PickScore: ``logit_scale * cos(image, text)``."""

    who = "pickscore"

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return float(self.model.logit_scale.exp()) * self.cosine(images, prompts)


class CLIPScore(_CLIP):
    """CLIPScore / 100: ``max(cos(image, text), 0)``."""

    who = "clipscore"

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return self.cosine(images, prompts).clamp_min(0.0)


class AestheticHead(torch.nn.Module):
    """LAION's improved aesthetic predictor MLP; its state-dict keys are ``layers.{0,2,4,6,7}``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
            torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
            torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def load_state(path: Path, who: str) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file or a ``torch.save``d state dict (weights only)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return dict(load_file(str(path)))
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle that is more than tensors is refused by weights_only
        raise RewardError(f"{who}: cannot read {str(path)!r} as a state dict: {e}") from None
    if isinstance(sd, Mapping) and "state_dict" in sd:
        sd = sd["state_dict"]
    if not isinstance(sd, Mapping):
        raise RewardError(f"{who}: {str(path)!r} holds {type(sd).__name__}, expected a state dict")
    return {str(k).removeprefix("module."): v for k, v in sd.items()}


class Aesthetic(_CLIP):
    """LAION aesthetic predictor v2 on a CLIP image embedding."""

    who = "aesthetic"
    what = ("a transformers CLIPModel (ViT-L/14: config.json + weights), " + _TOKENIZER +
            ", and the predictor head (*aesthetic*.pth or *.safetensors, keys layers.N.weight/bias)")

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        folder = Path(kw["weights"]).expanduser()
        head_file = weights_file(folder, ("*aesthetic*.safetensors", "*aesthetic*.pth", "*aesthetic*.pt"),
                                 self.who, self.what)
        self.head = AestheticHead(int(self.model.config.projection_dim))
        try:
            self.head.load_state_dict(load_state(head_file, self.who))
        except RuntimeError as e:
            raise RewardError(f"{self.who}: {str(head_file)!r} does not fit the predictor MLP: "
                              f"{str(e).splitlines()[0]}") from None
        self.head.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        out = [self.head(self.image_embeds(images[s])).squeeze(-1) for s in batches(images.shape[0], self.batch_size)]
        return torch.cat(out).float().cpu()


# ----------------------------------------------------------------------------- HPSv2.1

VIT_H_14 = {"embed_dim": 1024,
            "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80, "patch_size": 14},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24}}
"""open_clip's ViT-H-14 (HPSv2.1's architecture), used when the folder has no open_clip_config.json."""


def transformers_config(oc: Mapping[str, Any], tokenizer: Any = None) -> Any:
    """The transformers CLIPConfig of an open_clip model config (``model_cfg`` or the bare dict);
    special token ids from ``tokenizer`` (default: the CLIP BPE vocabulary's)."""
    from transformers import CLIPConfig
    oc = oc.get("model_cfg", oc)
    v, t = oc["vision_cfg"], oc["text_cfg"]
    width = int(v["width"])
    return CLIPConfig(
        projection_dim=int(oc["embed_dim"]),
        vision_config={"hidden_size": width, "intermediate_size": int(width * v.get("mlp_ratio", 4.0)),
                       "num_hidden_layers": int(v["layers"]), "num_attention_heads": width // int(v.get("head_width", 64)),
                       "image_size": int(v["image_size"]), "patch_size": int(v["patch_size"]),
                       "hidden_act": "gelu", "layer_norm_eps": 1e-5},
        text_config={"hidden_size": int(t["width"]), "intermediate_size": int(t["width"] * t.get("mlp_ratio", 4.0)),
                     "num_hidden_layers": int(t["layers"]), "num_attention_heads": int(t["heads"]),
                     "vocab_size": int(t["vocab_size"]), "max_position_embeddings": int(t["context_length"]),
                     "hidden_act": "gelu", "layer_norm_eps": 1e-5,
                     "bos_token_id": getattr(tokenizer, "bos_token_id", 49406),
                     "eos_token_id": getattr(tokenizer, "eos_token_id", 49407),
                     "pad_token_id": getattr(tokenizer, "pad_token_id", 0) or 0})


def _blocks(sd: Mapping[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    n = 1 + max(int(k[len(src):].split(".")[0]) for k in sd if k.startswith(src))
    for i in range(n):
        a, b = f"{src}{i}.", f"{dst}{i}."
        q, k, v = sd[a + "attn.in_proj_weight"].chunk(3)
        qb, kb, vb = sd[a + "attn.in_proj_bias"].chunk(3)
        out.update({b + "self_attn.q_proj.weight": q, b + "self_attn.k_proj.weight": k,
                    b + "self_attn.v_proj.weight": v, b + "self_attn.q_proj.bias": qb,
                    b + "self_attn.k_proj.bias": kb, b + "self_attn.v_proj.bias": vb})
        for s, d in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
                     ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
            out[f"{b}{d}.weight"], out[f"{b}{d}.bias"] = sd[f"{a}{s}.weight"], sd[f"{a}{s}.bias"]
    return out


def open_clip_to_transformers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An open_clip CLIP state dict (``visual.*``, ``transformer.*``, ...) as transformers'
    CLIPModel state dict: fused qkv split, projections transposed, names mapped."""
    vp, tp = "vision_model.", "text_model."
    out = {
        vp + "embeddings.class_embedding": sd["visual.class_embedding"],
        vp + "embeddings.patch_embedding.weight": sd["visual.conv1.weight"],
        vp + "embeddings.position_embedding.weight": sd["visual.positional_embedding"],
        vp + "pre_layrnorm.weight": sd["visual.ln_pre.weight"], vp + "pre_layrnorm.bias": sd["visual.ln_pre.bias"],
        vp + "post_layernorm.weight": sd["visual.ln_post.weight"], vp + "post_layernorm.bias": sd["visual.ln_post.bias"],
        "visual_projection.weight": sd["visual.proj"].t().contiguous(),
        tp + "embeddings.token_embedding.weight": sd["token_embedding.weight"],
        tp + "embeddings.position_embedding.weight": sd["positional_embedding"],
        tp + "final_layer_norm.weight": sd["ln_final.weight"], tp + "final_layer_norm.bias": sd["ln_final.bias"],
        "text_projection.weight": sd["text_projection"].t().contiguous(),
        "logit_scale": sd["logit_scale"].reshape(()),
    }
    out.update(_blocks(sd, "visual.transformer.resblocks.", vp + "encoder.layers."))
    out.update(_blocks(sd, "transformer.resblocks.", tp + "encoder.layers."))
    return out


class HPSv2(_CLIP):
    """HPSv2.1: cosine of image and prompt embeddings of its fine-tuned ViT-H-14."""

    who = "hpsv2"
    what = ("the HPSv2.1 open_clip checkpoint (HPS_v2*.pt or *.safetensors), optionally "
            f"open_clip_config.json (default ViT-H-14), and {_TOKENIZER}")

    def _load_model(self, folder: Path) -> Any:
        from transformers import CLIPModel
        ckpt = weights_file(folder, ("HPS_v2*.pt", "*.pt", "*.safetensors", "*.bin"), self.who, self.what)
        cfg_file = folder / "open_clip_config.json"
        oc = json.loads(cfg_file.read_text()) if cfg_file.is_file() else VIT_H_14
        model = CLIPModel(transformers_config(oc, self.tokenizer))
        try:
            sd = open_clip_to_transformers(load_state(ckpt, self.who))
        except KeyError as e:
            raise RewardError(f"{self.who}: {str(ckpt)!r} is not an open_clip CLIP state dict "
                              f"(no {e})") from None
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise RewardError(f"{self.who}: {str(ckpt)!r} does not fit its config: missing "
                              f"{missing[:3]}, unexpected {list(unexpected)[:3]}")
        return model

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return self.cosine(images, prompts)
