"""Checkpoint and resume: a run killed mid-step and resumed ends where an uninterrupted run ends.

Each interrupted run is a real ``digenrl launch`` process (its own session) that the
``DIGENRL_TEST_CRASH`` hook SIGKILLs, with its whole process group, in the middle of a step
with work in flight; ``digenrl launch --resume`` then continues it from the checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from digenrl.rl.checkpoint import (
    CheckpointError,
    checkpoint_root,
    commit_checkpoint,
    latest_checkpoint,
    load_trainer_state,
    save_trainer_state,
)
from digenrl.telemetry.metrics import read_metrics
from digenrl.transport.protocol import VersionAnnounce
from tests.conftest import (
    SMALL,
    bare_coordinator,
    final_weights,
    launch_command,
    launch_env,
    launch_run,
    set_args,
    shared_dir,
    wait_until,
)

SETS = [*SMALL, "run.steps=4", "run.checkpoint_every=1"]


def _fresh_args(mode: str, run_dir: Path, sets: list[str] = SETS) -> list[str]:
    return ["--mode", mode, "--run-dir", str(run_dir), *set_args(sets)]


def _interrupt_and_resume(tmp_path: Path, mode: str, crash: str, versions: tuple[int, ...],
                          sets: list[str] = SETS, killed: str = "") -> tuple[Path, dict]:
    """``killed``: the launcher survives its killed children and says so (multi-rank colocated)."""
    cut = tmp_path / f"{mode}-cut"
    r = launch_run(*_fresh_args(mode, cut, sets), crash=crash)
    if killed:
        assert r.returncode == 1 and killed in r.stderr, r.stderr[-2000:]
    else:
        assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert not (cut / "final").exists()
    assert latest_checkpoint(cut).version in versions
    r = launch_run("--resume", str(cut))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((cut / "summary.json").read_text())
    acc = summary["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
    assert acc["in_flight"] == 0
    steps = [r["step"] for r in read_metrics(cut)]  # train rows
    assert steps == [0, 1, 2, 3]
    return cut, summary


def whole_run(factory: pytest.TempPathFactory, mode: str) -> Path:
    """The uninterrupted run of :data:`SETS` in ``mode``, launched once per session: the
    reference of the k0 resume here and of the trainer kill in tests/test_faults.py."""
    def make(folder: Path) -> None:
        r = launch_run(*_fresh_args(mode, folder / "run"))
        assert r.returncode == 0, r.stderr[-3000:]

    return shared_dir(factory, f"resume-whole-{mode}", make) / "run"


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "crash"), [("disagg-sync", "commit:2"), ("colocated", "generate:2")])
def test_k0_run_killed_in_step_three_and_resumed_is_bit_identical_to_an_uninterrupted_run(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, mode: str, crash: str) -> None:
    whole = whole_run(tmp_path_factory, mode)
    cut, summary = _interrupt_and_resume(tmp_path, mode, crash, versions=(2,))
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys()
    # exact on purpose: same machine and thread count, so a resumed run must replay the same arithmetic
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert summary["accounting"]["trained"] + summary["accounting"]["discarded"].get(
        "zero_advantage", 0) == 4 * 4


EMA_SETS = [*SETS, "train.ema_decay=0.9"]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "crash"), [("disagg-sync", "commit:2"), ("colocated", "generate:2")])
def test_k0_run_with_an_ema_killed_and_resumed_ends_with_the_ema_bit_identical(
        tmp_path: Path, mode: str, crash: str) -> None:
    """The EMA a checkpoint carries (ema.safetensors) is restored exactly: the interrupted run's
    final/ema/ equals an uninterrupted run's bit for bit. Exact on purpose: same machine, same
    process kind and thread count, same inputs, so the resumed run replays the same arithmetic."""
    from safetensors.torch import load_file

    whole = tmp_path / f"{mode}-whole"
    r = launch_run(*_fresh_args(mode, whole, EMA_SETS))
    assert r.returncode == 0, r.stderr[-3000:]
    cut, _ = _interrupt_and_resume(tmp_path, mode, crash, versions=(2,), sets=EMA_SETS)
    assert "ema.safetensors" in latest_checkpoint(cut).trainer["files"]
    a, b = (load_file(d / "final" / "ema" / "policy.safetensors") for d in (whole, cut))
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)
    # and the EMA is not the policy (it averaged something)
    policy = final_weights(whole)
    assert any(not torch.equal(a[k], policy[k]) for k in a)


@pytest.mark.slow
def test_k1_run_killed_mid_step_resumes_with_exact_accounting_and_every_slot_consumed_once(
        tmp_path: Path) -> None:
    # K = 1: step 3 is generated by version 2 while step 2 trains, so the cut is at 2 or 3
    _, summary = _interrupt_and_resume(tmp_path, "digenrl", "commit:3", versions=(2, 3))
    assert summary["slots"]["consumed"] == summary["slots"]["expected"] == 4 * 2
    assert summary["resumed_from"] and summary["steps"] == 4
    hist = {int(k): v for k, v in summary["staleness_hist"].items()}
    assert max(hist) <= 1 and summary["accounting"]["discarded"].get("stale", 0) == 0


def test_fresh_launch_refuses_a_run_dir_that_holds_a_checkpoint(tmp_path: Path) -> None:
    from digenrl.config import ConfigError, load_config
    from digenrl.launch import launch

    (checkpoint_root(tmp_path)).mkdir(parents=True)
    (checkpoint_root(tmp_path) / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds a checkpoint"):
        launch(load_config(None, ["model.path=\"random\""]), tmp_path)


def _tiny_policy(seed: int = 0) -> Any:
    from digenrl.config import load_config
    from digenrl.rl.policy import build_policy
    torch.manual_seed(seed)
    cfg = load_config(None, ["model.path=\"random\"", f"run.seed={seed}"])
    return build_policy(cfg)


def test_checkpoint_round_trips_weights_optimizer_version_and_rng_exactly(tmp_path: Path) -> None:
    src = _tiny_policy()
    for p in src.params:  # one real AdamW step so the optimizer has state to restore
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    src.optimizer_step()
    save_trainer_state(tmp_path, src, {"rejected_stale": 3})
    commit_checkpoint(tmp_path, 1, {"scheduler": {}})
    rng_after_save = torch.rand(3)
    dst = _tiny_policy(seed=0)
    counters = load_trainer_state(latest_checkpoint(tmp_path), dst)
    assert counters == {"rejected_stale": 3} and dst.version == 1
    assert torch.equal(torch.rand(3), rng_after_save)  # RNG restored to the checkpoint's state
    for a, b in zip(src.params, dst.params, strict=True):
        assert torch.equal(a, b)
    sa, sb = src.optimizer.state_dict()["state"], dst.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_a_torn_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    policy = _tiny_policy()
    policy.version = 2
    save_trainer_state(tmp_path, policy, {})
    commit_checkpoint(tmp_path, 2, {"scheduler": {}})
    opt = latest_checkpoint(tmp_path).path / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"optimizer\.pt"):
        latest_checkpoint(tmp_path)


def test_a_version_without_manifest_is_never_used(tmp_path: Path) -> None:
    policy = _tiny_policy()
    policy.version = 1
    save_trainer_state(tmp_path, policy, {})
    commit_checkpoint(tmp_path, 1, {"scheduler": {}})
    policy.version = 2
    save_trainer_state(tmp_path, policy, {})  # the crash came before the coordinator's part
    assert latest_checkpoint(tmp_path).version == 1


def _two_checkpoints(tmp_path: Path) -> Any:
    policy = _tiny_policy()
    for v in (1, 2):
        policy.version = v
        save_trainer_state(tmp_path, policy, {})
        commit_checkpoint(tmp_path, v, {"scheduler": {}})
    return latest_checkpoint(tmp_path)


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-8])


def _flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x10
    p.write_bytes(bytes(b))


@pytest.mark.parametrize(("fault", "version", "why"), [
    (lambda d: _truncate(d / "optimizer.pt"), 1, r"v2: .*optimizer\.pt differs"),
    (lambda d: _flip(d / "policy.safetensors"), 1, r"v2: .*policy\.safetensors differs"),
    (lambda d: (d / "scheduler.json").unlink(), 1, r"v2: .*scheduler\.json is missing"),
    (lambda d: shutil.rmtree(d), 1, r"v2: .*is missing"),
    # the root manifest torn: v2's own manifest still names verified files
    (lambda d: _flip(d.parent / "manifest.json"), 2, "root manifest: .*not readable JSON")])
def test_resume_falls_back_to_the_newest_checkpoint_that_verifies_and_says_why(
        tmp_path: Path, fault: Any, version: int, why: str) -> None:
    # regression: with the newest checkpoint truncated, bit-flipped or missing, resume refused
    # although the older kept checkpoint was intact
    newest = _two_checkpoints(tmp_path)
    assert newest.version == 2 and newest.skipped == ()
    fault(newest.path)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.version == version
    assert len(ckpt.skipped) == 1 and re.search(why, ckpt.skipped[0]), ckpt.skipped


def test_resume_refuses_only_when_no_checkpoint_verifies_naming_each(tmp_path: Path) -> None:
    newest = _two_checkpoints(tmp_path)
    _truncate(newest.path / "optimizer.pt")
    _truncate(newest.path.parent / "v000001" / "policy.safetensors")
    with pytest.raises(CheckpointError, match=r"no checkpoint .* verifies: .*v2.*optimizer\.pt.*"
                                              r"v000001: checkpoint v1: .*policy\.safetensors"):
        latest_checkpoint(tmp_path)


def _published(run_dir: Path) -> int:
    """The newest version trainer rank 0 has logged as published (then announced)."""
    log = run_dir / "logs" / "trainer-0.log"
    text = log.read_text() if log.exists() else ""
    return max((int(json.loads(x)["version"]) for x in text.splitlines() if '"weights published"' in x),
               default=-1)


def _vote_worker(rank: int, store: str, out: str) -> None:
    """One of two gloo ranks: a step where no rank votes, then one where rank 1 votes to stop."""
    from digenrl.config import load_config
    from digenrl.rl.learner import Learner
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        learner = Learner(_tiny_policy(), load_config(None, ['model.path="random"']))
        params = learner.policy.params

        def all_reduce(t: torch.Tensor) -> None:
            torch.distributed.all_reduce(t)

        results = []
        for stop in (False, rank == 1):
            for p in params:
                p.grad = torch.full_like(p, float(rank + 1))
            took = learner.reduce_gradients(all_reduce, stop=stop)
            results.append({"took": took, "grads": sorted({float(v) for p in params for v in p.grad.unique()})})
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        torch.distributed.destroy_process_group()


def test_a_rank_told_to_stop_votes_in_the_steps_all_reduce_and_no_rank_steps(tmp_path: Path) -> None:
    """Two real gloo ranks. Rank 0 is inside the step's all-reduce; rank 1 was told to stop
    before its own. Rank 1 joins with a vote instead of leaving (which stranded rank 0:
    "Connection closed by peer", a traceback and no drain checkpoint, 1 of 5 two-rank stops
    by hand): both learn the step is off, and both keep their own gradients (no rank steps)."""
    torch.multiprocessing.spawn(_vote_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0[0] == r1[0] == {"took": True, "grads": [3.0]}  # summed: 1 + 2
    assert r0[1] == {"took": False, "grads": [1.0]} and r1[1] == {"took": False, "grads": [2.0]}


def _agree_worker(rank: int, store: str, root: str) -> None:
    """One of two gloo trainer ranks restoring from its own run dir (rank r's holds r + 1 versions)."""
    import asyncio

    import structlog

    from digenrl.actors.peers import NodePeers
    from digenrl.actors.trainer import TrainerActor
    from digenrl.config import load_config
    from digenrl.telemetry.trace import SpanRecorder
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        cfg = load_config(None, ['model.path="random"', "cluster.trainers=2"])
        run_dir = Path(root, f"rank{rank}")
        policy = _tiny_policy()
        for v in range(1, rank + 2):
            policy.version = v
            save_trainer_state(run_dir, policy, {})
            commit_checkpoint(run_dir, v, {"scheduler": {}})
        policy.version = 0
        actor = TrainerActor(peers=NodePeers(node_id=f"trainer-{rank}", incarnation=1, cfg=cfg, control=None),
                             cfg=cfg, policy=policy, rank=rank, world_size=2, run_dir=run_dir, reward_fn=None,
                             node_id=f"trainer-{rank}", recorder=SpanRecorder(f"trainer-{rank}", "trainer"),
                             log=structlog.get_logger())
        ok = asyncio.run(actor.restore())
        Path(root, f"rank{rank}.json").write_text(json.dumps(
            {"ok": ok, "version": policy.version, "reason": actor.stop_reason, "restored": actor.restored.is_set()}))
    finally:
        torch.distributed.destroy_process_group()


def test_trainer_ranks_that_verified_different_checkpoints_stop_instead_of_waiting(tmp_path: Path) -> None:
    """Seen by hand (two ranks, kill -9, resume): the coordinator re-committed the checkpoint
    it had just restored while rank 1 was verifying it; rank 1 saw it torn and restored the
    one before, then refused every commit of the run's step as out of its window, and the
    resumed run waited for good. The re-commit is gone (next test); the ranks also compare
    what they verified before loading anything, and fail the node (the coordinator rewinds)
    rather than hang. Here rank 0's newest checkpoint is version 1, rank 1's version 2."""
    torch.multiprocessing.spawn(_agree_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    for r in (0, 1):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["ok"] is False and got["version"] == 0 and not got["restored"]
        assert got["reason"].startswith("failed: trainer ranks verified different checkpoints "
                                        "(version by rank: [1, 2])"), got["reason"]


def test_a_resumed_coordinator_does_not_commit_the_checkpoint_it_restored_again(tmp_path: Path) -> None:
    sets = ["run.steps=10", "run.checkpoint_every=1"]
    policy = _tiny_policy()
    for v in (1, 2):
        policy.version = v
        save_trainer_state(tmp_path, policy, {})
        commit_checkpoint(tmp_path, v, {"scheduler": bare_coordinator(tmp_path, sets).sched.snapshot()})
    before = {p.name: p.stat().st_mtime_ns for p in checkpoint_root(tmp_path).rglob("*.json")}
    actor = bare_coordinator(tmp_path, sets)
    actor.restore_from(latest_checkpoint(tmp_path))
    announce = partial(VersionAnnounce, nparts=1, nbytes=4, checksum="c", segments=[], segment_since=[],
                       segment_parts=[], segment_sums=[])
    actor.resume.take_cut(announce(version=2, step=2), actor.sched, actor.staleness_hist)  # rank 0, restored
    assert {p.name: p.stat().st_mtime_ns for p in checkpoint_root(tmp_path).rglob("*.json")} == before
    assert actor.recovery["checkpoints"] == 0
    policy.version = 3
    save_trainer_state(tmp_path, policy, {})
    actor.resume.take_cut(announce(version=3, step=3), actor.sched, actor.staleness_hist)  # the next one is
    assert latest_checkpoint(tmp_path).version == 3 and actor.recovery["checkpoints"] == 1


def test_a_drain_keeps_no_cut_of_the_version_the_run_started_from(tmp_path: Path) -> None:
    """Version 0 (or the version a resume restored) is where the run starts: a stop before
    the first optimizer step has no boundary to keep, and must not log one as missing (a
    2-trainer launch stopped while loading said "no drain checkpoint" for version 0)."""
    actor = bare_coordinator(tmp_path, ["run.steps=10", "run.checkpoint_every=100"])
    actor.restore_from(None)
    for v, kept in ((0, None), (1, 1), (2, 2)):
        announce = VersionAnnounce(version=v, step=v, nparts=1, nbytes=4, checksum="c",
                                   segments=[], segment_since=[], segment_parts=[], segment_sums=[])
        actor.resume.take_cut(announce, actor.sched, actor.staleness_hist)
        assert (actor.resume.cut[0] if actor.resume.cut else None) == kept
    assert checkpoint_root(tmp_path).exists() is False  # none was due: only kept


DRAIN_SETS = [*SMALL, "run.steps=5", "run.checkpoint_every=100"]


@pytest.fixture
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The final weights of the drain tests' run, uninterrupted, by its settings past
    DRAIN_SETS (launched once each per session)."""
    def weights(extra: tuple[str, ...]) -> dict[str, torch.Tensor]:
        def make(folder: Path) -> None:
            r = launch_run(*_fresh_args("disagg-sync", folder / "whole", [*DRAIN_SETS, *extra]))
            assert r.returncode == 0, r.stderr[-3000:]

        name = "drain-whole-" + "-".join(extra).translate(str.maketrans('/="', "___"))
        return final_weights(shared_dir(tmp_path_factory, name, make) / "whole")
    return weights


@pytest.mark.slow
@pytest.mark.parametrize(("when", "trainers", "fsdp"), [
    ("after_publish", 1, False), ("announce_in_flight", 1, False), ("announce_in_flight", 2, False),
    ("announce_in_flight", 2, True)])
def test_a_k0_run_stopped_by_sigterm_between_checkpoints_resumes_bit_identical(
        tmp_path: Path, when: str, trainers: int, fsdp: bool, uninterrupted: Any) -> None:
    """No checkpoint is due before the end (every 100 steps): the drain writes one of the last
    step boundary (trainer rank 0's part as it leaves, the coordinator's cut of that version),
    and the resumed run ends exactly where an uninterrupted one does.

    ``after_publish``: the test sends SIGTERM once trainer rank 0 logged version 2 published
    (the coordinator is usually past that announcement, sometimes a step further).
    ``announce_in_flight``: the coordinator SIGTERMs itself as it handles the StepDone of
    version 2 (digenrl/faults.py), before rank 0's announcement of version 2 arrives; the
    coordinator stops reading, so the cut must come from the messages it reads after the
    stop (CoordinatorActor._read_late, for CoordinatorResume.drain in actors/resume.py). Without
    them no drain checkpoint is written (seen in CI as a flaky ``after_publish``). Two ranks: both finish the step in progress, and the
    resumed ranks restore before they judge work (TrainerResume.restore). Sharded (FSDP)
    ranks: the one told to stop first pads the step's passes, the ranks vote, and every rank
    writes its shard of the drain checkpoint (actors/resume.py)."""
    extra = (f"cluster.trainers={trainers}", *(["model.fsdp=true"] if fsdp else []))
    sets = [*DRAIN_SETS, *extra]
    cut = tmp_path / "cut"
    env = launch_env(sigterm="stepdone:2" if when == "announce_in_flight" else "")
    proc = subprocess.Popen(launch_command(*_fresh_args("disagg-sync", cut, sets)), env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if when == "after_publish":
            wait_until(lambda: _published(cut) >= 2, "version 2 published", 120, poll_s=0.05)
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    ckpt = latest_checkpoint(cut)
    assert ckpt is not None, out[-2000:]
    if when == "announce_in_flight":  # the stop landed between version 2's StepDone and its announcement
        assert ckpt.version == 2, out[-2000:]
    else:
        assert 2 <= ckpt.version < 5, out[-2000:]
    assert out.strip().splitlines()[-1].endswith(f"continues from its checkpoint of step {ckpt.version}")
    r = launch_run("--resume", str(cut))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["resumed_from"] == [ckpt.version] and summary["steps"] == 5
    acc = summary["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
    assert [row["step"] for row in read_metrics(cut)] == [0, 1, 2, 3, 4]
    a, b = uninterrupted(extra), final_weights(cut)
    if fsdp:
        assert ckpt.trainer["layout"] == "dcp"  # every rank wrote its shard
    assert a.keys() == b.keys()
    # exact on purpose: same machine and thread count, so a resumed run must replay the same arithmetic
    assert all(torch.equal(a[k], b[k]) for k in a)
