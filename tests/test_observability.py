"""What a user sees of a run: metrics keys, trace, busy fractions, report, launch output, Prometheus.

The fast tests use a real HTTP server on loopback; the slow ones read one real small run per
mode (``digenrl launch`` as a subprocess, stdout a pipe), launched once per session and shared
with tests/test_launch.py (tests/conftest.py mode_run).
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from digenrl.telemetry.logging import configure_logging, get_logger
from digenrl.telemetry.metrics import (
    MissingExtraError,
    StepMetrics,
    documented_keys,
    is_documented,
    read_metrics,
)
from digenrl.telemetry.progress import Progress
from digenrl.telemetry.prometheus import flatten_stats, serve_node_metrics, start_prometheus
from digenrl.telemetry.report import PNG_SIZES, make_report
from digenrl.telemetry.trace import Span, busy_fraction, read_trace
from tests.conftest import MODE_RUN_HEARTBEAT_S, MODE_RUN_STEPS, mode_run

MODES = ("digenrl", "disagg-sync", "colocated")
HEARTBEAT_S = MODE_RUN_HEARTBEAT_S
NODES = {"digenrl": {"rollout-0", "trainer-0"}, "disagg-sync": {"rollout-0", "trainer-0"},
         "colocated": {"colocated-0"}}
# NVML readings: documented, but a CPU machine (and, for now, the coordinator) never writes them.
NVML_ONLY = {"gpu_util/<node>", "gpu_mem_used_mb/<node>"}
#: emitted only by two-expert models (Wan2.2 A14B): tests/test_wan22.py checks them
TWO_EXPERTS_ONLY = {"expert/t<i>", "expert/held/r<i>", "expert/changed"}
#: emitted only by a rollout with step-level batching: tests/test_batching.py checks it
BATCHING_ONLY = {"batch/<node>"}
# C0 and C1 control characters except the newline.
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")

needs_prometheus = pytest.mark.skipif(
    importlib.util.find_spec("prometheus_client") is None,
    reason="prometheus-client (the 'metrics' extra) is not installed")


def _row(**over: Any) -> dict[str, Any]:
    row = {"step": 2, "policy_version": 3, "wall_time": 12.5, "step_seconds": 1.25,
           "samples_per_s": 12.8, "reward_mean": 0.4, "reward_std": 0.1, "loss": 1e-3, "kl": 0.0,
           "clipfrac": 0.25, "ratio_max_dev": 1e-4, "grad_norm": 0.7, "max_staleness": 1,
           "mean_staleness": 0.5, "zero_adv_groups": 1, "trained": 12, "discarded": 4,
           "train_seconds": 0.9, "rejected_stale": 0, "discarded_nonfinite": 0, "skipped_steps": 0,
           "net_messages": 410.0, "net_bytes": 9.5e6,
           "reward/jpeg_compressibility": -1.9,
           "reward/aesthetic": 0.3, "adv/aesthetic/std": 0.9, "adv/aesthetic/mean_abs": 0.7,
           "busy/rollout-0": 0.8, "busy/trainer-0": 0.6, "staleness/1": 12}
    return {**row, **over}


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


# ----------------------------------------------------------------------------- StepMetrics


def test_a_trainer_row_round_trips_through_step_metrics_without_losing_a_key():
    row = _row()
    record = StepMetrics.from_record(row)
    assert record.reward_terms == {"jpeg_compressibility": -1.9, "aesthetic": 0.3}
    assert record.train_seconds == 0.9 and record.rejected_stale == 0
    assert record.to_record() == row


def test_an_unknown_key_is_written_as_is_not_dropped():
    record = StepMetrics.from_record(_row(queue_depth=7))
    assert record.extra == {"queue_depth": 7}
    assert record.to_record()["queue_depth"] == 7


def test_a_row_without_a_required_key_is_rejected_naming_it():
    row = _row()
    del row["grad_norm"]
    with pytest.raises(ValueError, match="grad_norm"):
        StepMetrics.from_record(row)


# ----------------------------------------------------------------------------- Prometheus


def test_heartbeat_stats_flatten_to_names_with_gpu_labels():
    stats = {"policy_version": 3, "busy_s": 4.5, "sockets": {"data": {"received": 9}},
             "gpu": {"available": True, "reason": "", "gpus": [
                 {"index": 1, "name": "H100", "mem_used_mb": 512.0, "power_w": None}]}}
    assert sorted(flatten_stats(stats)) == sorted([
        ("policy_version", (), 3.0), ("busy_s", (), 4.5), ("sockets_data_received", (), 9.0),
        ("gpu_available", (), 1.0), ("gpu_mem_used_mb", (("gpu", "1"),), 512.0)])


@needs_prometheus
def test_node_metrics_are_scraped_live_with_node_and_gpu_labels():
    stats: dict[str, Any] = {"policy_version": 1, "busy_s": 2.0, "wall_s": 4.0,
                             "sockets": {"data": {"sent": 0, "received": 5, "bad_frames": 0}},
                             "gpu": {"available": True, "gpus": [{"index": 0, "util_pct": 87.0}]}}
    with serve_node_metrics(0, lambda: stats, node_id="rollout-0", addr="127.0.0.1") as server:
        first = _scrape(server.url)
        stats["policy_version"] = 2
        stats["sockets"]["data"]["bad_frames"] = 3
        second = _scrape(server.url)
    assert first['digenrl_node_policy_version{node="rollout-0"}'] == 1.0
    assert first['digenrl_node_gpu_util_pct{gpu="0",node="rollout-0"}'] == 87.0
    assert second['digenrl_node_policy_version{node="rollout-0"}'] == 2.0
    assert second['digenrl_node_sockets_data_bad_frames{node="rollout-0"}'] == 3.0


@needs_prometheus
def test_closing_the_node_server_releases_its_port():
    server = serve_node_metrics(0, dict, addr="127.0.0.1")
    port = server.port
    server.close()
    server.close()  # idempotent
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@needs_prometheus
def test_the_last_step_record_is_served_with_node_and_term_labels():
    with start_prometheus(0, lambda: StepMetrics.from_record(_row()).to_record()) as server:
        got = _scrape(server.url)
    assert got['digenrl_busy{node="trainer-0"}'] == 0.6
    assert got['digenrl_reward{term="aesthetic"}'] == 0.3
    assert got['digenrl_adv_std{term="aesthetic"}'] == 0.9
    assert got['digenrl_adv_mean_abs{term="aesthetic"}'] == 0.7
    assert got['digenrl_staleness{k="1"}'] == 12.0  # trajectories one version behind
    assert got["digenrl_reward_mean"] == 0.4


@needs_prometheus
def test_a_coordinator_nodes_endpoint_serves_each_step_record_as_it_is_written(tmp_path):
    """``digenrl-node --role coordinator --prometheus-port``: the run's MetricsWriter hands each
    record it writes to the endpoint (actors/node.py), nothing before the first."""
    from digenrl.actors.node import LatestStats, NodeOptions, _start_prometheus
    from digenrl.telemetry.metrics import MetricsWriter
    latest = LatestStats()
    opts = NodeOptions(role="coordinator", prometheus_port=0, prometheus_addr="127.0.0.1")
    server = _start_prometheus(opts, latest, "coordinator-0")
    assert server is not None
    try:
        assert not any(k.startswith("digenrl_reward") for k in _scrape(server.url))
        writer = MetricsWriter(tmp_path, tensorboard=False, sink=latest.update)
        writer.write(StepMetrics.from_record(_row()))
        writer.write(StepMetrics.from_record(_row(step=3, policy_version=4, reward_mean=0.5)))
        got = _scrape(server.url)
    finally:
        server.close()
    assert got["digenrl_policy_version"] == 4.0 and got["digenrl_reward_mean"] == 0.5
    assert got['digenrl_busy{node="trainer-0"}'] == 0.6


def test_a_node_without_a_prometheus_port_takes_no_snapshot_per_heartbeat():
    from digenrl.actors.node import LatestStats
    latest, looked = LatestStats(), []
    latest.watch(lambda: looked.append(1) or {"policy_version": 3})
    latest.served = False  # what run_node sets without --prometheus-port
    latest.update({"busy_s": 1.0})
    assert latest.stats == {} and looked == []
    latest.served = True
    latest.update({"busy_s": 1.0})
    assert latest.stats == {"busy_s": 1.0, "policy_version": 3} and looked == [1]


@needs_prometheus
def test_a_nodes_prometheus_port_already_taken_is_a_one_line_error_naming_it():
    from digenrl.actors.node import LatestStats, NodeOptions, _start_prometheus
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        opts = NodeOptions(role="trainer", prometheus_port=port, prometheus_addr="127.0.0.1")
        with pytest.raises(SystemExit, match=rf"--prometheus-port {port} on 127.0.0.1: .*in use"):
            _start_prometheus(opts, LatestStats(), "trainer-0")


def test_node_metrics_without_prometheus_client_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # what an absent package looks like
    with pytest.raises(MissingExtraError, match=r"pip install 'digenrl\[metrics\]'"):
        serve_node_metrics(0, dict)


@pytest.mark.parametrize("port", [-1, 65536, "9400", True])
def test_a_bad_port_is_a_value_error_naming_it(port):
    with pytest.raises(ValueError, match=re.escape(repr(port))):
        serve_node_metrics(port, dict)


# ----------------------------------------------------------------------------- terminal


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def restore_logging():
    yield
    configure_logging(json=True, stream=io.StringIO())
    logging.getLogger().setLevel(logging.WARNING)


def test_a_log_record_on_the_terminal_steps_around_the_progress_line(restore_logging):
    screen = Terminal()  # stdout and stderr of one terminal, as a user sees them
    configure_logging(stream=screen, level="info")
    progress = Progress(3, screen, clock=lambda: 0.0)
    progress.update(_row(step=0, policy_version=1))
    get_logger("coordinator", "coordinator").info("stopping", reason="done")
    text = screen.getvalue()
    before, rest = text.split("\r\x1b[2K")[1:]  # drawn, then erased for the record
    record, _, after = rest.rpartition("\n")
    assert before.startswith("step 1/3") and "\n" not in before
    assert "stopping" in record and "step" not in record
    assert after == before  # the line is drawn again under the record


def test_the_last_step_line_stays_so_the_next_print_starts_a_new_line():
    screen = Terminal()
    progress = Progress(2, screen, clock=lambda: 0.0)
    for step in range(2):
        progress.update(_row(step=step, policy_version=step + 1))
    print("digenrl: done", file=screen)
    assert screen.getvalue().splitlines()[-1] == "digenrl: done"
    assert "step 2/2" in screen.getvalue().splitlines()[-2]


# ----------------------------------------------------------------------------- real launches


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """The small run per mode (tests/conftest.py mode_run, shared with tests/test_launch.py),
    run as a user would, its stdout and stderr pipes."""
    return {mode: mode_run(tmp_path_factory, mode) for mode in MODES}


def _nest_or_follow(spans: list[Span]) -> None:
    """Within one lane, a span either lies inside the enclosing open span or after it."""
    stack: list[Span] = []
    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        while stack and stack[-1].end <= s.start:
            stack.pop()
        if stack:
            assert s.end <= stack[-1].end, f"{s} overlaps {stack[-1]} without nesting"
        stack.append(s)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_launch_output_to_a_pipe_has_no_control_characters(launched, mode):
    _, proc = launched[mode]
    for name, data in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        text = data.decode("utf-8")
        assert not CONTROL.findall(text), (name, sorted(set(CONTROL.findall(text))))
    lines = proc.stdout.decode().splitlines()
    n = MODE_RUN_STEPS[mode]
    assert [x for x in lines if x.startswith("step ")][-1].startswith(f"step {n}/{n}  v{n}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["digenrl", "disagg-sync"])
def test_every_node_froze_its_start_up_objects_when_it_joined(launched, mode):
    # nodes/node.py freeze_startup_objects: torch, diffusers and the model out of every full
    # collection and out of the interpreter's exit (docs/benchmarks.md, Start-up)
    run_dir, _ = launched[mode]
    for node in NODES[mode]:
        records = [json.loads(line) for line in (run_dir / "logs" / f"{node}.log").read_text().splitlines()
                   if line.startswith("{")]
        joined = [r for r in records if r["event"] == "joined"]
        assert len(joined) == 1 and joined[0]["frozen_objects"] > 100_000, (node, joined)
        assert [r["exit_code"] for r in records if r["event"] == "node_final"] == [0], node


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_metrics_keys_of_a_real_launch_are_exactly_the_documented_ones(launched, mode):
    run_dir, _ = launched[mode]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(MODE_RUN_STEPS[mode]))
    emitted = {k for r in rows for k in r}
    documented = documented_keys()
    assert {k for k in emitted if not is_documented(k, documented)} == set()
    # every documented key is emitted, except NVML's (no GPU here), the two-expert models', the
    # step batcher's, and
    # the evaluation's, which go in eval rows of runs with run.eval_every > 0 (tests/test_evaluate.py
    # checks those)
    eval_keys = {d for d in documented if d.startswith(("eval/", "eval_ema/"))}
    assert {d for d in documented - NVML_ONLY - TWO_EXPERTS_ONLY - BATCHING_ONLY - eval_keys
            if not any(is_documented(k, [d]) for k in emitted)} == set()
    assert {k for k in emitted if k.startswith("busy/")} == {f"busy/{n}" for n in NODES[mode]}
    assert "reward/jpeg_compressibility" in emitted


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_trace_json_has_one_track_per_node_process_and_spans_nest_in_each_lane(launched, mode):
    run_dir, _ = launched[mode]
    json.loads((run_dir / "trace.json").read_text())  # parses as plain JSON
    names, spans = read_trace(run_dir / "trace.json")
    assert sorted(names) == sorted(NODES[mode])
    assert {s.node for s in spans} == NODES[mode]
    lanes: dict[tuple[str, int], list[Span]] = {}
    for s in spans:
        assert s.end >= s.start
        lanes.setdefault((s.node, s.tid), []).append(s)
    for lane in lanes.values():
        _nest_or_follow(lane)


def _busy_range(spans: list[Span], t0: float, t_lo: float, t_hi: float) -> tuple[float, float]:
    """Busy fractions a heartbeat sent at any time in [t_lo, t_hi] can carry: the finished
    spans only, over [t0, t] (µs; sampled every millisecond)."""
    values = []
    t = t_lo
    while t <= t_hi:
        values.append(busy_fraction([s for s in spans if s.end <= t], t0, t))
        t += 1000.0
    return min(values), max(values)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["digenrl", "disagg-sync"])
def test_summary_busy_is_the_trace_busy_at_the_last_heartbeat(launched, mode):
    """summary.json's busy is busy_s / wall_s of each node's last heartbeat (BusyClock over the
    recorder's finished spans); recomputed from trace.json it must fall in the range the
    last heartbeat could have seen: sent at most two intervals (plus the coordinator's
    shutdown margin) before the node's last event."""
    run_dir, _ = launched[mode]
    summary = json.loads((run_dir / "summary.json").read_text())
    _, spans = read_trace(run_dir / "trace.json")
    for node in NODES[mode]:
        mine = [s for s in spans if s.node == node]
        t0, t_end = min(s.start for s in mine), max(s.end for s in mine)
        lo, hi = _busy_range(mine, t0, max(t0 + 1000.0, t_end - (2 * HEARTBEAT_S + 0.3) * 1e6),
                             t_end + 2 * HEARTBEAT_S * 1e6)
        assert lo - 0.01 <= summary["busy"][node] <= hi + 0.01, (node, summary["busy"][node], lo, hi)


@pytest.mark.slow
def test_colocated_trace_has_no_wait_and_is_busy_between_its_first_and_last_span(launched):
    """Colocated never waits for a peer: only bookkeeping (sample grids, metrics lines) sits
    between its spans. Its summary.json busy is not compared: the loop counts whole steps'
    wall time as busy over a window that includes saving the final weights (reported)."""
    run_dir, _ = launched["colocated"]
    _, spans = read_trace(run_dir / "trace.json")
    assert "wait" not in {s.name for s in spans}
    assert busy_fraction(spans, min(s.start for s in spans), max(s.end for s in spans)) >= 0.9


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_report_of_a_real_run_writes_every_png_at_its_size(launched, mode, tmp_path):
    run_dir, _ = launched[mode]
    result = make_report(run_dir, tmp_path, stream=io.StringIO())
    # these launches evaluate nothing (run.eval_every = 0): the eval curves are the one plot
    # skipped, and the report says why (tests/test_evaluate.py covers a run that evaluates)
    assert result["skipped"] == {"eval": "no eval/ rows in metrics.jsonl (run.eval_every = 0)"}
    assert set(result["pngs"]) == set(PNG_SIZES) - {"eval"}
    for name, path in result["pngs"].items():
        with Image.open(path) as img:
            assert img.size == PNG_SIZES[name], name
    assert "OK" in result["table"] and "MISMATCH" not in result["table"]
