"""Prompt encoders: a deterministic hash encoder for tiny models, and a pipeline folder's own.

The tiny models in tests and on CPU have no real text encoder (nothing may be downloaded), yet
prompts must matter to the policy, or RL has nothing to learn per prompt. :class:`HashPromptEncoder`
gives every lower-cased word a fixed random vector drawn from a ``torch.Generator`` seeded with
``zlib.crc32`` of the word (stable across processes and Python versions, unlike ``hash()``).

Every encoder returns the same conditioning keys (batch-first, see :mod:`digenrl.models.base`):

* ``prompt_embeds``  ``(B, L, dim)`` float32, zero rows after the last word;
* ``prompt_mask``    ``(B, L)`` int64, 1 for a real token, 0 for padding;
* ``pooled_embeds``  ``(B, pooled_dim)`` float32 (zeros-wide when an encoder has no pooled output).

:class:`PipelinePromptEncoder` runs a pipeline folder's text encoders through the family's
diffusers pipeline's own ``encode_prompt`` (so tokenisation, templates, the hidden layer
taken, padding and CLIP/T5 joining are exactly the pipeline's); its tensors come in the text
encoders' dtype (bfloat16 in a bfloat16 run), with the same keys.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from digenrl.models.base import Cond, cond_cat

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



#: The diffusers pipelines' default prompt lengths (``max_sequence_length``).
DEFAULT_TEXT_TOKENS = {"sd3": 256, "flux": 512, "wan": 226, "qwenimage": 1024, "hunyuanvideo": 256,
                       "flux2": 512, "zimage": 512, "flux_kontext": 512, "qwenimage_edit": 1024}


def template_prefix_tokens(tokenizer: Any, template: str) -> int:
    """Tokens of ``template`` before its ``{}`` or its first image (``<|vision_start|>``): what
    the pipeline crops off the encoder output (the system turn; the image's tokens are kept).

    diffusers hard-codes this count for the published tokenizers (Qwen-Image 34, Qwen-Image-Edit
    64, HunyuanVideo 95); measuring it gives the same number for those and the right one for
    any other.
    """
    return len(tokenizer(template.split("{}")[0].split("<|vision_start|>")[0]).input_ids)


class PipelinePromptEncoder:
    """Prompts -> conditioning through the family pipeline's ``encode_prompt``.

    ``pipe`` is the family's diffusers pipeline holding (at least) its text encoders and
    tokenizers on ``device``; ``max_tokens`` is its ``max_sequence_length`` (0: its default).
    No classifier-free-guidance batch is made here (the sampler encodes ``""`` itself).
    """

    def __init__(self, pipe: Any, family: str, *, device: str | torch.device = "cpu", max_tokens: int = 0) -> None:
        self.pipe, self.family, self.device = pipe, family, torch.device(device)
        self.max_tokens = max_tokens or DEFAULT_TEXT_TOKENS[family]
        self._template: dict[str, Any] | None = None
        #: prompt -> its conditioning (one row, host memory) once the text encoders are freed
        #: (:meth:`free`); None while they are loaded
        self.table: dict[str, Cond] | None = None
        if family in ("qwenimage", "qwenimage_edit"):
            pipe.prompt_template_encode_start_idx = template_prefix_tokens(pipe.tokenizer, pipe.prompt_template_encode)
        elif family == "hunyuanvideo":
            from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import (
                DEFAULT_PROMPT_TEMPLATE,
            )

            template = str(DEFAULT_PROMPT_TEMPLATE["template"])
            self._template = {"template": template,
                              "crop_start": template_prefix_tokens(pipe.tokenizer, template)}

    def __call__(self, prompts: Sequence[str]) -> Cond:
        if self.table is None:
            return self._encode(prompts)
        missing = [p for p in prompts if p not in self.table]
        if missing:
            raise ValueError(f"prompt {missing[0]!r} is not among the {len(self.table)} prompts encoded before "
                             "the text encoders were freed (model.free_text_encoders = true encodes the run's "
                             "train and test prompts only)")
        return cond_cat([self.table[p] for p in prompts])

    def free(self, prompts: Iterable[str], max_bytes: int) -> dict[str, int]:
        """Encode each of ``prompts`` alone, keep its row in host memory (:attr:`table`), then
        drop the pipeline's text encoder modules; every later call is a table lookup, and a
        prompt not encoded here is a ValueError naming it.

        Each prompt is encoded alone, so its row does not depend on which prompts share its
        batch (a batch's rows can differ from each alone by the encoders' batch-size rounding).
        :class:`~digenrl.config.ConfigError` as soon as the rows pass ``max_bytes``; the
        encoders then stay. Returns ``prompts``, ``bytes`` (the rows) and ``parameters``
        (those of the modules dropped)."""
        from digenrl.config import ConfigError
        from digenrl.devices import host

        if self.family == "qwenimage_edit":
            raise ValueError("qwenimage_edit: its text encoder reads each prompt's input images; a table of "
                             "prompts cannot stand in for it")
        unique = list(dict.fromkeys(prompts))
        table: dict[str, Cond] = {}
        held = 0
        for i, prompt in enumerate(unique):
            row = {k: host(v) for k, v in self._encode([prompt]).items()}
            held += sum(v.numel() * v.element_size() for v in row.values())
            table[prompt] = row
            if held > max_bytes:
                mib = held / (i + 1) * len(unique) / 2**20
                raise ConfigError(
                    f"model.free_text_encoders = true: the conditioning of the run's {len(unique)} prompts "
                    f"takes about {mib:.3g} MiB of host memory, above model.text_cache_mb = "
                    f"{max_bytes / 2**20:g}; "
                    "raise model.text_cache_mb or set model.free_text_encoders = false")
        dropped = 0
        for name, part in list(self.pipe.components.items()):
            if isinstance(part, torch.nn.Module):
                dropped += sum(p.numel() for p in part.parameters())
                setattr(self.pipe, name, None)
        self.table = table
        return {"prompts": len(table), "bytes": held, "parameters": dropped}

    @torch.no_grad()
    def _encode(self, prompts: Sequence[str]) -> Cond:
        prompts, pipe, dev, n = list(prompts), self.pipe, self.device, self.max_tokens
        pooled = None
        mask = None
        if self.family == "sd3":
            embeds, _, pooled, _ = pipe.encode_prompt(prompts, prompts, prompts, device=dev,
                                                      do_classifier_free_guidance=False, max_sequence_length=n)
        elif self.family in ("flux", "flux_kontext"):
            embeds, pooled, _ = pipe.encode_prompt(prompts, prompts, device=dev, max_sequence_length=n)
        elif self.family == "wan":
            embeds = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=n,
                                        device=dev)[0]
            # the pipeline zero-fills each row after its last token (and passes no mask on)
            mask = embeds.ne(0).any(-1)
        elif self.family == "qwenimage":
            # padded to the batch's longest prompt, as the pipeline does; cond_cat pads further
            embeds, mask = pipe.encode_prompt(prompts, device=dev, max_sequence_length=n)
        elif self.family == "qwenimage_edit":  # without images (the template as the pipeline's without one)
            embeds, mask = pipe.encode_prompt(prompts, device=dev)
        elif self.family == "flux2":  # all n tokens, padding included, as the pipeline attends
            embeds = pipe.encode_prompt(prompts, device=dev, max_sequence_length=n)[0]
        elif self.family == "zimage":
            # one tensor per prompt of its real tokens; padded here to the longest, with a mask
            # (the adapter cuts the rows again); the pipeline rewrites the list it is given
            rows = pipe.encode_prompt(list(prompts), device=dev, do_classifier_free_guidance=False,
                                      max_sequence_length=n)[0]
            embeds = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
            mask = torch.nn.utils.rnn.pad_sequence([r.new_ones(len(r), dtype=torch.long) for r in rows],
                                                   batch_first=True)
        else:
            embeds, pooled, mask = pipe.encode_prompt(prompts, prompt_template=self._template, device=dev,
                                                      max_sequence_length=n)
        return _cond(embeds, mask, pooled)

    @torch.no_grad()
    def encode_with_images(self, prompt: str, images: Any) -> Cond:
        """One edit prompt's conditioning with its input image(s) (PIL, at the size the text
        encoder sees them) through the edit pipeline's ``encode_prompt`` (Qwen-Image-Edit: one
        image; -Edit-Plus: a list). Every token is kept: the edit pipelines do not truncate."""
        if self.family != "qwenimage_edit":
            raise ValueError(f"{self.family}: its text encoder sees no images")
        embeds, mask = self.pipe.encode_prompt([prompt], image=images, device=self.device)
        return _cond(embeds, mask, None)


def _cond(embeds: torch.Tensor, mask: torch.Tensor | None, pooled: torch.Tensor | None) -> Cond:
    """The common conditioning keys of a pipeline's ``encode_prompt`` outputs."""
    b = embeds.shape[0]
    if mask is None:  # SD3 / FLUX attend to every (padded) token; Qwen drops an all-ones mask
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    if pooled is None:
        pooled = embeds.new_zeros(b, 0)
    return {"prompt_embeds": embeds, "prompt_mask": mask.long(), "pooled_embeds": pooled.to(embeds.dtype)}


def free_text_encoders(model: Any, cfg: Any) -> dict[str, int] | None:
    """``model.free_text_encoders``: encode the run's train and test prompts and ``""`` (the
    unconditional prompt, the trainer's idle pass) into the model's encoder table and drop its
    text encoder modules (:meth:`PipelinePromptEncoder.free`), then hand their device memory
    back. Returns the table's statistics; None when the setting is off or the model has no
    text encoder modules (the hash encoder, an emulated model) or they are already freed."""
    import gc

    if not cfg.model.free_text_encoders:
        return None
    encoder = getattr(model, "encoder", None)
    if not isinstance(encoder, PipelinePromptEncoder) or encoder.table is not None:
        return None
    from digenrl.data.prompts import load_splits

    train, test = load_splits(cfg.prompts)
    stats = encoder.free([*train.prompts, *(test.prompts if test is not None else []), ""],
                         cfg.model.text_cache_mb << 20)
    gc.collect()
    if encoder.device.type == "cuda":
        torch.cuda.empty_cache()
    return stats
