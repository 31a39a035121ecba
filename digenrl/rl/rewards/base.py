"""The reward framework: term specs -> scorers, one checked call per term, the weighted sum.

A ``[reward] terms`` entry is ``{ name, weight, args, label, key }``
(:class:`digenrl.config.RewardTerm`). ``name`` resolves to a built-in or to a
``"package.module:attr"`` plug-in, imported when the reward is built. The named object is

* a **function** ``f(images, prompts[, metadata], **args)``: ``args`` are passed as keyword
  arguments on every call (checked against its signature at build time); or
* a **class**: instantiated once with ``**args`` (load weights, open sessions there); its
  instances are called ``scorer(images, prompts[, metadata])``.

``images`` are uint8 ``(B, 3, H, W)`` RGB on the CPU, ``prompts`` B strings, ``metadata`` B
dicts: the prompt's record in the prompt file (a jsonl line as it is; ``{"prompt": text}``
for a txt line). Metadata is passed, as the keyword ``metadata``, only to callables that
declare a ``metadata`` parameter or ``**kwargs``, so plain ``(images, prompts)`` functions
keep working. An image-editing run's terms may also take ``input_images``: declared by name
(never through ``**kwargs``), it is passed uint8 ``(B, 3, H, W)``, each sample's input image
(the first of its prompt's ``image`` paths) resized to the output's size (Lanczos), read from
the paths in the metadata where the reward runs. A parameter without a default on prompts
without input images is a RewardError; one with a default (``input_images=None``) is simply
not passed there. A term returns a floating tensor ``(B,)`` or a mapping ``name -> (B,)`` (several
values, e.g. a judge's per-attribute scores); with a mapping, the term's ``key`` names the
value that is its reward, and :meth:`Reward.evaluate` reports every value.

Videos (``build_reward(..., frames=T)`` with T > 1, :func:`video_frames` of the model config)
reach the reward as decoded: each sample's T frames side by side, uint8 ``(B, 3, H, T*W)``. An
image term scores that whole picture, or with the term's ``per_frame = "mean" | "min"`` each
frame alone (B*T images, each with its sample's prompt and metadata), reduced over the frames.
A term whose first parameter is named ``frames`` takes the videos themselves: uint8
``(B, T, H, W, 3)`` RGB (an image model: T = 1).

Anything wrong with a term -- unknown name, import failure, bad ``args``, an exception inside
it, a result of the wrong type, shape or dtype, NaN or infinity -- raises :class:`RewardError`
naming the term and what was wrong.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from digenrl.config import RewardTerm

RewardFn = Callable[..., Any]
Metadata = Sequence[Mapping[str, Any]]


class RewardError(ValueError):
    """A reward term is unknown, failed or returned something unusable; names the term."""


# name -> the object itself, or "module:attr" imported on first use (model rewards pull in
# transformers / open_clip / onnxruntime only when a config names them)
_REGISTRY: dict[str, RewardFn | str] = {}


def register(name: str, target: RewardFn | str) -> None:
    """Make ``name`` a built-in term: a function, a class, or ``"module:attr"`` (lazy)."""
    if ":" in name:
        raise ValueError(f"reward name {name!r}: built-in names have no ':' (that is a plug-in)")
    _REGISTRY[name] = target


def builtin_names() -> list[str]:
    """Every built-in term name, in registration order."""
    return list(_REGISTRY)


def _import(name: str, spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"reward {name!r}: cannot import module {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward {name!r}: module {module_name!r} has no function {attr!r}")
    return fn


def resolve_reward(name: str) -> RewardFn:
    """The function or class for a built-in name or a ``module:attr`` plug-in."""
    if name in _REGISTRY:
        target = _REGISTRY[name]
        return _import(name, target) if isinstance(target, str) else target
    if ":" not in name:
        raise RewardError(
            f"reward {name!r}: unknown; expected a built-in ({', '.join(_REGISTRY)}) or "
            "'module:function'")
    return _import(name, name)


def check_images(images: torch.Tensor, prompts: Sequence[str]) -> None:
    """Raise :class:`RewardError` unless images are uint8 (B, 3, H, W) with B prompts."""
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4 \
            or images.shape[1] != 3:
        what = (f"{images.dtype} {tuple(images.shape)}" if isinstance(images, torch.Tensor)
                else type(images).__name__)
        raise RewardError(f"reward input: expected uint8 images (B, 3, H, W), got {what}")
    if len(prompts) != images.shape[0]:
        raise RewardError(
            f"reward input: {images.shape[0]} images but {len(prompts)} prompts")


def check_values(name: str, out: Any, b: int) -> torch.Tensor:
    """``out`` as a float32 CPU tensor (B,) of finite values, else :class:`RewardError`."""
    if not isinstance(out, torch.Tensor):
        raise RewardError(f"reward {name!r}: returned {type(out).__name__}, expected a tensor of shape ({b},)")
    if tuple(out.shape) != (b,):
        raise RewardError(f"reward {name!r}: returned shape {tuple(out.shape)}, expected ({b},)")
    if not out.is_floating_point():
        raise RewardError(f"reward {name!r}: returned dtype {out.dtype}, expected a floating dtype")
    out = out.detach().to(device="cpu", dtype=torch.float32)
    bad = ~torch.isfinite(out)
    if bad.any():
        idx = int(bad.nonzero()[0])
        raise RewardError(f"reward {name!r}: value {out[idx].item()} at index {idx} is not finite")
    return out


def call_reward(name: str, fn: RewardFn, images: torch.Tensor, prompts: Sequence[str],
                **kwargs: Any) -> torch.Tensor:
    """``fn(images, prompts, **kwargs)`` checked: a float32 tensor (B,) of finite values."""
    return check_values(name, _invoke(name, fn, images, prompts, kwargs), images.shape[0])


def _invoke(name: str, fn: RewardFn, images: torch.Tensor, prompts: Sequence[str],
            kwargs: Mapping[str, Any]) -> Any:
    try:
        return fn(images, prompts, **kwargs)
    except RewardError:
        raise
    except Exception as e:  # a plug-in's bug must surface with the term's name, not be lost
        raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e}") from e


def untile_frames(images: torch.Tensor, frames: int) -> torch.Tensor:
    """(B, 3, H, T*W) with T = ``frames`` side by side -> (B, T, H, W, 3): each sample's frames."""
    b, c, h, w = images.shape
    if frames < 1 or w % frames:
        raise RewardError(f"reward input: width {w} px is not {frames} frames side by side")
    return images.reshape(b, c, h, frames, w // frames).permute(0, 3, 2, 4, 1).contiguous()


def takes_frames(target: Any) -> bool:
    """Whether a reward function, class or instance takes videos: its first parameter (after a
    class's ``self``) is named ``frames``."""
    try:
        if inspect.isclass(target):
            params = list(inspect.signature(target.__call__).parameters)[1:]
        else:
            params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # no signature: an (images, prompts) builtin
        return False
    return bool(params) and params[0] == "frames"


def _takes_input_images(fn: RewardFn) -> str:
    """"required", "optional" (the parameter has a default: text prompts pass nothing) or ""."""
    try:
        p = inspect.signature(fn).parameters.get("input_images")
    except (TypeError, ValueError):
        return ""
    if p is None:
        return ""
    return "required" if p.default is inspect.Parameter.empty else "optional"


def input_images(label: str, metadata: Metadata, height: int, width: int) -> torch.Tensor:
    """uint8 (B, 3, height, width): each record's first input image at the output's size."""
    from digenrl.data.prompts import load_image, prompt_images
    from digenrl.models.pixels import image_to_tensor, to_uint8

    out = []
    for m in metadata:
        paths = prompt_images(m)
        if not paths:
            raise RewardError(f"reward {label!r} takes input_images, but prompt {m.get('prompt')!r} "
                              "has no input image (an edit prompt file's 'image')")
        try:
            out.append(to_uint8(image_to_tensor(load_image(paths[0]), height, width)))
        except OSError as e:
            raise RewardError(f"reward {label!r}: input image {paths[0]!r} cannot be read: {e}") from None
    return torch.stack(out)


def _takes_metadata(fn: RewardFn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: (images, prompts) only
        return False
    return any(p.name == "metadata" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@dataclass
class Term:
    """One resolved term: its scorer, how to call it, and where its value goes."""

    label: str
    weight: float
    scorer: RewardFn
    kwargs: dict[str, Any] = field(default_factory=dict)  # per call (function terms' args)
    takes_metadata: bool = False
    key: str = ""
    takes_frames: bool = False  # called with videos (B, T, H, W, 3)
    per_frame: str = ""  # an image term scored per frame: "mean" or "min" over the frames
    takes_input_images: str = ""  # an edit reward's "required" / "optional" input_images (module doc)

    def values(self, images: torch.Tensor, prompts: Sequence[str], metadata: Metadata,
               frames: int = 1) -> dict[str, torch.Tensor]:
        """Every value the term returns: ``{label: (B,)}`` or ``{label/<name>: (B,)}``.
        ``frames``: each sample is that many frames side by side (module doc)."""
        b = images.shape[0]
        if self.takes_frames:
            return self._call(untile_frames(images, frames), prompts, metadata, b)
        if not self.per_frame:
            return self._call(images, prompts, metadata, b)
        video = untile_frames(images, frames)  # (B, T, H, W, 3) -> B*T images (3, H, W)
        each = video.permute(0, 1, 4, 2, 3).reshape(b * frames, 3, *video.shape[2:4])
        out = self._call(each, [p for p in prompts for _ in range(frames)],
                         [m for m in metadata for _ in range(frames)], b * frames)
        reduce = torch.mean if self.per_frame == "mean" else torch.amin
        return {k: reduce(v.view(b, frames), dim=1) for k, v in out.items()}

    def _call(self, x: torch.Tensor, prompts: Sequence[str], metadata: Metadata, b: int) -> dict[str, torch.Tensor]:
        from digenrl.data.prompts import prompt_images

        kw = dict(self.kwargs)
        if self.takes_metadata:
            kw["metadata"] = metadata
        if self.takes_input_images == "required" or (
                self.takes_input_images and any(prompt_images(m) for m in metadata)):
            kw["input_images"] = input_images(self.label, metadata, x.shape[-2], x.shape[-1])
        out = _invoke(self.label, self.scorer, x, prompts, kw)
        if isinstance(out, Mapping):
            if not out:
                raise RewardError(f"reward {self.label!r}: returned an empty mapping")
            return {f"{self.label}/{k}": check_values(f"{self.label}/{k}", v, b) for k, v in out.items()}
        return {self.label: check_values(self.label, out, b)}

    def reward(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The term's reward among ``values`` (its only value, or the one ``key`` names)."""
        if self.label in values:
            if self.key:
                raise RewardError(f"reward {self.label!r}: key = {self.key!r} given but the term "
                                  "returned a single tensor")
            return values[self.label]
        if not self.key:
            names = ", ".join(k.split("/", 1)[1] for k in values)
            raise RewardError(f"reward {self.label!r}: returned several values ({names}); "
                              "set the term's key to the one that is the reward")
        want = f"{self.label}/{self.key}"
        if want not in values:
            names = ", ".join(k.split("/", 1)[1] for k in values)
            raise RewardError(f"reward {self.label!r}: key = {self.key!r} is not among its values ({names})")
        return values[want]


def _metadata(prompts: Sequence[str], metadata: Metadata | None) -> Metadata:
    if metadata is None:
        return [{"prompt": p} for p in prompts]
    if len(metadata) != len(prompts):
        raise RewardError(f"reward input: {len(prompts)} prompts but {len(metadata)} metadata records")
    return metadata


class Reward:
    """A weighted sum of reward terms: ``reward(images, prompts, metadata) -> (total[B], {label: [B]})``.

    ``frames``: each image is that many video frames side by side (module doc)."""

    def __init__(self, terms: Sequence[Term | tuple[str, float, RewardFn]], frames: int = 1) -> None:
        self.terms = [t if isinstance(t, Term) else
                      Term(label=t[0], weight=float(t[1]), scorer=t[2], takes_metadata=_takes_metadata(t[2]),
                           takes_frames=takes_frames(t[2]), takes_input_images=_takes_input_images(t[2]))
                      for t in terms]
        self.frames = frames

    @property
    def names(self) -> list[str]:
        """The terms' labels, in config order."""
        return [t.label for t in self.terms]

    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Metadata | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        check_images(images, prompts)
        images, meta = images.cpu(), _metadata(prompts, metadata)
        total = torch.zeros(images.shape[0], dtype=torch.float32)
        parts: dict[str, torch.Tensor] = {}
        for term in self.terms:
            parts[term.label] = term.reward(term.values(images, prompts, meta, self.frames))
            total += term.weight * parts[term.label]
        return total, parts

    def evaluate(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Metadata | None = None) -> dict[str, torch.Tensor]:
        """Every value of every term (a mapping term gives ``label/<name>`` for each of its
        values), unweighted: what held-out evaluation reports."""
        check_images(images, prompts)
        images, meta = images.cpu(), _metadata(prompts, metadata)
        out: dict[str, torch.Tensor] = {}
        for term in self.terms:
            out.update(term.values(images, prompts, meta, self.frames))
        return out


def _check_per_frame(label: str, spec: RewardTerm, target: Any) -> bool:
    """Whether the term takes frames; RewardError for ``per_frame`` on such a term."""
    frames = takes_frames(target)
    if frames and spec.per_frame:
        raise RewardError(f"reward {label!r}: per_frame = {spec.per_frame!r} is for image terms; "
                          "this one takes the frames itself")
    return frames


def _build_term(spec: RewardTerm) -> Term:
    label = spec.label or spec.name
    if not math.isfinite(spec.weight):
        raise RewardError(f"reward {label!r}: weight {spec.weight} is not finite")
    target = resolve_reward(spec.name)
    frames = _check_per_frame(label, spec, target)
    args = dict(spec.args)
    if inspect.isclass(target):
        try:
            scorer = target(**args)
        except RewardError:
            raise
        except TypeError as e:
            raise RewardError(f"reward {label!r}: args {args!r} do not fit {target.__name__}: {e}") from None
        except Exception as e:  # loading weights failed: name the term, keep the cause
            raise RewardError(f"reward {label!r}: building {target.__name__} raised "
                              f"{type(e).__name__}: {e}") from e
        if not callable(scorer):
            raise RewardError(f"reward {label!r}: a {target.__name__} is not callable (a reward "
                              "class needs __call__(images, prompts[, metadata]))")
        return Term(label=label, weight=float(spec.weight), scorer=scorer,
                    takes_metadata=_takes_metadata(scorer), key=spec.key,
                    takes_frames=frames, per_frame=spec.per_frame,
                    takes_input_images=_takes_input_images(scorer))
    if args:
        try:
            inspect.signature(target).bind_partial(None, None, **args)
        except TypeError as e:
            raise RewardError(f"reward {label!r}: args {args!r} do not fit its signature: {e}") from None
        except ValueError:  # no signature to check against: the first call will tell
            pass
    return Term(label=label, weight=float(spec.weight), scorer=target, kwargs=args,
                takes_metadata=_takes_metadata(target), key=spec.key,
                takes_frames=frames, per_frame=spec.per_frame,
                takes_input_images=_takes_input_images(target))


def build_reward(terms: Sequence[RewardTerm], device: Any = None, *, frames: int = 1) -> Reward:
    """Resolve (and build) each term now, so a typo or a missing weights folder fails at
    start-up, not after the first rollout. A class term whose constructor takes ``device``
    gets the node's (a reward model then sits on the node's GPU). ``frames``: the model's
    video frames (:func:`digenrl.rl.rewards.video.video_frames`; 1 for images)."""
    if not terms:
        raise RewardError("reward terms: expected at least one term")
    built: list[Term] = []
    for spec in terms:
        label = spec.label or spec.name
        if label in {t.label for t in built}:
            raise RewardError(f"reward {label!r}: listed twice; give it one weight (or each "
                              "entry its own label)")
        if device is not None and "device" not in spec.args and _takes_device(resolve_reward(spec.name)):
            spec = dataclasses.replace(spec, args={**spec.args, "device": str(device)})
        built.append(_build_term(spec))
    return Reward(built, frames=frames)


def _takes_device(target: Any) -> bool:
    if not inspect.isclass(target):
        return False
    try:
        return "device" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False


def check_reward(terms: Sequence[RewardTerm]) -> None:
    """What :func:`build_reward` checks, building nothing (no weights are loaded): every name
    resolves (a plug-in module imports), labels are unique, weights finite, ``args`` fit the
    function's or the class's signature. The launcher calls it before any process starts."""
    if not terms:
        raise RewardError("reward terms: expected at least one term")
    labels: set[str] = set()
    for spec in terms:
        label = spec.label or spec.name
        if label in labels:
            raise RewardError(f"reward {label!r}: listed twice; give it one weight (or each "
                              "entry its own label)")
        labels.add(label)
        if not math.isfinite(spec.weight):
            raise RewardError(f"reward {label!r}: weight {spec.weight} is not finite")
        target = resolve_reward(spec.name)
        _check_per_frame(label, spec, target)
        args = dict(spec.args)
        try:
            if inspect.isclass(target):
                inspect.signature(target).bind(**args)
            elif args:
                inspect.signature(target).bind_partial(None, None, **args)
        except TypeError as e:
            raise RewardError(f"reward {label!r}: args {args!r} do not fit its signature: {e}") from None
        except ValueError:  # no signature to check against: the build will tell
            pass
