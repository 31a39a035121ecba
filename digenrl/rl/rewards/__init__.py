"""Rewards: decoded images (or videos) + prompts (+ each prompt's metadata) -> one float per sample.

The simplest reward, built-in or plug-in, is a function::

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor
        # images: uint8 (B, 3, H, W) RGB; prompts: B strings
        # returns a floating tensor of shape (B,); it is cast to float32

It may also take ``metadata`` (each prompt's record of a jsonl prompt file) and keyword
``args`` from its ``[reward] terms`` entry, or be a class built once with those args (model
rewards load their weights there): :mod:`digenrl.rl.rewards.base` has the rules.
:func:`build_reward` returns a :class:`Reward` whose call gives the weighted sum and each
term's own values (for logging and hacking monitors); :meth:`Reward.evaluate` gives every
value of every term (held-out evaluation). Errors are :class:`RewardError`, naming the term.

Cheap built-ins (offline, no model weights; :mod:`digenrl.rl.rewards.stats`):

========================  ==================================================================
``jpeg_compressibility``  ``-kB`` of the image as JPEG at quality 95 (Pillow, 4:2:0, no
                          optimise), kB = 1000 bytes. We do *not* apply Flow-GRPO's ``/500``:
                          on 32x32 images sizes are ~0.5-2 kB, and GRPO normalises per group
                          anyway; multiply the term's ``weight`` by 1/500 to reproduce it.
``jpeg_incompressibility`` ``+kB`` of the same JPEG.
``brightness``            mean BT.709 luma ``0.2126 R + 0.7152 G + 0.0722 B`` of the sRGB
                          values (no linearisation), in [0, 1].
``saturation``            mean HSV saturation ``(max - min) / max`` per pixel, in [0, 1].
``colourfulness``         Hasler & Suesstrunk (2003) M = sigma_rgyb + 0.3 mu_rgyb, divided by
                          100 (about 0-1.5 for natural images).
``redness``               mean ``(R - (G + B) / 2) / 255``, in [-0.5, 1].
``pixel_std``             spatial standard deviation of each channel / 255, averaged over R, G,
                          B, in [0, 0.5]:
                          0 for a flat colour field (an evaluation term that shows collapse)
``prompt_colour_match``   how well the pixels show the colours the prompt names (shapes
                          world): see :func:`prompt_colour_match`. In [0, 1].
========================  ==================================================================

Shapes judges (tiny learned classifiers shipped as package data; :mod:`digenrl.rl.rewards.judge`):

========================  ==================================================================
``shapes_judge``          the reward judge's log-probability of the prompt's shape, shape
                          colour and background colour, <= 0; a prompt outside the shapes
                          grammar is a RewardError
``shapes_attributes``     the independent eval judge's per-image correctness: a mapping
                          ``shape``, ``colour``, ``background``, ``all`` of 0/1 (for ``[eval]``)
``shapes_spread``         each sample's mean feature distance to the other samples of its
                          prompt in the same scoring call (the reward judge's last convolution
                          map), in [0, 2]: a diversity term
========================  ==================================================================

Video (:mod:`digenrl.rl.rewards.video`; any image term also scores each frame with
``per_frame = "mean" | "min"``):

==========================  ================================================================
``temporal_consistency``    mean similarity of consecutive frames, 1 - mean absolute
                            difference of frames area-averaged to <= 32 px, in [0, 1]
==========================  ================================================================

Image editing (:mod:`digenrl.rl.rewards.edit`; the term gets each sample's input image):

==========================  ================================================================
``input_ssim``              SSIM of the output to its input image (Gaussian window 11 px,
                            sigma 1.5, on 0-255 RGB), in [-1, 1]: how much the edit preserves
==========================  ================================================================

Model rewards (weights from a local folder named in ``args.weights``; never a hub):

========================  ==================================================================
``pickscore``             PickScore (CLIP ViT-H/14 fine-tuned on Pick-a-Pic), transformers CLIP
``clipscore``             CLIPScore / 100, transformers CLIP: ``max(cos(image, text), 0)``
``aesthetic``             LAION aesthetic predictor v2: CLIP image embedding + MLP
``hpsv2``                 HPSv2.1: its open_clip ViT-H-14 checkpoint run as a transformers CLIP
``imagereward``           ImageReward: BLIP towers (transformers) + its MLP head
``ocr``                   1 - normalised edit distance between the text RapidOCR reads and
                          the prompt's quoted text (flow_grpo's OCR reward)
========================  ==================================================================

Remote rewards:

========================  ==================================================================
``http``                  a flow_grpo reward server (pickled JPEG batches over HTTP)
``vlm_judge``             an OpenAI-compatible chat endpoint asked for a score
========================  ==================================================================

Their modules (``clip``, ``imagereward``, ``ocr``, ``remote``, ``vlm``) document
their ``args``; docs/rewards.md has the whole picture.
"""

from __future__ import annotations

from digenrl.rl.rewards.base import (
    Metadata,
    Reward,
    RewardError,
    RewardFn,
    Term,
    build_reward,
    builtin_names,
    call_reward,
    check_images,
    check_reward,
    check_values,
    register,
    resolve_reward,
    takes_frames,
    untile_frames,
)
from digenrl.rl.rewards.stats import STATS, prompt_colour_match, prompt_colours

__all__ = ["BUILTIN", "Metadata", "Reward", "RewardError", "RewardFn", "Term", "build_reward",
           "builtin_names", "call_reward", "check_images", "check_reward", "check_values", "prompt_colour_match",
           "prompt_colours", "register", "resolve_reward", "takes_frames", "untile_frames"]

BUILTIN: dict[str, RewardFn] = dict(STATS)
"""The cheap built-ins by name (plain functions of images and prompts)."""

for _name, _fn in STATS.items():
    register(_name, _fn)
for _name, _target in {
    "pickscore": "digenrl.rl.rewards.clip:PickScore",
    "clipscore": "digenrl.rl.rewards.clip:CLIPScore",
    "aesthetic": "digenrl.rl.rewards.clip:Aesthetic",
    "hpsv2": "digenrl.rl.rewards.clip:HPSv2",
    "imagereward": "digenrl.rl.rewards.imagereward:ImageReward",
    "ocr": "digenrl.rl.rewards.ocr:OCR",
    "http": "digenrl.rl.rewards.remote:FlowGRPOServer",
    "vlm_judge": "digenrl.rl.rewards.vlm:VLMJudge",
    "shapes_judge": "digenrl.rl.rewards.judge:ShapesJudgeReward",
    "shapes_attributes": "digenrl.rl.rewards.judge:ShapesAttributes",
    "shapes_spread": "digenrl.rl.rewards.judge:ShapesSpread",
    "temporal_consistency": "digenrl.rl.rewards.video:temporal_consistency",
    "input_ssim": "digenrl.rl.rewards.edit:input_ssim",
}.items():
    register(_name, _target)  # imported when a config names it
