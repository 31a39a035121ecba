"""The run's configuration: a tree of frozen, keyword-only dataclasses loaded from TOML.

One function, :func:`load_config`, builds the tree from a TOML file (or the embedded
default ``configs/tiny-cpu.toml``) plus ``section.key=value`` overrides. It rejects unknown
keys, wrong types and out-of-range values with a :class:`ConfigError` that names the dotted
key, the value and what was expected. Runtime objects (models, sockets) never live here.

Modes are configurations of one scheduler, not separate code paths: :func:`resolve_mode`
returns the config with the runtime knobs that a mode fixes (staleness K, GAP fragments,
TSP, TAG) set, as a :data:`ResolvedConfig`, and that resolved tree is what a run records in
its run dir. It runs once, at the command line's edge (``digenrl/cli.py``); the code below
takes a ``ResolvedConfig`` and never resolves again. A config written resolved (a run dir's
``config.toml``, the one Welcome carries) is read back with :func:`read_resolved`.

K, the staleness bound, is ``runtime.staleness`` of a resolved config (0 in colocated and
disagg-sync mode): the trainer and the policy read it there, and the scheduler hands it to
its credit ledger, where the scheduler's checks and the simulator read it
(:mod:`digenrl.core.credits` states the rule).

Reading is ``tomllib`` and writing ``tomli-w``; the validator between them stays hand-written
(a few functions) rather than a schema library, because what it does is the point: one line per
error naming the dotted key (``train.group_size``), the value and the bound, with the bounds
and help text kept on the field itself, over plain frozen dataclasses that the torch-free
``core`` and the simulator use as they are, with no runtime dependency for it.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NewType, get_args, get_origin

import tomli_w

Mode = Literal["digenrl", "disagg-sync", "colocated"]
MODES: tuple[str, ...] = get_args(Mode)


class ConfigError(ValueError):
    """A configuration value a user wrote is wrong; the message names key, value, expectation."""


#: A node's exit code for a configuration or reward plug-in error: the launcher and
#: supervisors stop the run instead of restarting the node (it would fail the same way again).
CONFIG_ERROR_EXIT = 2


def _f(default: Any, help: str, **bounds: float) -> Any:
    """A config field with a help string and optional numeric bounds (ge, gt, le, lt)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **bounds})
    return field(default=default, metadata={"help": help, **bounds})


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    seed: int = _f(0, "seed for prompts, noise and parameter init; runs replay from it", ge=0)
    steps: int = _f(30, "optimizer steps (= policy versions) to train", ge=1, le=10**9)
    mode: Mode = _f("digenrl", "digenrl | disagg-sync | colocated (see DESIGN.md, Modes)")
    threads: int = _f(1, "torch intra-op threads per process", ge=1, le=1024)
    checkpoint_every: int = _f(100, "write a checkpoint every N steps, and at the end (0 = only at "
                                    "the end: a lost trainer or a stop then rewinds to the start)", ge=0)
    sample_grid_every: int = _f(0, "also save a sample grid every N steps (0 = first and last only)", ge=0)
    eval_every: int = _f(0, "held-out evaluation ([eval]) of the policy at version 0, every N "
                         "versions and at the end; 0 = none (needs a test split, [prompts])", ge=0)
    node_fault_limit: int = _f(3, "a node whose fragments held non-finite values (NaN, inf) this "
                               "many times in a row is broken (docs/operations.md)", ge=1, le=1000)
    node_fault_action: Literal["drop", "stop"] = _f(
        "drop", "a broken node: 'drop' (lost, its work reassigned; the run stops when it is the "
        "last rollout) or 'stop' (the run stops with an error naming it)")


@dataclass(frozen=True, kw_only=True)
class EmulateConfig:
    """``model.path = "emulated"``: an accelerator emulated from the cost model (models/emulated.py)."""

    time_scale: float = _f(1.0, "wall seconds per emulated GPU second (0.02 runs 50x faster than "
                           "the GPUs would; reported times are divided by it)", gt=0)
    latent_scale: float = _f(1.0, "latent elements relative to the recipe's (the spatial sides "
                             "shrink by its square root)", gt=0, le=1)
    weight_scale: float = _f(1.0, "weight-set bytes relative to the recipe's trainable bytes", gt=0, le=1)
    link_gbs: float = _f(45.0, "cross-host link for the step's gradient all-reduce once the "
                         "trainer ranks span hosts (a cluster TOML's network.link_gbs)", gt=0)


PIPELINE_FAMILIES: dict[str, str] = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "WanPipeline": "wan",  # Wan2.1 and Wan2.2 (TI2V-5B, T2V-A14B) folders alike
    "QwenImagePipeline": "qwenimage",
    "HunyuanVideoPipeline": "hunyuanvideo",
    "Flux2Pipeline": "flux2",  # FLUX.2-dev
    "Flux2KleinPipeline": "flux2",  # FLUX.2-klein
    "ZImagePipeline": "zimage",  # Z-Image(-Turbo)
    "QwenImageEditPipeline": "qwenimage_edit",
    "QwenImageEditPlusPipeline": "qwenimage_edit",
    "FluxKontextPipeline": "flux_kontext",
}
"""A pipeline folder's class (``model_index.json``'s ``_class_name``) -> its family. A class whose
family is not in :data:`FAMILIES` is known but not trained by this version (a one-line error names it)."""


EDIT_FAMILIES: dict[str, int] = {"flux_kontext": 1, "qwenimage_edit": 3}
"""Image-editing families -> the most input images one prompt may give (their prompts are
``.jsonl`` lines with an ``image`` or ``images``; see digenrl/data/prompts.py). A folder may
take fewer: :func:`edit_image_limit`."""

#: Edit pipelines that take fewer input images than their family (Qwen-Image-Edit: one; its
#: Plus pipeline, Qwen-Image-Edit-2509 and later, up to the family's three).
PIPELINE_IMAGE_LIMIT: dict[str, int] = {"QwenImageEditPipeline": 1}


def edit_image_limit(model: ModelConfig) -> int:
    """The most input images one prompt may give ``model`` (0: a text-to-image family): the
    family's, or fewer where ``model.path``'s pipeline class takes fewer."""
    most = EDIT_FAMILIES.get(model.family, 0)
    index = Path(model.path) / "model_index.json"
    if most and model.path not in ("builtin", "random", "emulated") and index.is_file():
        try:
            cls = json.loads(index.read_text()).get("_class_name", "")
        except (OSError, ValueError, AttributeError):
            return most  # build_model names the unreadable file
        most = min(most, PIPELINE_IMAGE_LIMIT.get(str(cls), most))
    return most


def detect_family(path: str) -> str:
    """The family of pipeline folder ``path``, read from its ``model_index.json``; "" when
    ``path`` is no pipeline folder. A pipeline DigenRL does not train is a :class:`ConfigError`
    naming its class and the supported ones."""
    index = Path(path) / "model_index.json"
    if path in ("builtin", "random", "emulated") or not index.is_file():
        return ""
    try:
        cls = json.loads(index.read_text()).get("_class_name", "")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{index}: not a readable model_index.json ({e})") from None
    return pipeline_family(str(cls), index)


def pipeline_family(pipeline_class: str, index: Path) -> str:
    """The family of ``pipeline_class`` (read from ``index``), or a one-line :class:`ConfigError`
    naming the class and the pipelines DigenRL trains."""
    family = PIPELINE_FAMILIES.get(pipeline_class, "")
    if family not in FAMILIES:
        supported = ", ".join(p for p, f in PIPELINE_FAMILIES.items() if f in FAMILIES)
        known = f" (family {family!r}, not trained by this version)" if family else ""
        raise ConfigError(f"{index} names pipeline {pipeline_class!r}{known}; DigenRL trains {supported}")
    return family


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: Literal["", "sd3", "flux", "wan", "qwenimage", "hunyuanvideo", "flux2", "zimage", "flux_kontext",
                    "qwenimage_edit"] = _f(
        "", "diffusers transformer family: sd3, flux, wan, qwenimage, hunyuanvideo, flux2, zimage, flux_kontext "
        "and qwenimage_edit (image editing) "
        "(docs/models.md); '' (the default) = the one model.path's model_index.json names, sd3 "
        "when model.path is no pipeline folder")
    path: str = _f("builtin", "'builtin' (the shipped tiny base model), 'random' (tiny random "
                   "init), 'emulated' (no weights: an accelerator emulated from the cost model, "
                   "see model.emulate) or a local diffusers folder loaded with from_pretrained, offline")
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", "compute dtype of the transformer and text encoders; trained parameters and "
        "optimizer state stay float32 (master weights) whatever this is")
    height: int = _f(0, "image height in pixels; 0 = the pipeline's default (SD3: sample_size x VAE "
                     "factor, FLUX/FLUX.2/Z-Image/Qwen-Image 1024, Wan 480, HunyuanVideo 720; tiny models 32)", ge=0,
                     le=16384)
    width: int = _f(0, "image width in pixels; 0 = the pipeline's default (Wan 832, HunyuanVideo 1280)", ge=0, le=16384)
    num_frames: int = _f(0, "video frames (wan, hunyuanvideo); 0 = the pipeline's default (81, 129); "
                         "must be 1 + a multiple of the VAE's time factor", ge=0, le=2049)
    text_encoder: Literal["auto", "pipeline", "hash"] = _f(
        "auto", "prompt encoder: 'pipeline' = the folder's own text encoders (as its diffusers "
        "pipeline encodes), 'hash' = the toy hash-of-words encoder; 'auto' = pipeline for a "
        "pipeline folder, hash for 'builtin' / 'random' (any other folder must say which)")
    max_text_tokens: int = _f(0, "prompt tokens the text encoders keep; 0 = the pipeline's default "
                              "(SD3 256, FLUX 512, Wan 226, Qwen-Image 1024, HunyuanVideo 256, FLUX.2 512, "
                              "Z-Image 512)", ge=0,
                              le=8192)
    lora_rank: int = _f(0, "LoRA rank via peft; 0 trains all parameters (at most the "
                       "transformer's width, checked at launch)", ge=0, le=16384)
    lora_alpha: float = _f(0.0, "LoRA alpha; 0 means 2 * rank (the Flow-GRPO default)", ge=0)
    lora_targets: list[str] = _f(
        ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
        "module names LoRA adapts (peft target_modules; flow_grpo's set: the image and text "
        "attention projections)")
    gradient_checkpointing: bool = _f(False, "activation checkpointing in the trainer")
    train_experts: Literal["both", "high", "low"] = _f(
        "both", "two-expert folders (Wan2.2 A14B: transformer for the high-noise steps, transformer_2 "
        "for the low-noise ones, switched at the folder's boundary_ratio): which the run trains "
        "(LoRA or full weights); the other stays the base's and is never synced or saved")
    fsdp: bool = _f(False, "shard parameters/grads/optimizer state over trainer ranks (FSDP2)")
    offload: Literal["none", "params", "optimizer"] = _f(
        "none", "trainer CPU offload: 'params' (needs model.fsdp = true) keeps the sharded "
        "parameters, their gradients and the optimizer state in (pinned) host memory (FSDP2's "
        "CPUOffloadPolicy); 'optimizer' keeps the parameters and gradients on the device and "
        "AdamW's state and a float32 master copy on the host (unsharded, a bf16 model's masters "
        "leave the device); both run the optimizer step on the CPU. 'none' keeps everything on "
        "the device")
    condition_area: int = _f(
        0, "qwenimage_edit: pixel area each input image is VAE-encoded at (its aspect kept, sides "
        "rounded to 32 px, as the pipelines' calculate_dimensions); 0 = the output's area "
        "(model.height x model.width). The pipelines use 1048576 (1024 x 1024)", ge=0, le=1 << 26)
    condition_vl_area: int = _f(
        0, "qwenimage_edit: pixel area of each input image the text encoder (Qwen2.5-VL) sees; 0 = "
        "the pipeline's: QwenImageEditPipeline the VAE's image (model.condition_area), "
        "QwenImageEditPlusPipeline 147456 (384 x 384)", ge=0, le=1 << 26)
    vae_tiling: bool = _f(False, "decode with the VAE tiled and sliced (diffusers' enable_tiling / "
                          "enable_slicing): large images and video decode in bounded memory")
    free_text_encoders: bool = _f(
        False, "a pipeline folder's text encoders leave memory once every node has encoded the run's "
        "train and test prompts (and the empty prompt) at its start, each alone, into a host table; a "
        "prompt outside them is then an error. No effect with the hash encoder")
    text_cache_mb: int = _f(4096, "host memory the table of model.free_text_encoders may take (MiB); "
                            "past it the launcher refuses the run (families with fixed-length rows) or "
                            "the node stops at its start, naming the size it needs", ge=1, le=2**30)
    emulate: EmulateConfig = field(default_factory=EmulateConfig,
                                   metadata={"help": "knobs of model.path = 'emulated'"})

    def __post_init__(self) -> None:
        if not self.family:  # read from the folder once; the resolved tree then names it
            object.__setattr__(self, "family", detect_family(self.path) or "sd3")


FAMILIES: tuple[str, ...] = tuple(f for f in get_args(typing.get_type_hints(ModelConfig)["family"]) if f)
"""The families DigenRL trains (``model.family``'s values; each has an adapter in
digenrl/models/families.py and a row in docs/models.md)."""


@dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    num_steps: int = _f(8, "denoising steps per trajectory (T)", ge=1, le=1000)
    sde_type: Literal["sde", "cps", "dance", "ode"] = _f(
        "sde", "sde (Flow-GRPO), cps, dance (DanceGRPO, constant eta) or ode (no noise)")
    noise_level: float = _f(0.7, "Flow-GRPO noise level a (0.7 SD3, 0.9 FLUX, 1.2 Qwen)", ge=0)
    eta: float = _f(0.3, "DanceGRPO constant eta", ge=0)
    shift: float = _f(3.0, "sigma shift s: sigma -> s*sigma/(1+(s-1)*sigma)", gt=0)
    guidance_scale: float = _f(1.0, "classifier-free guidance; 1 disables CFG (recommended). "
                               "uncond + g (cond - uncond): Z-Image's pipeline writes cond + g' (cond - "
                               "uncond), so its g' is this minus 1 (Turbo's 0 is 1 here)", ge=0)
    embedded_guidance: float = _f(
        0.0, "guidance value fed to a guidance-distilled transformer (FLUX.1-dev, FLUX.2-dev, "
        "HunyuanVideo); 0 = the pipeline's default (FLUX 3.5, FLUX.2 4.0, HunyuanVideo 6.0)", ge=0)
    wire_dtype: Literal["float32", "bfloat16"] = _f(
        "float32", "dtype latents are stored/sent in; log-probs are computed on the rounded value")
    ode_solver: Literal["euler", "dpm2"] = _f(
        "euler", "solver of the ODE (noise-free) steps: euler, or dpm2 (DPM-Solver++(2M), the "
        "higher-order solver of MixGRPO-Flash); SDE steps are always the SDE")
    ode_compress: float = _f(
        1.0, "share of the ODE steps after the last SDE step that are taken (MixGRPO-Flash: 0.4); "
        "the rest of the schedule is covered by fewer, longer steps. 1 = every step", gt=0, le=1)
    base_tail: int = _f(
        0, "the last N denoising steps are taken by the base model (the LoRA adapter off), in "
        "training rollouts and in evaluation alike: the fine detail the untrained last steps draw "
        "stays the base's instead of drifting (docs/judge.md). LoRA only; no trained step "
        "may fall in the tail", ge=0)
    max_batch: int = _f(
        0, "step-level batching (rl/batching.py StepBatcher): trajectories of several fragments, "
        "each at its own timestep, share one denoiser forward of up to this many rows; fragments "
        "join whole, so at least one fragment's rows (prompts per fragment x group_size). "
        "0 = off (one fragment at a time)", ge=0, le=1 << 20)
    join: Literal["pays", "fits"] = _f(
        "pays", "when a waiting fragment joins the fragments in flight (sampler.max_batch > 0): "
        "'pays' = when the node's own measured step times say carrying its rows costs at most "
        "0.85 of stepping them alone (a device whose time per row is flat, a CPU or a full GPU, "
        "steps fragments in turn instead of slowing the ones in flight); 'fits' = whenever its "
        "rows fit under max_batch")
    compile: bool = _f(
        False, "the step batcher's denoiser forward through torch.compile (rows padded to power-of-two "
        "buckets so it compiles once per bucket; on a GPU the flash/cuDNN SDPA kernels are "
        "preferred); a compile failure falls back to eager with a logged reason. Needs "
        "sampler.max_batch > 0")
    cond_cache_mb: int = _f(
        0, "the step batcher's per-prompt text-conditioning cache (LRU by bytes), in MiB; "
        "0 = no cache (each fragment encodes its prompts)", ge=0, le=1 << 20)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    prompts_per_step: int = _f(4, "distinct prompts (GRPO groups) per optimizer step", ge=1,
                            le=65536)
    group_size: int = _f(4, "generations per prompt (G)", ge=2, le=4096)
    lr: float = _f(3e-4, "AdamW learning rate", gt=0)
    weight_decay: float = _f(1e-4, "AdamW weight decay", ge=0)
    adam_betas: tuple[float, float] = _f((0.9, 0.999), "AdamW betas")
    max_grad_norm: float = _f(1.0, "gradient clipping norm (0 disables)", ge=0)
    clip_range: float = _f(1e-4, "PPO ratio clip epsilon (Flow-GRPO: 1e-4)", gt=0)
    kl_beta: float = _f(0.0, "KL-to-reference coefficient beta (0 = no reference pass)", ge=0)
    adv_clip: float = _f(5.0, "advantages are clipped to +-adv_clip", gt=0)
    adv_std: Literal["group", "global"] = _f(
        "group", "normalise advantages by the group's std or the whole step's std")
    advantage: Literal["sum", "gdpo"] = _f(
        "sum", "with several reward terms: 'sum' normalises their weighted sum within each group "
        "(Flow-GRPO); 'gdpo' normalises each term within the group, then their weighted sum "
        "(GDPO, so a term of small spread is not drowned by one of large spread); adv_std and "
        "adv_clip apply to both. One term: the two are the same (docs/algorithms.md)")
    timesteps: Literal["all", "fraction", "window", "mix"] = _f(
        "all", "which denoising steps are trained: all, a leading fraction, a Flow-GRPO-Fast "
        "window at a random place (SDE inside, ODE outside), or mix: MixGRPO's sliding window "
        "(SDE inside, ODE outside) whose position advances over training")
    timestep_fraction: float = _f(1.0, "fraction of steps trained when timesteps='fraction'", gt=0, le=1)
    window_size: int = _f(2, "window length W when timesteps='window' or 'mix'", ge=1,
                     le=1000)
    window_lo: int = _f(0, "earliest window start (inclusive)", ge=0)
    window_hi: int = _f(0, "latest window end (exclusive); 0 means T//2", ge=0)
    window_shift_every: int = _f(
        10, "mix: optimizer steps the window stays at one place (MixGRPO's shift interval tau)", ge=1)
    window_stride: int = _f(
        1, "mix: denoising steps the window moves by at each shift; past window_hi it rolls back "
        "to window_lo", ge=1)
    window_shift_decay: float = _f(
        0.0, "mix: MixGRPO's exp_decay: at window start p the window stays "
        "ceil(window_shift_every * exp(-decay * max(0, p - window_decay_from))) steps (>= 1); "
        "0 keeps the interval constant (the reference uses 0.1)", ge=0)
    window_decay_from: int = _f(
        0, "mix: window start from which window_shift_decay shortens the interval (the "
        "reference uses 13 of 25 steps)", ge=0)
    algorithm: Literal["grpo", "nft", "awm"] = _f(
        "grpo", "grpo: Flow-GRPO / DanceGRPO / MixGRPO (per-step chunks, behaviour log-probs); "
        "nft: DiffusionNFT; awm: Advantage Weighted Matching (both train on final clean samples "
        "at timesteps the trainer draws; rollouts may use any solver)")
    guard: bool = _f(False, "grpo: GRPO-Guard's regulated clipping (per-timestep ratio "
                     "normalisation, 1/|dt| gradient reweighting); 'sde' and 'dance' steps only")
    forward_timesteps: int = _f(
        2, "nft/awm: timesteps the trainer draws per sample and step (stratified, shifted like "
        "the sampler); at most sampler.num_steps", ge=1, le=1000)
    nft_beta: float = _f(1.0, "nft: beta, the step from the behaviour velocity to the implicit "
                         "positive/negative policies", gt=0)
    awm_clip: float = _f(1.0, "awm: PPO clip range of AWM's flow-matching likelihood ratio (the "
                         "reference uses 1, i.e. hardly any clipping)", gt=0)
    nft_adaptive: bool = _f(True, "nft: DiffusionNFT's adaptive weighting (each branch's squared "
                            "x0 error over its detached mean absolute error)")
    sequence_parallel: int = _f(
        1, "N: trainer ranks that train each sample together (Ulysses sequence parallelism): "
        "groups of N consecutive trainer ranks share their samples, each rank carrying 1/N of "
        "the image/video tokens through the transformer; N must divide cluster.trainers and "
        "the transformer's attention heads (sd3, flux, flux_kontext, qwenimage, wan, "
        "hunyuanvideo; not colocated)", ge=1, le=1024)
    ema_decay: float = _f(
        0.0, "decay d of an exponential moving average of the trained weights (float32, on the "
        "trainer ranks), after each applied optimizer step: ema = d * ema + (1 - d) * weights; "
        "evaluated per eval.policy and saved to final/ema/; 0 = off", ge=0, lt=1)


@dataclass(frozen=True, kw_only=True)
class RewardTerm:
    name: str = _f("jpeg_compressibility", "built-in reward name or 'module:function' (a function "
                   "or a class); docs/rewards.md")
    weight: float = _f(1.0, "weight in the summed reward")
    args: dict[str, Any] = _f({}, "passed to the term: a class's constructor arguments (weights "
                              "folder, device, batch_size, url, ...) or a function's keyword arguments")
    label: str = _f("", "the term's name in metrics (default: name); needed to list one reward twice")
    key: str = _f("", "for a term returning several values (a mapping), the one that is the reward")
    per_frame: Literal["", "mean", "min"] = _f(
        "", "video models: score each frame with this image term and take the mean or the minimum "
        "over the frames; '' = the whole sample (a video's frames side by side). A term that takes "
        "frames itself (docs/rewards.md) has none")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    terms: list[RewardTerm] = _f([RewardTerm()], "weighted reward terms, summed")
    worker_batch: int = _f(32, "reward workers (cluster.rewards > 0) score up to this many images "
                           "per call, gathered across fragments and rollouts", ge=1,
                           le=65536)
    worker_timeout_s: float = _f(300.0, "a fragment whose scores have not come back from a reward "
                                 "worker within this is discarded as 'reward_timeout'", ge=1)


@dataclass(frozen=True, kw_only=True)
class PromptConfig:
    file: str = _f("", "prompt file: .jsonl (one JSON object a line with a 'prompt' field plus any "
                   "metadata, e.g. flow_grpo's GenEval metadata.jsonl) or text (one prompt a "
                   "line); empty uses the built-in shapes set")
    test_file: str = _f("", "held-out prompts for evaluation (same formats); empty: see test_fraction")
    test_fraction: float = _f(0.0, "without test_file: hold this fraction of the prompt file out "
                              "of training as the test split (deterministic, from split_seed)",
                              ge=0, lt=1)
    split_seed: int = _f(0, "seed of the held-out split (not run.seed: runs with different seeds "
                         "share one test set)", ge=0)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    terms: list[RewardTerm] = _f([], "what evaluation scores (same entries as reward.terms, "
                                 "weights ignored); empty: the training reward's terms")
    prompts: int = _f(0, "evaluate the first N test prompts (0 = all)", ge=0, le=10**6)
    samples_per_prompt: int = _f(1, "samples per test prompt, each with its own fixed seed", ge=1,
                                    le=4096)
    seed: int = _f(0, "seed of the evaluation noise (fixed: every evaluation of a run and of "
                   "runs with other run.seed values sees the same noise)", ge=0)
    num_steps: int = _f(0, "denoising steps of evaluation sampling (ODE); 0 = sampler.num_steps",
                        ge=0, le=1000)
    batch_size: int = _f(16, "samples generated per batch during evaluation", ge=1, le=65536)
    policy: Literal["auto", "ema", "policy", "both"] = _f(
        "auto", "which weights evaluation scores: the EMA (train.ema_decay > 0; metrics eval_ema/), "
        "the trained policy (eval/), or both; auto: ema when train.ema_decay > 0, else policy")
    diversity: str = _f(
        "auto", "within-prompt diversity (eval/diversity: mean pairwise feature distance between "
        "one prompt's samples, rl/diversity.py): judge = the shapes eval judge's features; a path = a "
        "local CLIP folder's image embedding; auto = judge when a shapes term is evaluated; off")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    staleness: int = _f(1, "K: rollouts may be at most K policy versions behind (digenrl mode)", ge=0, le=8)
    fragments_per_step: int = _f(4, "GAP: fragments (of whole groups) a step is cut into", ge=1,
                                    le=65536)
    tsp: bool = _f(True, "TSP: spread trained timesteps over trainer ranks")
    tag: Literal["bts", "always", "never"] = _f(
        "bts", "trainer-assisted generation: bts (only when predicted to shorten the step)")
    tag_switch_s: float = _f(0.01, "BTS: seconds a trainer loses switching to generation and back "
                             "(same process and weights here: near 0; GPU offload: seconds)", ge=0)
    tag_min_free_mb: int = _f(0, "TAG needs this much free GPU memory (NVML); 0 = no check", ge=0)
    byte_window_mb: float = _f(256.0, "latent bytes in flight to trainers before rollouts block", gt=0,
                                    le=1 << 24)
    lease_s: float = _f(120.0, "a fragment not committed within this of starting (reaching the head "
                        "of its rollout's queue) is re-assigned (a shorter lease would re-assign "
                        "work that is merely being generated)", ge=1)
    lease_factor: float = _f(4.0, "the lease stretches to this many times the rollout's measured "
                             "seconds per fragment (a slow device is not re-assigned for being "
                             "slow); 0 = always lease_s", ge=0)
    stall_timeout_s: float = _f(
        1800.0, "no optimizer step completed for this long (heartbeats still flowing: a wedged "
        "GPU or collective) rewinds the run to its last checkpoint and restarts every node; 0 = off",
        ge=0)
    heartbeat_s: float = _f(0.5, "heartbeat interval", ge=0.01)
    heartbeat_misses: int = _f(10, "a peer silent for this many intervals is lost", ge=1)
    trace_flush_s: float = _f(5.0, "each node appends its new trace events to run_dir/trace every "
                              "this many seconds (memory stays flat; a killed node loses at most this much)",
                              ge=0.01)
    weights_fanout: int = _f(1, "weights relay: each rollout serves the parts it has verified to at "
                             "most this many others, trainer rank 0 serves one (1: a chain; 0: every "
                             "rollout fetches from rank 0, whose egress grows with the rollouts)", ge=0,
                             le=1024)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    rollouts: int = _f(1, "rollout processes `digenrl launch` starts", ge=0, le=65536)
    rewards: int = _f(0, "reward worker processes (`digenrl-node --role reward`) hosting the reward "
                      "terms; 0 scores in the generating process (cheap rewards)", ge=0,
                      le=65536)
    trainers: int = _f(1, "trainer ranks `digenrl launch` starts", ge=1, le=65536)
    gpu: str = _f("cpu", "GPU type nodes declare (H100, H800, H20, L40S, cpu)")
    rollout_gpu: str = _f("", "GPU type the launcher's rollout nodes declare ('' = cluster.gpu)")
    rollout_gpus: int = _f(
        1, "processes (devices) each rollout node runs a trajectory over: N > 1 starts N - 1 "
        "follower processes beside the node and splits every forward pass's image/video tokens "
        "N ways (sequence parallelism; the same families and divisibility as "
        "train.sequence_parallel). `digenrl launch` gives each rollout N GPUs; "
        "`digenrl-node --role rollout --gpus N` overrides it for one node", ge=1, le=64)
    trainer_gpu: str = _f("", "GPU type the launcher's trainer ranks declare ('' = cluster.gpu)")
    host: str = _f("127.0.0.1", "address the coordinator binds")
    rendezvous: Literal["tcp", "file"] = _f(
        "tcp", "trainer ranks' torch.distributed rendezvous: tcp = a port on cluster.host (trainer "
        "rank 0 must run on that host); file = a file under run_dir/dist/ (shared storage, any hosts)")
    spawn: Literal["fork", "exec"] = _f(
        "fork", "how `digenrl launch` starts its node processes: fork = from one server process that "
        "imported torch and diffusers once (start-up in a fraction of the time); exec = each a fresh "
        "interpreter (the fallback where fork servers do not exist)")


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    max_frame_bytes: int = _f(256 << 20, "largest frame a socket accepts", ge=1024,
                               le=1 << 34)
    hwm: int = _f(64, "ZeroMQ high-water mark, messages", ge=1, le=1 << 20)
    curve: Literal["auto", "on", "off"] = _f(
        "auto", "CurveZMQ: auto = on whenever a non-loopback address is bound")
    keys_dir: str = _f("", "folder written by `digenrl keys generate`")
    client_key: str = _f(
        "client", "the key pair of keys_dir this node's client sockets present; a key named "
        "after a node id (rollout-3.key) may speak only as that node, and only it may")
    allow_plaintext: bool = _f(False, "permit plain text on a non-loopback address (warns)")


TrackerName = Literal["tensorboard", "wandb", "swanlab", "mlflow"]
TRACKERS: tuple[str, ...] = get_args(TrackerName)


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """Experiment trackers the coordinator logs to (telemetry/tracking.py, docs/observability.md)."""

    backends: list[TrackerName] = _f(
        ["tensorboard"], "experiment trackers the coordinator logs the config, every metrics.jsonl "
        "row and sample grids to: any of tensorboard (the metrics extra), wandb, swanlab, mlflow "
        "(the tracking extra); [] = none. One that fails is logged and dropped, the run goes on")
    images_every: int = _f(
        50, "a grid of a fragment's samples (videos: frames side by side) with their prompts goes "
        "to the trackers at the first and last step and every N steps; evaluation grids at every "
        "evaluation; 0 = evaluation grids only", ge=0)
    project: str = _f("digenrl", "the trackers' project (wandb, swanlab) or experiment (mlflow)")
    run_name: str = _f("", "the run's name in the trackers; '' = the run dir's name")
    dir: str = _f("", "folder of the trackers' local files (tb/, wandb/, swanlog/, mlruns/); '' = the run dir")
    mode: Literal["auto", "offline", "online"] = _f(
        "auto", "auto: each package's default and environment (WANDB_MODE, SWANLAB_MODE); "
        "offline: wandb and swanlab write local files only (to sync later), no network; online: "
        "they upload as the run goes (a login is needed)")
    mlflow_uri: str = _f("", "MLflow tracking URI; '' = $MLFLOW_TRACKING_URI, else a local file "
                         "store <dir>/mlruns")


@dataclass(frozen=True, kw_only=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    prompts: PromptConfig = field(default_factory=PromptConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def batch_size(self) -> int:
        """B = prompts_per_step * group_size trajectories per optimizer step."""
        return self.train.prompts_per_step * self.train.group_size

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)


# ----------------------------------------------------------------------------- loading

MAX_CONFIG_BYTES = 1 << 20
"""Largest config file read (the shipped ones are a few KiB)."""

MAX_OVERRIDE_BYTES = 64 << 10
"""Largest ``--set`` value."""

MAX_DEPTH = 12
"""Deepest nesting of tables and lists in a config (``reward.terms[0].args`` is 4 levels)."""

SHOW_CHARS = 80
"""Characters of a value an error message quotes before cutting it."""


def show(value: Any, limit: int = SHOW_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with the full length
    named: a 20 MB value must not be printed whole."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as text"
    return f"{text[:limit]}... ({size})"


def nesting_depth(value: Any) -> int:
    """How deeply lists and tables nest in ``value`` (a scalar is 0), without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list | tuple):
            deepest = max(deepest, d + 1)
            todo.extend((x, d + 1) for x in v)
    return deepest


def parse_toml(text: str, origin: str) -> dict[str, Any]:
    """``tomllib.loads`` bounded: nesting past :data:`MAX_DEPTH` is a ConfigError naming
    ``origin``, never a RecursionError (tomllib's parser recurses once per level)."""
    try:
        table = tomllib.loads(text)
    except RecursionError:
        depth = None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{origin}: not valid TOML: {e}") from None
    else:
        depth = nesting_depth(table)
        if depth <= MAX_DEPTH:
            return table
    raise ConfigError(f"{origin}: nested deeper than {MAX_DEPTH} levels of tables and lists"
                      + (f" ({depth})" if depth is not None else ""))


def read_config_text(path: Path) -> str:
    """A config file's text: at most :data:`MAX_CONFIG_BYTES`, UTF-8 (an error names the byte)."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {str(path)!r}: {size} bytes; expected at most "
                              f"{MAX_CONFIG_BYTES} (is it a config file?)")
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r}: not UTF-8 at byte {e.start} "
                          f"({data[e.start:e.start + 1]!r}); TOML files are UTF-8") from None


def _check_bounds(key: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    for name, op, word in (("ge", float.__ge__, ">="), ("gt", float.__gt__, ">"),
                           ("le", float.__le__, "<="), ("lt", float.__lt__, "<")):
        if name in meta and not op(float(value), float(meta[name])):
            raise ConfigError(f"{key} = {value!r}: expected a value {word} {meta[name]}")


def _convert(key: str, value: Any, tp: Any) -> Any:
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key} = {show(value)}: expected one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in get_args(tp):
            try:
                return _convert(key, value, arm)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {show(value)}: expected a table")
        return _build(tp, value, key)
    if origin is dict:  # a free-form table (a reward term's args): TOML values as they are
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {show(value)}: expected a table")
        return {str(k): v for k, v in value.items()}
    if origin is list:
        (inner,) = get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {show(value)}: expected a list")
        return [_convert(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key} = {show(value)}: expected a list of {len(args)} values")
        return tuple(_convert(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {show(value)}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {show(value)}: expected an integer")
        if not -(2**63) <= value < 2**63:
            raise ConfigError(f"{key} = {show(value)}: expected a 64-bit integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} = {show(value)}: expected a number")
        if not math.isfinite(value):  # inf/nan parse as TOML floats; no setting means them
            raise ConfigError(f"{key} = {show(value)}: expected a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {show(value)}: expected a string")
        return value
    raise TypeError(f"config field {key} has unsupported type {tp!r}")  # our bug, not the user's


def _build(cls: Any, table: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(names))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown key {where}{unknown[0][:SHOW_CHARS]}: expected one of {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in table.items():
        key = f"{prefix}.{name}" if prefix else name
        converted = _convert(key, value, hints[name])
        if isinstance(converted, int | float) and not isinstance(converted, bool):
            _check_bounds(key, converted, names[name].metadata)
        kwargs[name] = converted
    return cls(**kwargs)


def _check_base_tail(cfg: Config) -> None:
    t, s = cfg.train, cfg.sampler
    if s.base_tail >= s.num_steps:
        raise ConfigError(f"sampler.base_tail = {s.base_tail}: expected fewer than sampler.num_steps "
                          f"= {s.num_steps} (the policy must take at least one step)")
    if cfg.model.lora_rank == 0:
        raise ConfigError(f"sampler.base_tail = {s.base_tail} with model.lora_rank = 0: the base is "
                          "the policy with its LoRA adapter off; a full fine-tune has no adapter")
    if 0 < cfg.eval.num_steps <= s.base_tail:
        raise ConfigError(f"eval.num_steps = {cfg.eval.num_steps}: evaluation would sample every "
                          f"step with the base model (sampler.base_tail = {s.base_tail})")
    if t.algorithm != "grpo":
        return  # the forward-process losses train on clean samples, not on sampled steps
    tail_from = s.num_steps - s.base_tail
    if t.timesteps in ("all", "fraction"):
        raise ConfigError(f"sampler.base_tail = {s.base_tail} with train.timesteps = "
                          f"{t.timesteps!r}: trained steps would fall in the base model's tail; "
                          f"use 'window' or 'mix' with train.window_hi <= {tail_from}")
    hi = t.window_hi or s.num_steps // 2 or 1
    if hi > tail_from:
        raise ConfigError(f"train.window_hi = {hi}: the trained window must end before the base "
                          f"model's tail, at step {tail_from} (sampler.base_tail = {s.base_tail})")


def _check_sequence_parallel(cfg: Config) -> None:
    """What ``train.sequence_parallel`` and ``cluster.rollout_gpus`` cannot combine with, from
    the config alone (the trainer count and the model's heads and tokens are checked at
    launch: ``digenrl.launch``)."""
    g = cfg.cluster.rollout_gpus
    if g > 1:
        if cfg.model.path == "emulated":
            raise ConfigError(f"cluster.rollout_gpus = {g} with model.path = 'emulated': the "
                              "emulated model has no transformer to shard")
        if cfg.sampler.compile:
            raise ConfigError(f"cluster.rollout_gpus = {g} with sampler.compile = true: the "
                              "sequence-parallel forward is not compiled; set one of them off")
    n = cfg.train.sequence_parallel
    if n == 1:
        return
    where = f"train.sequence_parallel = {n}"
    if cfg.run.mode == "colocated":
        raise ConfigError(f"{where} with run.mode = 'colocated': sequence-parallel groups are "
                          "trainer nodes; use run.mode = 'digenrl' or 'disagg-sync'")
    if cfg.runtime.tag == "always":
        raise ConfigError(f"{where} with runtime.tag = 'always': a sequence-parallel trainer rank "
                          "does not generate (its passes pair with its group's); use 'bts' or 'never'")
    if cfg.model.path == "emulated":
        raise ConfigError(f"{where} with model.path = 'emulated': the emulated model has no "
                          "transformer to shard")


def _check_consistency(cfg: Config) -> None:
    t, s = cfg.train, cfg.sampler
    if t.timesteps == "window":
        hi = t.window_hi or s.num_steps // 2 or 1
        if t.window_lo + t.window_size > max(hi, t.window_lo + 1) or t.window_lo + t.window_size > s.num_steps:
            raise ConfigError(
                f"train.window_size = {t.window_size}: the window [{t.window_lo}, "
                f"{t.window_lo}+{t.window_size}) must fit in train.window_hi = {hi} and "
                f"sampler.num_steps = {s.num_steps}")
    if t.timesteps == "mix" and t.algorithm == "grpo":
        hi = t.window_hi or s.num_steps // 2 or 1
        if t.window_size > min(hi, s.num_steps) - t.window_lo:
            raise ConfigError(
                f"train.window_size = {t.window_size}: the MixGRPO window must fit in "
                f"[train.window_lo = {t.window_lo}, train.window_hi = {hi}) and sampler.num_steps = "
                f"{s.num_steps}")
    if s.base_tail:
        _check_base_tail(cfg)
    if t.algorithm != "grpo":
        if t.forward_timesteps > s.num_steps:
            raise ConfigError(f"train.forward_timesteps = {t.forward_timesteps}: expected at most "
                              f"sampler.num_steps = {s.num_steps}")
        if t.guard:
            raise ConfigError(f"train.guard = true: GRPO-Guard is a switch on the GRPO loss; "
                              f"train.algorithm = {t.algorithm!r} has no likelihood ratio to guard")
        if cfg.model.fsdp:
            raise ConfigError(f"model.fsdp = true with train.algorithm = {t.algorithm!r}: sharded "
                              "training of the forward-process losses is not implemented")
    _check_sequence_parallel(cfg)
    if len(set(cfg.tracking.backends)) < len(cfg.tracking.backends):
        raise ConfigError(f"tracking.backends = {cfg.tracking.backends!r}: a tracker is listed twice")
    for key in ("condition_area", "condition_vl_area"):
        if getattr(cfg.model, key) and cfg.model.family != "qwenimage_edit":
            raise ConfigError(f"model.{key} = {getattr(cfg.model, key)}: sizes Qwen-Image-Edit's input images; "
                              f"model.family = {cfg.model.family!r} does not read it (leave it 0)")
    if cfg.model.free_text_encoders and cfg.model.family == "qwenimage_edit":
        raise ConfigError("model.free_text_encoders = true with model.family = 'qwenimage_edit': its text "
                          "encoder (Qwen2.5-VL) reads each prompt's input images, so a table of encoded "
                          "prompts cannot stand in for it; set model.free_text_encoders = false")
    if cfg.model.offload == "params" and not cfg.model.fsdp:
        raise ConfigError(f"model.offload = {cfg.model.offload!r} with model.fsdp = false: offload moves "
                          "FSDP shards to host memory; set model.fsdp = true or model.offload = \"none\"")
    if t.ema_decay > 0 and cfg.model.fsdp:
        raise ConfigError(f"train.ema_decay = {t.ema_decay} with model.fsdp = true: the EMA of "
                          "sharded weights is not implemented (set one of them off)")
    if cfg.eval.policy in ("ema", "both") and t.ema_decay == 0:
        raise ConfigError(f"eval.policy = {cfg.eval.policy!r}: there are EMA weights only with "
                          "train.ema_decay > 0")
    if t.guard and s.sde_type not in ("sde", "dance"):
        raise ConfigError(f"train.guard = true with sampler.sde_type = {s.sde_type!r}: GRPO-Guard's "
                          "ratio normalisation is defined for the Gaussian steps 'sde' and 'dance'")
    if t.guard and cfg.model.fsdp and cfg.runtime.staleness > 0 and cfg.run.mode == "digenrl":
        raise ConfigError("train.guard = true with model.fsdp and runtime.staleness > 0: the "
                          "behaviour weights of stale versions are not kept for sharded models")
    if cfg.runtime.fragments_per_step > t.prompts_per_step:
        raise ConfigError(
            f"runtime.fragments_per_step = {cfg.runtime.fragments_per_step}: expected at most "
            f"train.prompts_per_step = {t.prompts_per_step} (fragments hold whole groups)")
    if t.prompts_per_step % cfg.runtime.fragments_per_step:
        raise ConfigError(
            f"runtime.fragments_per_step = {cfg.runtime.fragments_per_step}: expected a divisor "
            f"of train.prompts_per_step = {t.prompts_per_step}")
    if s.compile and not s.max_batch:
        raise ConfigError("sampler.compile = true: expected sampler.max_batch > 0 (the step "
                          "batcher's forward is what is compiled)")
    frag_rows = t.prompts_per_step // cfg.runtime.fragments_per_step * t.group_size
    if 0 < s.max_batch < frag_rows:
        raise ConfigError(
            f"sampler.max_batch = {s.max_batch}: expected 0 (off) or at least one fragment's rows, "
            f"{frag_rows} (train.prompts_per_step / runtime.fragments_per_step x train.group_size)")
    if t.adv_std == "global" and cfg.runtime.fragments_per_step > 1 and cfg.run.mode == "digenrl":
        raise ConfigError(
            "train.adv_std = 'global': a step-wide std is unknown until the last fragment's "
            "rewards arrive, which defeats GAP; use 'group' or set runtime.fragments_per_step = 1")
    if not cfg.reward.terms:
        raise ConfigError("reward.terms = []: expected at least one reward term")
    if 0 < cfg.runtime.stall_timeout_s < 1:
        raise ConfigError(f"runtime.stall_timeout_s = {cfg.runtime.stall_timeout_s!r}: expected 0 "
                          "(off) or at least 1 (seconds without an optimizer step)")
    if cfg.run.eval_every and not (cfg.prompts.test_file or cfg.prompts.test_fraction > 0):
        raise ConfigError(
            f"run.eval_every = {cfg.run.eval_every}: evaluation needs held-out prompts; set "
            "prompts.test_file or prompts.test_fraction")


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``section.key=value``; the value is TOML (bare words are taken as strings)."""
    if "=" not in text:
        raise ConfigError(f"--set {show(text)}: expected section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or len(key) > 200 or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {show(text)}: expected a dotted key such as train.lr")
    if len(raw) > MAX_OVERRIDE_BYTES:
        raise ConfigError(f"--set {key}: a value of {len(raw)} bytes; expected at most "
                          f"{MAX_OVERRIDE_BYTES}")
    try:
        value = parse_toml(f"v = {raw.strip()}", f"--set {key}")["v"]
    except ConfigError as e:
        if "nested deeper" in str(e):
            raise
        value = raw.strip()
    return key.split("."), value


def default_config_text() -> str:
    """The embedded default config (``configs/tiny-cpu.toml`` shipped as package data)."""
    return importlib.resources.files("digenrl.data").joinpath("tiny-cpu.toml").read_text()


#: What run dirs' config.toml held when the slowdowns were a config section: with these values
#: it did nothing, so such a file still loads (an older run dir resumes).
_INERT_FAULTS = {"slowdown": 1.0, "slowdown_nodes": [], "trainer_slowdown": 1.0}


def _is_inert_faults(value: Any) -> bool:
    return isinstance(value, dict) and all(k in _INERT_FAULTS and v == _INERT_FAULTS[k] for k, v in value.items())


def config_from_dict(table: dict[str, Any]) -> Config:
    if nesting_depth(table) > MAX_DEPTH:
        raise ConfigError(f"config nested deeper than {MAX_DEPTH} levels of tables and lists")
    if "faults" in table:  # the TEST-ONLY slowdowns' old home
        if not _is_inert_faults(table["faults"]):
            raise ConfigError("[faults] is not a config section: test failpoints are set by the "
                              "environment variable DIGENRL_FAILPOINTS (digenrl/faults.py)")
        table = {k: v for k, v in table.items() if k != "faults"}  # a run dir's config.toml of before
    cfg: Config = _build(Config, table, "")
    _check_consistency(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load a config: TOML at ``path`` (default: the embedded tiny-cpu config) + overrides."""
    if path is None:
        text, origin = default_config_text(), "<embedded tiny-cpu.toml>"
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        text, origin = read_config_text(p), str(p)
    table = parse_toml(text, origin)
    for ov in overrides:
        parts, value = parse_override(ov)
        node = table
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {show(ov)}: {part} is not a section")
        node[parts[-1]] = value
    return config_from_dict(table)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain TOML-able data (tuples become lists)."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return v
    return typing.cast(dict[str, Any], plain(cfg))


def to_toml(cfg: Config) -> str:
    """Serialise the resolved config as TOML (what a run writes to its run dir and what
    Welcome carries to every node).

    ``tomli_w`` writes it, quoting and escaping every key and string as TOML requires. The
    reading half stays ours (:func:`load_config`, :func:`config_from_dict`): a generic TOML
    library parses, but cannot say which field of which section is wrong and what it expects.
    """
    return tomli_w.dumps(to_dict(cfg))


def check_mode(mode: str) -> Mode:
    """``mode`` if it names a mode, else ConfigError naming it and the modes."""
    if mode not in MODES:
        raise ConfigError(f"run.mode = {mode!r}: expected one of {', '.join(MODES)}")
    return typing.cast(Mode, mode)


ResolvedConfig = NewType("ResolvedConfig", Config)
"""A :class:`Config` whose mode's knobs are set: what :func:`resolve_mode` returns (and
:func:`read_resolved` reads back). Code that reads a knob a mode fixes (K, fragments, TSP,
TAG, the rollout count) takes this type, so that an unresolved config cannot reach it."""


def resolve_mode(cfg: Config, mode: str | None = None) -> ResolvedConfig:
    """Fix the runtime knobs a mode implies (DESIGN.md, Modes); called once per run, where
    the command line is read.

    colocated: no rollout nodes, K = 0, one fragment, no TSP, trainers always generate.
    disagg-sync: rollout nodes, K = 0, one fragment (the whole batch), no TSP, no TAG.
    digenrl: rollout nodes, K, GAP fragments, TSP and TAG as configured.
    """
    mode = check_mode(mode or cfg.run.mode)
    run = dataclasses.replace(cfg.run, mode=mode)
    rt, cl = cfg.runtime, cfg.cluster
    if mode == "colocated":
        rt = dataclasses.replace(rt, staleness=0, fragments_per_step=1, tsp=False, tag="always")
        cl = dataclasses.replace(cl, rollouts=0)
    elif mode == "disagg-sync":
        rt = dataclasses.replace(rt, staleness=0, fragments_per_step=1, tsp=False, tag="never")
        cl = dataclasses.replace(cl, rollouts=max(cl.rollouts, 1))
    else:
        cl = dataclasses.replace(cl, rollouts=max(cl.rollouts, 1))
    out = dataclasses.replace(cfg, run=run, runtime=rt, cluster=cl)
    _check_consistency(out)
    return ResolvedConfig(out)


def read_resolved(text: str, origin: str = "config") -> ResolvedConfig:
    """A config that was written resolved (``to_toml`` of a :data:`ResolvedConfig`: a run
    dir's ``config.toml``, the one Welcome carries), read back as one. ConfigError if it is
    not valid, or not resolved (a knob differs from what its mode fixes: it was not written
    by a run)."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{origin}: not valid TOML: {e}") from None
    cfg = config_from_dict(table)
    fixed = resolve_mode(cfg)
    if fixed != cfg:
        key, want, got = next((f"{name}.{f.name}", getattr(getattr(fixed, name), f.name),
                               getattr(getattr(cfg, name), f.name))
                              for name in ("run", "runtime", "cluster")
                              for f in dataclasses.fields(getattr(cfg, name))
                              if getattr(getattr(fixed, name), f.name) != getattr(getattr(cfg, name), f.name))
        raise ConfigError(f"{origin}: {key} = {got!r}: run.mode = {cfg.run.mode!r} fixes it to "
                          f"{want!r} (not a resolved config)")
    return fixed


def describe_fields(cls: Any = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every leaf field, for `digenrl config --help`-style docs."""
    rows: list[tuple[str, str, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe_fields(hints[f.name], key + ".")
        else:
            default = f.default
            if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            rows.append((key, repr(default), f.metadata.get("help", "")))
    return rows
