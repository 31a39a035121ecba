"""``digenrl export RUN_DIR --out DIR [--merge] [--ema]``: a trained policy as a standalone diffusers folder.

What it writes, from the run's ``config.toml`` and its trained weights (``final/``, else the
newest checkpoint that verifies):

* a **pipeline folder** when the run trained a diffusers pipeline folder (``model.path``): every
  component of the base folder, copied as it is, with ``transformer/`` replaced by the trained
  one. ``--merge`` folds a LoRA into the transformer's weights (``W + (alpha / r) B A``, in
  float32), so ``DiffusionPipeline.from_pretrained(DIR)`` loads it with plain diffusers, no
  peft. Without ``--merge`` a LoRA run keeps the base transformer and puts the adapter beside
  it (``pytorch_lora_weights.safetensors``, for the pipeline's ``load_lora_weights``). A full
  fine-tune always replaces the transformer.
* a **transformer folder** (``config.json`` + ``diffusion_pytorch_model.safetensors``) when the
  base is the shipped tiny model (``model.path = "builtin"`` or ``"random"``): it has no VAE or
  text encoders to make a pipeline of, and the message says so.
* ``--ema`` exports the EMA of the weights (``final/ema/``, runs with ``train.ema_decay > 0``)
  instead of the trained policy, the same way.
* ``README.md``: a model card with the base model, the algorithm and its settings, the reward
  terms, and the held-out evaluation scores at the exported version (from ``metrics.jsonl``).

Every failure a user can cause (no config, no trained weights, a base folder that is gone, an
output folder that is not empty) is an :class:`ExportError`, one line naming the path and what
to do.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from digenrl.config import Config, ConfigError, load_config

__all__ = ["ExportError", "export_run"]

WEIGHTS = "diffusion_pytorch_model.safetensors"


class ExportError(ConfigError):
    """An export that cannot be made: one line naming the path and what to do."""


def _trained_weights(run_dir: Path) -> tuple[Path, int]:
    """The policy file to export and its version: ``final/policy.safetensors``, else the newest
    checkpoint that verifies (an unsharded one: a sharded checkpoint is read by ``digenrl eval``)."""

    final = run_dir / "final" / "policy.safetensors"
    path: Path | None = final if final.is_file() else None
    if path is None:
        from digenrl.rl.checkpoint import CheckpointError, latest_checkpoint

        try:
            ckpt = latest_checkpoint(run_dir)
        except CheckpointError as e:
            raise ExportError(f"digenrl export {run_dir}: no final/ and no intact checkpoint ({e})") from None
        if ckpt is not None and (ckpt.path / "policy.safetensors").is_file():
            path = ckpt.path / "policy.safetensors"
    if path is None:
        raise ExportError(f"digenrl export {run_dir}: the run has neither final/policy.safetensors nor an "
                          "unsharded checkpoint; export a run that finished, or resume it first")
    return path, _version(path)


def _version(path: Path) -> int:
    """The policy version a run's safetensors file records; ExportError if it cannot be read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return int((f.metadata() or {}).get("version", 0))
    except (SafetensorError, OSError, ValueError) as e:
        raise ExportError(f"digenrl export: {path} is not a readable safetensors file ({e}); "
                          "the run's final/ or checkpoint is damaged") from None


def _ema_weights(run_dir: Path) -> tuple[Path, int]:
    """``final/ema/policy.safetensors`` and its version (``--ema``)."""

    path = run_dir / "final" / "ema" / "policy.safetensors"
    if not path.is_file():
        raise ExportError(f"digenrl export --ema {run_dir}: no final/ema/policy.safetensors (the run kept "
                          "no EMA, train.ema_decay = 0, or has not finished)")
    return path, _version(path)


def _eval_scores(run_dir: Path, version: int, prefix: str = "eval/") -> dict[str, float]:
    """The held-out evaluation row of ``version`` in metrics.jsonl (empty if none): its keys
    that start with ``prefix`` (``eval_ema/``: the EMA's scores)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    found: dict[str, float] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line: the rows before it still count
        if isinstance(row, dict) and row.get("policy_version") == version and any(
                k.startswith(prefix) for k in row):
            found = {k: v for k, v in row.items() if k.startswith(prefix) and isinstance(v, int | float)}
    return found


def _model_card(cfg: Config, run_dir: Path, version: int, kind: str, merged: bool,
                ema: bool = False) -> str:
    t = cfg.train
    scores = _eval_scores(run_dir, version, "eval_ema/" if ema else "eval/")
    rewards = ", ".join(f"{r.label or r.name} (weight {r.weight:g})" for r in cfg.reward.terms)
    lines = [
        "---",
        "library_name: diffusers",
        "tags: [digenrl, reinforcement-learning, flow-matching]",
        "---",
        "",
        f"# {cfg.model.family} trained with DigenRL",
        "",
        f"- base model: `{cfg.model.path}` (family `{cfg.model.family}`)",
        f"- exported: {kind}, policy version {version}"
        + (f", the EMA of the weights (decay {t.ema_decay:g})" if ema else "")
        + (" (LoRA merged into the transformer)" if merged else ""),
        f"- algorithm: `{t.algorithm}`, lr {t.lr}, "
        + (f"LoRA rank {cfg.model.lora_rank}" if cfg.model.lora_rank else "full fine-tune")
        + f", {cfg.batch_size} trajectories a step",
    ]
    if rewards:
        lines.append(f"- rewards: {rewards}")
    lines += ["", "## Held-out evaluation at this version", ""]
    if scores:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| `{k}` | {v:.4g} |" for k, v in sorted(scores.items())]
    else:
        lines.append(f"No evaluation row of version {version} in the run's metrics.jsonl.")
    lines += ["", "## The run's config", "", "```toml", (run_dir / "config.toml").read_text().rstrip(), "```", ""]
    return "\n".join(lines)


def export_run(run_dir: Path, out: Path, *, merge: bool = False, ema: bool = False) -> dict[str, Any]:
    """Write the run's trained policy as a standalone folder at ``out`` (see the module doc).
    ``ema``: the EMA of the weights (``final/ema/``, ``train.ema_decay > 0``) instead.
    Returns what was written: ``kind`` ("pipeline" or "transformer"), ``version``, ``merged``."""
    import torch
    from safetensors.torch import load_file

    from digenrl.models import build_model
    from digenrl.models.folder import is_pipeline_folder

    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.toml").is_file():
        raise ExportError(f"digenrl export {run_dir}: no config.toml in that folder (not a run directory)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"digenrl export --out {out}: exists and is not an empty folder; name a new one")
    cfg = load_config(run_dir / "config.toml")
    if cfg.model.path == "emulated":
        raise ExportError(f"digenrl export {run_dir}: the run trained an emulated model (no weights to export)")
    base = Path(cfg.model.path)
    pipeline = cfg.model.path not in ("builtin", "random")
    if pipeline and not base.exists():
        raise ExportError(f"digenrl export {run_dir}: its base model {str(base)!r} does not exist; "
                          "put the base folder back at that path (export copies its components)")
    if pipeline and not is_pipeline_folder(base):
        raise ExportError(f"digenrl export {run_dir}: its base model {str(base)!r} is not a diffusers "
                          "pipeline folder (no model_index.json)")
    path, version = _ema_weights(run_dir) if ema else _trained_weights(run_dir)

    # the trained transformer in float32, exactly as the trainer held its masters
    model = build_model(replace(cfg.model, dtype="float32"), seed=cfg.run.seed, device="cpu")
    model.load_sync_state_dict(load_file(str(path)))
    lora = bool(cfg.model.lora_rank)
    aside = out.with_name(out.name + ".tmp")
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir(parents=True)
    transformer_dir = aside / "transformer" if pipeline else aside
    if pipeline:
        for item in base.iterdir():  # every component as it is; the transformers are written below
            if item.name in ("transformer", "transformer_2", "README.md") and (merge or not lora):
                continue
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, aside / item.name)
    if lora and not merge:
        # pytorch_lora_weights.safetensors beside the base pipeline (two experts: the low-noise
        # expert's in transformer_2/, beside its base weights)
        model.save(aside)
    else:
        # one transformer, or Wan2.2's two experts (models/video.py WanExperts), each merged
        experts = getattr(model.transformer, "experts", lambda: {"transformer": model.transformer})()
        for name, transformer in experts.items():
            if lora and getattr(transformer, "peft_config", None):
                with torch.no_grad():
                    transformer.fuse_lora(lora_scale=1.0)
                transformer.unload_lora()
            target = transformer_dir if name == "transformer" else (aside / name)
            transformer.save_pretrained(target, safe_serialization=True)
    kind = "pipeline" if pipeline else "transformer"
    (aside / "README.md").write_text(_model_card(cfg, run_dir, version, kind, lora and merge, ema))
    if out.exists():  # an empty folder the user made for it
        out.rmdir()
    aside.replace(out)  # the folder appears whole
    return {"kind": kind, "version": version, "merged": lora and merge, "out": str(out),
            "from": str(path)}
