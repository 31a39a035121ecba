"""A run folder on a filesystem that fills up mid-run fails the run cleanly.

A real ``digenrl launch`` writes its run folder onto a small tmpfs (mounted here, so root
only; skipped elsewhere); once its first checkpoint is committed the test fills the
filesystem. The launcher must end with one line naming the cause and exit 1, leaving the
last checkpoint verifiable, no temporary file, and no process of the run alive (each
once seen: a traceback writing pids.json, a temp file, an orphaned trainer waiting for Welcome).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from digenrl.rl.checkpoint import latest_checkpoint
from tests.conftest import SUITE_SETS, processes_of

pytestmark = pytest.mark.slow

SETS = ["model.path=\"random\"", "train.prompts_per_step=2", "train.group_size=2",
        "runtime.fragments_per_step=2", "sampler.num_steps=4", "run.checkpoint_every=1",
        "runtime.heartbeat_s=0.25"]


@contextlib.contextmanager
def small_disk(path: Path, size: str = "256m") -> Iterator[Path]:
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, check=False)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _fill(path: Path) -> None:
    with (path / "filler").open("wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:  # until ENOSPC: the point
            f.write(b"\0" * (1 << 20))


def test_a_full_disk_fails_the_run_with_one_line_and_leaves_nothing_behind(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk") as disk:
        run_dir = disk / "run"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # far more steps than the fill takes: a fast machine ran 8 steps in under a second after
        # the first checkpoint, and finished before the filesystem was full
        cmd = [sys.executable, "-m", "digenrl.cli", "launch", "--mode", "digenrl", "--steps", "400",
               "--run-dir", str(run_dir), *[a for s in (*SUITE_SETS, *SETS) for a in ("--set", s)]]
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            manifest, deadline = run_dir / "checkpoint" / "manifest.json", time.monotonic() + 240
            while not manifest.exists():
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)  # waiting for a condition (a checkpoint), not for a duration
            _fill(disk)
            _, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        lines = err.strip().splitlines()
        assert proc.returncode == 1, err[-3000:]
        assert "Traceback" not in err and "Logging error" not in err, err[-3000:]
        assert lines[-1].startswith("digenrl: run failed") and "No space left" in lines[-1], lines[-3:]
        assert latest_checkpoint(run_dir) is not None  # the last committed checkpoint verifies
        assert list(run_dir.rglob(".*.tmp-*")) == []
        assert processes_of(run_dir) == []
