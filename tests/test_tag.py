"""TAG, BTS and heterogeneous assignment in real launches (processes, sockets, loopback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from digenrl.faults import FAILPOINTS_ENV, Failpoints
from digenrl.launch import launch, make_run_dir
from tests.conftest import shared_dir
from tests.factories import tiny_config

pytestmark = pytest.mark.slow

SMALL = ["train.prompts_per_step=4", "runtime.fragments_per_step=4"]  # over the suite's tiny run


def _launch(tmp_path: Path, name: str, extra: list[str], mode: str = "digenrl",
            failpoints: Failpoints | None = None, monkeypatch: pytest.MonkeyPatch | None = None) -> dict:
    """A launch of SMALL with ``extra``; ``failpoints`` reach its nodes by the environment."""
    if failpoints is not None:
        assert monkeypatch is not None
        monkeypatch.setenv(FAILPOINTS_ENV, failpoints.to_env())  # the spawned nodes inherit it
    cfg = tiny_config(*SMALL, *extra, mode=mode)
    return launch(cfg, make_run_dir(cfg, str(tmp_path / name)))


def _adds_up(summary: dict) -> None:
    acc = summary["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
    assert acc["in_flight"] == 0


def test_tag_helper_generates_without_breaking_staleness_or_accounting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # generation-bound (one trained timestep, the rollout slowed 3x by the TEST-ONLY knob)
    # and TAG forced on: the idle trainer must help
    s = _launch(tmp_path, "tag", ["run.steps=3", "train.timesteps=window", "train.window_size=1",
                                  "runtime.tag=always"],
                failpoints=Failpoints(slowdown=3.0), monkeypatch=monkeypatch)
    _adds_up(s)
    sched = s["scheduler"]
    assert sched["tag_granted"] >= 1 and sched["tag_consumed"] == sched["tag_granted"]
    assert sched["max_trained_staleness"] <= 1
    assert sched["stale_commits"] == 0
    assert s["nodes"]["trainer-0"]["committed"] >= 1      # the helper's fragments were trained
    assert s["steps"] == 3                                # and only the trainer stepped versions


@pytest.fixture
def hetero(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """TAG off, two rollouts, rollout-1 made 5x slower by the TEST-ONLY failpoint (the trainer
    idles the more for it, so a TAG grant would be the likelier if ``never`` leaked one): its
    summary, the run launched once for the tests that read it."""
    def make(folder: Path) -> None:
        with pytest.MonkeyPatch.context() as mp:
            _launch(folder, "hetero", ["run.steps=6", "runtime.tag=never", "cluster.rollouts=2"],
                    failpoints=Failpoints(slowdown=5.0, slowdown_nodes=("rollout-1",)), monkeypatch=mp)

    folder = shared_dir(tmp_path_factory, "tag-hetero", make)
    return dict(json.loads((folder / "hetero" / "summary.json").read_text()))


def test_tag_never_means_the_trainer_generates_nothing(hetero: dict) -> None:
    s = hetero
    _adds_up(s)
    assert s["scheduler"]["tag_granted"] == 0
    assert s["nodes"]["trainer-0"]["assigned"] == 0


def test_a_slow_rollout_gets_proportionally_fewer_fragments(hetero: dict) -> None:
    # rollout-0 should take most fragments (each node holds up to 2 fragments before any
    # speed is measured, so the run has enough steps)
    s = hetero
    _adds_up(s)
    fast = s["nodes"]["rollout-0"]["committed"]
    slow = s["nodes"]["rollout-1"]["committed"]
    assert fast + slow == 24
    assert fast >= 2 * slow, (fast, slow)
