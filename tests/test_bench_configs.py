"""The benches that launch real runs start on the default config.

Two of them once stopped unnoticed when the default changed (a LoRA with the base
model's tail): bench/tag.py's training-bound row asked for every step trained,
which the new default refuses, and bench/rewards.py's reward plug-in no longer imported once
the launch checked it in its own process. The config checks here are cheap; the rewards bench
is run for real, at one step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from digenrl.config import load_config, resolve_mode

ROOT = Path(__file__).resolve().parents[1]
#: The shipped default itself (tests/test_config.py: the same text as the embedded one), not
#: the suite's version of it that load_config(None) gives inside tests (conftest.SUITE_SETS)
DEFAULT = ROOT / "configs" / "tiny-cpu.toml"


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("row", list(_bench("tag").CONFIGS))
def test_every_tag_bench_row_loads_on_the_default(row: str) -> None:
    overrides = _bench("tag").CONFIGS[row]
    for tag in ("never", "bts"):  # what bench/tag.py's main() launches for each row
        cfg = resolve_mode(load_config(DEFAULT, ["run.eval_every=0", *overrides, "run.steps=12",
                                                 "run.threads=1", f"runtime.tag={tag}"]), "digenrl")
        assert cfg.runtime.tag == tag and cfg.run.eval_every == 0


@pytest.mark.slow
def test_the_rewards_bench_runs_on_the_default(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": ""}  # as a user runs it: nothing but the script's own path
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rewards.py"), "--steps", "2",
                          "--repeats", "1", "--reward-s", "0.001", "--json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["samples_per_s"]) == {"in-process", "worker"}
    assert all(v > 0 for v in result["samples_per_s"].values())
