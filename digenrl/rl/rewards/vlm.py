"""A VLM judge behind an OpenAI-compatible chat endpoint (vLLM, SGLang, TGI, a hosted API).

Each image is sent with a question built from ``template`` (``{prompt}`` is the prompt; any
``{field}`` of the prompt's metadata record works too); the answer's text is parsed by
``pattern`` (a regular expression whose first group is the number) and divided by ``scale``.
An answer the pattern does not match is an error naming the endpoint and the answer: a
judge that stopped answering in the expected form must not become a silent zero.

``{ name = "vlm_judge", args = { url = "http://10.0.0.7:8000/v1", model = "Qwen2.5-VL-7B" } }``

=================  ===========================================================================
``url``            base URL; requests go to ``<url>/chat/completions``
``model``          the served model's name
``template``       the question (default asks for a 0-10 score of how well the image matches)
``pattern``        regex with one group for the number (default: the first number)
``scale``          the score is the number / scale (default 10)
``api_key_env``    name of an environment variable holding a bearer token (never the key itself)
``max_tokens``     answer length (default 16); temperature is 0
``concurrency``    requests in flight at once (default 8)
``timeout_s``, ``retries``, ``backoff_s``   as for ``http`` (:mod:`digenrl.rl.rewards.remote`)
=================  ===========================================================================

Edit prompts (an input image each): the input image is sent first, then the output, and
``{prompt}`` is the edit instruction; the default question for edits is ``EDIT_TEMPLATE``
(``args.edit_template`` replaces it).

Only JSON travels here (no pickle).
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from digenrl.rl.rewards.base import RewardError
from digenrl.rl.rewards.remote import check_url, jpeg_bytes, post

DEFAULT_TEMPLATE = ("Does this image show: \"{prompt}\"? Rate how well it matches from 0 (not at "
                    "all) to 10 (exactly). Answer with the number only.")


EDIT_TEMPLATE = ("The first image is the input, the second the result of the edit \"{prompt}\". "
                 "Rate from 0 (not done, or the rest of the image ruined) to 10 (done exactly, the "
                 "rest kept). Answer with the number only.")


class VLMJudge:
    """Scores each image by asking a VLM (see the module doc for ``args``)."""

    def __init__(self, *, url: str, model: str, template: str = DEFAULT_TEMPLATE,
                 edit_template: str = EDIT_TEMPLATE,
                 pattern: str = r"(-?\d+(?:\.\d+)?)", scale: float = 10.0, api_key_env: str = "",
                 max_tokens: int = 16, concurrency: int = 8, timeout_s: float = 60.0,
                 retries: int = 2, backoff_s: float = 1.0) -> None:
        self.endpoint = check_url(url, "vlm_judge").rstrip("/") + "/chat/completions"
        try:
            self.pattern = re.compile(pattern)
        except re.error as e:
            raise RewardError(f"vlm_judge: args.pattern = {pattern!r} is not a regular expression: {e}") from None
        if self.pattern.groups < 1:
            raise RewardError(f"vlm_judge: args.pattern = {pattern!r}: expected one group around the number")
        if scale == 0 or concurrency < 1:
            raise RewardError(f"vlm_judge: expected scale != 0 and concurrency >= 1, got {scale}, {concurrency}")
        self.headers: dict[str, str] = {}
        if api_key_env:
            token = os.environ.get(api_key_env)
            if not token:
                raise RewardError(f"vlm_judge: args.api_key_env = {api_key_env!r}, but that variable is not set")
            self.headers["Authorization"] = f"Bearer {token}"
        self.edit_template = edit_template
        self.model, self.template, self.scale, self.max_tokens = model, template, float(scale), max_tokens
        self.concurrency, self.timeout_s, self.retries, self.backoff_s = concurrency, timeout_s, retries, backoff_s

    def question(self, prompt: str, metadata: Mapping[str, Any], edit: bool = False) -> str:
        try:
            return (self.edit_template if edit else self.template).format_map({**metadata, "prompt": prompt})
        except (KeyError, IndexError, ValueError) as e:
            raise RewardError(f"vlm_judge: args.template needs {e} that prompt {prompt!r}'s "
                              "metadata does not have") from None

    def parse(self, answer: str) -> float:
        m = self.pattern.search(answer)
        if m is None:
            raise RewardError(f"vlm_judge {self.endpoint}: answer {answer[:80]!r} does not match "
                              f"args.pattern {self.pattern.pattern!r}")
        return float(m.group(1)) / self.scale

    def _ask(self, jpeg: bytes, question: str, input_jpeg: bytes | None = None) -> float:
        shown = [jpeg] if input_jpeg is None else [input_jpeg, jpeg]
        body = {"model": self.model, "temperature": 0, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": [
                    *({"type": "image_url",
                       "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(j).decode()}}
                      for j in shown),
                    {"type": "text", "text": question}]}]}
        raw = post(self.endpoint, json.dumps(body).encode(), content_type="application/json",
                   timeout_s=self.timeout_s, retries=self.retries, backoff_s=self.backoff_s,
                   headers=self.headers)
        try:
            text = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise RewardError(f"vlm_judge {self.endpoint}: not a chat completion "
                              f"({type(e).__name__}: {e}); first bytes {raw[:60]!r}") from None
        if not isinstance(text, str):
            raise RewardError(f"vlm_judge {self.endpoint}: message content is {type(text).__name__}, expected text")
        return self.parse(text)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]], input_images: torch.Tensor | None = None) -> torch.Tensor:
        edit = input_images is not None
        questions = [self.question(p, m, edit) for p, m in zip(prompts, metadata)]
        jpegs = jpeg_bytes(images)
        inputs: list[bytes | None] = [None] * len(jpegs) if input_images is None else list(jpeg_bytes(input_images))
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(jpegs) or 1)) as pool:
            scores = list(pool.map(self._ask, jpegs, questions, inputs))
        return torch.tensor(scores, dtype=torch.float32)
