"""A coordinator killed mid-run and restarted (as systemd/supervisor would) finishes the run.

Nodes started by hand with ``digenrl-node`` notice the silent coordinator (no answer to
their heartbeats), exit non-zero for their supervisor to restart them (the test plays the
supervisor), and the restarted coordinator resumes from its last checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from digenrl.rl.checkpoint import latest_checkpoint
from digenrl.transport.endpoints import free_port
from tests.conftest import wait_until

pytestmark = pytest.mark.slow

CONFIG = """
[run]
steps = 4
checkpoint_every = 1
[model]
path = "random"
[sampler]
num_steps = 4
[train]
prompts_per_step = 2
group_size = 2
timesteps = "all"
[runtime]
fragments_per_step = 2
heartbeat_s = 0.3
heartbeat_misses = 10
"""


def _node(args: list[str], run_dir: Path, name: str) -> subprocess.Popen:
    log = open(run_dir / f"{name}.out", "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen([sys.executable, "-m", "digenrl.cli", "node", *args],
                            stdout=log, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_restarted_coordinator_resumes_and_the_nodes_rejoin(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG)
    addr = f"tcp://127.0.0.1:{free_port()}"
    coord_args = ["--role", "coordinator", "--bind", addr, "--run-dir", str(run_dir), "--config", str(cfg)]

    def start_nodes() -> list[subprocess.Popen]:
        return [_node(["--role", role, "--coordinator", addr, "--node-id", f"{role}-0",
                       "--run-dir", str(run_dir), "--config", str(cfg)], run_dir, f"{role}-0")
                for role in ("trainer", "rollout")]

    procs: list[subprocess.Popen] = []
    try:
        coord = _node(coord_args, run_dir, "coordinator")
        procs = [coord, *start_nodes()]
        # a committed checkpoint, not just a metrics line: a step's metrics are sent before its
        # checkpoint is written, and a coordinator killed in between rightly starts over
        wait_until(lambda: _steps_done(run_dir) >= 1 and latest_checkpoint(run_dir) is not None,
                   "the first checkpoint", 120)
        coord.send_signal(signal.SIGKILL)
        coord.wait(10)
        # the nodes hear nothing back and stop on their own, non-zero (for a supervisor)
        for p in procs[1:]:
            assert p.wait(60) != 0
        coord = _node(coord_args, run_dir, "coordinator-2")
        procs = [coord, *start_nodes()]
        assert coord.wait(240) == 0
        for p in procs[1:]:
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["steps"] == 4
    assert summary["resumed_from"] and summary["resumed_from"][-1] >= 1  # from a checkpoint, not 0
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
    assert acc["in_flight"] == 0
