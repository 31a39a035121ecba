"""Checkpoints: the trainer's and the coordinator's state at one step boundary, written atomically.

Layout (one folder per checkpointed version, the newest two kept)::

    run_dir/checkpoint/manifest.json            <- written last (tmp + os.replace): names the
                                                   version and every file's size and sha256
    run_dir/checkpoint/v000004/manifest.json        the same, kept with its version: resume
                                                   falls back to an older kept checkpoint
                                                   when the newest does not verify
    run_dir/checkpoint/v000004/policy.safetensors   trainable weights (LoRA: the adapter)
                              optimizer.pt          AdamW state (torch.save, weights_only load)
                              ema.safetensors       the EMA of the weights (train.ema_decay > 0;
                                                    rl/ema.py), verified like the others
                              dcp/                  instead of those two when the trainer is
                                                    sharded (FSDP): torch.distributed.checkpoint,
                                                    one file per rank with its own shard of the
                                                    weights and optimizer state (no gather), and
                                                    the metadata that lets any rank count load it
                              trainer.json          version, torch/python RNG states, counters
                              scheduler.json        coordinator: scheduler.snapshot(), last
                                                    VersionAnnounce, staleness histogram, ...

Two processes write one checkpoint: trainer rank 0 writes its three files when it reaches a
checkpointed version (before announcing it; sharded, every rank writes its shard first and
rank 0 then lists them in ``trainer.json``), then the coordinator, on that announcement,
writes ``scheduler.json`` and the manifest. Every file is written to a temporary name and
renamed, and a reader trusts only what the manifest names with matching sizes and hashes,
so a checkpoint torn by a crash at any moment is never used: the previous one is.

The coordinator's snapshot is taken while it handles the announcement of version v. Rank
0's messages arrive in order (Consumed of step v-1, StepDone, VersionAnnounce), so the
ledger then holds exactly the steps below v as trained, and the attempts alive at that
moment become discarded "restart" on restore (their slots are regenerated; content is a
function of (seed, step), so nothing else needs saving). Multi-host runs need ``run_dir``
on storage that trainer rank 0 and the coordinator share (sharded: every trainer rank).

Nothing in a checkpoint depends on the trainer rank count, so a run resumes on another one
(``digenrl launch --resume RUN_DIR --trainers N``): the scheduler's snapshot holds no task
owners or ranks (TSP owners are a function of the step and the rank count; the attempts in
flight, wherever they were going, become "restart" discards), a committed cut has no work
of step v consumed, every rank restores rank 0's RNG states and counters, a ``dcp/``
checkpoint reshards to any rank count (one unsharded trainer reads it whole), a whole one
is read by every rank (sharded: each keeps its part), and a colocated run's per-rank
counters are summed into the new rank 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from digenrl.fileio import read_jsonl, write_atomic, write_json_atomic, write_text_atomic
from digenrl.rl.ema import EMA_FILE
from digenrl.telemetry.metrics import is_eval_row

FORMAT = 1
TRAINER_FILES = ("policy.safetensors", "optimizer.pt", "trainer.json")
ALL_FILES = (*TRAINER_FILES, "scheduler.json")
DCP_DIR = "dcp"
"""A sharded trainer's weights and optimizer state (torch.distributed.checkpoint) instead of
policy.safetensors + optimizer.pt; its files are listed in trainer.json and the manifest."""
KEEP = 2


class CheckpointError(ValueError):
    """A checkpoint on disk is missing, torn or does not match the run; the message says which."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: its version, folder and the two JSON documents."""

    version: int
    path: Path
    trainer: dict[str, Any]
    coordinator: dict[str, Any]
    skipped: tuple[str, ...] = ()
    """Newer checkpoints that did not verify, each with why (the caller reports them)."""


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoint"


def version_dir(run_dir: Path, version: int) -> Path:
    return checkpoint_root(run_dir) / f"v{version:06d}"


def why_no_checkpoint(every: int) -> str:
    """Why a run folder holds no checkpoint, for errors and the stop line (``every``: the
    run's ``run.checkpoint_every``)."""
    if every:
        return f"the run wrote none: it stopped before its first, at step {every} (run.checkpoint_every)"
    return "the run wrote none: run.checkpoint_every = 0 checkpoints only at the end"


def checkpoint_due(version: int, *, steps: int, every: int) -> bool:
    """Is ``version`` checkpointed? Every ``every`` versions (0 = never) and the last one."""
    return version > 0 and (version == steps or (every > 0 and version % every == 0))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _describe(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


# ---------------------------------------------------------------------------- trainer side

def capture_rng() -> dict[str, Any]:
    """The RNG states a checkpoint holds, as they are now (trainer.json's ``rng``)."""
    py_state = random.getstate()
    return {"torch": torch.get_rng_state().tolist(), "python": [py_state[0], list(py_state[1]), py_state[2]]}


def save_trainer_state(run_dir: Path, policy: Any, counters: dict[str, Any], *,
                       write: bool = True, rng: dict[str, Any] | None = None) -> Path:
    """Rank 0 at a step boundary: weights, optimizer state, version, RNG states, ``counters``.

    ``rng``: the states :func:`capture_rng` took at the step boundary, for a checkpoint of that
    boundary written later (a drain's: the weights and optimizer have not moved since, the RNGs
    may have); None takes them now.

    A sharded (FSDP) policy writes through torch.distributed.checkpoint: every trainer rank
    calls this and writes its own shard (a collective, nothing gathered), then the one with
    ``write`` (rank 0) writes trainer.json naming every rank's files. Experts placed over
    ranks (rl/experts.py): every rank calls this, rank 0 receives the experts it lacks and
    writes the whole layout, as one rank training both would (any rank count loads it).
    """
    from safetensors.torch import save_file

    d = version_dir(run_dir, policy.version)
    if getattr(policy, "sharded", False):
        import torch.distributed as dist

        from digenrl.rl.sharding import save_sharded

        shards = d / DCP_DIR
        if write and shards.exists():  # an earlier attempt at this version (before a rewind)
            shutil.rmtree(shards)
        dist.barrier()  # no rank writes its shard before that is gone
        save_sharded(shards, policy)
        if write:
            files = sorted(str(p.relative_to(d)) for p in shards.rglob("*") if p.is_file())
            _write_trainer_json(d, policy, counters, files, layout="dcp", rng=rng)
        return d
    if getattr(policy, "placement", None) is not None:  # experts placed over ranks: a collective
        sd = {k: v.detach().to("cpu").contiguous() for k, v in policy.whole_sync_state(keep=write).items()}
        optimizer_state = policy.whole_optimizer_state(keep=write)
    else:
        sd = {k: v.detach().to("cpu").contiguous() for k, v in policy.state_dict_for_sync().items()}
        optimizer_state = policy.optimizer_state()
    ema = getattr(policy, "ema", None)
    ema_sd = None if ema is None else ema.state_dict()
    if not write:
        return d
    d.mkdir(parents=True, exist_ok=True)
    write_atomic(d / "policy.safetensors",
                 lambda tmp: save_file(sd, str(tmp), metadata={"version": str(policy.version)}))
    write_atomic(d / "optimizer.pt", lambda tmp: torch.save(optimizer_state, tmp))
    files = ["policy.safetensors", "optimizer.pt"]
    if ema_sd is not None:
        write_atomic(d / EMA_FILE, lambda tmp: save_file(ema_sd, str(tmp), metadata={"version": str(policy.version)}))
        files.append(EMA_FILE)
    _write_trainer_json(d, policy, counters, files, layout="whole", rng=rng)
    return d


def _write_trainer_json(d: Path, policy: Any, counters: dict[str, Any], files: list[str], *,
                        layout: str, rng: dict[str, Any] | None = None) -> None:
    write_json_atomic(d / "trainer.json", {
        "format": FORMAT, "version": policy.version, "counters": counters, "layout": layout,
        "rng": capture_rng() if rng is None else rng, "files": {n: _describe(d / n) for n in files}})


def load_trainer_state(ckpt: Checkpoint, policy: Any) -> dict[str, Any]:
    """Load weights, optimizer state, EMA (if the policy keeps one), version and RNG states
    into ``policy``; returns the counters."""
    from safetensors.torch import load_file

    ema = getattr(policy, "ema", None)
    if ema is not None and EMA_FILE not in ckpt.trainer.get("files", {}):
        raise CheckpointError(f"checkpoint {ckpt.path} holds no EMA ({EMA_FILE}): it was written "
                              "with train.ema_decay = 0, this run keeps one")
    if ckpt.trainer.get("layout") == "dcp":  # any rank count reads it (a collective if sharded)
        from digenrl.rl.sharding import load_sharded
        load_sharded(ckpt.path / DCP_DIR, policy)
    else:
        policy.load_sync_state(load_file(str(ckpt.path / "policy.safetensors")))
        state = torch.load(ckpt.path / "optimizer.pt", map_location="cpu", weights_only=True)
        policy.load_optimizer_state(state)
    if ema is not None:
        ema.load_state_dict(load_file(str(ckpt.path / EMA_FILE)))
    policy.zero_grad()
    policy.version = ckpt.version
    rng = ckpt.trainer["rng"]
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    py = rng["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    return dict(ckpt.trainer.get("counters", {}))


def checkpoint_weights(folder: Path, model: Any) -> tuple[int, dict[str, torch.Tensor]] | None:
    """(version, sync state for ``model``) of a checkpoint version folder written sharded
    (``dcp/``), read whole in this process; None for any other folder. Keys the checkpoint
    does not hold (frozen buffers) keep ``model``'s values. For ``digenrl eval``."""
    if not (folder / DCP_DIR / ".metadata").is_file():
        return None
    from digenrl.rl.sharding import sync_keys_of, whole_state

    try:
        version = int(json.loads((folder / "trainer.json").read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder}/trainer.json: unreadable ({e})") from e
    state = whole_state(folder / DCP_DIR)
    sd = {k: v.detach().clone() for k, v in model.sync_state_dict().items()}
    sd.update({key: state["model"][fqn] for fqn, key in sync_keys_of(state, bool(getattr(model, "lora_rank", 0))).items()
               if key in sd})
    return version, sd


# ---------------------------------------------------------------------------- coordinator side

def trainer_part_ready(run_dir: Path, version: int) -> bool:
    """Has trainer rank 0 finished writing its files for ``version``?"""
    p = version_dir(run_dir, version) / "trainer.json"
    if not p.is_file():
        return False
    return int(json.loads(p.read_text()).get("version", -1)) == version


def commit_checkpoint(run_dir: Path, version: int, coordinator: dict[str, Any]) -> Path:
    """Write ``scheduler.json`` next to the trainer's files, then the manifest; prune old ones."""
    d = version_dir(run_dir, version)
    if not trainer_part_ready(run_dir, version):
        raise CheckpointError(f"checkpoint v{version}: {d}/trainer.json is missing or of another "
                              "version (trainer rank 0 writes it before announcing the version)")
    write_json_atomic(d / "scheduler.json", {"format": FORMAT, "version": version, **coordinator})
    trainer_files = sorted(json.loads((d / "trainer.json").read_text()).get("files", {}))
    manifest = {"format": FORMAT, "version": version, "dir": d.name,
                "files": {n: _describe(d / n) for n in [*trainer_files, "trainer.json", "scheduler.json"]}}
    write_json_atomic(d / "manifest.json", manifest)
    write_json_atomic(checkpoint_root(run_dir) / "manifest.json", manifest)
    _prune(run_dir, keep_from=version)
    return d


def _prune(run_dir: Path, keep_from: int) -> None:
    """Remove all but the newest KEEP committed versions (never the one just committed)."""
    dirs = sorted(p for p in checkpoint_root(run_dir).glob("v[0-9]*") if p.is_dir())
    older = [p for p in dirs if int(p.name[1:]) < keep_from]
    for p in older[:max(0, len(older) - (KEEP - 1))]:
        shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(run_dir: Path, *, verify: bool = True) -> Checkpoint | None:
    """The newest checkpoint that verifies file by file; None if there is no manifest at all.

    Candidates, newest first: the version the root manifest names, then every kept version
    folder with its own manifest. One whose manifest is unreadable, or whose files are
    missing or differ in size or sha256 (torn, truncated, bit-flipped) is skipped; the
    result's ``skipped`` says which and why. Raises :class:`CheckpointError` naming every
    candidate and its fault only when none verifies (a torn checkpoint is never loaded).
    """
    root = checkpoint_root(run_dir)
    candidates: list[tuple[int, str, Path]] = []  # (version, name, manifest path)
    mpath = root / "manifest.json"
    if mpath.is_file():
        candidates.append((1 << 62, "the root manifest", mpath))  # tried first: the commit point
    for d in root.glob("v[0-9]*"):
        if (d / "manifest.json").is_file() and d.name[1:].isdigit():
            candidates.append((int(d.name[1:]), d.name, d / "manifest.json"))
    if not candidates:
        return None
    skipped: list[str] = []
    tried: set[str] = set()
    for _, name, path in sorted(candidates, reverse=True):
        try:
            manifest = _read_manifest(path)
            if str(manifest["dir"]) in tried:
                continue
            tried.add(str(manifest["dir"]))
            ckpt = _verified(root, manifest, verify)
        except CheckpointError as e:
            skipped.append(f"{name}: {e}")
            continue
        return dataclasses.replace(ckpt, skipped=tuple(skipped))
    raise CheckpointError(f"no checkpoint in {root} verifies: " + "; ".join(skipped))


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{path}: format = {got!r:.40}: expected {FORMAT}")
    dname, files = manifest.get("dir"), manifest.get("files")
    whole = isinstance(files, dict) and set(files) - {EMA_FILE} == set(ALL_FILES)
    sharded = isinstance(files, dict) and {"trainer.json", "scheduler.json"} <= set(files) and \
        f"{DCP_DIR}/.metadata" in files and all(n.startswith(f"{DCP_DIR}/") or n.endswith(".json") for n in files)
    if (not isinstance(dname, str) or not dname.startswith("v") or not dname[1:].isdigit()
            or not (whole or sharded) or not isinstance(manifest.get("version"), int)):
        raise CheckpointError(f"{path}: not a checkpoint manifest (dir, version and the files "
                              f"{', '.join(ALL_FILES)}, or {DCP_DIR}/ instead of the first two, expected)")
    return manifest


def _verified(root: Path, manifest: dict[str, Any], verify: bool) -> Checkpoint:
    d = root / str(manifest["dir"])
    for name, want in manifest["files"].items():
        p = d / name
        if not p.is_file():
            raise CheckpointError(f"checkpoint v{manifest['version']}: {p} is missing")
        if (not isinstance(want, dict) or p.stat().st_size != want.get("bytes")
                or (verify and _sha256(p) != want.get("sha256"))):
            raise CheckpointError(f"checkpoint v{manifest['version']}: {p} differs from the "
                                  "manifest (size or sha256): torn or modified")
    try:
        trainer = json.loads((d / "trainer.json").read_text())
        coordinator = json.loads((d / "scheduler.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {d}: {e}") from e
    version = int(manifest["version"])
    if trainer.get("version") != version or coordinator.get("version") != version:
        raise CheckpointError(f"checkpoint {d}: trainer.json version {trainer.get('version')}, "
                              f"scheduler.json version {coordinator.get('version')}: expected {version}")
    return Checkpoint(version=version, path=d, trainer=trainer, coordinator=coordinator)


def trim_metrics(run_dir: Path, below_step: int) -> None:
    """Keep metrics.jsonl rows of steps < ``below_step`` (those after the checkpoint are redone)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    keep = [line for line, row in read_jsonl(path)[0] if row.get("step", -1) < below_step]
    write_text_atomic(path, "".join(line + "\n" for line in keep))


def dedupe_metrics(run_dir: Path) -> None:
    """One row per step (and one evaluation row per version), the last one written (steps
    redone after a trainer restart); an evaluation of version v sorts before step v's row."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    rows: dict[tuple[int, int], str] = {}
    for line, row in read_jsonl(path)[0]:
        is_eval = is_eval_row(row)
        rows[(int(row.get("step", -1)), 0 if is_eval else 1)] = line
    write_text_atomic(path, "".join(rows[k] + "\n" for k in sorted(rows)))


# ---------------------------------------------------------------------------- colocated loop

def colocated_resume(run_dir: Path, policy: Any, rank: int) -> tuple[int, int, dict[str, int]]:
    """Load the checkpoint into ``policy`` (every rank); returns (first step, trained, discarded)
    this rank carries on from. The run's totals are sums over ranks, so rank 0 carries every
    saved rank's counts and the others none: right for any rank count, also another one
    than the checkpoint's. CheckpointError if there is none."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"resume {run_dir}: no checkpoint/manifest.json there")
    load_trainer_state(ckpt, policy)
    if rank != 0:
        return ckpt.version, 0, {}
    trim_metrics(run_dir, below_step=ckpt.version)
    trained, discarded = 0, Counter[str]()
    for n, d in ckpt.coordinator["colocated"]["ranks"]:
        trained += int(n)
        discarded.update({str(k): int(v) for k, v in d.items()})
    return ckpt.version, trained, dict(discarded)


def colocated_checkpoint(run_dir: Path, policy: Any, *, rank: int, world_size: int,
                         trained: int, discarded: dict[str, int], steps: int, every: int) -> None:
    """At a due step boundary: rank 0 writes the whole checkpoint; every rank's counters go in."""
    if not checkpoint_due(policy.version, steps=steps, every=every):
        return
    ranks: list[Any] = [(trained, discarded)]
    if world_size > 1:
        import torch.distributed as dist
        ranks = [None] * world_size
        dist.all_gather_object(ranks, (trained, discarded))
    if rank == 0 or getattr(policy, "sharded", False):  # sharded: a gather every rank joins
        save_trainer_state(run_dir, policy, {}, write=rank == 0)
    if rank == 0:
        commit_checkpoint(run_dir, policy.version, {"colocated": {"ranks": [list(r) for r in ranks]}})
