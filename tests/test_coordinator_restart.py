"""A coordinator killed or stopped mid-run and restarted (as systemd/supervisor would) finishes the run.

Nodes started by hand with ``digenrl-node`` notice the silent coordinator (no answer to
their heartbeats), exit non-zero for their supervisor to restart them (the test plays the
supervisor), and the restarted coordinator resumes from its last checkpoint. A coordinator
stopped by its service manager (SIGTERM) says so first: READY, watchdog pings and STOPPING
reach a stand-in for systemd's notify socket, the nodes are told to stop and exit 1 at once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from digenrl.actors.cluster import COORDINATOR_STOPPED
from digenrl.actors.resume import DRAIN_CHECKPOINT_WAIT_S
from digenrl.faults import SIGNAL_ENV
from digenrl.rl.checkpoint import latest_checkpoint
from digenrl.transport.endpoints import free_port
from tests.conftest import (
    SMALL,
    datagrams,
    launch_command,
    launch_env,
    node_final,
    processes_of,
    wait_until,
)

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


class _ByHand:
    """A run of nodes started by hand, the test playing their supervisor: a coordinator bound
    on a free port, a trainer and a rollout dialling it, all on one run folder."""

    def __init__(self, tmp_path: Path, config: str = CONFIG) -> None:
        self.run_dir = tmp_path / "run"
        self.run_dir.mkdir()
        self.cfg = tmp_path / "cfg.toml"
        self.cfg.write_text(config)
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[subprocess.Popen] = []

    def _node(self, args: list[str], name: str, env: dict[str, str] | None) -> subprocess.Popen:
        log = open(self.run_dir / f"{name}.out", "ab")  # noqa: SIM115 - the child owns it
        p = subprocess.Popen([sys.executable, "-m", "digenrl.cli", "node", *args, "--run-dir", str(self.run_dir),
                              "--config", str(self.cfg)], stdout=log, stderr=log,
                             env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.procs.append(p)
        return p

    def start(self, coordinator: str = "coordinator", env: dict[str, str] | None = None
              ) -> tuple[subprocess.Popen, list[subprocess.Popen]]:
        """The coordinator (its output in ``coordinator``.out) and the two nodes."""
        coord = self._node(["--role", "coordinator", "--bind", self.addr], coordinator, env)
        return coord, [self._node(["--role", role, "--coordinator", self.addr, "--node-id", f"{role}-0"],
                                  f"{role}-0", None) for role in ("trainer", "rollout")]

    def checkpointed(self) -> bool:
        # a committed checkpoint, not just a metrics line: a step's metrics are sent before its
        # checkpoint is written, and a coordinator killed in between rightly starts over
        metrics = self.run_dir / "metrics.jsonl"
        return metrics.exists() and bool(metrics.read_text().strip()) and latest_checkpoint(self.run_dir) is not None

    def restart_and_finish(self) -> dict:
        """Start everything again; the run resumes from its checkpoint and ends: its summary."""
        coord, nodes = self.start("coordinator-2")
        assert coord.wait(240) == 0
        for p in nodes:
            p.wait(60)
        summary = json.loads((self.run_dir / "summary.json").read_text())
        acc = summary["accounting"]
        assert summary["steps"] == 4 and summary["stop_reason"] == "done"
        assert summary["resumed_from"] and summary["resumed_from"][-1] >= 1  # from a checkpoint, not 0
        assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
        assert acc["in_flight"] == 0
        return summary

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_restarted_coordinator_resumes_and_the_nodes_rejoin(tmp_path: Path) -> None:
    run = _ByHand(tmp_path)
    try:
        coord, nodes = run.start()
        wait_until(run.checkpointed, "the first checkpoint", 120)
        coord.send_signal(signal.SIGKILL)
        coord.wait(10)
        # the nodes hear nothing back and stop on their own, non-zero (for a supervisor)
        for p in nodes:
            assert p.wait(60) != 0
        run.restart_and_finish()
    finally:
        run.kill_all()


def test_a_coordinator_stopped_by_its_service_manager_drains_and_the_run_resumes(tmp_path: Path) -> None:
    run = _ByHand(tmp_path)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.setblocking(False)
    # a 1 s watchdog: pinged every 0.5 s while the tick loop (every heartbeat_s / 2) runs
    service = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000"}
    stopped_reason = f"{COORDINATOR_STOPPED} (SIGTERM)"
    try:
        coord, nodes = run.start(env=service)
        notices: list[str] = []  # read as systemd does, all along (its queue holds ~10 datagrams)
        wait_until(lambda: notices.extend(datagrams(notify)) or run.checkpointed(), "the first checkpoint", 120)
        coord.send_signal(signal.SIGTERM)
        wait_until(lambda: notices.extend(datagrams(notify)) or coord.poll() is not None, "the drain", 60)
        assert coord.returncode == 0  # a drain on request is not a failure: no restart for it
        notices.extend(datagrams(notify))
        assert notices[0] == "READY=1" and notices[1].startswith(f"STATUS=coordinator on {run.addr}")
        stop = notices.index("STOPPING=1")  # the watchdog may go on pinging through the drain
        assert notices[2:stop].count("WATCHDOG=1") >= 2
        # the wait for trainer rank 0's drain part (60 s) may outlast the unit's stop timeout
        assert f"EXTEND_TIMEOUT_USEC={int((DRAIN_CHECKPOINT_WAIT_S + 30) * 1e6)}" in notices[stop:]
        stopped = json.loads((run.run_dir / "summary.json").read_text())
        assert stopped["stop_reason"] == stopped_reason and stopped["steps"] < 4
        # told, not left to notice the silence: exit 1, for their supervisors to restart them
        for p, node_id in zip(nodes, ("trainer-0", "rollout-0")):
            assert p.wait(60) == 1
            assert node_final(run.run_dir / "logs" / f"{node_id}.log")["stop_reason"] == stopped_reason
        run.restart_and_finish()
    finally:
        notify.close()
        run.kill_all()


def test_a_stopped_coordinator_between_checkpoints_commits_the_drain_checkpoint(tmp_path: Path) -> None:
    """No checkpoint is due before the end: the coordinator, stopped by SIGTERM as it handles
    version 2's StepDone (digenrl/faults.py: before rank 0's announcement of it arrives),
    reads that announcement after the stop, waits for trainer rank 0's part of the boundary
    (written as the trainer leaves) and commits it; the restarted run resumes from version 2."""
    run = _ByHand(tmp_path, CONFIG.replace("checkpoint_every = 1", "checkpoint_every = 100"))
    try:
        coord, nodes = run.start(env={SIGNAL_ENV: "stepdone:2"})
        assert coord.wait(120) == 0
        for p in nodes:
            assert p.wait(60) == 1
        ckpt = latest_checkpoint(run.run_dir)
        assert ckpt is not None and ckpt.version == 2, (run.run_dir / "coordinator.out").read_text()[-2000:]
        assert run.restart_and_finish()["resumed_from"] == [2]
    finally:
        run.kill_all()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_launch_stopped_by_a_signal_drains_its_nodes_and_says_how_to_resume(tmp_path: Path,
                                                                              sig: signal.Signals) -> None:
    """``docker stop``, ``kill``, a batch system's cancel (SIGTERM to the launcher), Ctrl-C in a
    terminal (SIGINT to the launcher and its nodes): the launcher (its coordinator) stops the
    nodes, waits for them, writes summary.json and exits 128 + the signal with one line."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(launch_command("--mode", "digenrl", "--run-dir", str(run_dir),
                                           sets=[*SMALL, "run.steps=60", "run.checkpoint_every=1"]),
                            env=launch_env(), start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: latest_checkpoint(run_dir) is not None, "the first checkpoint", 120)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # a terminal signals its whole foreground process group
        else:
            proc.send_signal(sig)  # the launcher only
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"digenrl: stopped ({sig.name}) after "), last
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and last.endswith(f"--resume {run_dir}` continues from its checkpoint "
                                              f"of step {ckpt.version}"), last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == sig.name and 1 <= summary["steps"] < 60
    for node_id in ("trainer-0", "rollout-0"):  # drained (exit 0), not killed
        assert node_final(run_dir / "logs" / f"{node_id}.log")["stop_reason"] == sig.name
    assert processes_of(run_dir) == []
