"""``digenrl launch``: run a whole job on this machine and leave a complete run dir.

colocated: the SPMD loop in this process (or one process per rank, gloo).
disagg-sync / digenrl: the coordinator runs in this process; rollout and trainer nodes are
child processes on loopback, supervised (a crashed rollout is restarted; a crashed trainer
stops the run with a clear error unless a checkpoint allows resuming).

Run dir: config.toml, metrics.jsonl, summary.json, trace/<node>.jsonl, trace.json,
samples/step_<n>.png, logs/<node>.log.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from digenrl.config import Config, ConfigError, ResolvedConfig, load_config, to_toml
from digenrl.fileio import write_json_atomic, write_text_atomic
from digenrl.transport.endpoints import free_port

if TYPE_CHECKING:
    from digenrl.actors.colocated import ColocatedResult


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """What ``digenrl launch`` was asked besides the config (digenrl/cli.py builds it from the
    flags, with the resolved config)."""

    run_dir: str | None = None
    """--run-dir: the output folder; None = runs/<mode>-<time>."""
    resume: str | None = None
    """--resume RUN_DIR: continue that run from its checkpoint (the config is its config.toml)."""
    record: bool = False
    """--record: with --rollout-only, record the fragments for --trainer-only."""
    rollout_only: bool = False
    """--rollout-only: run rollouts alone (no training, weights stay at version 0)."""
    trainer_only: str | None = None
    """--trainer-only RECORDING: run trainers alone, fed from a recording."""


def _check_prompts(cfg: Config) -> None:
    """Read the prompt files now: a bad one is a config error before any process starts."""
    from digenrl.data.prompts import check_edit_prompts, load_splits
    train, test = load_splits(cfg.prompts)
    check_edit_prompts(cfg, train, test)


def make_run_dir(cfg: Config, run_dir: str | None) -> Path:
    """Create the run folder and write its config.toml; ConfigError if it cannot be written."""
    path = Path(run_dir) if run_dir else Path("runs") / f"{cfg.run.mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        for sub in ("trace", "samples", "logs"):
            (path / sub).mkdir(exist_ok=True)
        write_text_atomic(path / "config.toml", to_toml(cfg))
    except OSError as e:
        raise ConfigError(f"--run-dir {str(path)!r}: cannot write there ({e.strerror or e})") from None
    return path


def prepare_resume(cfg: ResolvedConfig, resume: str) -> Path:
    """Check that the run in folder ``resume`` can continue as ``cfg`` (its config.toml with
    --steps / --rollouts / --set applied, resolved by digenrl/cli.py) and record ``cfg`` there;
    returns the run dir. Refuses (ConfigError) what a resume cannot honour, before anything
    starts."""
    from digenrl.rl.checkpoint import latest_checkpoint, why_no_checkpoint
    run_dir = Path(resume)
    saved = load_config(run_dir / "config.toml")
    ckpt = latest_checkpoint(run_dir)  # CheckpointError (runtime) if none verifies
    if ckpt is None:
        raise ConfigError(f"--resume {resume}: no checkpoint there "
                          f"({why_no_checkpoint(saved.run.checkpoint_every)})")
    for why in ckpt.skipped:
        print(f"digenrl: skipped a checkpoint that does not verify: {why}", file=sys.stderr, flush=True)
    was_colocated = "colocated" in ckpt.coordinator
    if was_colocated != (cfg.run.mode == "colocated"):
        raise ConfigError(f"--resume {resume}: its checkpoint is of a "
                          f"{'colocated' if was_colocated else 'disaggregated'} run; it cannot "
                          f"resume in {cfg.run.mode} mode")
    if not was_colocated:
        shape = list(ckpt.coordinator["scheduler"]["ledger"]["shape"])[1:]
        want = [cfg.train.prompts_per_step, cfg.train.group_size, cfg.runtime.fragments_per_step]
        if shape != want:
            raise ConfigError(f"--resume {resume}: its checkpoint has (prompts_per_step, "
                              f"group_size, fragments_per_step) = {shape}; the config now says {want}")
    if cfg.run.steps < ckpt.version:
        raise ConfigError(f"--resume {resume}: run.steps = {cfg.run.steps} but the checkpoint "
                          f"is at step {ckpt.version} already")
    if cfg.cluster.trainers != saved.cluster.trainers:
        check_trainer_count(cfg, f"--resume {resume}: ")
        print(f"digenrl: resuming with {cfg.cluster.trainers} trainer rank(s) (the run had "
              f"{saved.cluster.trainers}); {_reshard_how(ckpt.trainer.get('layout'), cfg)}",
              flush=True)
    _check_prompts(cfg)
    from digenrl.telemetry.metrics import repair_metrics
    dropped = repair_metrics(run_dir)  # DamagedFile if the damage is not a torn last line
    if dropped is not None:
        print(f"digenrl: warning: {dropped}", file=sys.stderr, flush=True)
    if cfg != saved:  # --steps / --rollouts / --trainers / --set: the run dir records what now runs
        write_text_atomic(run_dir / "config.toml", to_toml(cfg))
    return run_dir


def _reshard_how(layout: object, cfg: Config) -> str:
    """How the checkpoint reaches the new trainer ranks (for the resume's one-line notice)."""
    sharded = cfg.model.fsdp and cfg.cluster.trainers > 1
    if layout == "dcp":
        return ("each rank reads its part of the sharded checkpoint (torch.distributed.checkpoint "
                "reshards it)" if sharded else "the sharded checkpoint is read whole")
    return ("every rank reads the whole checkpoint and keeps its shard" if sharded
            else "every rank reads the whole checkpoint")


def check_trainer_count(cfg: Config, where: str = "") -> None:
    """Refuse (ConfigError) a trainer rank count the run's config cannot train with."""
    n, P = cfg.cluster.trainers, cfg.train.prompts_per_step
    if cfg.run.mode == "colocated" and P % n:
        raise ConfigError(f"{where}cluster.trainers = {n}: colocated ranks split "
                          f"train.prompts_per_step = {P} evenly; use a divisor of it")
    sp = cfg.train.sequence_parallel
    if n % sp:
        raise ConfigError(f"{where}cluster.trainers = {n}: train.sequence_parallel = {sp} lays the "
                          f"trainer ranks out in groups of {sp}; expected a multiple of {sp}")


def _child_env(cfg: Config, index: int = 0) -> dict[str, str]:
    from digenrl.devices import child_gpu_env

    env = dict(os.environ, **child_gpu_env(index))
    env["OMP_NUM_THREADS"] = str(cfg.run.threads)
    env["MKL_NUM_THREADS"] = str(cfg.run.threads)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_colocated_ranks(cfg: ResolvedConfig, run_dir: Path, resume: bool = False) -> ColocatedResult:
    """One process per rank (world > 1) or this process (world 1)."""
    from digenrl.actors.colocated import run_colocated
    from digenrl.telemetry.progress import Progress

    world = cfg.cluster.trainers
    if world == 1:
        return run_colocated(cfg, run_dir, progress=Progress(cfg.run.steps), resume=resume)
    from digenrl.actors.colocated import SUMMARY

    summary = run_dir / SUMMARY
    summary.unlink(missing_ok=True)  # an earlier launch's (a resume): only this one's says done
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for rank in range(world):
        log = open(run_dir / "logs" / f"colocated-{rank}.stderr", "wb")  # noqa: SIM115 - child owns it
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "digenrl.actors.colocated", str(run_dir), str(rank), str(world), init,
             *(["resume"] if resume else [])],
            env=_child_env(cfg, rank), stdout=log if rank else None, stderr=log))
    codes = [p.wait() for p in procs]
    return colocated_outcome(codes, summary, run_dir)


def colocated_outcome(codes: list[int], summary: Path, run_dir: Path) -> ColocatedResult:
    """The result of a multi-rank colocated launch from its ranks' exit codes and the summary
    rank 0 writes once every rank has finished its run (weights, checkpoints and totals saved)
    and before they tear their process group down. A rank that fails after that (gloo can
    abort a process in its teardown: "terminate called without an active exception", seen
    rarely in the suite's two-rank colocated run) lost nothing:
    the run completed, and a warning names the ranks. Any other failure is the run's."""
    from digenrl.actors.base import RunFailed

    if not summary.exists():
        raise RunFailed(f"colocated ranks exited with codes {codes}; see {run_dir}/logs")
    if any(codes):
        failed = ", ".join(f"rank {r} ({c})" for r, c in enumerate(codes) if c)
        print(f"digenrl: the run completed, but {failed} exited abnormally in the teardown "
              f"after it; see {run_dir}/logs", file=sys.stderr, flush=True)
    result: ColocatedResult = json.loads(summary.read_text())
    return result


def check_runtime_support(cfg: Config) -> None:
    """Refuse, before any process starts, what the runtime cannot do."""
    check_trainer_count(cfg)
    g = cfg.cluster.rollout_gpus
    if g > 1 and cfg.cluster.rollouts and cfg.run.mode != "colocated":
        from digenrl.devices import child_gpu_envs
        try:  # the launcher hands each rollout node g GPUs of its own (actors/cluster.py)
            child_gpu_envs([g])
        except ConfigError as e:
            raise ConfigError(f"cluster.rollout_gpus = {g}: {e}") from None
    if cfg.cluster.rewards and cfg.run.mode == "colocated":
        raise ConfigError(f"cluster.rewards = {cfg.cluster.rewards}: reward workers serve rollout "
                          "nodes; colocated mode has none (use digenrl or disagg-sync, or 0)")
    if cfg.model.fsdp and _two_experts(cfg):
        check_sharded_experts(cfg)
    if cfg.model.fsdp and cfg.runtime.tag == "always" and cfg.run.mode != "colocated":
        raise ConfigError("model.fsdp = true with runtime.tag = 'always': a sharded trainer rank "
                          "cannot generate alone (its passes are collectives over all ranks); "
                          "use runtime.tag = 'bts' or 'never'")


def check_before_start(cfg: Config) -> None:
    """What a node would refuse when it starts, refused here, before any process starts (a
    child that refused its configuration would only be restarted to refuse it again): the
    runtime's limits, the model folder (family, completeness, size; config files only), the
    memory a step's buffers and the freed text encoders' table take
    (:mod:`digenrl.models.footprint`) and the reward terms (names, plug-in imports, args;
    nothing is built)."""
    from digenrl.models import check_model_path
    from digenrl.models.meta import latent_shape_of
    from digenrl.rl.evaluate import eval_terms
    from digenrl.rl.rewards import RewardError, check_reward

    check_runtime_support(cfg)
    check_model_path(cfg.model)
    check_sequence_parallel(cfg)
    shape = latent_shape_of(cfg.model)
    from digenrl.models.footprint import check_footprint
    test = None
    if cfg.run.eval_every:
        from digenrl.data.prompts import load_splits
        test = load_splits(cfg.prompts)[1]
    check_footprint(cfg, shape, test_prompts=len(test) if test is not None else 0)
    if cfg.model.free_text_encoders:  # the table the nodes will build, where its size is known
        from digenrl.data.prompts import load_splits
        from digenrl.models.footprint import check_text_table
        train, test_set = load_splits(cfg.prompts)
        check_text_table(cfg, len({*train.prompts, *(test_set.prompts if test_set is not None else []), ""}))
    try:
        check_reward(cfg.reward.terms)
    except RewardError as e:
        raise ConfigError(str(e)) from None
    if cfg.run.eval_every and cfg.eval.terms:  # what the trainer's rank 0 builds to evaluate
        try:
            check_reward(eval_terms(cfg))
        except RewardError as e:
            raise ConfigError(f"eval.terms: {e}") from None
    check_expert_timesteps(cfg)
    if cfg.run.eval_every:
        from digenrl.rl.diversity import check_diversity
        try:
            check_diversity(cfg)
        except RewardError as e:
            raise ConfigError(str(e)) from None
    from digenrl.telemetry.tracking import check_trackers
    try:
        check_trackers(cfg.tracking)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_sequence_parallel(cfg: Config) -> None:
    """Refuse a ``train.sequence_parallel`` or ``cluster.rollout_gpus`` the model cannot run: a
    family without a sequence-parallel forward, attention heads or image/video tokens the
    degree does not divide (the folder's config files; nothing is loaded)."""
    from digenrl.models.meta import check_sequence_parallel_degree

    if cfg.cluster.rollout_gpus > 1 and cfg.cluster.rollouts:
        check_sequence_parallel_degree(cfg.model, cfg.cluster.rollout_gpus, "cluster.rollout_gpus")
    if cfg.train.sequence_parallel > 1:
        check_sequence_parallel_degree(cfg.model, cfg.train.sequence_parallel, "train.sequence_parallel")


def _two_experts(cfg: Config) -> bool:
    from digenrl.models.folder import PipelineFolder, is_pipeline_folder
    path = Path(cfg.model.path)
    return is_pipeline_folder(path) and PipelineFolder(path).entry("transformer_2") is not None


def check_sharded_experts(cfg: Config) -> None:
    """``model.fsdp`` with two experts shards each expert over the trainer ranks that hold it
    (rl/experts.py), so a rank may hold only one: its passes pair with that expert's other
    holders only. Refused where a rank would hold both, naming it and why."""
    from digenrl.rl.experts import placement_for

    ranks = cfg.cluster.trainers
    placement = placement_for(cfg, ranks)
    if placement is None or ranks < 2:
        return
    both = [r for r in range(ranks) if len(placement.held[r]) > 1]
    if not both:
        return
    r = both[0]
    if cfg.run.mode == "colocated":
        why = "colocated ranks generate whole trajectories"
    elif cfg.runtime.tag == "always":
        why = "runtime.tag = 'always' has every rank generate whole trajectories"
    elif cfg.train.ema_decay > 0:
        why = "an EMA is kept whole on every rank"
    elif cfg.train.algorithm != "grpo":
        why = f"train.algorithm = {cfg.train.algorithm!r} draws noise levels over both experts' range"
    elif r == 0 and cfg.run.eval_every > 0:
        why = "rank 0 evaluates (run.eval_every > 0), denoising whole trajectories"
    else:
        why = "the step indices TSP gives it fall on both sides of the boundary"
    raise ConfigError(f"model.fsdp = true with {cfg.model.path}: trainer rank {r} of {ranks} would hold both "
                      f"experts ({why}); FSDP shards each expert over the ranks that hold only it: "
                      "change that, or train unsharded (model.fsdp = false)")


def check_expert_timesteps(cfg: Config) -> None:
    """A two-expert folder trained on one expert (``model.train_experts``): every step index the
    run may train must be one that expert denoises (the other's weights are frozen, so its steps
    would train nothing). Refused before any process starts, naming the indices that fit."""
    from digenrl.models.folder import PipelineFolder, is_pipeline_folder
    from digenrl.rl.sde import sigma_schedule

    if cfg.model.train_experts == "both" or not is_pipeline_folder(Path(cfg.model.path)):
        return
    ratio = PipelineFolder(Path(cfg.model.path)).index.get("boundary_ratio")
    if not isinstance(ratio, (int, float)):
        return  # a one-expert folder: check_model_path refuses train_experts there
    sc, tc = cfg.sampler, cfg.train
    if tc.algorithm != "grpo":  # nft / awm train at noise levels drawn over the whole range
        raise ConfigError(f"model.train_experts = {cfg.model.train_experts!r} with train.algorithm = "
                          f"{tc.algorithm!r}: its noise levels span both experts; train both ('both') "
                          "or use grpo with a window inside one expert's steps")
    sigmas = sigma_schedule(sc.num_steps, sc.shift).tolist()[:-1]
    high = [i for i, s in enumerate(sigmas) if s * 1000 >= ratio * 1000]
    ours = high if cfg.model.train_experts == "high" else [i for i in range(sc.num_steps) if i not in high]
    if tc.timesteps in ("window", "mix"):
        may = set(range(tc.window_lo, tc.window_hi or max(sc.num_steps // 2, 1)))
    else:
        may = set(range(sc.num_steps))
    if not may <= set(ours):
        span = f"{ours[0]}..{ours[-1]}" if ours else "none"
        raise ConfigError(
            f"model.train_experts = {cfg.model.train_experts!r}: train.timesteps = {tc.timesteps!r} may "
            f"train step indices {sorted(may - set(ours))}, which the other expert denoises (boundary_ratio "
            f"{ratio}, {sc.num_steps} steps, shift {sc.shift}); this expert's indices are {span}: use "
            "train.timesteps = 'window' with train.window_lo / window_hi inside them")


def launch(cfg: ResolvedConfig, run_dir: Path, *, resume: bool = False) -> dict[str, Any]:
    """Run ``cfg`` to the end; returns (and writes) summary.json.

    ``resume`` continues from ``run_dir``'s checkpoint (:mod:`digenrl.rl.checkpoint`); without
    it a run dir that already holds a checkpoint is refused, so that no trainer loads it.
    """
    from digenrl.rl.checkpoint import CheckpointError, checkpoint_root, latest_checkpoint
    from digenrl.telemetry.trace import merge_traces

    check_before_start(cfg)

    if not resume and (checkpoint_root(run_dir) / "manifest.json").exists():
        raise ConfigError(f"run dir {run_dir} holds a checkpoint: continue it with "
                          "`digenrl launch --resume` or choose another --run-dir")
    if resume and latest_checkpoint(run_dir) is None:
        raise CheckpointError(f"--resume {run_dir}: no checkpoint/manifest.json there")
    t0 = time.perf_counter()
    if cfg.run.mode == "colocated":
        result = run_colocated_ranks(cfg, run_dir, resume)
        b = cfg.batch_size * cfg.run.steps
        summary = {
            "mode": "colocated", "steps": cfg.run.steps, "wall_s": time.perf_counter() - t0,
            "samples_per_s": result["samples_per_s"],
            "accounting": {"admitted": b, "trained": int(result["trained"]),
                           "discarded": result.get("discarded", {}), "in_flight": 0},
            "staleness_hist": {"0": int(result["trained"])},
            "busy": {f"colocated-{r}": result.get("busy", 1.0) for r in range(cfg.cluster.trainers)},
        }
        write_json_atomic(run_dir / "summary.json", summary)
    else:
        from digenrl.actors.cluster import run_local_cluster
        summary = run_local_cluster(cfg, run_dir, resume=resume)
    merge_traces(run_dir)
    return summary


def evaluate_run(run_dir: Path, checkpoint: str | None = None, overrides: list[str] | None = None,
                 out_dir: Path | None = None) -> dict[str, Any]:
    """``digenrl eval``: held-out evaluation of a saved policy of ``run_dir`` (its config.toml).

    ``checkpoint``: None = ``run_dir/final/policy.safetensors``; ``"base"`` = the base model
    (version 0); a ``.safetensors`` file or a folder holding ``policy.safetensors`` (``final/``,
    ``checkpoint/v<N>/``), or a sharded run's ``checkpoint/v<N>/`` (``dcp/``, read whole here). Writes ``eval/v<version>.jsonl`` and ``samples/eval_v<version>.png``
    under ``out_dir`` (default ``run_dir``); returns the ``eval/`` metrics plus the version.
    """
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    from digenrl.data.prompts import load_splits
    from digenrl.models import build_model
    from digenrl.rl.evaluate import build_eval_reward, evaluate

    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"digenrl eval {run_dir}: no config.toml in that folder")
    cfg = load_config(run_dir / "config.toml", overrides or [])
    import torch
    torch.set_num_threads(cfg.run.threads)
    test = load_splits(cfg.prompts)[1]
    if test is None:
        raise ConfigError(f"digenrl eval {run_dir}: the run has no test split; pass "
                          "--set prompts.test_file=... or --set prompts.test_fraction=...")
    from digenrl.devices import resolve_device, use_device

    device = resolve_device()  # this process's GPU when there is one (CUDA_VISIBLE_DEVICES, LOCAL_RANK)
    use_device(device)
    model = build_model(cfg.model, seed=cfg.run.seed, device=device,
                        embedded_guidance=cfg.sampler.embedded_guidance)
    version = 0
    sharded = None
    if checkpoint not in (None, "base"):  # a checkpoint version folder written sharded (dcp/)?
        from digenrl.rl.checkpoint import checkpoint_weights
        sharded = checkpoint_weights(Path(checkpoint), model)
    if sharded is not None:
        version, sd = sharded
        model.load_sync_state_dict(sd)
    elif checkpoint != "base":
        path = Path(checkpoint) if checkpoint else run_dir / "final" / "policy.safetensors"
        if path.is_dir():
            path = path / "policy.safetensors"
        if not path.is_file():
            raise ConfigError(f"digenrl eval: {str(path)!r} does not exist (expected a "
                              "policy.safetensors written by a run, its folder, or 'base')")
        try:
            with safe_open(str(path), framework="pt") as f:
                version = int((f.metadata() or {}).get("version", 0))
            weights = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            from digenrl.rl.checkpoint import CheckpointError
            raise CheckpointError(f"digenrl eval: {path}: truncated or not safetensors ({e}); "
                                  "evaluate another one (--checkpoint checkpoint/v<N>) or 'base'") from None
        model.load_sync_state_dict(weights)
    row = evaluate(model, cfg, test, build_eval_reward(cfg, device), version=version,
                   run_dir=out_dir or run_dir)
    return {"policy_version": version, **row}


def run_launch(cfg: ResolvedConfig, opts: LaunchOptions) -> int:
    """``digenrl launch``: ``cfg`` (resolved by digenrl/cli.py) run to the end as ``opts``
    asks; the exit code, after one line saying how the run ended."""
    from digenrl.telemetry.logging import configure_logging

    if opts.resume:
        run_dir = prepare_resume(cfg, opts.resume)
    else:
        _check_prompts(cfg)
        run_dir = make_run_dir(cfg, opts.run_dir)
    configure_logging(log_file=run_dir / "logs" / "launcher.log")
    if opts.rollout_only or opts.trainer_only:
        from digenrl.actors import roles_alone
        if opts.trainer_only:
            res = roles_alone.trainer_only(cfg, Path(opts.trainer_only))
        else:
            rec = run_dir / "recording.pt" if opts.record else None
            res = roles_alone.rollout_only(cfg, cfg.run.steps, record=rec)
        write_json_atomic(run_dir / "roles_alone.json", res)
        print(f"digenrl: {'trainer' if opts.trainer_only else 'rollout'} alone: "
              f"{res['samples_per_s']:.2f} samples/s, step times "
              f"{', '.join(f'{t:.2f}' for t in res['step_seconds'])} s", flush=True)
        return 0
    print(f"digenrl: mode={cfg.run.mode} steps={cfg.run.steps} B={cfg.batch_size} "
          f"rollouts={cfg.cluster.rollouts} trainers={cfg.cluster.trainers} run_dir={run_dir}",
          flush=True)
    summary = launch(cfg, run_dir, resume=bool(opts.resume))
    # the run is over and the process exits next: without this its exit would walk every object
    # torch left (~0.6 s on a 2-core CPU; docs/benchmarks.md, Start-up), as a node's would
    gc.freeze()
    reason = summary.get("stop_reason", "done")  # a colocated run has none: it ran to its end
    if reason != "done":  # SIGTERM, Ctrl-C: the coordinator drained the nodes, wrote summary.json
        from digenrl.rl.checkpoint import latest_checkpoint, why_no_checkpoint
        ckpt = latest_checkpoint(run_dir)
        then = (f"`digenrl launch --resume {run_dir}` continues from its checkpoint of step "
                f"{ckpt.version}" if ckpt is not None else
                f"no checkpoint to resume from ({why_no_checkpoint(cfg.run.checkpoint_every)})")
        print(f"digenrl: stopped ({reason}) after {summary['steps']} of {cfg.run.steps} steps; "
              f"see {run_dir}/summary.json; {then}", flush=True)
        sig = getattr(signal.Signals, reason, None)
        return 128 + sig if sig is not None else 1  # as a shell reports a process the signal ended
    acc = summary["accounting"]
    print(f"digenrl: done in {summary['wall_s']:.1f}s, {summary['samples_per_s']:.2f} samples/s, "
          f"trained {acc['trained']} of {acc['admitted']} admitted "
          f"(discarded {sum(acc['discarded'].values()) if acc['discarded'] else 0}); "
          f"see {run_dir}/summary.json, `digenrl report {run_dir}`", flush=True)
    return 0
