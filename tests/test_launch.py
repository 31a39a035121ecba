"""End-to-end launches on the tiny config: every mode, real processes, real sockets on loopback.

The small run of each mode is launched once per session and shared with
tests/test_observability.py (tests/conftest.py mode_run); the other tests launch configs of
their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from digenrl.config import load_config, resolve_mode
from digenrl.launch import launch, make_run_dir
from digenrl.telemetry.metrics import read_metrics
from tests.conftest import MODE_RUN_STEPS, final_weights, mode_run
from tests.conftest import SMALL as TINY_RUN

pytestmark = pytest.mark.slow

SMALL = [*TINY_RUN, "run.steps=2"]


def _launch(tmp_path: Path, mode: str, extra: list[str] = (), **cluster: int) -> tuple[Path, dict]:
    cfg = resolve_mode(load_config(None, [*SMALL, *extra,
                                          *[f"cluster.{k}={v}" for k, v in cluster.items()]]), mode)
    run_dir = make_run_dir(cfg, str(tmp_path / mode))
    summary = launch(cfg, run_dir)
    return run_dir, summary


def _accounting_adds_up(summary: dict, cfg_batch: int, steps: int) -> None:
    acc = summary["accounting"]
    discarded = sum(acc["discarded"].values())
    assert acc["admitted"] == acc["trained"] + discarded + acc["in_flight"]
    assert acc["in_flight"] == 0
    # every step's batch was accounted for at least once (re-assignments add attempts)
    assert acc["trained"] + acc["discarded"].get("zero_advantage", 0) >= cfg_batch * steps


def _mode_run(factory: pytest.TempPathFactory, mode: str) -> tuple[Path, dict]:
    """The shared small run in ``mode`` and its summary."""
    run_dir, _ = mode_run(factory, mode)
    return run_dir, json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("mode", ["colocated", "disagg-sync", "digenrl"])
def test_each_mode_runs_end_to_end_and_accounting_adds_up(tmp_path_factory: pytest.TempPathFactory,
                                                          mode: str) -> None:
    run_dir, summary = _mode_run(tmp_path_factory, mode)
    steps = MODE_RUN_STEPS[mode]
    _accounting_adds_up(summary, 4, steps)
    lines = read_metrics(run_dir)  # train rows
    assert [x["step"] for x in lines] == list(range(steps))
    assert all(x["max_staleness"] <= (1 if mode == "digenrl" else 0) for x in lines)
    assert (run_dir / "trace.json").is_file()
    assert list((run_dir / "samples").glob("*.png"))


def test_digenrl_mode_never_trains_beyond_staleness_one(tmp_path_factory: pytest.TempPathFactory) -> None:
    from digenrl.telemetry.trace import read_trace

    run_dir, summary = _mode_run(tmp_path_factory, "digenrl")
    assert summary["steps"] == MODE_RUN_STEPS["digenrl"] == 4
    hist = {int(k): v for k, v in summary["staleness_hist"].items()}
    assert max(hist) <= 1 and min(hist) >= 0
    assert summary["accounting"]["discarded"].get("stale", 0) == 0
    for row in read_metrics(run_dir):  # every trained trajectory is dated, by the ledger
        assert sum(v for k, v in row.items() if k.startswith("staleness/")) == row["trained"]
        assert row["rejected_stale"] == 0
    # every new version reached the rollout by prefetch or boundary fetch, and was applied
    _, spans = read_trace(run_dir / "trace.json")
    rollout = [s for s in spans if s.node.startswith("rollout")]
    fetched = [s for s in rollout if s.name in ("weight_prefetch", "weight_fetch")]
    applied = [s for s in rollout if s.name == "weight_apply"]
    assert fetched and len(applied) >= 1 and len(fetched) >= len(applied)


def test_disagg_sync_equals_colocated_after_two_steps(tmp_path: Path,
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    assert MODE_RUN_STEPS["disagg-sync"] == 2
    a, _ = _launch(tmp_path, "colocated", ["runtime.fragments_per_step=1"])
    b, _ = _mode_run(tmp_path_factory, "disagg-sync")
    pa, pb = final_weights(a), final_weights(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=1e-6, msg=k)


def test_tsp_two_ranks_and_gap_four_fragments_give_the_same_update(tmp_path: Path) -> None:
    extra = ["train.prompts_per_step=4", "run.steps=1"]
    base, _ = _launch(tmp_path / "one", "digenrl", [*extra, "runtime.fragments_per_step=1"])
    gap, _ = _launch(tmp_path / "gap", "digenrl", [*extra, "runtime.fragments_per_step=4"])
    tsp, _ = _launch(tmp_path / "tsp", "digenrl", [*extra, "runtime.fragments_per_step=1"], trainers=2)
    p0 = final_weights(base)
    for other in (final_weights(gap), final_weights(tsp)):
        for k in p0:
            torch.testing.assert_close(other[k], p0[k], rtol=0, atol=1e-6, msg=k)


def test_nft_runtime_update_equals_the_colocated_loops_at_staleness_zero(tmp_path: Path) -> None:
    """DiffusionNFT through the wire (CleanSample, the trainer's own draws, two TSP ranks
    splitting the draw slots) leaves the colocated loop's parameters."""
    nft = ["train.algorithm=nft", "train.forward_timesteps=2", "sampler.ode_solver=dpm2"]
    a, _ = _launch(tmp_path, "colocated", [*nft, "runtime.fragments_per_step=1"])
    b, summary = _launch(tmp_path, "disagg-sync", nft, trainers=2)
    _accounting_adds_up(summary, 4, 2)
    pa, pb = final_weights(a), final_weights(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=1e-6, msg=k)



def test_nodes_forked_from_the_server_train_the_weights_exec_started_nodes_train(tmp_path: Path) -> None:
    """``cluster.spawn``: a node forked from the pre-imported server (actors/forkserver.py) runs
    the code an exec'd interpreter runs, on its own environment and thread count."""
    fork_dir, fork_summary = _launch(tmp_path / "fork", "disagg-sync", ['cluster.spawn="fork"'])
    exec_dir, exec_summary = _launch(tmp_path / "exec", "disagg-sync", ['cluster.spawn="exec"'])
    assert fork_summary["accounting"] == exec_summary["accounting"]
    a, b = final_weights(fork_dir), final_weights(exec_dir)
    assert a.keys() == b.keys()
    # exact on purpose: a K = 0 run replays the same arithmetic on the same machine and thread
    # count whichever way its processes started
    assert all(torch.equal(a[k], b[k]) for k in a)
