"""A client for flow_grpo's reward-server protocol (GenEval, DeQA, ... served over HTTP).

The protocol (yifan123/reward-server, flow_grpo's ``rewards.py``): POST one pickled dict::

    {"images": [JPEG bytes, ...], "meta_datas": [metadata record, ...], "only_strict": bool}

and read back a pickled dict such as ``{"scores": [...], "rewards": [...], "strict_rewards":
[...], "group_rewards": {...}, "group_strict_rewards": {...}}``. The reward is the list under
``key`` (``"scores"`` unless the term's args name another), one number per image.

Configure it as ``{ name = "http", args = { url = "http://10.0.0.5:18085" } }``; args:

=================  ===========================================================================
``url``            the server (http or https); the only place responses are unpickled from
``key``            the response entry that is the reward (default ``scores``)
``only_strict``    sent as is (GenEval: strict vs. lenient matching; default false)
``prompts``        also send ``"prompts": [...]`` (servers that score text-image pairs)
``batch_size``     images per request (default 64)
``jpeg_quality``   JPEG quality of the images sent (default 95, as flow_grpo)
``timeout_s``      per request (default 120)
``retries``        further attempts after a connection error, timeout or 5xx (default 2)
``backoff_s``      wait before the first retry, doubled each time (default 1)
=================  ===========================================================================

**Pickle is code execution**: unpickling a response runs whatever the server put in it. This
client unpickles only answers of the URL its config names, never follows a redirect (a
redirect is an error), and only over http(s). Point it only at servers you run.
"""

from __future__ import annotations

import io
import pickle
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from PIL import Image

from digenrl.rl.rewards.base import RewardError


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused (the "
                                     "config names the only URL answers are read from)", headers, fp)


_OPENER = urllib.request.build_opener(_NoRedirect)


def check_url(url: Any, who: str) -> str:
    """``url`` if it is an http(s) URL with a host, else a one-line :class:`RewardError`."""
    parsed = urllib.parse.urlparse(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise RewardError(f"{who}: args.url = {url!r}: expected an http:// or https:// URL")
    return url


def post(url: str, body: bytes, *, content_type: str, timeout_s: float, retries: int,
         backoff_s: float, headers: Mapping[str, str] | None = None) -> bytes:
    """POST ``body``; retry connection errors, timeouts and 5xx ``retries`` times (exponential
    backoff); a 4xx, a redirect, or the last failure raises a RewardError naming ``url``."""
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        req = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": content_type, **(headers or {})})
        try:
            with _OPENER.open(req, timeout=timeout_s) as resp:
                return bytes(resp.read())
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code} {e.reason}"
            if e.code < 500:
                break  # the request is wrong: another attempt gets the same answer
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            last = f"{type(reason).__name__}: {reason}"
    raise RewardError(f"reward server {url}: {last} (after {attempt + 1} attempt"
                      f"{'s' if attempt else ''}, timeout {timeout_s:g} s)")


def jpeg_bytes(images: torch.Tensor, quality: int = 95) -> list[bytes]:
    """Each uint8 (3, H, W) image as JPEG bytes."""
    out = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img.permute(1, 2, 0).contiguous().numpy()).save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


class FlowGRPOServer:
    """Scores images on a flow_grpo reward server (see the module doc for ``args``)."""

    def __init__(self, *, url: str, key: str = "scores", only_strict: bool = False,
                 prompts: bool = False, batch_size: int = 64, jpeg_quality: int = 95,
                 timeout_s: float = 120.0, retries: int = 2, backoff_s: float = 1.0) -> None:
        self.url = check_url(url, "http reward")
        if batch_size < 1 or retries < 0 or timeout_s <= 0 or not 1 <= jpeg_quality <= 100:
            raise RewardError(f"http reward {url}: expected batch_size >= 1, retries >= 0, "
                              f"timeout_s > 0 and jpeg_quality in 1..100; got {batch_size}, "
                              f"{retries}, {timeout_s}, {jpeg_quality}")
        self.key, self.only_strict, self.send_prompts = key, bool(only_strict), bool(prompts)
        self.batch_size, self.quality = batch_size, jpeg_quality
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s

    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        out: list[float] = []
        for lo in range(0, images.shape[0], self.batch_size):
            hi = min(lo + self.batch_size, images.shape[0])
            out += self._request(images[lo:hi], prompts[lo:hi], metadata[lo:hi])
        return torch.tensor(out, dtype=torch.float32)

    def _request(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]]) -> list[float]:
        data: dict[str, Any] = {"images": jpeg_bytes(images, self.quality),
                                "meta_datas": [dict(m) for m in metadata], "only_strict": self.only_strict}
        if self.send_prompts:
            data["prompts"] = list(prompts)
        raw = post(self.url, pickle.dumps(data), content_type="application/octet-stream",
                   timeout_s=self.timeout_s, retries=self.retries, backoff_s=self.backoff_s)
        try:
            answer = pickle.loads(raw)
        except Exception as e:  # an HTML error page, a truncated body: name the server
            raise RewardError(f"reward server {self.url}: answer is not a pickle "
                              f"({type(e).__name__}: {e}); first bytes {raw[:40]!r}") from None
        if not isinstance(answer, dict) or self.key not in answer:
            keys = sorted(map(str, answer)) if isinstance(answer, dict) else type(answer).__name__
            raise RewardError(f"reward server {self.url}: answer has no {self.key!r} (got {keys}); "
                              "set args.key to the entry that holds the scores")
        values = answer[self.key]
        try:
            scores = [float(v) for v in values]
        except (TypeError, ValueError) as e:
            raise RewardError(f"reward server {self.url}: {self.key!r} is not a list of numbers: {e}") from None
        if len(scores) != images.shape[0]:
            raise RewardError(f"reward server {self.url}: {len(scores)} scores under {self.key!r} "
                              f"for {images.shape[0]} images")
        return scores
