"""Cost model: seconds per unit of work, per GPU type and model, from FLOPs and achieved TFLOP/s.

Every figure cites ``/work/shared/reference/costmodel.md`` (abbreviated ``cm``) by section;
figures computed here say "derived" with the formula. Cost is FLOP-linear (cm quick summary:
one efficiency constant reproduces MixGRPO's five iteration times within 5%), so::

    generation  (s / sample / denoising step)   = fwd_tflop * cfg_passes / gen_tflops(gpu, where)
    training    (s / sample / trained timestep) = fwd_tflop * (3 | 4 ckpt) (+1 KL ref) (*2 CFG)
                                                  / train_tflops(gpu)
    reward      (s / sample)                    = reward_tflop / gen_tflops + reward_fixed_s
    weight sync (s)                             = sync_bytes / weight_gbs + latency
    latents     (s)                             = latent bytes / link_gbs + latency
    switch      (s, colocated only)             = optimizer-state shard over PCIe + bf16 weights
                                                  all-gathered over NVLink, each way
    sequence parallel (N ranks on one sample)   = the above x per-rank FLOP share (image/video
                                                  tokens / N, attention / N, text replicated)
                                                  + the Ulysses exchanges over the group's link

Batching is not modelled: per-sample cost is constant (cm 3a notes batch-1 at 512 px under-fills
a GPU; the achieved TFLOP/s figures below come from batch-1 measurements, so a batched engine
would be faster, which only helps the disaggregated rollouts).

Where generation runs matters. A dedicated rollout node runs an inference engine (compiled,
no FSDP): ``gen_tflops``. Generation inside a training process (colocated baseline and TAG)
runs eager through the FSDP-wrapped model: ``colo_gen_tflops`` (cm 3a: FLUX on H100 eager
6.71 s vs compiled 4.30 s, a 1.56x gap; cm 4c: veRL-Omni rollout ~445 vs trainer ~150-230).
No torch here: the planner, the simulator and the emulated accelerators
(:mod:`digenrl.models.emulated`, which sleep these seconds instead of computing) import this
module, so an emulated run and its plan price work with the same constants.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CostModelError(ValueError):
    """An unknown GPU/model name or a bad calibration file; the message names the value."""


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Achieved throughputs of one GPU type (TFLOP/s) and its links (GB/s)."""

    name: str
    peak_tflops: float
    """Dense BF16 peak (cm 7; verl flops_counter constants in cm 4b)."""
    gen_tflops: float
    """Achieved by a dedicated, compiled inference engine on a rollout node."""
    colo_gen_tflops: float
    """Achieved by eager generation inside the training process (colocated, TAG)."""
    train_tflops: float
    """Achieved by the GRPO trainer (fwd + bwd, activation checkpointing counted in FLOPs)."""
    memory_gb: float
    nvlink_gbs: float
    """Effective intra-node bandwidth for all-reduce / all-gather."""
    pcie_gbs: float
    """Effective host<->device bandwidth for offloading (colocated switch)."""
    exchange_latency_s: float = 4e-6
    """Fixed cost of one collective (all-to-all, all-gather) between the ranks of a sequence-
    parallel group: NVIDIA/nccl #1984 measures 3.5 us (all-reduce) and 3.7 us (send/recv) for
    1 KiB over NVLink on 4 H800 without CUDA graphs; 4 us is taken for every GPU type."""


# cm 7: NVLink 900 GB/s H100/H200/H20, 400 GB/s H800, 600 GB/s A100, none on L40S (PCIe Gen4 64
# bidir). Effective all-reduce bandwidth is taken as 370 GB/s on 900 GB/s NVLink (cm 6, "NVLink
# ring ~370 GB/s effective"); derived for the others as 370 * nvlink / 900.
# PCIe effective = half the per-direction peak (assumption: pageable copies; cm 7 lists peaks).
# The 1.6x compiled/eager factor is derived from cm 3a (xDiT-FLUX H100: 6.71 s eager / 4.30 s
# compiled = 1.56); gen_tflops = colo_gen_tflops * 1.56 where no compiled figure exists.
_EAGER_TO_COMPILED = 6.71 / 4.30  # derived, cm 3a
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    # colo 300: cm 3a "H100 eager ~300" (derived 74.4 TF x 28 / 6.71 s); gen 480: cm 3a
    # "H100 compile ~480"; train 297: cm 4c "30% H100 MFU" = 0.30 x 989.
    GpuSpec(name="H100", peak_tflops=989.0, gen_tflops=480.0, colo_gen_tflops=300.0,
            train_tflops=297.0, memory_gb=80.0, nvlink_gbs=370.0, pcie_gbs=32.0),
    # cm 7: same compute and memory as H100, NVLink 400 GB/s -> 370 * 400 / 900 = 164 (derived).
    GpuSpec(name="H800", peak_tflops=989.0, gen_tflops=480.0, colo_gen_tflops=300.0,
            train_tflops=297.0, memory_gb=80.0, nvlink_gbs=164.0, pcie_gbs=32.0),
    # colo 366: cm 3b LightX2V Wan I2V 480p 9.15 s/step on 1xH200 -> 3.35 PF / 9.15 s (derived);
    # gen = 366 * 1.56 (derived); train = 0.30 x 989 (cm 4c convention).
    GpuSpec(name="H200", peak_tflops=989.0, gen_tflops=366.0 * _EAGER_TO_COMPILED,
            colo_gen_tflops=366.0, train_tflops=297.0, memory_gb=141.0, nvlink_gbs=370.0,
            pcie_gbs=32.0),
    # colo 133: cm 3a "A100 ~133" (BenchmarkFlux 15.65 s); train 0.30 x 312 = 94 (derived).
    GpuSpec(name="A100", peak_tflops=312.0, gen_tflops=133.0 * _EAGER_TO_COMPILED,
            colo_gen_tflops=133.0, train_tflops=94.0, memory_gb=80.0,
            nvlink_gbs=370.0 * 600 / 900, pcie_gbs=16.0),
    # colo 92: cm 3b/3c "H20 ~94" (Wan) and "~91" (HYV), mean; train 82: cm 4b UniRL H20
    # "~82 TFLOP/s/GPU" (derived there).
    GpuSpec(name="H20", peak_tflops=148.0, gen_tflops=92.0 * _EAGER_TO_COMPILED,
            colo_gen_tflops=92.0, train_tflops=82.0, memory_gb=96.0, nvlink_gbs=370.0,
            pcie_gbs=32.0),
    # colo 129: cm 3a RTX 6000 Ada (L40S-class proxy) 1.74 it/s x 74.4 TF (derived);
    # train 0.30 x 362 = 109 (derived). No NVLink: all-reduce over PCIe Gen4 (cm 7), 32 GB/s.
    GpuSpec(name="L40S", peak_tflops=362.0, gen_tflops=129.0 * _EAGER_TO_COMPILED,
            colo_gen_tflops=129.0, train_tflops=109.0, memory_gb=48.0, nvlink_gbs=32.0,
            pcie_gbs=16.0),
    # The tiny CPU model is costed in seconds (see ModelSpec.cpu_seconds); these TFLOP/s are
    # unused placeholders so every type has the same fields. Memory copy ~20 GB/s
    # (cpu-feasibility.md 5: numpy memcpy 21.8-45.9 GB/s).
    # A gloo exchange between processes: the DEALER/ROUTER ping-pong p50 of cpu-feasibility.md 5
    # (~0.2 ms) is taken as its fixed cost (assumption: both are a loopback TCP round trip).
    GpuSpec(name="cpu", peak_tflops=1.0, gen_tflops=1.0, colo_gen_tflops=1.0, train_tflops=1.0,
            memory_gb=16.0, nvlink_gbs=20.0, pcie_gbs=20.0, exchange_latency_s=2e-4),
)}


@dataclass(frozen=True, kw_only=True)
class Arch:
    """The transformer's shape at the entry's resolution: what sequence parallelism's costs need.

    One forward's FLOPs follow cm 0's formula, ``2 P_tok S + 4 L d S^2`` (+ ``4 L d S_img C`` for
    Wan's cross-attention), with ``S = image_tokens + text_tokens``. Under Ulysses over N ranks
    (digenrl/models/ulysses.py, sp 1.1) a rank carries ``image_tokens / N`` through the linear
    layers, the replicated text whole, and attends over all ``S`` tokens for ``heads / N``
    heads; per attention layer and forward it exchanges its q, k, v and output (4 all-to-alls of
    ``image_tokens / N x d`` activations) and, with joint text, all-gathers the text output's
    heads (``text_tokens x d``)."""

    hidden: int
    """d: the attention width (heads x head dim)."""
    layers: int
    """Blocks with a self / joint attention (FLUX: 19 double + 38 single)."""
    heads: int
    image_tokens: int
    """Image/video tokens per sample at the entry's resolution (sharded N ways)."""
    text_tokens: int = 0
    """Text tokens in the joint attention (replicated on every rank of a group)."""
    cross_tokens: int = 0
    """Cross-attention context (Wan's 512 UMT5 tokens): replicated, attended locally."""
    p_tok_b: float
    """Per-token active parameters (billions, cm 0)."""
    act_bytes: int = 2
    """Bytes per exchanged activation element (bf16 autocast)."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model at the resolution of its published GRPO recipe."""

    name: str
    fwd_tflop: float
    """Forward FLOPs per sample per denoising step, one CFG branch."""
    params_b: float
    """Total parameters (billions); bf16 bytes = 2 x params."""
    latent_bytes: int
    """bf16 latent of one sample (cm 1)."""
    latent_shape: tuple[int, ...] = ()
    """The latent of one sample at the recipe's resolution (and frames): C, (F,) H, W (cm 1)."""
    reward_tflop: float
    """Reward model FLOPs per sample (cm 5)."""
    reward_fixed_s: float
    """Per-sample reward latency not in FLOPs (VAE decode, resize)."""
    cpu_seconds: tuple[float, float] | None = None
    """(generation s/sample/step, training s/sample/timestep) measured on CPU, or None."""
    arch: Arch | None = None
    """The shape sequence parallelism is priced from; None: the family has no sequence-parallel
    forward (digenrl/models/catalog.py SEQUENCE_PARALLEL_FAMILIES)."""


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    # FLUX.1-dev 720x720 (DanceGRPO / MixGRPO setting): 37.3 TF/fwd (cm 2), 11.8 B params (cm 0),
    # latent 259,200 B (cm 1). Reward: PickScore/HPS ViT-H 0.38 TF (cm 5) + VAE decode 0.028 s
    # (cm 3a, SGLang trace).
    # Shape (cm 0; sp 2.2): d 3,072 (24 heads), 19 double + 38 single blocks, P_tok 6.46 B; 2,025
    # image + 512 text tokens (cm 2: S = 2,537).
    ModelSpec(name="flux", fwd_tflop=37.3, params_b=11.8, latent_bytes=259_200,
              latent_shape=(16, 90, 90), reward_tflop=0.38, reward_fixed_s=0.028,
              arch=Arch(hidden=3072, layers=57, heads=24, image_tokens=2025, text_tokens=512, p_tok_b=6.46)),
    # FLUX.1-Kontext-dev (image editing, 12 B: FLUX.1-dev's transformer) at 1024x1024 px, the
    # pipeline's default max_area, with its input image at the same size: S = 4,096 output +
    # 4,096 input-image tokens + 512 text tokens = 8,704. Forward FLOPs from the "flux" entry's
    # two terms, 2 * P_tok * S + 4 * L * d * S^2 (L = 57 blocks, d = 3,072; P_tok = 6.46 B is what
    # gives back 37.3 TF at S = 2,537): 112.5 + 53.1 = 165.6 TF/fwd (derived). The input-image
    # tokens are in every forward (rollout and trainer); only the output latent (16, 128, 128)
    # bf16 travels per step (the input's tokens go once per fragment, with the conditioning).
    # Sequence parallelism shards the output's and the input image's tokens (8,192) together.
    ModelSpec(name="flux_kontext", fwd_tflop=165.6, params_b=11.8, latent_bytes=524_288,
              latent_shape=(16, 128, 128), reward_tflop=0.38, reward_fixed_s=0.028,
              arch=Arch(hidden=3072, layers=57, heads=24, image_tokens=8192, text_tokens=512, p_tok_b=6.46)),
    # Qwen-Image 512x512 (Flow-GRPO / veRL-Omni recipe): 18.6 TF/fwd (cm 2), 20.4 B (cm 0),
    # latent 131,072 B (cm 1). Reward as FLUX (CLIP-class).
    # Shape (cm 0, 2): d 3,072 (24 heads x 128), 60 blocks, P_tok 6.79 B; 1,024 image + 256 text.
    ModelSpec(name="qwenimage", fwd_tflop=18.6, params_b=20.4, latent_bytes=131_072,
              latent_shape=(16, 64, 64), reward_tflop=0.38, reward_fixed_s=0.028,
              arch=Arch(hidden=3072, layers=60, heads=24, image_tokens=1024, text_tokens=256, p_tok_b=6.79)),
    # Qwen-Image-Edit(-2509, the Plus pipeline; 20.4 B: Qwen-Image's transformer) at 1024x1024
    # px with one input image VAE-encoded at the pipeline's 1024 x 1024 area (model.condition_area
    # = 1048576): S = 4,096 output + 4,096 input-image tokens + 256 text tokens (the "qwenimage"
    # entries' count) + 196 tokens of the 384 x 384 image its Qwen2.5-VL sees (392 x 392 after the
    # processor's 28 px rounding, 14 px patches merged 2x2) = 8,644. Forward FLOPs with cm 0's MM-DiT
    # formula 2 * P_tok * S + 4 * L * d * S^2 (P_tok 6.79 B, L 60, d 3,072: cm 0; it gives back
    # the 18.6 TF of the entry above): 117.4 + 55.1 = 172.5 TF/fwd (derived). Only the output latent
    # (16, 128, 128) bf16 travels per step; the input's tokens go once per fragment.
    ModelSpec(name="qwenimage_edit", fwd_tflop=172.5, params_b=20.4, latent_bytes=524_288,
              latent_shape=(16, 128, 128), reward_tflop=0.38, reward_fixed_s=0.028),
    # Wan2.1-T2V-14B 480p 81f: 1.68 PF/fwd (cm 2), 14.0 B (cm 0), latent 4,193,280 B (cm 1).
    # Reward: VideoAlign-class ~8 TF/video (cm 5, derived 6-10 TF); decode not in cm: 0.5 s
    # (assumption).
    # Shape (cm 0; sp 2.2): d 5,120 (40 heads), 40 layers, P_tok 11.95 B; 32,760 video tokens,
    # 512 text tokens in cross-attention only.
    ModelSpec(name="wan", fwd_tflop=1680.0, params_b=14.0, latent_bytes=4_193_280,
              latent_shape=(16, 21, 60, 104), reward_tflop=8.0, reward_fixed_s=0.5,
              arch=Arch(hidden=5120, layers=40, heads=40, image_tokens=32760, cross_tokens=512, p_tok_b=11.95)),
    # Wan2.2 T2V-A14B 480p 81f: two experts of Wan2.1-14B's shape (sp 2.2), one per denoising
    # step, so a forward costs Wan2.1-14B's 1.68 PF (cm 2) and the latent is the same (cm 1);
    # the weights are both experts', 2 x 14.0 B (a node holds both to sample a trajectory).
    ModelSpec(name="wan22_a14b", fwd_tflop=1680.0, params_b=28.0, latent_bytes=4_193_280,
              latent_shape=(16, 21, 60, 104), reward_tflop=8.0, reward_fixed_s=0.5,
              arch=Arch(hidden=5120, layers=40, heads=40, image_tokens=32760, cross_tokens=512, p_tok_b=11.95)),
    # Wan2.2 TI2V-5B 704x1280 121f (its default): the 48-channel VAE compresses 16 x 16 x 4, so
    # the latent is (48, 31, 44, 80), 10,475,520 B bf16, and with patch (1, 2, 2) 27,280 tokens
    # (derived). 5 B params, d 3072, 30 layers (sp 2.2): 2 x 5 B x 27,280 + 4 x 30 x 3072 x
    # 27,280^2 = 547 TF/fwd (derived with cm 0's formula). Reward as Wan.
    # Sequence parallelism: 24 heads (sp 2.2), 512 UMT5 tokens in cross-attention.
    ModelSpec(name="wan22_ti2v_5b", fwd_tflop=547.0, params_b=5.0, latent_bytes=10_475_520,
              latent_shape=(48, 31, 44, 80), reward_tflop=8.0, reward_fixed_s=0.5,
              arch=Arch(hidden=3072, layers=30, heads=24, image_tokens=27280, cross_tokens=512, p_tok_b=5.0)),
    # HunyuanVideo 480x480x53f (DanceGRPO open-source setting): 0.297 PF/fwd (cm 2), 12.8 B
    # (cm 0), latent 1,612,800 B (cm 1). Reward as Wan.
    # Shape (cm 0, 2; sp 2.2): d 3,072 (24 heads), 20 dual + 40 single blocks, P_tok 6.79 B;
    # 12,600 video + 256 text tokens (S = 12,856).
    ModelSpec(name="hunyuanvideo", fwd_tflop=297.0, params_b=12.8, latent_bytes=1_612_800,
              latent_shape=(16, 14, 60, 60), reward_tflop=8.0, reward_fixed_s=0.5,
              arch=Arch(hidden=3072, layers=60, heads=24, image_tokens=12600, text_tokens=256, p_tok_b=6.79)),
    # FLUX.2 and Z-Image at 1024x1024 px (the pipelines' default size), 512 text tokens (their
    # default max_sequence_length; Z-Image passes only a prompt's real tokens, so this bounds
    # it): 4,096 image tokens (sequence-parallel-and-memory.md 2.1, "sp" below). Forward FLOPs are
    # derived with cm 0's MM-DiT formula 2 * P_tok * S + 4 * L * d * S^2, S = 4,608, where a block
    # holds 13 d^2 per-token weights (attention 4 d^2; FLUX.2's SwiGLU MLP of ratio 3 in and out,
    # 9 d^2), so total params = (2 double + single) * 13 d^2, which gives back the published sizes.
    # Rewards as FLUX.1 (CLIP-class, cm 5).
    # FLUX.2-dev: 32 B params (sp 2.2, black-forest-labs/flux2), 8 double + 48 single blocks,
    # 48 heads x 128 = d 6144 (sp 2.2, 4.5): P_tok 27.5 B, 282 TF/fwd (derived; total 31.4 B).
    # Latent (128, 64, 64): the 32-channel VAE's latent patchified 2x2 (sp 4.5), bf16.
    ModelSpec(name="flux2", fwd_tflop=282.0, params_b=32.0, latent_bytes=1_048_576,
              latent_shape=(128, 64, 64), reward_tflop=0.38, reward_fixed_s=0.028,
              arch=Arch(hidden=6144, layers=56, heads=48, image_tokens=4096, text_tokens=512, p_tok_b=27.5)),
    # FLUX.2-klein 4B (sp 2.2): 5 double + 20 single blocks, d 3072 (24 heads x 128; the shape is
    # ServeurpersoCom/flux2.c's README, not in the reference) -> P_tok 3.07 B, 34.8 TF/fwd,
    # total 3.7 B (derived).
    ModelSpec(name="flux2_klein_4b", fwd_tflop=34.8, params_b=4.0, latent_bytes=1_048_576,
              latent_shape=(128, 64, 64), reward_tflop=0.38, reward_fixed_s=0.028,
              arch=Arch(hidden=3072, layers=25, heads=24, image_tokens=4096, text_tokens=512, p_tok_b=3.07)),
    # FLUX.2-klein 9B (sp 2.2): d 4096 (32 heads x 128), 8 double + 24 single blocks taken as
    # the shape whose (2 x 8 + 24) x 13 d^2 = 8.7 B is nearest the published 9 B (assumption)
    # -> P_tok 6.98 B, 75.5 TF/fwd (derived).
    ModelSpec(name="flux2_klein_9b", fwd_tflop=75.5, params_b=9.0, latent_bytes=1_048_576,
              latent_shape=(128, 64, 64), reward_tflop=0.38, reward_fixed_s=0.028,
              arch=Arch(hidden=4096, layers=32, heads=32, image_tokens=4096, text_tokens=512, p_tok_b=6.98)),
    # Z-Image(-Turbo): 6 B (sp 2.2, diffusers docs), single stream, d 3840, 30 layers + 2 image
    # + 2 text refiner layers (sp 4.6); a layer is 4 d^2 + SwiGLU 3 d x 10240 = 0.177 B (34 layers:
    # 6.0 B, derived). Every layer sees every token of its stream: 2 x 0.177 B x (30 x 4,608 +
    # 2 x 4,096 + 2 x 512) + 4 d (30 x 4,608^2 + 2 x 4,096^2 + 2 x 512^2) = 62.5 TF/fwd (derived).
    # Latent (16, 128, 128) bf16 (16-channel VAE, 8x; sp 4.6). Turbo samples in 8 steps without
    # CFG (sp 4.6). Sequence parallelism splits Z-Image's whole unified image+caption sequence
    # (models/seqpar.py), so its Arch has 4,608 sharded tokens and no replicated text; P_tok 5.72 B
    # folds the refiners in so that the formula over the 30 main layers gives back 62.5 TF (derived).
    ModelSpec(name="zimage", fwd_tflop=62.5, params_b=6.0, latent_bytes=524_288,
              latent_shape=(16, 128, 128), reward_tflop=0.38, reward_fixed_s=0.028,
              arch=Arch(hidden=3840, layers=30, heads=30, image_tokens=4608, p_tok_b=5.72)),
    # Tiny SD3 on CPU: cpu-feasibility.md 3, e2e GRPO iteration, 1 thread, batch 8 x 10 steps:
    # rollout 0.20-0.27 s -> 0.235 / 80 = 2.9 ms per sample-step; 2 training passes 1.12-1.30 s
    # -> 1.21 / 160 = 7.6 ms per sample-timestep (derived). `plan --calibrate` replaces these.
    # Latent 12x16x16 fp32 = 12,288 B (digenrl/models/sd3.py tiny config; fp32 on the wire).
    # Shape: the tiny config (digenrl/models/sd3.py TINY_SD3: d 64 = 4 heads x 16, 4 joint blocks,
    # 64 image tokens) with the hash prompt encoder's 16 text tokens (digenrl/models/text.py);
    # per-token weights 12 d^2 a block (cm 0's MM-DiT count).
    ModelSpec(name="sd3", fwd_tflop=0.0, params_b=0.0003, latent_bytes=12_288,
              latent_shape=(12, 16, 16), reward_tflop=0.0, reward_fixed_s=0.0002, cpu_seconds=(0.0029, 0.0076),
              arch=Arch(hidden=64, layers=4, heads=4, image_tokens=64, text_tokens=16,
                        p_tok_b=4 * 12 * 64 ** 2 / 1e9)),
)}


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The per-step shape of the RL recipe that the costs depend on (from a Config)."""

    model: str
    num_steps: int
    trained_steps: int
    cfg_gen: bool
    cfg_train: bool
    grad_ckpt: bool
    kl: bool
    lora_rank: int
    fsdp: bool = True
    rows_per_forward: int = 0
    """Trajectory rows a rollout's denoiser forward carries (a fragment's, or a step batcher's
    occupancy); 0: unknown. Used only with a calibrated batching curve."""
    sequence_parallel: int = 1
    """Trainer ranks that train one sample together (``train.sequence_parallel``)."""
    rollout_gpus: int = 1
    """Devices a rollout node runs each trajectory over (``cluster.rollout_gpus``)."""


@dataclass(frozen=True, kw_only=True)
class NodeCosts:
    """Seconds per unit of work on one GPU type; what the simulator consumes."""

    gen_step_s: float
    """Dedicated rollout: one sample, one denoising step (all CFG passes)."""
    colo_gen_step_s: float
    """Same, generated inside a trainer process (colocated baseline, TAG)."""
    train_step_s: float
    """One sample, one trained timestep (fwd+bwd, checkpointing, KL reference, CFG)."""
    reward_s: float
    """One sample: decode + reward model."""
    optimizer_s: float
    """One optimizer step (AdamW over the trainable parameters' shard)."""
    switch_s: float
    """Colocated: one switch between generation and training states."""


@dataclass(frozen=True, kw_only=True)
class Network:
    """Cluster links: cross-node latents and weights; the planner reads it from the cluster TOML."""

    link_gbs: float = 45.0
    """Latent streaming rollout -> trainer; cm 6: one 400G NIC ~45 GB/s effective."""
    weight_gbs: float = 8.25
    """Weight broadcast; cm 6: verl NCCL checkpoint engine 8.25 GB/s over 400G IB."""
    latency_s: float = 0.0002
    """Per message; cpu-feasibility.md 5: DEALER/ROUTER ping-pong p50 ~0.2 ms."""


def trainable_bytes(model: ModelSpec, lora_rank: int) -> float:
    """bf16 bytes of the trainable parameters: 2 x params, or LoRA ~1% per rank 64 (cm 6), derived."""
    full = 2.0 * model.params_b * 1e9
    return full if lora_rank <= 0 else full * 0.01 * lora_rank / 64.0


def _specs(gpu: str, model: str) -> tuple[GpuSpec, ModelSpec]:
    if gpu not in GPUS:
        raise CostModelError(f"gpu = {gpu!r}: expected one of {', '.join(GPUS)}")
    if model not in MODELS:
        raise CostModelError(f"model = {model!r}: expected one of {', '.join(MODELS)}")
    return GPUS[gpu], MODELS[model]


WHERE = ("rollout", "trainer_gen", "train")
"""Where a forward runs: a rollout's inference engine, eager generation inside a trainer
(colocated, TAG), or the trainer's training pass (its KL reference forward too)."""


def forward_s(gpu: str, model: str, where: str) -> float:
    """Seconds of one forward of one sample through one CFG branch: fwd_tflop / achieved TFLOP/s."""
    g, m = _specs(gpu, model)
    rate = {"rollout": g.gen_tflops, "trainer_gen": g.colo_gen_tflops, "train": g.train_tflops}
    if where not in rate:
        raise CostModelError(f"where = {where!r}: expected one of {', '.join(WHERE)}")
    return m.fwd_tflop / rate[where]


def backward_factor(grad_ckpt: bool) -> int:
    """A backward in forwards: 2 (fwd+bwd = 3x fwd), 3 with activation checkpointing (4x), cm 0."""
    return 3 if grad_ckpt else 2


def reward_s(gpu: str, model: str) -> float:
    """One sample: reward model FLOPs at the generation rate + decode latency (cm 5, 3a)."""
    g, m = _specs(gpu, model)
    return m.reward_tflop / g.gen_tflops + m.reward_fixed_s


def optimizer_s(model: str, lora_rank: int, shards: int) -> float:
    """One AdamW step over a shard of the trainable parameters (derived: param, grad, m, v,
    master ~16 B/param read and written once at ~half of HBM bandwidth, 1.5 TB/s)."""
    tparams = trainable_bytes(MODELS[model], lora_rank) / 2.0
    return 16.0 * tparams / max(1, shards) / 1.5e12


def step_sync_s(model: str, lora_rank: int, trainer_gpus: list[str] | tuple[str, ...], net: Network) -> float:
    """The gradient all-reduce at a step's end over ``trainer_gpus``: a ring over the slowest
    NVLink, or over the NIC once the ranks span hosts (more than 8 GPUs, cm 6)."""
    R = len(trainer_gpus)
    if R <= 1:
        return 0.0
    slowest = min(trainer_gpus, key=lambda g: GPUS[g].nvlink_gbs)
    out = allreduce_s(model, lora_rank, R, slowest)
    if R > 8:
        grad = trainable_bytes(MODELS[model], lora_rank)
        out = max(out, 2.0 * (R - 1) / R * grad / (net.link_gbs * 1e9))
    return out


def _sp_arch(model: str, n: int) -> Arch:
    m = MODELS[model]
    if m.arch is None:
        raise CostModelError(f"sequence parallelism over {n} ranks with model = {model!r}: its family has "
                             "no sequence-parallel forward")
    if n < 1 or m.arch.heads % n:
        raise CostModelError(f"sequence parallelism over {n} ranks with model = {model!r}: expected a "
                             f"divisor of its {m.arch.heads} attention heads")
    if model == "zimage" and 32 % n:  # it pads its sequences to multiples of 32 tokens (models/seqpar.py)
        raise CostModelError(f"sequence parallelism over {n} ranks with model = 'zimage': expected a "
                             "divisor of 32 (Z-Image pads its sequences to multiples of 32 tokens)")
    return m.arch


def sp_forward_flop(model: str, n: int, image_tokens: int = 0) -> float:
    """FLOPs of one rank's share of one forward of one sample, over ``n`` ranks (derived, cm 0's
    formula as :class:`Arch` splits it): ``2 P_tok (S_img / n + T) + 4 L d (S_img + T)^2 / n +
    4 L d S_img C / n``. ``image_tokens``: another sequence length than the entry's (0)."""
    a = _sp_arch(model, n)
    s = image_tokens or a.image_tokens
    t = a.text_tokens
    linear = 2.0 * a.p_tok_b * 1e9 * (s / n + t)
    attention = 4.0 * a.layers * a.hidden * ((s + t) ** 2 + s * a.cross_tokens) / n
    return linear + attention


def sp_exchange_s(model: str, n: int, gpu: str, *, image_tokens: int = 0,
                  net: Network | None = None) -> float:
    """Seconds one rank spends in one forward's Ulysses exchanges over ``n`` ranks (0 at n = 1).

    Per attention layer: 4 all-to-alls (q, k, v before, the output after: sp 1.1,
    digenrl/models/ulysses.py) of the rank's ``S_img / n x d`` activations, and with joint text an
    all-gather of the text output's heads (``T x d``). An all-to-all or all-gather moves
    ``(n - 1) / n`` of its buffer at the link's bus bandwidth (nccl-tests' busbw definition;
    cm 7: ~370 GB/s effective on H100 NVLink for non-all-reduce ops, NVIDIA/nccl-tests #212, the
    ``nvlink_gbs`` of :data:`GPUS`) plus :attr:`GpuSpec.exchange_latency_s`. A group of more than
    8 ranks spans hosts: its exchanges run at the NIC's ``net.link_gbs`` (cm 7, 8 GPUs a node)."""
    a = _sp_arch(model, n)
    if n == 1:
        return 0.0
    if gpu not in GPUS:
        raise CostModelError(f"gpu = {gpu!r}: expected one of {', '.join(GPUS)}")
    g = GPUS[gpu]
    bw = (g.nvlink_gbs if n <= 8 else min(g.nvlink_gbs, (net or Network()).link_gbs)) * 1e9
    s = image_tokens or a.image_tokens
    share = (n - 1) / n
    per_layer = 4 * (s / n * a.hidden * a.act_bytes * share / bw + g.exchange_latency_s)
    if a.text_tokens:
        per_layer += a.text_tokens * a.hidden * a.act_bytes * share / bw + g.exchange_latency_s
    return a.layers * per_layer


def sp_seconds(base_s: float, model: str, n: int, gpu: str, passes: int, *, image_tokens: int = 0,
               net: Network | None = None) -> float:
    """Seconds of work that takes ``base_s`` on one device at the entry's sequence length, on one
    rank of an ``n``-rank group: ``base_s`` x the rank's FLOP share + ``passes`` forwards'
    exchanges (a backward mirrors its forward's exchanges: sp 1.1, so a training pass of forward,
    backward and a checkpointed recompute is 3). FLOP-linear like the rest of the model: the
    per-rank kernels are assumed as efficient on ``1/n`` of the tokens."""
    if n == 1 and not image_tokens:
        return base_s
    share = sp_forward_flop(model, n, image_tokens) / sp_forward_flop(model, 1)
    return base_s * share + passes * sp_exchange_s(model, n, gpu, image_tokens=image_tokens, net=net)


def train_passes(wl: Workload) -> int:
    """Forward-sized exchange passes of one trained sample-timestep: forward + backward (+ the
    checkpointed forward's recompute, + the KL reference forward), x2 with CFG."""
    return (2 + (1 if wl.grad_ckpt else 0) + (1 if wl.kl else 0)) * (2 if wl.cfg_train else 1)


def node_costs(gpu: str, wl: Workload, *, trainer_ranks: int = 1,
               calibration: dict[str, Any] | None = None) -> NodeCosts:
    """Per-unit seconds of ``wl`` on ``gpu``; a calibration (``plan --calibrate`` JSON) overrides.

    With a calibrated batching curve (``forward_fixed_s``, ``forward_row_s``) and a known
    ``wl.rows_per_forward`` = r, a rollout's seconds per sample and step are
    ``(forward_fixed_s + forward_row_s * r) / r``.

    ``wl.sequence_parallel`` = N prices ``train_step_s`` on one rank of an N-rank group and
    ``wl.rollout_gpus`` = G ``gen_step_s`` on a G-device rollout node (:func:`sp_seconds`; a
    calibration's figures are taken as one device's and scaled the same way). The colocated /
    TAG generation inside a trainer (``colo_gen_step_s``) stays one device's: a sequence-parallel
    rank does not generate."""
    g, m = _specs(gpu, wl.model)
    cfg_gen = 2 if wl.cfg_gen else 1
    # cm 0: 3x fwd (fwd+bwd), 4x with checkpointing, +1 fwd reference when KL > 0, x2 with CFG.
    train_mult = (1 + backward_factor(wl.grad_ckpt) + (1 if wl.kl else 0)) * (2 if wl.cfg_train else 1)
    if m.cpu_seconds is not None or gpu == "cpu":
        gen1, train1 = m.cpu_seconds or (0.0029, 0.0076)
        # cpu-feasibility numbers are for 3x fwd, no CFG; scale by the same multipliers (derived).
        gen, colo_gen = gen1 * cfg_gen, gen1 * cfg_gen
        train = train1 * train_mult / 3.0
        reward = m.reward_fixed_s
    else:
        gen = forward_s(gpu, wl.model, "rollout") * cfg_gen
        colo_gen = forward_s(gpu, wl.model, "trainer_gen") * cfg_gen
        train = forward_s(gpu, wl.model, "train") * train_mult
        reward = reward_s(gpu, wl.model)
    shards = trainer_ranks if wl.fsdp else 1
    optimizer = optimizer_s(wl.model, wl.lora_rank, shards)
    # Colocated switch (derived): offload/reload the fp32 optimizer shard (12 B/param) over PCIe
    # and all-gather bf16 weights for generation over NVLink.
    tparams = trainable_bytes(m, wl.lora_rank) / 2.0
    switch = (12.0 * tparams / shards) / (g.pcie_gbs * 1e9) + trainable_bytes(m, 0) / (g.nvlink_gbs * 1e9)
    if calibration:
        gen = float(calibration.get("gen_step_s", gen))
        colo_gen = float(calibration.get("colo_gen_step_s", calibration.get("gen_step_s", colo_gen)))
        train = float(calibration.get("train_step_s", train))
        reward = float(calibration.get("reward_s", reward))
        optimizer = float(calibration.get("optimizer_s", optimizer))
        switch = float(calibration.get("switch_s", switch))
        if wl.rows_per_forward and "forward_row_s" in calibration:
            # a batching run's curve: one step of r rows takes fixed + row * r, shared by r samples
            r = wl.rows_per_forward
            gen = (float(calibration.get("forward_fixed_s", 0.0)) + float(calibration["forward_row_s"]) * r) / r
    if wl.sequence_parallel > 1:
        train = sp_seconds(train, wl.model, wl.sequence_parallel, gpu, train_passes(wl))
    if wl.rollout_gpus > 1:
        gen = sp_seconds(gen, wl.model, wl.rollout_gpus, gpu, cfg_gen)
    return NodeCosts(gen_step_s=gen, colo_gen_step_s=colo_gen, train_step_s=train,
                     reward_s=reward, optimizer_s=optimizer, switch_s=switch)


SYNC_BYTES_PER_PARAM = 4
"""What the runtime sends per trainable parameter: its float32 master (``Policy.state_dict_for_sync``
sends the masters, not their bf16 rounding), twice the bf16 bytes cm 6 sizes."""
PART_BYTES = 4 << 20
"""A weight part (transport/weights.py PART_BYTES): the relay forwards whole parts."""


def sync_bytes(model: str, lora_rank: int) -> float:
    """Bytes of one version on the wire: trainable parameters x :data:`SYNC_BYTES_PER_PARAM`."""
    return trainable_bytes(MODELS[model], lora_rank) / 2.0 * SYNC_BYTES_PER_PARAM


def relay_parent(position: int, fanout: int) -> int:
    """The 1-based position feeding ``position`` in the relay tree (0: trainer rank 0).
    core/relay.py: rank 0 feeds position 1, position j >= 2 hangs under (j - 2) // fanout + 1."""
    return 0 if position <= 1 else (position - 2) // fanout + 1


def relay_depth(position: int, fanout: int) -> int:
    """Hops from trainer rank 0 to the rollout at 1-based ``position`` of the relay tree."""
    depth = 0
    while position > 0:
        position = relay_parent(position, fanout)
        depth += 1
    return depth


def relay_children(position: int, fanout: int, rollouts: int) -> int:
    """How many rollouts the one at ``position`` serves (its uplink is split among them)."""
    first = (position - 1) * fanout + 2
    return max(0, min(rollouts, first + fanout - 1) - first + 1)


def weight_sync_s(model: str, lora_rank: int, net: Network, *, position: int = 1, fanout: int = 1,
                  rollouts: int = 1) -> float:
    """Seconds from a version's publication until the rollout at ``position`` holds it.

    Relayed (``fanout`` >= 1, the runtime's default): the set streams down the tree, each
    rollout forwarding a part as soon as it has verified it, so the set crosses one link once
    (at ``weight_gbs`` shared by the children of the busiest forwarder on the way: 1 in a
    chain) and every hop below rank 0 adds one part and a message latency. ``fanout = 0``:
    every one of the ``rollouts`` fetches from rank 0, whose link they share: all of them
    finish after N sets.
    """
    b = sync_bytes(model, lora_rank)
    bw = net.weight_gbs * 1e9
    if fanout <= 0:
        return max(1, rollouts) * b / bw + net.latency_s
    d = relay_depth(position, fanout)
    share, p = 1, relay_parent(position, fanout)
    while p > 0:  # rank 0 feeds position 1 alone
        share = max(share, relay_children(p, fanout, max(rollouts, position)))
        p = relay_parent(p, fanout)
    return share * (b + (d - 1) * min(b, PART_BYTES)) / bw + d * net.latency_s


def allreduce_s(model: str, lora_rank: int, ranks: int, gpu: str) -> float:
    """Ring all-reduce of bf16 gradients: 2 (R-1)/R x bytes / NVLink effective (derived)."""
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * trainable_bytes(MODELS[model], lora_rank) / (GPUS[gpu].nvlink_gbs * 1e9)


def chunk_bytes(model: str, wire_fp32: bool) -> int:
    """One per-timestep chunk of one sample: x_t and x_next (+ a log-prob), derived."""
    elem_scale = 2 if wire_fp32 and model != "sd3" else 1  # cm 1 sizes are bf16; sd3 is fp32 already
    return 2 * MODELS[model].latent_bytes * elem_scale + 4


CLUSTER_CALIBRATION = ("weight_fetch_s", "weight_apply_s", "latency_s", "forward_fixed_s", "forward_row_s")
"""Calibration keys that are not NodeCosts fields: a rollout's background fetch of one version
(replaces :func:`weight_sync_s`), its apply at a trajectory boundary (0 without a fit), one
message's latency (replaces ``Network.latency_s``), and a batching rollout's curve (one
step-batcher step = ``forward_fixed_s + forward_row_s * rows``; :func:`node_costs`)."""


def load_calibration(path: str | Path) -> dict[str, Any]:
    """Read a ``plan --calibrate`` JSON; keys are NodeCosts fields or CLUSTER_CALIBRATION (seconds)."""
    p = Path(path)
    if not p.is_file():
        raise CostModelError(f"--cost {str(path)!r}: file does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CostModelError(f"--cost {str(path)!r}: not valid JSON ({e})") from None
    names = {f.name for f in dataclasses.fields(NodeCosts)} | set(CLUSTER_CALIBRATION)
    costs = data.get("costs", data) if isinstance(data, dict) else None
    if not isinstance(costs, dict):
        raise CostModelError(f"--cost {str(path)!r}: expected a JSON object with a 'costs' table")
    for k, v in costs.items():
        if k not in names:
            raise CostModelError(f"--cost {str(path)!r}: unknown key costs.{k}: expected one of "
                                 f"{', '.join(sorted(names))}")
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise CostModelError(f"--cost {str(path)!r}: costs.{k} = {v!r}: expected seconds >= 0")
    return dict(costs)
