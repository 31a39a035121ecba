"""Prompt encoders: a deterministic hash encoder for tiny configs, and local CLIP/T5 encoders.

The tiny models in tests and on CPU have no real text encoder (nothing may be downloaded), yet
prompts must matter to the policy, or RL has nothing to learn per prompt. :class:`HashPromptEncoder`
gives every lower-cased word a fixed random vector drawn from a ``torch.Generator`` seeded with
``zlib.crc32`` of the word (stable across processes and Python versions, unlike ``hash()``).

Every encoder returns the same conditioning keys (batch-first, see :mod:`digenrl.models.base`):

* ``prompt_embeds``  ``(B, L, dim)`` float32, zero rows after the last word;
* ``prompt_mask``    ``(B, L)`` int64, 1 for a real token, 0 for padding;
* ``pooled_embeds``  ``(B, pooled_dim)`` float32 (zeros-wide when an encoder has no pooled output).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

from digenrl.models.base import Cond

_WORD = re.compile(r"[a-z0-9]+")


def prompt_words(prompt: str) -> list[str]:
    """Lower-cased alphanumeric words of ``prompt`` (punctuation and case do not matter)."""
    return _WORD.findall(prompt.lower())


class HashPromptEncoder:
    """Deterministic word-vector prompt encoder for tiny models.

    Word ``w`` maps to ``randn(dim)`` from a generator seeded with ``crc32(f"{seed}:{w}")``; the
    sequence is the first ``max_tokens`` words, zero-padded, with a mask; the pooled vector is the
    mean of the word vectors times a fixed ``(dim, pooled_dim)`` projection drawn from ``seed``.
    """

    def __init__(self, dim: int, pooled_dim: int, max_tokens: int = 16, seed: int = 0) -> None:
        if dim < 1 or pooled_dim < 0 or max_tokens < 1:
            raise ValueError(
                f"HashPromptEncoder needs dim >= 1, pooled_dim >= 0, max_tokens >= 1; got dim={dim}, "
                f"pooled_dim={pooled_dim}, max_tokens={max_tokens}")
        self.dim, self.pooled_dim, self.max_tokens, self.seed = dim, pooled_dim, max_tokens, seed
        gen = torch.Generator().manual_seed(seed)
        self._proj = torch.randn(dim, pooled_dim, generator=gen) / dim**0.5
        self._cache: dict[str, torch.Tensor] = {}

    def word_vector(self, word: str) -> torch.Tensor:
        """The fixed ``(dim,)`` vector of one (already lower-cased) word."""
        vec = self._cache.get(word)
        if vec is None:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{word}".encode()))
            vec = self._cache[word] = torch.randn(self.dim, generator=gen)
        return vec

    def __call__(self, prompts: Sequence[str]) -> Cond:
        batch = len(prompts)
        embeds = torch.zeros(batch, self.max_tokens, self.dim)
        mask = torch.zeros(batch, self.max_tokens, dtype=torch.long)
        pooled = torch.zeros(batch, self.pooled_dim)
        for i, prompt in enumerate(prompts):
            words = prompt_words(prompt)[: self.max_tokens]
            if not words:
                continue
            vecs = torch.stack([self.word_vector(w) for w in words])
            embeds[i, : len(words)] = vecs
            mask[i, : len(words)] = 1
            pooled[i] = vecs.mean(0) @ self._proj
        return {"prompt_embeds": embeds, "prompt_mask": mask, "pooled_embeds": pooled}


class ClipT5PromptEncoder:
    """The SD3 / FLUX text stack loaded offline from a local pipeline folder (``transformers``).

    SD3: CLIP-L and CLIP-G penultimate hidden states are concatenated, zero-padded to T5's width and
    joined with the T5 sequence; pooled = both CLIP pooled outputs concatenated (as in
    ``StableDiffusion3Pipeline.encode_prompt``). FLUX: T5 sequence + CLIP-L pooled output.
    """

    def __init__(self, folder: str | Path, family: str, *, max_tokens: int = 256,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        try:
            from transformers import (
                CLIPTextModel,
                CLIPTextModelWithProjection,
                CLIPTokenizer,
                T5EncoderModel,
                T5TokenizerFast,
            )
        except ImportError as err:  # pragma: no cover - transformers is a declared dependency here
            raise NotImplementedError(
                f"the text encoders of {folder} need the 'transformers' package") from err
        if family not in ("sd3", "flux"):
            raise NotImplementedError(f"ClipT5PromptEncoder supports sd3 and flux, not {family!r}")
        root = Path(folder)
        kw = {"local_files_only": True}
        self.family, self.max_tokens, self.device = family, max_tokens, torch.device(device)
        clip_cls = CLIPTextModelWithProjection if family == "sd3" else CLIPTextModel
        self.tok1 = CLIPTokenizer.from_pretrained(root / "tokenizer", **kw)
        self.enc1 = clip_cls.from_pretrained(root / "text_encoder", torch_dtype=dtype, **kw)
        self.enc1.to(self.device).requires_grad_(False).eval()
        self.tok2 = self.enc2 = None
        if family == "sd3":
            self.tok2 = CLIPTokenizer.from_pretrained(root / "tokenizer_2", **kw)
            self.enc2 = CLIPTextModelWithProjection.from_pretrained(root / "text_encoder_2", torch_dtype=dtype, **kw)
            self.enc2.to(self.device).requires_grad_(False).eval()
        t5_dir, t5_tok_dir = ("text_encoder_3", "tokenizer_3") if family == "sd3" else ("text_encoder_2", "tokenizer_2")
        self.tok_t5 = T5TokenizerFast.from_pretrained(root / t5_tok_dir, **kw)
        self.enc_t5 = T5EncoderModel.from_pretrained(root / t5_dir, torch_dtype=dtype, **kw)
        self.enc_t5.to(self.device).requires_grad_(False).eval()

    def _clip(self, tok, enc, prompts):
        ids = tok(list(prompts), padding="max_length", max_length=tok.model_max_length, truncation=True,
                  return_tensors="pt").input_ids.to(self.device)
        out = enc(ids, output_hidden_states=True)
        pooled = out.text_embeds if hasattr(out, "text_embeds") else out.pooler_output
        return out.hidden_states[-2], pooled

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> Cond:
        t5 = self.tok_t5(list(prompts), padding="max_length", max_length=self.max_tokens, truncation=True,
                         return_tensors="pt")
        mask = t5.attention_mask.to(self.device)
        t5_embeds = self.enc_t5(t5.input_ids.to(self.device))[0]
        h1, p1 = self._clip(self.tok1, self.enc1, prompts)
        if self.family == "flux":
            return {"prompt_embeds": t5_embeds.float(), "prompt_mask": mask.long(), "pooled_embeds": p1.float()}
        h2, p2 = self._clip(self.tok2, self.enc2, prompts)
        clip = torch.cat([h1, h2], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5_embeds.shape[-1] - clip.shape[-1]))
        embeds = torch.cat([clip, t5_embeds], dim=-2)
        full_mask = torch.cat([torch.ones(clip.shape[:2], dtype=torch.long, device=self.device), mask.long()], 1)
        return {"prompt_embeds": embeds.float(), "prompt_mask": full_mask,
                "pooled_embeds": torch.cat([p1, p2], dim=-1).float()}
