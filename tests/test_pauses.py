"""Paused processes (SIGSTOP past the heartbeat timeout, then SIGCONT) in a live run.

A VM stall, a long GC pause or a healed partition look like this: the node is declared lost,
then comes back as if nothing happened. A rollout is fenced (its attempts were revoked and
re-assigned; what it sends for them is refused) and re-joins; a trainer rank cannot be
re-joined into a torch.distributed group, so the run rewinds to its checkpoint. Either way
the run finishes with exact accounting (a regression: a paused rollout hung the run for good).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.test_faults import _finish, _start

pytestmark = pytest.mark.slow

# lost after 6 silent beats of 0.25 s; the pause lasts three times that
FAST = ("runtime.heartbeat_s=0.25", "runtime.heartbeat_misses=6")
PAUSE_S = 4.5


def _pause(run_dir: Path, proc: object, victim: str) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.exists() and metrics.stat().st_size):
        assert time.monotonic() < deadline and proc.poll() is None  # type: ignore[attr-defined]
        time.sleep(0.05)  # waiting for a condition (step 0 trained), not for a duration
    pid = json.loads((run_dir / "logs" / "pids.json").read_text())[victim]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(PAUSE_S)  # the pause itself is what is under test
    finally:
        with contextlib.suppress(ProcessLookupError):  # a trainer: the rewind killed it stopped
            os.kill(pid, signal.SIGCONT)


def test_a_rollout_paused_past_the_heartbeat_timeout_is_fenced_rejoins_and_the_run_finishes(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "digenrl", 4, 1, sets=FAST)
    _pause(run_dir, proc, "rollout-0")
    s = _finish(proc, run_dir, 4)
    assert s["recovery"]["rollouts_lost"] >= 1 and s["recovery"]["rejoins"] >= 1
    assert s["recovery"]["trainer_resets"] == 0 and not s["restarts"].get("rollout-0")


def test_a_trainer_rank_paused_past_the_heartbeat_timeout_rewinds_the_run_which_finishes(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "digenrl", 4, 1, sets=FAST)
    _pause(run_dir, proc, "trainer-0")
    s = _finish(proc, run_dir, 4)
    assert s["recovery"]["trainer_resets"] >= 1 and s["restarts"]["trainer-0"] >= 1
