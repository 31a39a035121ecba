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
from digenrl.rl.checkpoint import latest_checkpoint
from digenrl.transport.endpoints import free_port
from tests.conftest import SMALL, launch_command, launch_env, processes_of, wait_until

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


def _node(args: list[str], run_dir: Path, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(run_dir / f"{name}.out", "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen([sys.executable, "-m", "digenrl.cli", "node", *args], stdout=log, stderr=log,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


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


def _notices(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def _final_reason(run_dir: Path, node_id: str) -> str:
    """The stop reason in the node's last ``node_final`` log record."""
    lines = [json.loads(x) for x in (run_dir / "logs" / f"{node_id}.log").read_text().splitlines()
             if '"node_final"' in x]
    return str(lines[-1]["stop_reason"])


def test_a_coordinator_stopped_by_its_service_manager_drains_and_the_run_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG)
    addr = f"tcp://127.0.0.1:{free_port()}"
    coord_args = ["--role", "coordinator", "--bind", addr, "--run-dir", str(run_dir), "--config", str(cfg)]
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.setblocking(False)
    # a 1 s watchdog: pinged every 0.5 s while the tick loop (every heartbeat_s / 2) runs
    service = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000"}

    def start_nodes() -> list[subprocess.Popen]:
        return [_node(["--role", role, "--coordinator", addr, "--node-id", f"{role}-0",
                       "--run-dir", str(run_dir), "--config", str(cfg)], run_dir, f"{role}-0")
                for role in ("trainer", "rollout")]

    procs: list[subprocess.Popen] = []
    try:
        coord = _node(coord_args, run_dir, "coordinator", env=service)
        procs = [coord, *start_nodes()]
        notices: list[str] = []  # read as systemd does, all along (its queue holds ~10 datagrams)
        wait_until(lambda: notices.extend(_notices(notify)) or (
            _steps_done(run_dir) >= 1 and latest_checkpoint(run_dir) is not None), "the first checkpoint", 120)
        coord.send_signal(signal.SIGTERM)
        wait_until(lambda: notices.extend(_notices(notify)) or coord.poll() is not None, "the drain", 60)
        assert coord.returncode == 0  # a drain on request is not a failure: no restart for it
        notices.extend(_notices(notify))
        assert notices[0] == "READY=1" and notices[1].startswith(f"STATUS=coordinator on {addr}")
        stop = notices.index("STOPPING=1")  # the watchdog may go on pinging through the drain
        assert notices[2:stop].count("WATCHDOG=1") >= 2
        stopped = json.loads((run_dir / "summary.json").read_text())
        assert stopped["stop_reason"] == f"{COORDINATOR_STOPPED} (SIGTERM)" and stopped["steps"] < 4
        # told, not left to notice the silence: exit 1, for their supervisors to restart them
        for p, node_id in zip(procs[1:], ("trainer-0", "rollout-0")):
            assert p.wait(60) == 1
            assert _final_reason(run_dir, node_id) == f"{COORDINATOR_STOPPED} (SIGTERM)"
        coord = _node(coord_args, run_dir, "coordinator-2")
        procs = [coord, *start_nodes()]
        assert coord.wait(240) == 0
        for p in procs[1:]:
            p.wait(60)
    finally:
        notify.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["stop_reason"] == "done"
    assert summary["resumed_from"] and summary["resumed_from"][-1] >= 1


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
        assert _final_reason(run_dir, node_id) == sig.name
    assert processes_of(run_dir) == []
