"""``digenrl plan --memory``: each role's peak device memory, whether it fits its GPU, and if not
the smallest setting that does.

    digenrl plan --memory --config configs/models/wan.toml --cluster configs/clusters/h100-16.toml

The model comes from ``model.path``: a local folder (its transformer's, VAE's and text
encoders' ``config.json``, no weights read) or ``"builtin"`` at its own shapes; ``"random"`` and
``"emulated"`` are planned at the family's published size (:data:`~digenrl.models.catalog.REAL_CONFIGS`,
the model the throughput plan prices). Everything is built on the meta device from those
configs and the work is traced there (:mod:`digenrl.sim.memplan`), at the config's
resolution, frames, rows per forward, LoRA rank, dtype, activation checkpointing, CFG and KL.

Trainer (one rank)::

    resident = transformer weights (compute dtype; a second expert, the KL reference copy of a
               full fine-tune) + text encoders (compute dtype) + VAE (float32)
             + float32 masters of the trained parameters + AdamW's two float32 moments
    step     = max(forward + backward peak, optimizer-step peak)   (traced; gradients included)

``model.fsdp`` over ``cluster.trainers`` ranks divides the transformer's weights, masters,
gradients and AdamW state by the rank count and adds two blocks' gathered weights;
``model.offload = "params"`` keeps all four in host memory (the device holds two gathered
blocks and one block's gradients; the optimizer step runs on the CPU); ``"optimizer"`` keeps the
masters and AdamW state in host memory. ``train.sequence_parallel = N`` traces a forward over
``1/N`` of the latent's tokens with the whole prompt (Ulysses: the rank's share of the image
tokens, the replicated text).

Rollout::

    resident = transformer weights (with the LoRA) + text encoders + VAE
    work     = max(one denoising forward over the most rows it batches, the VAE decode of a
               fragment's rows)                                     (traced)

Both add ``reserve``: 1 GiB on a GPU for the CUDA context, cuBLAS workspace and NCCL buffers,
which ``torch.cuda.max_memory_allocated`` does not count (0 on a CPU). The workspace term of the
trainer is what the trace shows beyond the saved activations and gradients at the peak: the
backward's gradients of activations in flight, attention's backward buffers, the
gradient-checkpointing recompute of one block, AdamW's foreach temporaries.

GPU memory is the cost model's table (:data:`~digenrl.core.costmodel.GPUS`, ``memory_gb`` read as
GiB); ``cpu`` is this host's memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from digenrl.config import Config, ConfigError
from digenrl.sim.cluster import load_cluster
from digenrl.sim.plan import config_cluster, throughput_at

GiB = 2**30
RESERVE_GPU = 1 * GiB
"""CUDA context + cuBLAS workspace + NCCL buffers: device memory outside the caching allocator."""


def gib(n: float) -> str:
    """``n`` bytes in GiB (MiB below one GiB)."""
    return f"{n / GiB:.3g} GiB" if abs(n) >= GiB else f"{n / 2**20:.3g} MiB"


@dataclass(frozen=True)
class Setting:
    """What the plan varies: the keys that move a role's memory."""

    rows: int
    """trainer rows per forward (a fragment's: prompts_per_step / fragments_per_step x group_size)"""
    sequence_parallel: int
    gradient_checkpointing: bool
    offload: str
    fsdp: bool


# -- the model's shapes --------------------------------------------------------------------------


@dataclass
class ModelShapes:
    family: str
    label: str
    config: dict[str, Any]
    vae: tuple[str, dict[str, Any]] | None
    text_encoders: list[torch.nn.Module]
    text: tuple[int, int, int]
    experts: int = 1


def _text_tokens(cfg: Config, hashed: bool) -> int:
    from digenrl.models import families
    from digenrl.models.text import DEFAULT_TEXT_TOKENS

    if hashed:
        return families.SPECS[cfg.model.family].max_tokens
    n = cfg.model.max_text_tokens or DEFAULT_TEXT_TOKENS[cfg.model.family]
    return n + 77 if cfg.model.family == "sd3" else n  # SD3 joins CLIP's 77 tokens to T5's


def _meta_transformers_model(cls_name: str, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    cls = getattr(transformers, cls_name)
    with torch.device("meta"):
        model: torch.nn.Module = cls._from_config(config, dtype=dtype)
    return model


def model_shapes(cfg: Config) -> ModelShapes:
    """The transformer config, VAE config and text encoders (on the meta device) ``cfg`` runs."""
    from digenrl.models import catalog, families
    from digenrl.models.meta import ModelConfigError, _folder, _read_config
    from digenrl.models.registry import DTYPES

    m = cfg.model
    family = m.family
    if family == "flux_kontext":
        raise ConfigError("model.family = 'flux_kontext': digenrl plan --memory does not plan image editing "
                          "(the input image's tokens); expected sd3, flux, qwenimage, wan, hunyuanvideo, flux2, zimage")
    dtype = DTYPES[m.dtype]
    spec = families.SPECS[family]
    if m.path in ("random", "emulated"):
        config = dict(catalog.REAL_CONFIGS[family])
        import transformers

        real = [_meta_transformers_model(cls, getattr(transformers, ccls)(**kw), dtype)
                for cls, ccls, kw in catalog.REAL_TEXT_ENCODERS[family]]
        width = spec.text_dims(SimpleNamespace(**_class_config(family, config)))[0]
        text = (_text_tokens(cfg, False), width, catalog.REAL_POOLED.get(family, 0))
        return ModelShapes(family, f"{family} (published size, model.path = {m.path!r})", config,
                           (catalog.VAE_CLASS[family], catalog.REAL_VAES[family]), real, text)
    folder, pipeline = _folder(m)
    if not folder.exists():
        raise ModelConfigError(f"model.path {str(folder)!r}: no such folder (expected a diffusers pipeline "
                               "or transformer folder)")
    tpath = folder / "transformer" / "config.json" if pipeline else folder / "config.json"
    if not tpath.is_file():
        raise ModelConfigError(f"model.path {str(folder)!r}: {tpath} does not exist (expected a diffusers "
                               "transformer folder or pipeline folder)")
    config = _read_config(tpath, {})
    vae = None
    encoders: list[torch.nn.Module] = []
    hashed = not pipeline or m.text_encoder == "hash"
    experts = 1
    if pipeline:
        index = json.loads((folder / "model_index.json").read_text())
        vae_entry = index.get("vae")
        if isinstance(vae_entry, list) and vae_entry[1]:
            vae = (str(vae_entry[1]), _read_config(folder / "vae" / "config.json", {}))
        if isinstance(index.get("transformer_2"), list) and None not in index["transformer_2"]:
            experts = 2
        if not hashed:
            import transformers

            from digenrl.models.folder import TEXT_COMPONENTS

            for name in TEXT_COMPONENTS[family]:
                entry = index.get(name)
                if name.startswith("text_encoder") and isinstance(entry, list) and entry[1]:
                    cls = getattr(transformers, str(entry[1]))
                    conf = cls.config_class.from_pretrained(folder / name, local_files_only=True)
                    encoders.append(_meta_transformers_model(str(entry[1]), conf, dtype))
    width, pooled = spec.text_dims(SimpleNamespace(**_class_config(family, config)))
    return ModelShapes(family, f"{family} ({folder})", config, vae, encoders,
                       (_text_tokens(cfg, hashed), width, pooled), experts)


def _class_config(family: str, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` over the transformer class's constructor defaults."""
    import inspect

    from digenrl.models import families

    sig = inspect.signature(families.SPECS[family].cls.__init__)
    defaults = {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    return {**defaults, **config}


def _build_vae(vae: tuple[str, dict[str, Any]] | None) -> torch.nn.Module | None:
    if vae is None:
        return None
    import diffusers

    cls = getattr(diffusers, vae[0])
    with torch.device("meta"):
        model: torch.nn.Module = cls.from_config(vae[1])  # float32, as build_model loads a VAE
    return model


# -- the plan ------------------------------------------------------------------------------------


@dataclass
class RolePlan:
    role: str
    gpu: str
    capacity: int
    parts: dict[str, int]
    total: int
    setting: dict[str, Any]

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def gpu_capacity(gpu: str) -> int:
    """Bytes of device memory of GPU type ``gpu`` (the cost model's table; ``cpu``: this host's)."""
    from digenrl.core.costmodel import GPUS
    from digenrl.models.footprint import host_memory_bytes

    if gpu == "cpu":
        return host_memory_bytes() or int(GPUS["cpu"].memory_gb * GiB)
    if gpu not in GPUS:
        raise ConfigError(f"GPU type {gpu!r}: expected one of {', '.join(GPUS)}")
    return int(GPUS[gpu].memory_gb * GiB)


class MemoryPlanner:
    """Plans ``cfg``'s roles; traces are cached by what changes them (rows, SP, checkpointing)."""

    def __init__(self, cfg: Config, *, trainer_gpu: str, rollout_gpu: str, trainers: int = 0) -> None:
        from digenrl.models import catalog
        from digenrl.models.registry import DTYPES
        from digenrl.sim.memplan import build_transformer, largest_block_bytes, module_bytes

        self.cfg = cfg
        self.shapes = model_shapes(cfg)
        self.dtype = DTYPES[cfg.model.dtype]
        self.trainer_gpu, self.rollout_gpu = trainer_gpu, rollout_gpu
        self.trainers = trainers or cfg.cluster.trainers
        self.vae = _build_vae(self.shapes.vae)
        base = build_transformer(self.shapes.family, self.shapes.config, self.dtype)
        vae_ns = (SimpleNamespace(config=SimpleNamespace(**dict(self.vae.config)))  # type: ignore[arg-type]
                  if self.vae is not None else None)
        self.geometry = catalog.GEOMETRY[self.shapes.family](base.config, vae_ns)
        m = cfg.model
        self.latent = self.geometry.latent_shape(m.height, m.width, m.num_frames)
        self.patch = self.geometry.multiple
        self.transformer_bytes = module_bytes(base)
        self.block_bytes = largest_block_bytes(base)
        self.text_bytes = sum(module_bytes(e) for e in self.shapes.text_encoders)
        self.vae_bytes = module_bytes(self.vae)
        self._traces: dict[tuple[int, int, bool], Any] = {}
        self._rollout: dict[int, dict[str, int]] = {}
        t = cfg.train
        self.fragment_rows = t.prompts_per_step // cfg.runtime.fragments_per_step * t.group_size

    def _model(self, ckpt: bool, latent: tuple[int, ...]) -> Any:
        from digenrl.sim.memplan import adapt, build_transformer

        torch.manual_seed(0)
        transformer = build_transformer(self.shapes.family, self.shapes.config, self.dtype)
        return adapt(self.shapes.family, transformer, latent, self.shapes.text,
                     lora_rank=self.cfg.model.lora_rank, lora_targets=list(self.cfg.model.lora_targets),
                     dtype=self.dtype, gradient_checkpointing=ckpt)

    def trace(self, rows: int, sp: int, ckpt: bool) -> Any:
        from digenrl.sim.memplan import sp_latent_shape, trace_training_step

        key = (rows, sp, ckpt)
        if key not in self._traces:
            model = self._model(ckpt, sp_latent_shape(self.latent, self.patch, sp))
            self._traces[key] = (trace_training_step(
                model, rows, guidance_scale=self.cfg.sampler.guidance_scale, kl_beta=self.cfg.train.kl_beta,
                foreach=self.trainer_gpu != "cpu", max_grad_norm=self.cfg.train.max_grad_norm or 1.0),
                sum(p.numel() for p in model.transformer.parameters() if p.requires_grad),
                _block_trainable(model.transformer))
        return self._traces[key]

    def setting(self) -> Setting:
        c = self.cfg
        return Setting(rows=self.fragment_rows, sequence_parallel=int(getattr(c.train, "sequence_parallel", 1) or 1),
                       gradient_checkpointing=c.model.gradient_checkpointing, offload=c.model.offload, fsdp=c.model.fsdp)

    def trainer(self, s: Setting) -> RolePlan:
        st, trainable, block_trainable = self.trace(s.rows, s.sequence_parallel, s.gradient_checkpointing)
        c = self.cfg
        ranks = self.trainers if s.fsdp else 1
        lora = c.model.lora_rank > 0
        weights = self.transformer_bytes * self.shapes.experts
        reference = self.transformer_bytes if c.train.kl_beta > 0 and not lora else 0
        trained_fp32 = trainable * 4
        masters = st.masters
        optimizer = st.optimizer_state
        grads_fb = st.fb_at_peak.get("grads", 0)
        parts: dict[str, int] = {}
        if s.offload == "params":
            # FSDP2 CPUOffloadPolicy: shards, their gradients and AdamW in host memory
            parts["weights (two gathered blocks)"] = 2 * self.block_bytes
            parts["gradients (one block, float32)"] = block_trainable * 4
            grads_kept = 0.0
            masters_dev = optimizer_dev = 0
            opt_on_device = False
        else:
            shard = 1 / ranks
            if s.fsdp and ranks > 1:
                # sharded: the trained parameters are float32 masters themselves, the frozen ones
                # stay in the compute dtype; two blocks gathered at a time
                frozen = weights - trainable * self.dtype.itemsize
                parts["weights (sharded)"] = int((frozen + trained_fp32) * shard)
                parts["weights (two gathered blocks)"] = 2 * self.block_bytes
                masters_dev = 0
            else:
                parts["weights"] = weights
                masters_dev = masters
            grads_kept = shard
            optimizer_dev = int(optimizer * shard) if s.offload != "optimizer" else 0
            if s.offload == "optimizer":
                masters_dev = 0
            opt_on_device = s.offload != "optimizer"
        if reference:
            parts["KL reference copy"] = reference
        parts["text encoders"] = self.text_bytes
        parts["VAE"] = self.vae_bytes
        if masters_dev:
            parts["float32 masters"] = masters_dev
        if optimizer_dev:
            parts["AdamW state"] = optimizer_dev
        fb = st.fb_peak - int(grads_fb * (1 - grads_kept))
        # the optimizer step's tensors (gradients, AdamW's temporaries) are parameter-sized: shards
        # under FSDP; what else is alive then (the model's caches) is not
        opt_params = st.opt_peak - st.opt_at_peak.get("activations", 0)
        opt = int(opt_params * grads_kept) + st.opt_at_peak.get("activations", 0) if opt_on_device else 0
        acts = st.fb_at_peak.get("activations", 0)
        if fb >= opt:
            parts["activations (saved for the backward)"] = acts
            parts["gradients"] = int(grads_fb * grads_kept)
            parts["workspace (backward transients)"] = fb - acts - int(grads_fb * grads_kept)
        else:
            parts["gradients"] = int(st.opt_at_peak.get("grads", 0) * grads_kept)
            parts["workspace (optimizer-step temporaries, caches)"] = opt - parts["gradients"]
        parts["reserve (CUDA context, cuBLAS, NCCL)"] = RESERVE_GPU if self.trainer_gpu != "cpu" else 0
        parts = {k: v for k, v in parts.items() if v}
        return RolePlan("trainer", self.trainer_gpu, gpu_capacity(self.trainer_gpu), parts, sum(parts.values()),
                        {**dataclasses.asdict(s), "latent": list(self.latent), "trainable_params": trainable,
                         "saved_bytes": st.saved})

    def rollout(self, rows: int = 0) -> RolePlan:
        """The rollout's plan, its denoising forward over ``rows`` (default: ``sampler.max_batch``,
        else a fragment's rows) and its decode over a fragment's rows (no more than ``rows``)."""
        from digenrl.sim.memplan import module_bytes, trace_decode, trace_inference

        c = self.cfg
        rows = rows or c.sampler.max_batch or self.fragment_rows
        decode_rows = min(rows, self.fragment_rows)
        if rows not in self._rollout:
            model = self._model(False, self.latent)
            infer = trace_inference(model, rows, guidance_scale=c.sampler.guidance_scale)
            decode = 0
            if self.vae is not None:
                if c.model.vae_tiling:
                    for switch in ("enable_tiling", "enable_slicing"):
                        if hasattr(self.vae, switch):
                            getattr(self.vae, switch)()
                decode = trace_decode(self.vae, self.shapes.family, decode_rows, self.latent)
            self._rollout[rows] = {"weights": module_bytes(model.transformer) * self.shapes.experts,
                                   "infer": infer, "decode": decode}
        r = self._rollout[rows]
        parts = {"weights": r["weights"], "text encoders": self.text_bytes, "VAE": self.vae_bytes}
        cfg_note = ", x2 for CFG" if c.sampler.guidance_scale != 1.0 else ""
        if r["infer"] >= r["decode"]:
            parts[f"denoising forward ({rows} rows{cfg_note})"] = r["infer"]
        else:
            parts[f"VAE decode ({decode_rows} rows)"] = r["decode"]
        parts["reserve (CUDA context, cuBLAS, NCCL)"] = RESERVE_GPU if self.rollout_gpu != "cpu" else 0
        parts = {k: v for k, v in parts.items() if v}
        return RolePlan("rollout", self.rollout_gpu, gpu_capacity(self.rollout_gpu), parts, sum(parts.values()),
                        {"rows": rows, "decode_rows": decode_rows, "latent": list(self.latent),
                         "denoise_peak_bytes": r["infer"], "decode_peak_bytes": r["decode"]})

    def rollout_fit(self) -> tuple[int, RolePlan] | None:
        """The most rows per forward (whole prompts) with which the rollout fits, or None."""
        t = self.cfg.train
        rows = self.cfg.sampler.max_batch or self.fragment_rows
        for d in range(rows // t.group_size - 1, 0, -1):
            if t.prompts_per_step % d == 0:
                plan = self.rollout(d * t.group_size)
                if plan.fits:
                    return d * t.group_size, plan
        return None

    def candidates(self, s: Setting) -> list[Setting]:
        """Settings that take less trainer memory than ``s``, nearest first: fewest changed keys,
        then activation checkpointing before sequence parallelism before offload before fewer rows
        per forward (a fragment holds whole groups: rows go down by whole prompts)."""
        t = self.cfg.train
        per = s.rows // t.group_size
        rows = [d * t.group_size for d in range(per, 0, -1) if t.prompts_per_step % d == 0 and per % d == 0]
        sps = [x for x in sorted({s.sequence_parallel, 2, 4, 8}) if x >= s.sequence_parallel]
        offloads = [s.offload] if s.offload == "params" else [s.offload, "params"]
        ranked = []
        for ckpt, sp, off, r in itertools.product(sorted({s.gradient_checkpointing, True}), sps, offloads, rows):
            changes = (ckpt != s.gradient_checkpointing, sp != s.sequence_parallel, off != s.offload, r != s.rows)
            if not any(changes):
                continue
            cost = (sum(changes), changes[0] + 2 * math.log2(sp / s.sequence_parallel) + 3 * changes[2]
                    + 2 * math.log2(s.rows / r))
            ranked.append((cost, Setting(rows=r, sequence_parallel=sp, gradient_checkpointing=ckpt, offload=off,
                                         fsdp=s.fsdp or off == "params")))
        return [c for _, c in sorted(ranked, key=lambda x: x[0])]

    def smallest_fit(self, s: Setting) -> tuple[Setting, RolePlan] | None:
        """The first of :meth:`candidates` whose trainer fits, or None. A candidate that saves no
        more than one already seen not to fit (in every key) is skipped untraced."""
        failed: list[Setting] = []

        def saves_no_more(c: Setting, f: Setting) -> bool:
            return (f.gradient_checkpointing >= c.gradient_checkpointing and f.sequence_parallel >= c.sequence_parallel
                    and (f.offload == "params" or c.offload != "params") and f.rows <= c.rows)

        found = self.candidates(s)
        if found and not self.trainer(_most_saving(found)).fits:
            return None
        for cand in found:
            if any(saves_no_more(cand, f) for f in failed):
                continue
            plan = self.trainer(cand)
            if plan.fits:
                return cand, plan
            failed.append(cand)
        return None


def _most_saving(cands: list[Setting]) -> Setting:
    return Setting(rows=min(c.rows for c in cands), sequence_parallel=max(c.sequence_parallel for c in cands),
                   gradient_checkpointing=any(c.gradient_checkpointing for c in cands),
                   offload="params" if any(c.offload == "params" for c in cands) else cands[0].offload,
                   fsdp=any(c.fsdp for c in cands))


def _block_trainable(transformer: torch.nn.Module) -> int:
    best = 0
    for module in transformer.modules():
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                best = max(best, sum(p.numel() for p in block.parameters() if p.requires_grad))
    return best


def describe_change(old: Setting, new: Setting, cfg: Config) -> str:
    out = []
    if new.gradient_checkpointing != old.gradient_checkpointing:
        out.append("model.gradient_checkpointing = true")
    if new.sequence_parallel != old.sequence_parallel:
        out.append(f"train.sequence_parallel = {new.sequence_parallel}")
    if new.offload != old.offload:
        out.append(("model.fsdp = true, " if not old.fsdp else "") + f"model.offload = \"{new.offload}\"")
    if new.rows != old.rows:
        per = new.rows // cfg.train.group_size
        out.append(f"runtime.fragments_per_step = {cfg.train.prompts_per_step // per} ({new.rows} rows per forward)")
    return ", ".join(out)


def memory_plan(cfg: Config, cluster_path: str | None = None) -> dict[str, Any]:
    """Each role's plan as plain data (``--json``'s report)."""
    trainer_gpu = cfg.cluster.trainer_gpu or cfg.cluster.gpu
    rollout_gpu = cfg.cluster.rollout_gpu or cfg.cluster.gpu
    trainer_count = cfg.cluster.trainers
    if cluster_path is not None:
        cluster = load_cluster(cluster_path)
        rollouts, trainers = cluster.split()
        trainer_gpu = min(trainers, key=gpu_capacity)
        trainer_count = len(trainers)
        rollout_gpu = min(rollouts, key=gpu_capacity) if rollouts else trainer_gpu
    gpu_capacity(trainer_gpu)  # names an unknown type before anything is built
    gpu_capacity(rollout_gpu)
    planner = MemoryPlanner(cfg, trainer_gpu=trainer_gpu, rollout_gpu=rollout_gpu, trainers=trainer_count)
    s = planner.setting()
    out: dict[str, Any] = {"model": planner.shapes.label, "dtype": cfg.model.dtype, "latent": list(planner.latent),
                           "trainer_ranks": planner.trainers, "roles": {}}
    for plan in (planner.trainer(s), planner.rollout()):
        row: dict[str, Any] = {"gpu": plan.gpu, "capacity_bytes": plan.capacity, "peak_bytes": plan.total,
                               "fits": plan.fits, "parts": plan.parts, "setting": plan.setting}
        if not plan.fits and plan.role == "trainer":
            found = planner.smallest_fit(s)
            row["fits_with"] = (None if found is None else
                                {"change": describe_change(s, found[0], cfg), "peak_bytes": found[1].total,
                                 "sequence_parallel": found[0].sequence_parallel})
            if found is not None and found[0].sequence_parallel != s.sequence_parallel:
                # the layout needs sequence parallelism: what it does to the throughput
                f = found[0]
                out["throughput"] = throughput_at(
                    cfg, load_cluster(cluster_path) if cluster_path is not None else config_cluster(cfg),
                    sequence_parallel=f.sequence_parallel, gradient_checkpointing=f.gradient_checkpointing,
                    rows=f.rows)
        elif not plan.fits:
            fit = planner.rollout_fit()
            row["fits_with"] = (None if fit is None else {"change": (
                f"runtime.fragments_per_step = {cfg.train.prompts_per_step * cfg.train.group_size // fit[0]} "
                f"and sampler.max_batch = 0 ({fit[0]} rows per forward)"), "peak_bytes": fit[1].total})
        out["roles"][plan.role] = row
    return out


def verdict(role: str, row: dict[str, Any]) -> str:
    """One line: fits, or does not and what would."""
    head = f"{role}: {gib(row['peak_bytes'])} {'<=' if row['fits'] else '>'} {gib(row['capacity_bytes'])} on {row['gpu']}"
    if row["fits"]:
        return head + ": fits"
    found = row.get("fits_with")
    if found is None:
        return head + ("; nothing searched fits (activation checkpointing, sequence parallelism up to 8, "
                       "offload, fewer rows per forward down to one prompt's group)" if role == "trainer" else
                       "; nothing searched fits (fewer rows per forward down to one prompt's group)")
    return head + f"; fits with {found['change']} ({gib(found['peak_bytes'])})"


def render(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']}  dtype {report['dtype']}  latent {report['latent']}", ""]
    for role, row in report["roles"].items():
        lines.append(f"{role} ({row['gpu']}):")
        for k, v in row["parts"].items():
            lines.append(f"  {k:44} {gib(v):>12}")
        lines.append(f"  {'peak':44} {gib(row['peak_bytes']):>12}")
    lines.append("")
    lines += [verdict(role, row) for role, row in report["roles"].items()]
    t = report.get("throughput")
    if t is not None:
        head = f"throughput at train.sequence_parallel = {t['sequence_parallel']} (digenrl mode, cluster {t['cluster']})"
        lines.append(f"{head}: {t['error']}" if "error" in t else
                     f"{head}: {t['samples_per_s']:.4g} samples/s, {t['s_per_step']:.4g} s/step, "
                     f"{t['train_s_per_sample_timestep']:.4g} s per sample-timestep on a trainer rank")
    return "\n".join(lines)


def run_memory_plan(cfg: Config, cluster: str | None, as_json: bool) -> int:
    """``digenrl plan --memory`` (wired in digenrl/cli.py): the report, as a table or JSON."""
    if cfg.model.path != "random" and cfg.model.path not in ("builtin", "emulated") and not Path(cfg.model.path).exists():
        raise ConfigError(f"model.path {cfg.model.path!r}: no such folder (expected a diffusers pipeline "
                          "or transformer folder)")
    report = memory_plan(cfg, cluster)
    print(json.dumps(report, indent=2, sort_keys=True) if as_json else render(report))
    return 0
