"""Device selection, process-group backend and GPU hand-out (the logic; CUDA itself is absent here)."""

from __future__ import annotations

import pytest
import torch

from digenrl.config import ConfigError
from digenrl.devices import backend_for, child_gpu_env, host, resolve_device


def test_without_a_gpu_every_process_computes_on_the_cpu_with_gloo():
    assert resolve_device(None, env={}, gpus=0) == torch.device("cpu")
    assert resolve_device(None, env={"LOCAL_RANK": "3"}, gpus=0) == torch.device("cpu")
    assert backend_for(torch.device("cpu")) == "gloo"
    assert child_gpu_env(5, env={}, gpus=0) == {}


def test_the_device_flag_wins_then_local_rank_then_the_first_visible_gpu():
    assert resolve_device("cuda:1", env={"LOCAL_RANK": "0"}, gpus=2) == torch.device("cuda", 1)
    assert resolve_device("cpu", env={}, gpus=2) == torch.device("cpu")
    assert resolve_device("cuda", env={}, gpus=2) == torch.device("cuda", 0)
    assert resolve_device(None, env={"LOCAL_RANK": "3"}, gpus=2) == torch.device("cuda", 1)  # 3 mod 2
    assert resolve_device(None, env={}, gpus=4) == torch.device("cuda", 0)
    assert backend_for(torch.device("cuda", 1)) == "nccl"


@pytest.mark.parametrize(("flag", "env", "gpus", "message"), [
    ("cuda:2", {}, 2, r"--device 'cuda:2': this process sees 2 CUDA device\(s\) \(cuda:0\.\.cuda:1\)"),
    ("cuda", {}, 0, r"--device 'cuda': this process sees no CUDA device"),
    ("tpu", {}, 1, r"--device 'tpu': expected cpu, cuda or cuda:N"),
    ("gpu0", {}, 1, r"--device 'gpu0': expected cpu, cuda or cuda:N"),
    (None, {"LOCAL_RANK": "x"}, 1, r"LOCAL_RANK='x': expected an integer"),
])
def test_a_device_this_process_cannot_use_is_one_line(flag, env, gpus, message):
    with pytest.raises(ConfigError, match=message):
        resolve_device(flag, env=env, gpus=gpus)


def test_local_children_get_one_gpu_each_trainers_first_wrapping_around():
    # 2 trainer ranks + 3 rollouts on a 4-GPU machine: trainers 0 1, rollouts 2 3 0
    assert [child_gpu_env(i, env={}, gpus=4) for i in range(5)] == [
        {"CUDA_VISIBLE_DEVICES": d} for d in ("0", "1", "2", "3", "0")]
    # the launcher itself restricted to GPUs 5 and 7: children get those
    env = {"CUDA_VISIBLE_DEVICES": "5,7"}
    assert [child_gpu_env(i, env=env, gpus=2)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["5", "7", "5"]
    # one GPU: every role shares it
    assert {child_gpu_env(i, env={}, gpus=1)["CUDA_VISIBLE_DEVICES"] for i in range(3)} == {"0"}


def test_host_copies_never_share_storage_even_on_the_cpu():
    t = torch.arange(4.0, requires_grad=True)
    h = host(t)
    # exact: a copy holds the same stored bits (no arithmetic happens)
    assert h.device.type == "cpu" and not h.requires_grad and torch.equal(h, t.detach())
    h.add_(1)
    assert torch.equal(t.detach(), torch.arange(4.0))  # the copy is its own storage
