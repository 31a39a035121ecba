"""Every bad input a user can give ends in one line on stderr and exit 2 (usage, config) or 1
(a run or its files broken), never a traceback, and is refused before any process starts.

The commands run in this process (``digenrl.cli.main`` / ``node_main``), so an exception that
escapes fails the test; none of these cases gets as far as launching a node.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from digenrl.cli import main, node_main
from digenrl.config import load_config, to_toml

SMALL = ["--set", "model.path=\"random\"", "--set", "train.prompts_per_step=2",
         "--set", "sampler.num_steps=4", "--set", "runtime.fragments_per_step=2"]


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """A folder nobody may write, root included (a read-only tmpfs), or chmod 555 for others."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                       capture_output=True, check=False)
    if r.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _run_dir_with_checkpoint(tmp: Path, mode: str, *, torn: bool = False) -> Path:
    """A run folder as a launch leaves it after checkpoint v1 (written by the real functions)."""
    from digenrl.config import resolve_mode
    from digenrl.rl.checkpoint import commit_checkpoint, save_trainer_state
    from digenrl.rl.policy import build_policy
    cfg = resolve_mode(load_config(None, ["model.path=\"random\"", "train.prompts_per_step=2",
                                          "runtime.fragments_per_step=2", "run.steps=3"]), mode)
    run = tmp / f"{mode}-run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(cfg))
    policy = build_policy(cfg)
    policy.version = 1
    save_trainer_state(run, policy, {})
    if mode == "colocated":
        doc: dict[str, Any] = {"colocated": {"ranks": [[4, {}]]}}
    else:
        from digenrl.actors.cluster import make_scheduler
        doc = {"scheduler": make_scheduler(cfg, 8).snapshot()}
    d = commit_checkpoint(run, 1, doc)
    if torn:
        (d / "optimizer.pt").write_bytes(b"torn")
    return run


def _prompt_file(tmp: Path, name: str, content: bytes | None) -> list[str]:
    p = tmp / name
    if content is not None:
        p.write_bytes(content)
    return ["launch", *SMALL, "--run-dir", str(tmp / "r"), "--set", f"prompts.file=\"{p}\""]


# (case id, build argv from tmp_path, expected exit code, a phrase the line must contain)
CASES: list[tuple[str, Callable[[Path, contextlib.ExitStack], list[str]], int, str]] = [
    ("report on a missing folder", lambda t, s: ["report", str(t / "nope")], 2, "no such run folder"),
    ("plan with one step", lambda t, s: ["plan", "--steps", "1"], 2, "--steps 1: expected at least 2"),
    ("keys generate into a read-only folder",
     lambda t, s: ["keys", "generate", str(s.enter_context(read_only_dir(t / "ro")) / "keys")], 1,
     "Read-only file system"),
    ("digenrl-node with an http:// endpoint",
     lambda t, s: ["NODE", "--role", "rollout", "--coordinator", "http://10.0.0.1:5555"], 2, "http://"),
    ("resuming a colocated run in digenrl mode",
     lambda t, s: ["launch", "--resume", str(_run_dir_with_checkpoint(t, "colocated")),
                   "--set", "run.mode=\"digenrl\""], 2, "colocated run"),
    ("the plaintext refusal",
     lambda t, s: ["launch", *SMALL, "--run-dir", str(t / "r"), "--set", "cluster.host=\"0.0.0.0\""], 2,
     "refusing to bind"),
    ("CheckpointError: no checkpoint verifies",
     lambda t, s: ["launch", "--resume", str(_run_dir_with_checkpoint(t, "digenrl", torn=True))], 1,
     "no checkpoint"),
    ("prompt file empty", lambda t, s: _prompt_file(t, "p.txt", b""), 2, "holds no prompts"),
    ("prompt file of comments only", lambda t, s: _prompt_file(t, "p.txt", b"# a\n\n# b\n"), 2,
     "holds no prompts"),
    ("prompt file binary", lambda t, s: _prompt_file(t, "p.txt", bytes(range(256)) * 4), 2,
     "cannot be read"),
    ("prompt file missing", lambda t, s: _prompt_file(t, "p.txt", None), 2, "does not exist"),
    ("a read-only run folder",
     lambda t, s: ["launch", *SMALL, "--run-dir", str(s.enter_context(read_only_dir(t / "ro")) / "run")],
     2, "cannot write there"),
    ("a run folder that is a file",
     lambda t, s: [(t / "f").write_text("x") and "launch", *SMALL, "--run-dir", str(t / "f")], 2,
     "cannot write there"),
    ("--resume with no checkpoint",
     lambda t, s: [(t / "config.toml").write_text(to_toml(load_config())) and "launch", "--resume", str(t)],
     2, "no checkpoint there"),
    ("--resume of another config",
     lambda t, s: ["launch", "--resume", str(_run_dir_with_checkpoint(t, "digenrl")),
                   "--set", "train.group_size=3"], 2, "group_size"),
    ("--resume with a smaller --steps than trained",
     lambda t, s: ["launch", "--resume", str(_run_dir_with_checkpoint(t, "digenrl")), "--steps", "0"], 2,
     "--steps 0"),
    ("--resume with --mode", lambda t, s: ["launch", "--resume", str(t), "--mode", "colocated"], 2,
     "--mode cannot be changed"),
    ("--resume on trainer ranks that cannot split the step's prompts",
     lambda t, s: ["launch", "--resume", str(_run_dir_with_checkpoint(t, "colocated")), "--trainers", "3"], 2,
     "cluster.trainers = 3: colocated ranks split train.prompts_per_step = 2 evenly"),
    ("runtime.heartbeat_s = inf",
     lambda t, s: ["launch", "--run-dir", str(t / "r"), "--set", "runtime.heartbeat_s=inf"], 2,
     "expected a finite number"),
    ("a [faults] table: test failpoints are set by the environment",
     lambda t, s: ["launch", "--run-dir", str(t / "r"), "--set", "faults.slowdown=2"], 2,
     "environment variable DIGENRL_FAILPOINTS"),
    ("--rollouts -1", lambda t, s: ["launch", "--run-dir", str(t / "r"), "--rollouts", "-1"], 2,
     "--rollouts -1"),
    ("export of a folder that is not a run",
     lambda t, s: ["export", str(t), "--out", str(t / "o")], 2, "no config.toml in that folder"),
    ("export of a run with no final/ or checkpoint",
     lambda t, s: [(t / "config.toml").write_text(to_toml(load_config())) and "export", str(t), "--out",
                   str(t / "o")], 2, "neither final/policy.safetensors nor an unsharded checkpoint"),
    ("parameter offload without FSDP",
     lambda t, s: ["launch", *SMALL, "--run-dir", str(t / "r"), "--set", "model.offload=\"params\""], 2,
     "model.offload = 'params' with model.fsdp = false"),
    ("digenrl-node with parameter offload without FSDP",
     lambda t, s: ["NODE", "--role", "trainer", "--coordinator", "tcp://127.0.0.1:9", "--set",
                   "model.offload=\"params\""], 2, "model.offload = 'params' with model.fsdp = false"),
    ("an offload mode that does not exist",
     lambda t, s: ["launch", *SMALL, "--run-dir", str(t / "r"), "--set", "model.offload=\"gradients\""], 2,
     "model.offload"),
    ("--rollouts 0 in digenrl mode",
     lambda t, s: ["launch", "--run-dir", str(t / "r"), "--rollouts", "0"], 2, "needs at least one"),
]


@pytest.mark.parametrize(("argv", "code", "phrase"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_bad_input_is_one_line_and_the_right_exit_code(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: Callable[..., list[str]], code: int,
        phrase: str) -> None:
    with contextlib.ExitStack() as stack:
        args = argv(tmp_path, stack)
        capsys.readouterr()
        got = node_main(args[1:]) if args[0] == "NODE" else main(args)
        err = capsys.readouterr().err.strip().splitlines()
    assert got == code, err
    assert len(err) == 1 and phrase in err[0], err
    assert err[0].startswith(("digenrl: ", "digenrl-node: ")) and "Traceback" not in err[0]


def test_resume_honours_steps_and_rollouts_and_records_them(tmp_path: Path) -> None:
    from digenrl.cli import build_parser, launch_inputs
    from digenrl.launch import prepare_resume
    run = _run_dir_with_checkpoint(tmp_path, "digenrl")
    cfg, opts = launch_inputs(build_parser().parse_args(["launch", "--resume", str(run), "--steps", "5",
                                                         "--rollouts", "2"]))
    assert opts.resume is not None
    run_dir = prepare_resume(cfg, opts.resume)
    assert (cfg.run.steps, cfg.cluster.rollouts, run_dir) == (5, 2, run)
    assert load_config(run / "config.toml").run.steps == 5  # the run dir says what now runs
