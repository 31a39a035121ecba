"""Checkpoint and resume: a run killed mid-step and resumed ends where an uninterrupted run ends.

Each interrupted run is a real ``digenrl launch`` process (its own session) that the
``DIGENRL_TEST_CRASH`` hook SIGKILLs, with its whole process group, in the middle of a step
with work in flight; ``digenrl launch --resume`` then continues it from the checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from digenrl.checkpoint import (
    CheckpointError,
    checkpoint_root,
    commit_checkpoint,
    latest_checkpoint,
    load_trainer_state,
    save_trainer_state,
)

SETS = ["run.steps=4", "run.checkpoint_every=1", "model.path=\"random\"", "train.prompts_per_step=2",
        "train.group_size=2", "runtime.fragments_per_step=2", "sampler.num_steps=4"]


def _launch(*args: str, crash: str = "") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DIGENRL_TEST_CRASH", None)
    if crash:
        env["DIGENRL_TEST_CRASH"] = crash
    cmd = [sys.executable, "-m", "digenrl.cli", "launch", *args]
    # a session of its own: the crash hook kills the launcher's whole process group
    return subprocess.run(cmd, env=env, start_new_session=True, capture_output=True, text=True,
                          timeout=300, check=False)


def _fresh_args(mode: str, run_dir: Path) -> list[str]:
    return ["--mode", mode, "--run-dir", str(run_dir), *[a for s in SETS for a in ("--set", s)]]


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(run_dir / "final" / "policy.safetensors")


def _interrupt_and_resume(tmp_path: Path, mode: str, crash: str) -> tuple[Path, dict]:
    cut = tmp_path / f"{mode}-cut"
    r = _launch(*_fresh_args(mode, cut), crash=crash)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert not (cut / "final").exists()
    assert latest_checkpoint(cut).version == int(crash.split(":")[1])
    r = _launch("--resume", str(cut))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((cut / "summary.json").read_text())
    acc = summary["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
    assert acc["in_flight"] == 0
    steps = [json.loads(x)["step"] for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
    return cut, summary


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "crash"), [("disagg-sync", "commit:2"), ("colocated", "generate:2")])
def test_k0_run_killed_in_step_three_and_resumed_is_bit_identical_to_an_uninterrupted_run(
        tmp_path: Path, mode: str, crash: str) -> None:
    whole = tmp_path / f"{mode}-whole"
    r = _launch(*_fresh_args(mode, whole))
    assert r.returncode == 0, r.stderr[-3000:]
    cut, summary = _interrupt_and_resume(tmp_path, mode, crash)
    a, b = _final(whole), _final(cut)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert summary["accounting"]["trained"] + summary["accounting"]["discarded"].get(
        "zero_advantage", 0) == 4 * 4


@pytest.mark.slow
def test_k1_run_killed_mid_step_resumes_with_exact_accounting_and_every_slot_consumed_once(
        tmp_path: Path) -> None:
    _, summary = _interrupt_and_resume(tmp_path, "digenrl", "commit:3")
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
    from digenrl.colocated import build_policy
    from digenrl.config import load_config
    torch.manual_seed(seed)
    cfg = load_config(None, ["model.path=\"random\"", f"run.seed={seed}"])
    return build_policy(cfg)


def test_checkpoint_round_trips_weights_optimizer_version_and_rng_exactly(tmp_path: Path) -> None:
    torch.set_num_threads(1)
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
