"""Backpressure end to end: a tenfold slower trainer holds rollouts to the credit byte window."""

from __future__ import annotations

from math import prod
from pathlib import Path

import pytest

from digenrl.actors.cluster import bytes_per_trajectory
from digenrl.faults import FAILPOINTS_ENV, Failpoints
from digenrl.launch import launch, make_run_dir
from digenrl.models import build_model
from tests.conftest import node_final
from tests.factories import tiny_config

pytestmark = pytest.mark.slow

WINDOW_MB = 0.02
# What a rollout may grow by after it is ready besides the latents in flight: allocator
# arenas and activations of its first generations (measured 20-40 MiB on the tiny model).
MARGIN_MB = 96.0


def test_a_tenfold_slower_trainer_keeps_rollout_memory_within_the_byte_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAILPOINTS_ENV, Failpoints(trainer_slowdown=10).to_env())  # the nodes inherit it
    cfg = tiny_config("run.steps=3", f"runtime.byte_window_mb={WINDOW_MB}", mode="digenrl")
    run_dir = make_run_dir(cfg, str(tmp_path / "bp"))
    summary = launch(cfg, run_dir)

    acc = summary["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
    bpt = bytes_per_trajectory(cfg, prod(build_model(cfg.model, seed=0).latent_shape))
    window = int(WINDOW_MB * 2**20)
    fragment = bpt * cfg.batch_size // cfg.runtime.fragments_per_step
    # the run moved more than the window, so the window (not the run's size) was the bound
    assert acc["admitted"] * bpt > 2 * max(window, fragment)
    assert summary["scheduler"]["peak_bytes_in_flight"] <= max(window, fragment)

    rollout = node_final(run_dir / "logs" / "rollout-0.log")
    assert rollout["exit_code"] == 0
    growth = rollout["rss_peak_mb"] - rollout["rss_ready_mb"]
    assert 0 <= growth <= WINDOW_MB + MARGIN_MB, rollout
    trainer = node_final(run_dir / "logs" / "trainer-0.log")
    assert trainer["bad_frames"] == 0 and trainer["zap_rejected"] == 0
