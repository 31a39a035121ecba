"""Node failures in a live run: kill -9 a trainer or a rollout; the run completes, accounting exact.

The trainer kill is deterministic (the ``DIGENRL_TEST_CRASH=trainer:N`` hook SIGKILLs the
trainer once, as it starts training its first fragment of step N); the rollout kill is a
real ``kill -9`` of the pid the launcher lists in ``logs/pids.json`` once training runs.
bench/faults.py repeats the latter at random moments over many runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from digenrl.actors.cluster import Children
from digenrl.config import load_config
from digenrl.telemetry.metrics import read_metrics
from tests.conftest import SMALL, final_weights, launch_command, launch_env, wait_until
from tests.test_resume import SETS as RESUME_SETS
from tests.test_resume import whole_run

pytestmark = pytest.mark.slow

SETS = [*SMALL, "run.checkpoint_every=1", "runtime.heartbeat_s=0.25"]


def _start(run_dir: Path, mode: str, steps: int, rollouts: int, crash: str = "", hang: str = "",
           sets: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = launch_command("--mode", mode, "--steps", str(steps), "--rollouts", str(rollouts),
                         "--run-dir", str(run_dir), sets=[*SETS, *sets])
    # a session of its own: a crash point kills the launcher's whole process group
    return subprocess.Popen(cmd, env=launch_env(crash=crash, hang=hang), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, run_dir: Path, steps: int) -> dict:
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, err[-3000:]
    return _finished(run_dir, steps)


def _finished(run_dir: Path, steps: int) -> dict:
    """The summary of a run that ended: its accounting exact, each step trained once."""
    s = json.loads((run_dir / "summary.json").read_text())
    acc = s["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
    assert acc["in_flight"] == 0 and s["steps"] == steps
    assert s["slots"]["consumed"] == s["slots"]["expected"]  # each (step, fragment) once
    rows = [r["step"] for r in read_metrics(run_dir)]  # train rows
    assert rows == list(range(steps))
    return s


def test_a_killed_trainer_rewinds_the_run_to_its_checkpoint_and_ends_bit_identical(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # the uninterrupted run of the same config (4 steps, a checkpoint each), shared with
    # tests/test_resume.py; heartbeats do not enter a disagg-sync run's arithmetic
    whole_dir = whole_run(tmp_path_factory, "disagg-sync")
    assert {"run.steps=4", "run.checkpoint_every=1"} <= set(RESUME_SETS) and set(SMALL) <= set(RESUME_SETS)
    whole = _finished(whole_dir, 4)
    # every child joined and heard the Shutdown: the launcher terminated none (cluster.py)
    assert "had not joined" not in (whole_dir / "logs" / "launcher.log").read_text()
    s = _finish(_start(tmp_path / "cut", "disagg-sync", 4, 1, crash="trainer:2"), tmp_path / "cut", 4)
    assert s["recovery"]["trainer_resets"] == 1 and whole["recovery"]["trainer_resets"] == 0
    assert s["restarts"]["trainer-0"] == 1 and s["resumed_from"] == [2]
    a, b = final_weights(whole_dir), final_weights(tmp_path / "cut")
    # exact on purpose: same machine and thread count, so the rewound run must replay the same arithmetic
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_rollout_killed_with_kill_9_is_restarted_and_its_work_redone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "digenrl", 4, 2)
    metrics = run_dir / "metrics.jsonl"
    wait_until(lambda: (metrics.exists() and metrics.stat().st_size > 0) or proc.poll() is not None,
               "step 0 trained", 240, poll_s=0.05)
    pids = json.loads((run_dir / "logs" / "pids.json").read_text())
    os.kill(pids["rollout-0"], signal.SIGKILL)
    s = _finish(proc, run_dir, 4)
    assert s["restarts"]["rollout-0"] == 1
    assert s["recovery"]["rollouts_lost"] == 1 and s["recovery"]["trainer_resets"] == 0


async def test_at_the_end_a_child_that_never_joined_is_terminated_and_a_joined_one_waited_for(
        tmp_path: Path) -> None:
    """A rollout restarted late in a run is still starting when the run ends: it never hears
    the Shutdown. The launcher used to wait its whole 30 s for it (then SIGKILL); now only the
    children the coordinator knows (by pid) are waited for, the others terminated at once."""
    children = Children(load_config(None), tmp_path, "tcp://127.0.0.1:1")
    joined = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(1.5)")
    starting = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(120)")
    children.procs = {"trainer-0": joined, "rollout-0": starting}
    await children.wait_all(30.0, told={joined.pid})
    assert joined.returncode == 0  # waited for: it exited by itself
    assert starting.returncode == -signal.SIGTERM  # not the SIGKILL at the timeout


def test_a_wedged_trainer_that_still_heartbeats_is_caught_by_the_stall_watchdog(tmp_path: Path) -> None:
    """A GPU or collective hang: the trainer's compute thread never returns while its event
    loop keeps answering heartbeats, so no liveness check fires. The coordinator sees no step
    for ``runtime.stall_timeout_s``, rewinds to the checkpoint and restarts the nodes."""
    run_dir = tmp_path / "run"
    s = _finish(_start(run_dir, "digenrl", 3, 1, hang="trainer:1", sets=("runtime.stall_timeout_s=5",)),
                run_dir, 3)
    assert (run_dir / "logs" / "hung-trainer-0").exists()  # the hang did fire, once
    assert s["recovery"]["stalls"] == 1 and s["recovery"]["trainer_resets"] == 1
    assert s["restarts"]["trainer-0"] == 1
