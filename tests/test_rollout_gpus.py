"""A rollout node over several devices as users start it: ``digenrl-node --role rollout --gpus N``
(checked before anything starts, then run for real over gloo), the GPU slices ``digenrl launch``
hands its children (a fake device count: this machine has no GPU), and followers that never
outlive their leader (a SIGKILLed leader's followers exit: real processes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import digenrl.devices
from digenrl.cli import node_main
from digenrl.config import ConfigError, load_config, resolve_mode
from digenrl.devices import child_gpu_envs, group_devices
from digenrl.telemetry.metrics import read_metrics
from digenrl.transport.endpoints import free_port
from tests.conftest import SMALL, wait_until

ROOT = Path(__file__).resolve().parents[1]


def _visible(envs: list[dict[str, str]]) -> list[str]:
    return [e["CUDA_VISIBLE_DEVICES"] for e in envs]


def test_the_launcher_hands_each_rollout_a_slice_of_its_own_after_the_trainers():
    # 2 trainer ranks, 2 rollouts over 2 devices, 1 reward worker on 8 GPUs: no GPU shared
    widths = [1, 1, 2, 2, 1]
    assert _visible(child_gpu_envs(widths, env={}, gpus=8)) == ["0", "1", "2,3", "4,5", "6"]
    # the launcher itself restricted to four GPUs: the slices are of those, in their order
    env = {"CUDA_VISIBLE_DEVICES": "7,6,5,4"}
    assert _visible(child_gpu_envs([1, 2, 1], env=env, gpus=4)) == ["7", "6,5", "4"]
    # fewer GPUs than the children want: the slices wrap around, as one-GPU children do
    assert _visible(child_gpu_envs(widths, env={}, gpus=4)) == ["0", "1", "2,3", "0,1", "2"]
    assert _visible(child_gpu_envs([1, 1, 1], env={}, gpus=1)) == ["0", "0", "0"]
    assert child_gpu_envs([1, 2, 1], env={}, gpus=0) == [{}, {}, {}]  # the CPU: nothing to hand out


def test_a_node_wider_than_the_visible_gpus_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"^a node over 3 devices: this launch sees 2 GPU\(s\) \(0,1\)"):
        child_gpu_envs([1, 3], env={}, gpus=2)


def test_a_launchs_children_get_their_slices_in_role_order(monkeypatch, tmp_path):
    """The local cluster's own hand-out (actors/cluster.py), on a machine that says it has 8 GPUs."""
    from digenrl.actors.cluster import Children

    monkeypatch.setattr(digenrl.devices, "cuda_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = resolve_mode(load_config(None, [*SMALL, "cluster.trainers=2", "cluster.rollouts=2",
                                          "cluster.rollout_gpus=2", "cluster.rewards=1"]))
    got = {name: env["CUDA_VISIBLE_DEVICES"] for name, env in Children(cfg, tmp_path, "tcp://x:1").gpu_env().items()}
    assert got == {"trainer-0": "0", "trainer-1": "1", "rollout-0": "2,3", "rollout-1": "4,5", "reward-0": "6"}


def test_a_launch_whose_rollouts_need_more_gpus_than_it_sees_is_refused_before_starting(monkeypatch):
    from digenrl.launch import check_runtime_support

    monkeypatch.setattr(digenrl.devices, "cuda_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = resolve_mode(load_config(None, [*SMALL, "cluster.rollout_gpus=4"]))
    with pytest.raises(ConfigError, match=r"^cluster\.rollout_gpus = 4: a node over 4 devices: this launch sees 2 GPU"):
        check_runtime_support(cfg)
    monkeypatch.setattr(digenrl.devices, "cuda_count", lambda: 0)
    check_runtime_support(cfg)  # no GPU: the group's processes share the CPU


def test_a_group_computes_on_the_leaders_device_and_the_next_ones():
    assert group_devices(torch.device("cpu"), 3, "--gpus 3", gpus=0) == [torch.device("cpu")] * 3
    assert group_devices(torch.device("cuda", 0), 2, "--gpus 2", gpus=2) == [torch.device("cuda", 0),
                                                                            torch.device("cuda", 1)]
    assert group_devices(torch.device("cuda", 1), 2, "--gpus 2", gpus=4) == [torch.device("cuda", 1),
                                                                            torch.device("cuda", 2)]
    with pytest.raises(ConfigError, match=r"^--gpus 2: this process sees 2 CUDA device\(s\); a rollout over "
                                          r"2 devices from its own \(cuda:1\) needs cuda:1\.\.cuda:2$"):
        group_devices(torch.device("cuda", 1), 2, "--gpus 2", gpus=2)


@pytest.mark.parametrize(("args", "message"), [
    (["--role", "trainer", "--gpus", "2"], "--gpus 2 with --role trainer: only a rollout node runs over several"),
    (["--role", "rollout", "--gpus", "0"], "--gpus 0: expected 1 or more"),
    (["--from-env", "--gpus", "2"], "--gpus 2 with --from-env: it starts one node per local GPU"),
    (["--from-env", "--dry-run", "--set", "cluster.rollout_gpus=2"],
     "cluster.rollout_gpus = 2 with --from-env: it starts one node per local GPU"),
])
def test_a_gpus_flag_the_node_cannot_honour_is_one_line(capsys, args, message):
    assert node_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"digenrl-node: config error: {message}") and err.count("\n") == 1


def test_more_gpus_than_the_node_sees_is_refused_before_it_dials_the_coordinator(monkeypatch, capsys):
    """A fake one-GPU process: the refusal comes before any socket or follower (nothing answers
    at the coordinator's address, and no connect timeout is waited out)."""
    monkeypatch.setattr(digenrl.devices, "cuda_count", lambda: 1)
    t0 = time.monotonic()
    code = node_main(["--role", "rollout", "--gpus", "2", "--device", "cuda",
                      "--coordinator", f"tcp://127.0.0.1:{free_port()}", "--connect-timeout", "30"])
    assert code == 2 and time.monotonic() - t0 < 5
    assert capsys.readouterr().err == ("digenrl-node: config error: --gpus 2: this process sees 1 CUDA "
                                       "device(s); a rollout over 2 devices from its own (cuda:0) needs "
                                       "cuda:0..cuda:1\n")


def test_a_degree_the_model_cannot_take_is_refused_naming_the_flag():
    from digenrl.actors.rolloutgroup import with_group_size

    cfg = resolve_mode(load_config(None, SMALL))  # the tiny SD3 has 4 attention heads
    with pytest.raises(ConfigError, match=r"^--gpus 3: cluster\.rollout_gpus = 3: the transformer has 4 attention"):
        with_group_size(cfg, 3, "--gpus 3")
    assert with_group_size(cfg, 2, "--gpus 2").cluster.rollout_gpus == 2


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


LEADER = """
import sys, time
from pathlib import Path
import torch
from digenrl.actors.rolloutgroup import RolloutGroup
from digenrl.config import load_config, resolve_mode
cfg = resolve_mode(load_config(None, sys.argv[2:]))
group = RolloutGroup.spawn(cfg, [torch.device("cpu")] * 3, folder=Path(sys.argv[1]), node_id="leader")
print(" ".join(str(p.pid) for p in group.procs), flush=True)
time.sleep(600)  # never joins: the followers wait for rank 0, as behind a leader still building its model
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_followers_exit_when_their_leader_is_killed(tmp_path):
    """Waiting to join, a follower sees no connection close: only the parent-death signal ends
    it (without it, it would wait out the rendezvous timeout, 30 minutes)."""
    leader = subprocess.Popen([sys.executable, "-c", LEADER, str(tmp_path), *SMALL], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    followers: list[int] = []
    try:
        assert leader.stdout is not None
        followers = [int(p) for p in leader.stdout.readline().split()]
        assert len(followers) == 2
        logs = [tmp_path / f"leader-follower-{r}.stderr" for r in (1, 2)]
        wait_until(lambda: all("joining the group" in f.read_text() for f in logs), "both followers waiting", 60)
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        t0 = time.monotonic()
        wait_until(lambda: not any(_alive(p) for p in followers), "the followers to exit", 5, poll_s=0.05)
        assert time.monotonic() - t0 < 5
    finally:
        for p in [leader.pid, *followers]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        leader.wait(10)


def _node(run_dir: Path, args: list[str], name: str, sets: list[str]) -> subprocess.Popen:
    log = open(run_dir / f"{name}.out", "ab")  # noqa: SIM115 - the child owns it
    p = subprocess.Popen([sys.executable, "-m", "digenrl.cli", "node", *args, "--run-dir", str(run_dir),
                          *[a for s in sets for a in ("--set", s)]], cwd=ROOT, stdout=log, stderr=log,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    log.close()
    return p


def _run_by_hand(run_dir: Path, rollout_args: list[str]) -> None:
    """One step at K = 0 of a coordinator, a trainer and a rollout (``rollout_args`` added)
    started by hand, in a run whose config says one process per rollout; each exits 0."""
    run_dir.mkdir()
    sets = [*SMALL, "run.steps=1", "runtime.staleness=0"]
    addr = f"tcp://127.0.0.1:{free_port()}"
    procs = [_node(run_dir, ["--role", "coordinator", "--bind", addr], "coordinator", sets),
             _node(run_dir, ["--role", "trainer", "--coordinator", addr, "--node-id", "trainer-0"], "trainer-0", sets),
             _node(run_dir, ["--role", "rollout", "--coordinator", addr, "--node-id", "rollout-0", *rollout_args],
                   "rollout-0", sets)]
    try:
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0, 0], (run_dir / "rollout-0.out").read_text()[-2000:]
    acc = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert acc["trained"] == 4 and acc["in_flight"] == 0 and not acc["discarded"]


@pytest.mark.slow
def test_a_rollout_started_with_gpus_2_samples_over_two_processes_what_one_process_samples(tmp_path):
    """``digenrl-node --role rollout --gpus 2`` against a coordinator and a trainer started by
    hand, in a run whose config says one process per rollout: the node runs a follower; at K = 0
    the trainer's one-process forward recomputes the log-probabilities of the group's
    trajectories, and the step's update is that of the same run with a one-process rollout (the
    tolerances of the cluster.rollout_gpus launch test, test_sequence_parallel_launch.py)."""
    from tests.conftest import final_weights

    group, one = tmp_path / "gpus2", tmp_path / "one"
    _run_by_hand(group, ["--gpus", "2"])
    joined = [json.loads(x) for x in (group / "logs" / "rollout-0.log").read_text().splitlines() if '"joined"' in x]
    assert joined[0]["sequence_parallel"] == 2
    served = (group / "logs" / "rollout-0-follower-1.stderr").read_text()
    assert "follower 1: served" in served and "served 0 " not in served  # it ran the forward passes
    rows = read_metrics(group)
    assert rows[0]["max_staleness"] == 0 and rows[0]["ratio_max_dev"] <= 1e-5
    _run_by_hand(one, [])
    assert not (one / "logs" / "rollout-0-follower-1.stderr").exists()
    a, b = final_weights(group), final_weights(one)
    assert a.keys() == b.keys()
    assert rows[0]["grad_norm"] > 0  # the step moved the weights it compares
    for k in a:  # float32: the sharded forward sums attention in another order
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
