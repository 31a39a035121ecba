"""Held-out evaluation: deterministic ODE samples with fixed seeds, eval/ rows in every mode,
the report's curves, and `digenrl eval` on a saved policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from digenrl.config import load_config, resolve_mode
from digenrl.data.prompts import load_splits
from digenrl.launch import evaluate_run, launch, make_run_dir
from digenrl.models import build_model
from digenrl.rl.evaluate import build_eval_reward, eval_due, eval_samples, evaluate, generate
from digenrl.telemetry.metrics import documented_keys, is_documented, read_metrics
from tests.conftest import SUITE_SETS, TEST_THREADS, launch_env

TINY = [*SUITE_SETS, 'model.path="random"', "train.prompts_per_step=2", "train.group_size=2",
        "runtime.fragments_per_step=1", "sampler.num_steps=4", "prompts.test_fraction=0.1",
        "eval.prompts=3", "eval.samples_per_prompt=2", "eval.batch_size=4",
        'eval.terms=[{ name = "brightness" }, { name = "reward_plugins:attributes", label = "judge" }]']


def test_evaluation_is_deterministic_batch_independent_and_ignores_the_run_seed():
    cfg = load_config(None, [*TINY, "run.eval_every=1"])
    test = load_splits(cfg.prompts)[1]
    model = build_model(cfg.model, seed=0)
    a, plan = generate(model, cfg, test)
    b, _ = generate(model, cfg, test)
    assert torch.equal(a, b)  # same process, same weights, same seeds: exactly the same
    assert len(plan) == 6 and len({s for _, s in plan}) == 6 and [i for i, _ in plan] == [0, 0, 1, 1, 2, 2]
    other = load_config(None, [*TINY, "run.eval_every=1", "run.seed=7", "eval.batch_size=1"])
    assert eval_samples(other, test) == plan  # the noise is the eval's, not the run's
    c, _ = generate(model, other, test)
    # batch 1 vs 4: per-sample seeds give the same noise; the model's batch-size rounding
    # (~1e-7 in float32) may flip a pixel's last uint8 step, never more
    assert (a.int() - c.int()).abs().max() <= 1
    reseeded = load_config(None, [*TINY, "run.eval_every=1", "eval.seed=1"])
    assert not torch.equal(generate(model, reseeded, test)[0], a)


def test_evaluation_reports_every_value_and_writes_grid_and_per_sample_lines(tmp_path):
    cfg = load_config(None, [*TINY, "run.eval_every=1"])
    test = load_splits(cfg.prompts)[1]
    row = evaluate(build_model(cfg.model, seed=0), cfg, test, build_eval_reward(cfg), version=4,
                   run_dir=tmp_path)
    assert set(row) == {"eval/brightness", "eval/judge/shape", "eval/judge/all", "eval/samples",
                        "eval/seconds"}
    assert row["eval/judge/all"] == 0.5 and row["eval/samples"] == 6
    lines = [json.loads(x) for x in (tmp_path / "eval" / "v0004.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and {x["prompt"] for x in lines} <= set(test.prompts)
    assert sum(x["brightness"] for x in lines) / 6 \
        == pytest.approx(row["eval/brightness"], rel=1e-6)
    assert (tmp_path / "samples" / "eval_v0004.png").is_file()
    docs = documented_keys()
    assert all(is_documented(k, docs) for k in row), sorted(k for k in row if not is_documented(k, docs))


def test_evaluation_is_due_at_zero_every_n_and_at_the_end():
    cfg = load_config(None, [*TINY, "run.eval_every=4", "run.steps=10"])
    assert [v for v in range(11) if eval_due(v, cfg)] == [0, 4, 8, 10]
    assert not any(eval_due(v, load_config(None, TINY)) for v in range(5))


def _eval_rows(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir, kind="eval")


def test_colocated_run_evaluates_at_start_every_n_and_end_and_digenrl_eval_reproduces_it(tmp_path):
    from digenrl.telemetry.report import make_report

    cfg = resolve_mode(load_config(None, [*TINY, "run.steps=3", "run.eval_every=2"]), "colocated")
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    launch(cfg, run_dir)
    rows = _eval_rows(run_dir)
    assert [r["policy_version"] for r in rows] == [0, 2, 3]
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]  # train rows unchanged
    assert all("eval/judge/all" in r and "eval/brightness" in r for r in rows)
    assert (run_dir / "samples" / "eval_v0000.png").is_file() and (run_dir / "eval" / "v0003.jsonl").is_file()
    report = make_report(run_dir, stream=None)
    assert "eval" in report["pngs"] and "held-out evaluation, version 0 -> 3" in report["table"]
    again = evaluate_run(run_dir, out_dir=tmp_path / "again")
    assert again["policy_version"] == 3
    # the same weights, seeds and code in a fresh model: the training run's final evaluation
    assert again["eval/brightness"] == pytest.approx(rows[-1]["eval/brightness"], abs=1e-6)
    base = evaluate_run(run_dir, "base", out_dir=tmp_path / "base")
    assert base["policy_version"] == 0 and base["eval/brightness"] == pytest.approx(
        rows[0]["eval/brightness"], abs=1e-6)


def test_digenrl_eval_refuses_a_missing_checkpoint_in_one_line(tmp_path):
    from digenrl.config import ConfigError

    cfg = resolve_mode(load_config(None, [*TINY, "run.eval_every=1"]), "colocated")
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"final/policy.safetensors' does not exist"):
        evaluate_run(run_dir)


@pytest.mark.slow
def test_digenrl_mode_evaluates_on_trainer_rank_0_at_start_and_end(tmp_path, monkeypatch):
    # the eval terms name tests/reward_plugins.py: the launched nodes import it too
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    cfg = resolve_mode(load_config(None, [*TINY, "run.steps=2", "run.eval_every=2"]), "digenrl")
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    summary = launch(cfg, run_dir)
    assert summary["accounting"]["in_flight"] == 0
    rows = _eval_rows(run_dir)
    assert [r["policy_version"] for r in rows] == [0, 2]
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]
    assert (run_dir / "samples" / "eval_v0002.png").is_file()
    # rank 0 evaluated the very weights it saved: `digenrl eval` of final/ agrees
    again = evaluate_run(run_dir, out_dir=tmp_path / "again")
    assert again["eval/brightness"] == pytest.approx(rows[-1]["eval/brightness"], abs=1e-6)


@pytest.mark.slow
def test_the_shipped_default_trains_a_lora_on_the_judge_and_evaluates_at_start_and_end(tmp_path):
    """The real default (not the suite's, tests/conftest.py): the shipped base, LoRA, the base
    model's tail, the shapes judge as reward, the other judge and pixel_std as evaluation. Only
    its length is cut: 3 steps, and 1 of the 16 evaluation seeds per test prompt."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "digenrl.cli", "launch", "--steps", "3", "--run-dir", str(run_dir),
         "--set", f"run.threads={TEST_THREADS}", "--set", "eval.samples_per_prompt=1"],
        env=launch_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = read_metrics(run_dir)
    assert len(train) == 3 and all("reward/shapes_judge" in r for r in train)
    assert all(r["reward/shapes_judge"] <= 0 for r in train)  # a sum of log-probabilities
    evals = read_metrics(run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 3]
    for r in evals:
        assert r["eval/samples"] == 40
        assert 0 <= r["eval/shapes_attributes/all"] <= 1 and 0 < r["eval/pixel_std"] <= 0.5
    assert (run_dir / "final" / "pytorch_lora_weights.safetensors").is_file()
