"""The report and the metrics contract, on a synthetic run dir made with the real recorders."""

from __future__ import annotations

import io
import json
import random
import sys
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from digenrl.telemetry.metrics import (
    MetricsWriter,
    MissingExtraError,
    StepMetrics,
    documented_keys,
    is_documented,
    read_metrics,
)
from digenrl.telemetry.prometheus import start_prometheus
from digenrl.telemetry.report import PNG_SIZES, make_report
from digenrl.telemetry.trace import SpanRecorder, busy_by_node, merge_traces
from tests.test_observability import TWO_EXPERTS_ONLY

MS = 1_000_000
EPOCH = 1_700_000_000 * 1_000_000_000
STEP_MS = 100


class Clock:
    def __init__(self) -> None:
        self.t = EPOCH

    def __call__(self) -> int:
        return self.t


def _span(rec: SpanRecorder, clock: Clock, name: str, start_ms: float, end_ms: float,
          tid: int = 0) -> None:
    clock.t = EPOCH + int(start_ms * MS)
    token = rec.begin(name, tid=tid)
    clock.t = EPOCH + int(end_ms * MS)
    rec.end(token)


def make_run_dir(run_dir: Path, steps: int = 6, seed: int = 0) -> Path:
    """A 2-rollout, 2-trainer one-step-async run: rollouts generate step s+1 while trainers
    train step s; rollout-1 is 15 % slower; trainers wait for each fragment's rewards."""
    rng = random.Random(seed)
    clock = Clock()
    rollouts = [SpanRecorder(f"rollout-{i}", "rollout", clock) for i in range(2)]
    trainers = [SpanRecorder(f"trainer-{i}", "trainer", clock) for i in range(2)]
    writer = MetricsWriter(run_dir, tensorboard=False)
    for s in range(steps):
        t = s * STEP_MS
        for i, rec in enumerate(rollouts):
            per = 8 * (1.15 if i else 1.0)
            _span(rec, clock, "weight_apply", t, t + 3)
            cursor = t + 3
            for _fragment in range(2):
                for _ in range(4):
                    _span(rec, clock, "denoise_step", cursor, cursor + per)
                    _span(rec, clock, "send_chunk", cursor + per, cursor + per + 1.5, tid=1)
                    cursor += per
                _span(rec, clock, "reward", cursor, cursor + 5)
                cursor += 5
            _span(rec, clock, "wait", cursor, t + STEP_MS)
        for r, rec in enumerate(trainers):
            _span(rec, clock, "wait", t, t + 42)
            _span(rec, clock, "fragment_train", t + 42, t + 57 + r)
            _span(rec, clock, "wait", t + 57 + r, t + 79)
            _span(rec, clock, "fragment_train", t + 79, t + 93)
            _span(rec, clock, "optimizer_step", t + 93, t + 97)
            if r == 0:
                _span(rec, clock, "weight_publish", t + 97, t + 99.5)
        window = (EPOCH + t * MS, EPOCH + (t + STEP_MS) * MS)
        spans = [sp for rec in rollouts + trainers for sp in rec.spans(since_ns=window[0])]
        mean = 0.3 + 0.05 * s + rng.uniform(-0.02, 0.02)
        writer.write(StepMetrics(
            step=s, policy_version=s + 1, wall_time=(window[1] - EPOCH) / 1e9, step_seconds=STEP_MS / 1e3,
            samples_per_s=16 / (STEP_MS / 1e3) * rng.uniform(0.9, 1.0), reward_mean=mean,
            reward_std=0.1 - 0.01 * s, loss=rng.gauss(0, 0.01), kl=1e-4 * s, clipfrac=0.01 * s,
            ratio_max_dev=1e-4 * s, grad_norm=rng.uniform(0.5, 1.5), max_staleness=min(s, 1),
            mean_staleness=0.5 if s else 0.0, zero_adv_groups=s % 2, trained=16,
            discarded=4 * (s % 2), reward_terms={"jpeg_compressibility": mean},
            adv_terms={"jpeg_compressibility/std": 0.9, "jpeg_compressibility/mean_abs": 0.8},
            staleness_hist={str(min(s, 1)): 16},
            busy=busy_by_node(spans, *window), batch={"rollout-1": 4.0 - 0.5 * (s % 2)},
            gpu_util={n.node_id: 90.0 for n in trainers}, gpu_mem_used_mb={"trainer-0": 4096.0}))
        if s in (0, steps - 1):  # held-out evaluations of versions 0 and the last one, policy and EMA
            v = 0 if s == 0 else steps
            writer.write_eval(v, (window[1] - EPOCH) / 1e9, {
                "eval/shapes_attributes/all": 0.35 + 0.01 * v, "eval/shapes_attributes/shape": 0.4,
                "eval/shapes_judge": -2.0 + 0.1 * v, "eval/diversity": 0.6 - 0.01 * v,
                "eval/samples": 96, "eval/seconds": 1.5,
                # and its EMA's (eval.policy = "both")
                "eval_ema/shapes_attributes/all": 0.34 + 0.01 * v, "eval_ema/shapes_judge": -2.1 + 0.1 * v,
                "eval_ema/diversity": 0.59 - 0.01 * v, "eval_ema/samples": 96, "eval_ema/seconds": 1.5})
    writer.close()
    for rec in rollouts + trainers:
        rec.dump(run_dir / "trace" / f"{rec.node_id}.jsonl")
    merge_traces(run_dir)
    everything = [sp for rec in rollouts + trainers for sp in rec.spans()]
    summary = {
        "samples_per_s": 16 * steps / (steps * STEP_MS / 1e3), "wall_s": steps * STEP_MS / 1e3,
        "steps": steps,
        "accounting": {"admitted": 16 * steps + 16 + 8, "trained": 16 * steps,
                       "discarded": {"zero_adv_group": 8 * (steps // 2), "stale": 0},
                       "in_flight": 16 + 8 - 8 * (steps // 2)},
        "staleness_hist": {"0": 16, "1": 16 * (steps - 1)},
        "busy": busy_by_node(everything, min(x.start for x in everything),
                             max(x.end for x in everything)),
        "batch_rows_per_forward": {"rollout-1": 3.75},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "config.toml").write_text(f'[run]\nsteps = {steps}\nmode = "digenrl"\n')
    (run_dir / "samples").mkdir()
    for s in (0, steps - 1):
        img = Image.new("RGB", (256, 128), "white")
        draw = ImageDraw.Draw(img)
        for k in range(8):  # later steps draw rounder, redder shapes
            x = 32 * k
            draw.ellipse((x + 4, 40, x + 28, 64 + 4 * s), fill=(40 * s % 256, 80, 200 - 20 * s))
        img.save(run_dir / "samples" / f"step_{s}.png")
    (run_dir / "logs").mkdir()
    return run_dir


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run_dir = make_run_dir(tmp_path_factory.mktemp("run"))
    return run_dir, make_report(run_dir, stream=io.StringIO())


def test_every_png_exists_opens_and_has_its_size(report):
    _, result = report
    assert set(result["pngs"]) == set(PNG_SIZES) and result["skipped"] == {}
    for name, path in result["pngs"].items():
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:
            assert img.size == PNG_SIZES[name], name


def test_summary_table_shows_throughput_busy_staleness_and_balanced_accounting(report):
    _, result = report
    table = result["table"]
    assert "throughput 160.000 samples/s" in table
    for node in ("rollout-0", "rollout-1", "trainer-0", "trainer-1"):
        assert node in table
    assert "    1        80   83.3%" in table
    assert "trained 96 + discarded 24 (stale 0, zero_adv_group 24) + in flight 0   OK" in table


def test_summary_table_shows_each_batching_rollouts_occupancy(report):
    lines = report[1]["table"].splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("rollout batch occupancy"))
    assert lines[i + 1].split() == ["rollout-1", "3.75"]


def test_step_rows_carry_each_batching_rollouts_rows_per_forward_since_the_last_row(tmp_path):
    from digenrl.telemetry.steprows import StepRows

    written = []

    class Ledger:
        def step_consumed(self, step):
            return 1

        def pop_trained_staleness(self, step):
            return {}

    class Sink:
        def write(self, m):
            written.append(m.to_record())

    rows = StepRows(Sink())
    base = {"busy_s": 1.0, "wall_s": 2.0}
    rows.node_stats("rollout-0", {**base, "batch_forwards": 10.0, "batch_rows": 40.0})
    rows.node_stats("rollout-1", base)  # one fragment at a time: no batch stats
    metrics = {k: 0 for k in ("step_seconds", "samples_per_s", "reward_mean", "reward_std", "loss", "kl",
                              "clipfrac", "ratio_max_dev", "grad_norm", "max_staleness", "mean_staleness",
                              "zero_adv_groups", "trained", "discarded")}
    rows.step_done(0, 1, metrics, wall_time=1.0, traffic=(0, 0))
    rows.node_stats("rollout-0", {**base, "batch_forwards": 14.0, "batch_rows": 64.0})
    rows.step_done(1, 2, metrics, wall_time=2.0, traffic=(0, 0))
    rows.step_done(2, 3, metrics, wall_time=3.0, traffic=(0, 0))  # no forward since the last row
    rows.flush(Ledger(), 1)
    assert [{k: v for k, v in r.items() if k.startswith("batch/")} for r in written] == [
        {"batch/rollout-0": 4.0}, {"batch/rollout-0": 6.0}, {}]
    assert rows.batch_occupancy() == {"rollout-0": 64.0 / 14.0}


def test_busy_fractions_from_trace_json_equal_the_summary(report):
    _, result = report
    assert result["busy_trace"] == pytest.approx(result["summary"]["busy"], abs=1e-9)


def test_unbalanced_accounting_is_flagged(tmp_path):
    run_dir = make_run_dir(tmp_path, steps=2)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["accounting"]["trained"] -= 1
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert "MISMATCH" in make_report(run_dir, stream=None)["table"]


def test_report_merges_node_traces_when_trace_json_is_missing_and_skips_absent_samples(tmp_path):
    run_dir = make_run_dir(tmp_path, steps=2)
    (run_dir / "trace.json").unlink()
    for p in (run_dir / "samples").iterdir():
        p.unlink()
    result = make_report(run_dir, tmp_path / "out", stream=None)
    assert (run_dir / "trace.json").exists() and "timeline" in result["pngs"]
    assert result["skipped"] == {"samples": "no samples/step_<n>.png"}


def test_missing_run_dir_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="nope"):
        make_report(tmp_path / "nope", stream=None)


def test_every_emitted_key_is_documented_and_every_documented_key_is_emitted(report):
    run_dir, _ = report
    documented = documented_keys()
    emitted = {k for rec in read_metrics(run_dir, kind="all") for k in rec}
    assert {k for k in emitted if not is_documented(k, documented)} == set()
    for doc in documented - TWO_EXPERTS_ONLY:  # those only a two-expert model emits (tests/test_wan22.py)
        assert any(is_documented(k, [doc]) for k in emitted), doc


def test_wildcard_documentation_matches_only_its_prefix():
    assert is_documented("busy/trainer-3", {"busy/<node>"})
    assert not is_documented("busy/", {"busy/<node>"})
    assert not is_documented("busybody", {"busy/<node>"})


def test_metrics_lines_are_flushed_before_close(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    record = writer.write(StepMetrics(
        step=0, policy_version=1, wall_time=1.0, step_seconds=1.0, samples_per_s=2.0,
        reward_mean=0.5, reward_std=0.1, loss=float("nan"), kl=0.0, clipfrac=0.0,
        ratio_max_dev=0.0, grad_norm=1.0, max_staleness=0, mean_staleness=0.0,
        zero_adv_groups=0, trained=2, discarded=0, busy={"rollout-0": 0.5}))
    (line,) = read_metrics(tmp_path)
    # a NaN is written as null (no value) and counted, never as NaN (docs/operations.md)
    assert line["busy/rollout-0"] == 0.5 and line["loss"] is None and line["nonfinite_metrics"] == 1
    assert line.keys() == record.keys()
    writer.close()


def test_tensorboard_is_skipped_when_not_installed(tmp_path):
    import importlib.util
    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    with MetricsWriter(tmp_path) as writer:
        assert writer.trackers.names == []
    assert not (tmp_path / "tb").exists()


def test_prometheus_without_the_extra_is_a_clear_error(monkeypatch):
    # the suite installs prometheus-client (tests/test_observability.py scrapes it): here a
    # None in sys.modules makes its import fail as it does where the extra is not installed
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    with pytest.raises(MissingExtraError, match=r"digenrl\[metrics\]"):
        start_prometheus(9400, dict)


def test_sample_grids_upscale_small_images_and_never_exceed_the_cap():
    import torch

    from digenrl.telemetry.images import MAX_SIDE, grid

    small = torch.zeros(16, 3, 32, 32, dtype=torch.uint8)
    assert grid(small, nrow=4).size == (4 * (4 * 34 + 2),) * 2  # 4x nearest, as always
    # 16 FLUX samples of 1024 px: once a 16424 px square of 62 MB written for 19 s
    large = torch.zeros(16, 3, 1024, 1024, dtype=torch.uint8)
    img = grid(large, nrow=4)
    assert max(img.size) == MAX_SIDE == 2048 and img.size[0] == img.size[1]
    wide = torch.zeros(2, 3, 64, 4096, dtype=torch.uint8)  # video frames tiled side by side
    assert max(grid(wide, nrow=2).size) == MAX_SIDE


def test_summary_table_shows_the_emas_evaluation_beside_the_policys(report):
    table = report[1]["table"]
    assert "eval/shapes_judge" in table and "eval_ema/shapes_judge" in table
    assert "eval/diversity" in table and "eval_ema/diversity" in table  # beside the fidelity terms
    assert "eval_ema/samples" not in table  # bookkeeping, not a score
