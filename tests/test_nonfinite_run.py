"""A rollout whose GPU starts emitting NaN, in a live run: nothing poisoned, nothing lost, the node named.

``DIGENRL_TEST_NAN=rollout-1:3`` (digenrl/faults.py) makes rollout-1's sampler output NaN for
every fragment of step >= 3. The trainer discards those trajectories as ``nonfinite``, the
scheduler counts them against rollout-1 and, ``run.node_fault_limit`` fragments in a row
later, drops it (its work goes to rollout-0) or stops the run naming it.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.conftest import SMALL, final_weights, launch_command, launch_env

pytestmark = pytest.mark.slow

STEPS = 6


def _launch(run_dir: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    cmd = launch_command("--mode", "digenrl", "--steps", str(STEPS), "--rollouts", "2",
                         "--run-dir", str(run_dir),
                         sets=[*SMALL, "runtime.heartbeat_s=0.25", "run.node_fault_limit=2", *sets])
    return subprocess.run(cmd, env=launch_env(nan="rollout-1:3"), start_new_session=True,
                          capture_output=True, text=True, timeout=400, check=False)


def _no_constant(name: str) -> float:
    raise AssertionError(f"metrics.jsonl holds {name}")


def _numbers(value: object) -> list[float]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return [float(value)] if isinstance(value, int | float) else []


def test_a_rollout_emitting_nan_from_step_3_is_discarded_counted_named_and_dropped(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _launch(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    acc = s["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
    assert acc["in_flight"] == 0 and s["steps"] == STEPS
    assert s["slots"]["consumed"] == s["slots"]["expected"]
    assert acc["discarded"].get("nonfinite", 0) > 0
    sched = s["scheduler"]
    # only rollout-1 sent non-finite values, and only from step 3 on
    assert set(sched["nonfinite_by_node"]) == {"rollout-1"}
    assert sched["nonfinite_by_node"]["rollout-1"] >= acc["discarded"]["nonfinite"]
    assert set(sched["broken_nodes"]) == {"rollout-1"} and s["recovery"]["nodes_broken"] == 1
    assert any(k.startswith("rollout-1") and v["broken"] for k, v in s["nodes"].items())
    # every row parses without NaN / Infinity, and every number in it is finite
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=_no_constant) for line in lines]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(math.isfinite(x) for r in rows for x in _numbers(r))
    assert all(r["loss"] is not None and r["reward_mean"] is not None for r in rows)
    assert sum(r["discarded_nonfinite"] for r in rows[:3]) == 0  # nothing before step 3
    assert all(r["skipped_steps"] == 0 for r in rows)  # bad trajectories never reach the loss
    # the weights trained on finite data only
    assert all(bool(t.isfinite().all()) for t in final_weights(run_dir).values())
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert '"non-finite trajectories discarded"' in trainer_log and '"rollout-1"' in trainer_log
    coord_log = (run_dir / "logs" / "launcher.log").read_text()  # the coordinator runs in the launcher
    assert "node broken: dropped, its work reassigned" in coord_log


def test_with_node_fault_action_stop_the_run_stops_with_one_line_naming_the_node(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, 'run.node_fault_action="stop"')
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    named = [ln for ln in proc.stderr.splitlines() if "node rollout-1 is broken" in ln]
    assert named and "non-finite values" in named[-1], proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    acc = s["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
    assert s["stop_reason"].startswith("failed: node rollout-1 is broken")
