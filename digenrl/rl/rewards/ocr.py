"""The OCR reward (flow_grpo's): how closely the text read in the image matches the asked text.

``score = 1 - min(d, n) / n`` with ``d`` the Levenshtein distance between the recognised text
and the target, ``n`` the target's length, both lower-cased without spaces (``case_sensitive``
keeps case). The target is the prompt's metadata field ``text`` when it has one, else the
first ``"..."`` span of the prompt (flow_grpo's OCR prompts: ``A sign that says "OPEN"``); a
prompt with neither is an error naming it.

Text is read by RapidOCR (PP-OCR detection + recognition models on onnxruntime, the models
flow_grpo's PaddleOCR runs). ``args``:

==================  ==========================================================================
``weights``         a folder with the ONNX models: ``*det*.onnx``, ``*rec*.onnx`` and optionally
                    ``*cls*.onnx`` (the ``rapidocr_onnxruntime`` wheel ships PP-OCRv4 ones in its
                    ``models/`` folder: point here, or copy them)
``device``          ``auto`` (CUDA when onnxruntime has it), ``cpu`` or ``cuda``
``min_confidence``  recognised pieces below this confidence are ignored (default 0.5)
``case_sensitive``  compare with case (default false, as flow_grpo)
==================  ==========================================================================

Needs the ``rewards`` extra (``rapidocr-onnxruntime``, ``levenshtein``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from digenrl.rl.rewards.base import RewardError
from digenrl.rl.rewards.local import weights_file, weights_folder

_QUOTED = re.compile(r'"([^"]+)"')
WHAT = ("the PP-OCR ONNX models *det*.onnx and *rec*.onnx (optionally *cls*.onnx); the "
        "rapidocr_onnxruntime package ships them in its models/ folder")


def target_text(prompt: str, metadata: Mapping[str, Any]) -> str:
    """The text an image should show: metadata ``text``, else the prompt's first quoted span."""
    text = metadata.get("text")
    if isinstance(text, str) and text.strip():
        return text
    m = _QUOTED.search(prompt)
    if m is None:
        raise RewardError(f"ocr: prompt {prompt!r} quotes no text and its metadata has no 'text' "
                          "field; expected e.g. 'a sign that says \"OPEN\"'")
    return m.group(1)


def ocr_score(read: str, target: str, case_sensitive: bool = False) -> float:
    """``1 - min(distance, n) / n`` over the texts without spaces (lower-cased unless asked)."""
    from Levenshtein import distance

    a, b = read.replace(" ", ""), target.replace(" ", "")
    if not case_sensitive:
        a, b = a.lower(), b.lower()
    if not b:
        raise RewardError(f"ocr: target text {target!r} is empty once spaces are removed")
    return 1.0 - min(distance(a, b), len(b)) / len(b)


class OCR:
    """Reads each image with RapidOCR and scores it against its target text."""

    def __init__(self, *, weights: str, device: str = "auto", min_confidence: float = 0.5,
                 case_sensitive: bool = False) -> None:
        folder = weights_folder(weights, "ocr", WHAT)
        det = weights_file(folder, ("*det*.onnx",), "ocr", WHAT)
        rec = weights_file(folder, ("*rec*.onnx",), "ocr", WHAT)
        cls = sorted(Path(folder).glob("*cls*.onnx"))
        try:
            import onnxruntime
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as e:
            raise RewardError(f"ocr: {e.name} is not installed: pip install 'digenrl[rewards]'") from None
        if device not in ("auto", "cpu", "cuda"):
            raise RewardError(f"ocr: args.device = {device!r}: expected auto, cpu or cuda")
        cuda = device == "cuda" or (device == "auto" and
                                    "CUDAExecutionProvider" in onnxruntime.get_available_providers())
        kw: dict[str, Any] = {"det_model_path": str(det), "rec_model_path": str(rec),
                              "det_use_cuda": cuda, "rec_use_cuda": cuda, "use_cls": bool(cls)}
        if cls:
            kw.update(cls_model_path=str(cls[0]), cls_use_cuda=cuda)
        self.engine = RapidOCR(**kw)
        self.min_confidence, self.case_sensitive = float(min_confidence), bool(case_sensitive)

    def read(self, image: torch.Tensor) -> str:
        """The text RapidOCR reads in one uint8 (3, H, W) image, pieces in reading order."""
        result, _ = self.engine(image.permute(1, 2, 0).contiguous().numpy()[:, :, ::-1].copy())  # BGR
        # RapidOCR returns its boxes sorted top to bottom, left to right
        return "".join(text for _, text, conf in (result or []) if float(conf) >= self.min_confidence)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        targets = [target_text(p, m) for p, m in zip(prompts, metadata)]
        return torch.tensor([ocr_score(self.read(img), t, self.case_sensitive)
                             for img, t in zip(images, targets)], dtype=torch.float32)
