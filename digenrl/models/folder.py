"""Diffusers pipeline folders: which family one holds, whether it is complete, its parts loaded.

A pipeline folder is what ``DiffusionPipeline.save_pretrained`` writes and what a download
of ``stable-diffusion-3.5-medium``, ``FLUX.1-dev``, ``Wan2.1-T2V-1.3B-Diffusers``,
``Qwen-Image`` or ``HunyuanVideo`` holds: ``model_index.json`` (the pipeline class and,
per component, its library and class) and one subfolder per component. The family comes
from ``model_index.json``'s ``_class_name``, never from a guess; every component is loaded
with the class ``model_index.json`` names, ``local_files_only=True`` (nothing is
downloaded). What is missing or inconsistent is a :class:`ModelFolderError`, one line that
names the path and what belongs there.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

# the pipeline class -> family table is the config's (model.family is read from it)
from digenrl.config import PIPELINE_FAMILIES as PIPELINE_FAMILIES
from digenrl.config import ConfigError, pipeline_family

#: The text stack each family's pipeline encodes prompts with: component -> what it is.
TEXT_COMPONENTS: dict[str, dict[str, str]] = {
    "sd3": {"text_encoder": "CLIP-L (CLIPTextModelWithProjection)", "tokenizer": "CLIP-L's CLIPTokenizer",
            "text_encoder_2": "CLIP-G (CLIPTextModelWithProjection)", "tokenizer_2": "CLIP-G's CLIPTokenizer",
            "text_encoder_3": "T5-XXL (T5EncoderModel)", "tokenizer_3": "T5's T5TokenizerFast"},
    "flux": {"text_encoder": "CLIP-L (CLIPTextModel)", "tokenizer": "CLIP-L's CLIPTokenizer",
             "text_encoder_2": "T5-XXL (T5EncoderModel)", "tokenizer_2": "T5's T5TokenizerFast"},
    "flux_kontext": {"text_encoder": "CLIP-L (CLIPTextModel)", "tokenizer": "CLIP-L's CLIPTokenizer",
                     "text_encoder_2": "T5-XXL (T5EncoderModel)", "tokenizer_2": "T5's T5TokenizerFast"},
    "wan": {"text_encoder": "umT5-XXL (UMT5EncoderModel)", "tokenizer": "umT5's T5TokenizerFast"},
    "qwenimage": {"text_encoder": "Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration)",
                  "tokenizer": "Qwen2.5-VL's Qwen2Tokenizer"},
    "qwenimage_edit": {"text_encoder": "Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration)",
                       "tokenizer": "Qwen2.5-VL's Qwen2Tokenizer",
                       "processor": "Qwen2.5-VL's Qwen2VLProcessor (its tokenizer and image processor)"},
    "hunyuanvideo": {"text_encoder": "LLaVA-Llama-3 (LlamaModel)", "tokenizer": "its LlamaTokenizerFast",
                     "text_encoder_2": "CLIP-L (CLIPTextModel)", "tokenizer_2": "CLIP-L's CLIPTokenizer"},
    "flux2": {"text_encoder": "Mistral Small 3.1 (Mistral3ForConditionalGeneration; FLUX.2-dev) or Qwen3 "
                              "(Qwen3ForCausalLM; FLUX.2-klein)",
              "tokenizer": "its PixtralProcessor (dev) or Qwen2Tokenizer (klein)"},
    "zimage": {"text_encoder": "Qwen3 (Qwen3Model)", "tokenizer": "Qwen3's Qwen2Tokenizer"},
}


class ModelFolderError(ConfigError):
    """A model path that is missing, incomplete or not what the config says it is."""


def text_processor(folder: Path) -> Any:
    """The text half of a multimodal processor saved at ``folder``: its tokenizer and its chat
    template, behind transformers' own ``ProcessorMixin.apply_chat_template`` (so text-only
    messages tokenize as the full processor tokenizes them). What FLUX.2-dev's
    ``PixtralProcessor`` is where torchvision is not installed (its image processor and the
    processor class itself import torchvision under transformers 5); with torchvision, the
    folder's own class loads."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return text_processor_class()(tokenizer=tokenizer, chat_template=_chat_template(folder) or tokenizer.chat_template)


def _chat_template(folder: Path) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():  # the older processors' file
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return None


def has_torchvision() -> bool:
    from transformers.utils import is_torchvision_available

    return bool(is_torchvision_available())


def vl_processor(folder: Path) -> Any:
    """A ``Qwen2VLProcessor`` saved at ``folder`` (Qwen-Image-Edit's ``processor/``) without its
    video half, its images through ``Qwen2VLImageProcessorPil`` (PIL resizing, no torchvision):
    what the edit pipelines' ``encode_prompt`` needs (text and images), where torchvision is not
    installed (the folder's own image and video processors import it under transformers 5).
    The PIL resize (bicubic) may differ from torchvision's by a level in a few pixels."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder, local_files_only=True)
    return vl_processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                                chat_template=_chat_template(folder) or tokenizer.chat_template)


def vl_processor_class() -> type:
    """:class:`Qwen2VLImageTextProcessor`, defined on first use (transformers loads only with a model)."""
    global _VL_PROCESSOR
    if _VL_PROCESSOR is None:
        from transformers import Qwen2VLProcessor

        class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
            """Qwen2VLProcessor of an image processor and a tokenizer, no video processor (see
            :func:`vl_processor`)."""

            def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                         **kwargs: Any) -> None:
                # ProcessorMixin keeps the attributes this signature names: no video_processor
                super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

        _VL_PROCESSOR = Qwen2VLImageTextProcessor
    return _VL_PROCESSOR


_VL_PROCESSOR: type | None = None


def text_processor_class() -> type:
    """:class:`ChatTextProcessor`, defined on first use (transformers loads only with a model)."""
    global _TEXT_PROCESSOR
    if _TEXT_PROCESSOR is None:
        from transformers import ProcessorMixin

        class ChatTextProcessor(ProcessorMixin):
            """A processor of a tokenizer alone (see :func:`text_processor`)."""

            def __init__(self, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any) -> None:
                super().__init__(tokenizer, chat_template=chat_template)

        _TEXT_PROCESSOR = ChatTextProcessor
    return _TEXT_PROCESSOR


_TEXT_PROCESSOR: type | None = None


def is_pipeline_folder(folder: Path) -> bool:
    return (folder / "model_index.json").is_file()


class PipelineFolder:
    """A pipeline folder's ``model_index.json``, read and checked; components load on demand."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        path = self.root / "model_index.json"
        try:
            self.index: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelFolderError(f"{path}: not a readable model_index.json ({e})") from None
        self.pipeline_class = str(self.index.get("_class_name", ""))
        try:
            self.family = pipeline_family(self.pipeline_class, path)
        except ConfigError as e:
            raise ModelFolderError(str(e)) from None

    def check_family(self, family: str) -> None:
        """A config whose ``model.family`` disagrees with the folder is a one-line error."""
        if family != self.family:
            raise ModelFolderError(
                f"model.family = {family!r}, but {self.root / 'model_index.json'} names "
                f"{self.pipeline_class} (family {self.family!r}): set model.family = {self.family!r}")

    def entry(self, name: str) -> tuple[str, str] | None:
        """(library, class) ``model_index.json`` gives component ``name``; None when it has none."""
        value = self.index.get(name)
        if not isinstance(value, list) or len(value) != 2 or None in value:
            return None
        return str(value[0]), str(value[1])

    def require(self, names: dict[str, str]) -> None:
        """Every component in ``names`` (name -> what it is) is listed and its folder exists."""
        for name, what in names.items():
            sub = self.root / name
            if self.entry(name) is None:
                raise ModelFolderError(
                    f"{self.root / 'model_index.json'} lists no {name!r}; a {self.pipeline_class} "
                    f"folder needs {name}/ with {what}")
            if not sub.is_dir() or not any(sub.iterdir()):
                raise ModelFolderError(
                    f"{sub}/ is missing or empty: it should hold {what} "
                    f"({'.'.join(self.entry(name) or ())}, as model_index.json says)")

    def substituted(self, name: str) -> bool:
        """Whether component ``name`` loads as DigenRL's stand-in rather than its own class: a
        ``Qwen2VLProcessor`` where torchvision is not installed (:func:`vl_processor`)."""
        return self.entry(name) == ("transformers", "Qwen2VLProcessor") and not has_torchvision()

    def has_text_encoders(self) -> bool:
        return all((self.root / n).is_dir() for n in TEXT_COMPONENTS[self.family])

    def load(self, name: str, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
             frozen: bool = True) -> Any:
        """Component ``name`` with the class model_index.json names, offline (modules frozen and in
        eval mode unless ``frozen`` is False)."""
        entry = self.entry(name)
        if entry is None:
            raise ModelFolderError(f"{self.root / 'model_index.json'} lists no {name!r}")
        library, cls_name = entry
        try:
            cls = getattr(importlib.import_module(library), cls_name)
        except (ImportError, AttributeError):
            raise ModelFolderError(
                f"{self.root / 'model_index.json'}: {name} is {library}.{cls_name}, which this "
                f"{library} does not have") from None
        if library == "transformers" and cls_name.endswith("Processor") and getattr(cls, "is_dummy", False):
            # a processor whose image half needs a backend not installed (PixtralProcessor:
            # torchvision): prompts need only its text half, built from the same files
            return text_processor(self.root / name)
        if self.substituted(name):
            return vl_processor(self.root / name)
        if library == "transformers":
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # a bar per component in every node's log otherwise
        kw: dict[str, Any] = {"local_files_only": True}
        is_module = isinstance(cls, type) and issubclass(cls, torch.nn.Module)
        if dtype is not None and is_module:
            kw["dtype" if library == "transformers" else "torch_dtype"] = dtype
        obj = cls.from_pretrained(self.root / name, **kw)
        if is_module:
            if frozen:
                obj.requires_grad_(False).eval()
            if device is not None:
                obj.to(device)
        return obj
