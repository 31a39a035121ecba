"""transport/allocator.py: nodes fix glibc's allocator thresholds unless the operator chose."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

CALL = "from digenrl.transport import allocator; print(allocator.tune())"


def _tune_in_child(**env: str) -> str:
    """tune() in a fresh interpreter (the thresholds are process-wide; this one stays as it is)."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("GLIBC_TUNABLES", "DIGENRL_MALLOC") and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CALL], env={**base, **env}, capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only (musl and macOS have no mallopt)")
def test_a_node_sets_the_thresholds_on_glibc() -> None:
    assert _tune_in_child() == "True"


@pytest.mark.parametrize("env", [{"DIGENRL_MALLOC": "default"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"},
                                 {"MALLOC_ARENA_MAX": "2"}],
                         ids=["opted out", "glibc tunables", "malloc env"])
def test_the_operators_allocator_settings_are_left_alone(env: dict[str, str]) -> None:
    assert _tune_in_child(**env) == "False"
