"""The shipped supervisord config runs a local cluster and restarts a rollout killed mid-run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from digenrl.config import to_toml
from digenrl.faults import FAILPOINTS_ENV, Failpoints
from digenrl.transport.endpoints import free_port
from tests.conftest import wait_until
from tests.factories import tiny_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SMALL = ["run.steps=4", "runtime.heartbeat_s=0.2", "runtime.tag=\"never\""]  # over the suite's tiny run
SLOWDOWN = Failpoints(slowdown=2)  # the rollouts' denoising, unless a test asks for another


def supervisor_conf(state: Path) -> Path:
    """ops/supervisor/digenrl.conf with test timings: a node up 1 s counts as started (the
    tiny run ends sooner than the shipped 10 s, which supervisord would take for a failed
    start and restart), a 15 s stop timeout, and minfds=1024 (sandboxes cap the fd limit at
    the shipped 65536, which supervisord refuses)."""
    text = (REPO / "ops" / "supervisor" / "digenrl.conf").read_text()
    for shipped in ("startsecs=10", "stopwaitsecs=120", "minfds=4096"):
        assert shipped in text, shipped
    path = state / "supervisord.conf"
    path.write_text(text.replace("startsecs=10", "startsecs=1").replace("stopwaitsecs=120", "stopwaitsecs=15")
                    .replace("minfds=4096", "minfds=1024"))
    return path


def ctl(conf: Path, env: dict[str, str], *args: str) -> str:
    """supervisorctl's output (it reads the same %(ENV_...)s as supervisord)."""
    out = subprocess.run([str(BIN / "supervisorctl"), "-c", str(conf), *args], capture_output=True,
                         text=True, timeout=30, env=env)
    return out.stdout.strip()


def start_supervisord(tmp_path: Path, sets: list[str], failpoints: Failpoints = SLOWDOWN, **extra_env: str
                      ) -> tuple[subprocess.Popen, Path, dict[str, str], Path]:
    """supervisord running the shipped config on a fresh state dir: (process, conf, env, run dir);
    ``failpoints`` reach the nodes it starts by their environment."""
    state, run_dir = tmp_path / "state", tmp_path / "run"
    state.mkdir()
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(to_toml(tiny_config(*SMALL, *sets, mode="digenrl")))
    endpoint = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1",
               DIGENRL_STATE_DIR=str(state), DIGENRL_COORDINATOR=endpoint,
               DIGENRL_COORDINATOR_BIND=endpoint, DIGENRL_TRAINER_BIND="tcp://127.0.0.1:*",
               DIGENRL_GPU="cpu", DIGENRL_CONFIG=str(cfg_path), DIGENRL_RUN_DIR=str(run_dir),
               DIGENRL_NODE_ARGS="", DIGENRL_LOCAL_COORDINATOR="1", DIGENRL_LOCAL_TRAINERS="1",
               DIGENRL_LOCAL_ROLLOUTS="1", **{FAILPOINTS_ENV: failpoints.to_env()}, **extra_env)
    if "DIGENRL_TEST_HANG" not in extra_env:
        env.pop("DIGENRL_TEST_HANG", None)
    conf = supervisor_conf(state)
    sup = subprocess.Popen([str(BIN / "supervisord"), "-n", "-c", str(conf)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return sup, conf, env, run_dir


def stop_supervisord(sup: subprocess.Popen) -> None:
    sup.send_signal(signal.SIGTERM)  # supervisord stops what is left, then exits
    try:
        sup.wait(60)
    except subprocess.TimeoutExpired:
        sup.kill()
        sup.wait()


def assert_finished(run_dir: Path, steps: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["stop_reason"] == "done"
    acc = summary["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
    assert acc["in_flight"] == 0
    return summary


@pytest.mark.skipif(shutil.which("supervisord", path=str(BIN)) is None, reason="supervisor not installed")
def test_supervisord_restarts_a_killed_rollout_and_the_run_finishes(tmp_path: Path) -> None:
    # the tiny run's 4 steps take ~1 s on a fast machine: with the rollout's denoising slowed
    # 20x and its pid read before the first step, the kill lands with fragments still to
    # generate, so the restarted rollout re-joins (a kill after the last fragment went unseen)
    sup, conf, env, run_dir = start_supervisord(tmp_path, [], Failpoints(slowdown=20))
    rollout = "digenrl:digenrl-rollout-0"
    try:
        wait_until(lambda: ctl(conf, env, "pid", rollout) not in ("0", ""), "the rollout to start", 90)
        old_pid = int(ctl(conf, env, "pid", rollout))
        metrics = run_dir / "metrics.jsonl"
        wait_until(lambda: metrics.is_file() and metrics.read_text().strip(), "the first step", 90, poll_s=0.05)
        os.kill(old_pid, signal.SIGKILL)
        wait_until(lambda: ctl(conf, env, "pid", rollout) not in ("0", str(old_pid), ""), "the restart", 30)
        wait_until(lambda: "EXITED" in ctl(conf, env, "status", "digenrl:digenrl-coordinator"),
                 "the coordinator to exit", 90)
        status = ctl(conf, env, "status")
        assert "FATAL" not in status and "BACKOFF" not in status, status
        summary = assert_finished(run_dir, 4)
        assert any("#lost" in k for k in summary["nodes"]), summary["nodes"]
        restarted = [n for k, n in summary["nodes"].items() if n["role"] == "rollout" and "#lost" not in k]
        assert restarted and restarted[0]["committed"] > 0, summary["nodes"]  # it took over the work
        # exit 0 at the end of the run: supervisord (autorestart=unexpected) leaves them down
        wait_until(lambda: "RUNNING" not in ctl(conf, env, "status"), "every node to exit", 30)
        assert ctl(conf, env, "status").count("EXITED") == 3, ctl(conf, env, "status")
    finally:
        stop_supervisord(sup)


@pytest.mark.skipif(shutil.which("supervisord", path=str(BIN)) is None, reason="supervisor not installed")
def test_supervisord_recovers_a_wedged_trainer_that_still_heartbeats(tmp_path: Path) -> None:
    """A hung GPU or collective under a process manager: nobody SIGKILLs the trainer. The
    coordinator's stall watchdog restarts the run; the trainer, whose compute thread never
    returns, must still exit (hard) so that supervisord can start it again."""
    sup, conf, env, run_dir = start_supervisord(
        tmp_path, ["runtime.stall_timeout_s=5", "run.checkpoint_every=1"], DIGENRL_TEST_HANG="trainer:1")
    try:
        wait_until(lambda: "EXITED" in ctl(conf, env, "status", "digenrl:digenrl-coordinator"),
                 "the coordinator to exit", 180)
        summary = assert_finished(run_dir, 4)
        assert summary["recovery"]["stalls"] == 1 and summary["recovery"]["trainer_resets"] == 1
        log = "".join(p.read_text() for p in (run_dir / "logs").glob("*trainer-0.log"))
        assert "compute thread wedged at stop; exiting hard" in log
    finally:
        stop_supervisord(sup)
