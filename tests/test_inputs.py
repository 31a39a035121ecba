"""Hostile or careless input and damaged run-dir files end in one line naming the file, key or
line and what to do, quickly and in bounded memory, never a traceback (docs/operations.md).

Like tests/test_cli_errors.py, the commands run in this process (``digenrl.cli.main``), so an
exception that escapes fails the test; none of these cases gets as far as starting a node.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from digenrl.cli import main
from digenrl.config import ConfigError, load_config, to_toml
from digenrl.data.prompts import PromptError, load_prompt_set

SMALL = ["--set", "model.path=\"random\"", "--set", "train.prompts_per_step=2",
         "--set", "sampler.num_steps=4", "--set", "runtime.fragments_per_step=2"]


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _file(t: Path, name: str, content: bytes | str) -> Path:
    p = t / name
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    return p


def _prompts(t: Path, name: str, content: bytes | str) -> list[str]:
    p = _file(t, name, content)
    return ["launch", *SMALL, "--run-dir", str(t / "r"), "--set", f"prompts.file=\"{p}\""]


def _run_dir(t: Path, *, metrics: str | None = None, summary: str | None = None,
             config: str | None = None) -> Path:
    """A run folder with the files a finished run leaves (config.toml, metrics.jsonl, summary.json)."""
    run = t / "run"
    run.mkdir(exist_ok=True)
    (run / "config.toml").write_text(config if config is not None else to_toml(load_config(
        None, ["model.path=\"random\"", "prompts.test_fraction=0.25"])))
    rows = [json.dumps({"step": s, "policy_version": s + 1, "reward_mean": 0.5}) for s in range(3)]
    (run / "metrics.jsonl").write_text(metrics if metrics is not None else "".join(r + "\n" for r in rows))
    (run / "summary.json").write_text(summary if summary is not None else json.dumps({"steps": 3}))
    return run


def _truncated_policy(t: Path) -> list[str]:
    run = _run_dir(t)
    (run / "final").mkdir()
    import torch
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(64)}, str(run / "final" / "policy.safetensors"))
    whole = (run / "final" / "policy.safetensors").read_bytes()
    (run / "final" / "policy.safetensors").write_bytes(whole[:len(whole) // 2])
    return ["eval", str(run)]


# (case id, build argv from tmp_path, expected exit code, phrases the one line must contain)
CASES: list[tuple[str, Callable[[Path], list[str]], int, tuple[str, ...]]] = [
    # ---- config files and --set values
    ("config file nested 2000 deep",
     lambda t: ["config", "--config", str(_file(t, "c.toml", f"[reward]\nx = {_deep(2000)}\n"))], 2,
     ("c.toml", "nested deeper than")),
    ("config file nested 40 deep",
     lambda t: ["config", "--config", str(_file(t, "c.toml", f"[reward]\nx = {_deep(40)}\n"))], 2,
     ("c.toml", "nested deeper than")),
    ("--set value nested 3000 deep", lambda t: ["config", "--set", f"train.lr={_deep(3000)}"], 2,
     ("--set train.lr", "nested deeper than")),
    ("config file not UTF-8",
     lambda t: ["config", "--config", str(_file(t, "c.toml", b"[run]\nseed = 1\n# \xff\xfe\n"))], 2,
     ("c.toml", "not UTF-8", "byte 17")),
    ("config file of 2 MB", lambda t: ["config", "--config", str(_file(t, "c.toml", "#" * (2 << 20)))],
     2, ("c.toml", "bytes")),
    ("--set value of 20 MB", lambda t: ["config", "--set", "model.path=\"" + "x" * (20 << 20) + "\""], 2,
     ("--set model.path", "bytes")),
    ("a long value quoted in an error is cut",
     lambda t: ["config", "--config", str(_file(t, "c.toml", f"[model]\nfamily = \"{'y' * 500_000}\"\n"))],
     2, ("model.family", "500000 characters")),
    # ---- sizes, memory, timeouts
    ("a step that cannot fit in memory",
     lambda t: ["launch", *SMALL, "--run-dir", str(t / "r"), "--set", "train.prompts_per_step=4096",
                "--set", "train.group_size=1024", "--set", "model.family=\"flux\"", "--set", "model.height=2048",
                "--set", "model.width=2048"],
     2, ("train.prompts_per_step x train.group_size", "GiB")),
    ("a LoRA rank past the model's width",
     lambda t: ["launch", *SMALL, "--run-dir", str(t / "r"), "--set", "model.lora_rank=4096"], 2,
     ("model.lora_rank = 4096", "width")),
    ("a lease of 1e-9 s", lambda t: ["config", "--set", "runtime.lease_s=1e-9"], 2, ("runtime.lease_s",)),
    # ---- prompt files
    ("a jsonl prompt nested 100000 deep",
     lambda t: _prompts(t, "p.jsonl", '{"prompt": "a cat"}\n{"prompt": "a dog", "m": ' + _deep(100_000) + "}\n"),
     2, ("p.jsonl", "line 2", "nested deeper than")),
    ("a 5 MB prompt line",
     lambda t: _prompts(t, "p.txt", "a cat\na dog\n" + "x" * (5 << 20) + "\n"), 2,
     ("p.txt", "line 3", "longer than")),
    ("a 5 MB jsonl prompt line",
     lambda t: _prompts(t, "p.jsonl", '{"prompt": "a cat"}\n{"prompt": "' + "x" * (5 << 20) + '"}\n'), 2,
     ("p.jsonl", "line 2", "longer than")),
    ("a prompt file that is not UTF-8",
     lambda t: _prompts(t, "p.txt", b"a cat\na \xff dog\n"), 2, ("p.txt", "not UTF-8", "byte 8")),
    # ---- damaged run-dir files
    ("report on a corrupt summary.json",
     lambda t: ["report", str(_run_dir(t, summary='{"steps": 3, "wall'))], 1,
     ("summary.json", "not JSON", "rerun")),
    ("report with damage in the middle of metrics.jsonl",
     lambda t: ["report", str(_run_dir(t, metrics='{"step": 0}\n{"st\x00ep\n{"step": 2}\n'))], 1,
     ("metrics.jsonl", "line 2")),
    ("eval of a truncated final checkpoint", _truncated_policy, 1,
     ("policy.safetensors", "truncated or not safetensors")),
    ("eval of a run whose config.toml is damaged",
     lambda t: ["eval", str(_run_dir(t, config="[run\nseed = 1\n"))], 2, ("config.toml", "not valid TOML")),
]


@pytest.mark.parametrize(("argv", "code", "phrases"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_bad_input_is_one_short_line_within_seconds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: Callable[[Path], list[str]], code: int,
        phrases: tuple[str, ...]) -> None:
    args = argv(tmp_path)
    capsys.readouterr()
    t0 = time.monotonic()
    got = main(args)
    took = time.monotonic() - t0
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert got == code, err
    assert len(err) == 1 and all(p in err[0] for p in phrases), err
    assert err[0].startswith("digenrl: ") and "Traceback" not in err[0]
    assert len(err[0]) < 600, err[0][:600]  # long values are cut, never printed whole
    assert took < 20, took


SIZE_KEYS = ["train.prompts_per_step", "train.group_size", "eval.prompts", "eval.samples_per_prompt",
             "eval.batch_size", "model.lora_rank", "model.height", "model.width", "model.num_frames",
             "model.max_text_tokens", "runtime.fragments_per_step", "runtime.byte_window_mb",
             "runtime.weights_fanout", "cluster.rollouts", "cluster.rewards", "cluster.trainers",
             "reward.worker_batch", "transport.hwm", "transport.max_frame_bytes", "run.threads",
             "run.steps", "train.forward_timesteps", "train.window_size"]


@pytest.mark.parametrize("key", SIZE_KEYS)
def test_every_size_like_key_has_an_upper_bound(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')} = 1000000000000(\.0)?: expected a value <="):
        load_config(None, [f"{key}=1000000000000"])


@pytest.mark.parametrize("key", ["runtime.lease_s", "runtime.heartbeat_s", "reward.worker_timeout_s",
                                 "runtime.stall_timeout_s", "runtime.trace_flush_s"])
def test_timeouts_and_leases_have_a_sane_lower_bound(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')} = 1e-09: expected"):
        load_config(None, [f"{key}=1e-9"])


def test_stall_timeout_zero_still_means_off() -> None:
    assert load_config(None, ["runtime.stall_timeout_s=0"]).runtime.stall_timeout_s == 0


def test_the_shipped_configs_fit_the_bounds() -> None:
    for path in sorted((Path(__file__).parent.parent / "configs").glob("*.toml")):
        try:
            load_config(path)
        except ConfigError as e:
            assert "does not exist" in str(e) or "model.path" in str(e), (path, e)


def test_a_prompt_file_with_nesting_inside_the_limit_loads(tmp_path: Path) -> None:
    p = _file(tmp_path, "p.jsonl", '{"prompt": "a cat", "m": ' + _deep(8) + "}\n")
    assert load_prompt_set(str(p)).prompts == ["a cat"]
    p = _file(tmp_path, "q.jsonl", '{"prompt": "a cat", "m": ' + _deep(100) + "}\n")
    with pytest.raises(PromptError, match="line 1: nested deeper than"):
        load_prompt_set(str(p))


# ---------------------------------------------------------------------------- metrics.jsonl on resume


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from digenrl.rl.checkpoint import trim_metrics
    from digenrl.telemetry.metrics import repair_metrics
    good = "".join(json.dumps({"step": s}) + "\n" for s in range(3))
    for torn in ('{"step": 3, "rew', "\x00\x00\x00\x00", '{"step": 3}garbage\n'):
        run = _run_dir(tmp_path, metrics=good + torn)
        dropped = repair_metrics(run)
        assert dropped is not None and "metrics.jsonl" in dropped and "line 4" in dropped
        assert (run / "metrics.jsonl").read_text() == good
        trim_metrics(run, below_step=2)
        assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert repair_metrics(_run_dir(tmp_path, metrics=good)) is None


def test_damage_in_the_middle_of_metrics_is_a_named_error(tmp_path: Path) -> None:
    from digenrl.fileio import DamagedFile
    from digenrl.rl.checkpoint import dedupe_metrics, trim_metrics
    from digenrl.telemetry.metrics import repair_metrics
    run = _run_dir(tmp_path, metrics='{"step": 0}\nnot json\n{"step": 2}\n')
    for call in (lambda: repair_metrics(run), lambda: trim_metrics(run, 1), lambda: dedupe_metrics(run)):
        with pytest.raises(DamagedFile, match=r"metrics\.jsonl line 2"):
            call()


def test_resume_drops_a_torn_metrics_line_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from digenrl.cli import build_parser, launch_inputs
    from digenrl.launch import prepare_resume
    from tests.test_cli_errors import _run_dir_with_checkpoint
    run = _run_dir_with_checkpoint(tmp_path, "digenrl")
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "loss": 0.')
    cfg, opts = launch_inputs(build_parser().parse_args(["launch", "--resume", str(run)]))
    assert opts.resume is not None
    prepare_resume(cfg, opts.resume)
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and "dropped" in err and "line 2" in err, err
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"st\n{"step": 1}\n')
    capsys.readouterr()
    assert main(["launch", "--resume", str(run)]) == 1
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "metrics.jsonl line 2" in err_lines[0], err_lines
