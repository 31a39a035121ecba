"""Ulysses attention (digenrl.models.ulysses) over real gloo process groups against
one-process attention: joint text+image attention, outputs and gradients."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import sp_worker


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for n in (2, 4):
        path = tmp_path_factory.mktemp(f"sp{n}") / "got.pt"
        subprocess.run([sys.executable, str(Path(__file__).parent / "sp_worker.py"), str(n),
                        str(_port()), str(path)], check=True, timeout=300)
        out[n] = torch.load(path)
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_ulysses_joint_attention_matches_one_process(runs: dict, n: int) -> None:
    # float64 throughout; the sharded run sums in another order, so 1e-10 relative
    ref, got = sp_worker.reference(), runs[n]
    assert set(got) == set(ref)
    for name, want in ref.items():
        torch.testing.assert_close(got[name], want, rtol=1e-10, atol=1e-10, msg=name)
