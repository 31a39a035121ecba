"""The TEST-ONLY knobs live in one place, ``digenrl/faults.py``: failpoints set by the
environment (``DIGENRL_FAILPOINTS``), never by a run's config."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog

from digenrl.actors.base import Actor
from digenrl.config import ConfigError, load_config
from digenrl.faults import (
    FAILPOINTS_ENV,
    NO_FAILPOINTS,
    NO_SLOWDOWN,
    Failpoints,
    Slowdown,
    failpoints,
    node_slowdown,
    parse_failpoints,
    set_failpoints,
)
from digenrl.telemetry.trace import SpanRecorder

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", [None, *sorted((ROOT / "configs" / "models").glob("*.toml"))],
                         ids=lambda p: p.name if p else "embedded")
def test_no_shipped_config_sets_a_fault_knob(path: Path | None) -> None:
    load_config(path)  # a [faults] table in it is refused (next test)


@pytest.mark.parametrize("how", [["faults.slowdown=2"], ["faults.trainer_slowdown=2"]])
def test_a_config_with_a_faults_table_is_refused_naming_the_variable(how: list[str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^\[faults\] .*environment variable DIGENRL_FAILPOINTS"):
        load_config(None, how)
    path = tmp_path / "old.toml"
    path.write_text('[model]\npath = "random"\n\n[faults]\nslowdown = 3.0\n')
    with pytest.raises(ConfigError, match=r"DIGENRL_FAILPOINTS") as e:
        load_config(path)
    assert "\n" not in str(e.value)


def test_failpoints_are_read_from_the_environment_and_written_back_alike() -> None:
    fp = parse_failpoints(" slowdown=5 ; slowdown_nodes=rollout-1,trainer-0;trainer_slowdown=2.5;")
    assert fp == Failpoints(slowdown=5.0, slowdown_nodes=("rollout-1", "trainer-0"), trainer_slowdown=2.5)
    assert parse_failpoints(fp.to_env()) == fp
    assert parse_failpoints("") == NO_FAILPOINTS and NO_FAILPOINTS.to_env() == ""


@pytest.mark.parametrize(("text", "named"), [
    ("slowdown=0.5", "slowdown = '0.5'"), ("trainer_slowdown=fast", "trainer_slowdown = 'fast'"),
    ("slowdown=inf", "slowdown = 'inf'"), ("slowdwn=2", "'slowdwn=2'"), ("slowdown", "'slowdown'")])
def test_a_bad_failpoint_is_refused_naming_it(text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=f"^DIGENRL_FAILPOINTS: {named}"):
        parse_failpoints(text)


def test_a_process_reads_its_failpoints_once_and_tests_set_them_in_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAILPOINTS_ENV, "slowdown=3")
    set_failpoints(None)
    try:
        assert failpoints() == Failpoints(slowdown=3.0)
        monkeypatch.setenv(FAILPOINTS_ENV, "slowdown=4")
        assert failpoints() == Failpoints(slowdown=3.0)  # read once
        set_failpoints(Failpoints(trainer_slowdown=2.0))
        assert failpoints() == Failpoints(trainer_slowdown=2.0)
    finally:
        set_failpoints(None)


def test_a_spawned_process_inherits_the_failpoints_of_its_environment() -> None:
    env = dict(os.environ, **{FAILPOINTS_ENV: Failpoints(slowdown=5.0, slowdown_nodes=("rollout-1",)).to_env()})
    code = ("from digenrl.faults import failpoints, node_slowdown;"
            "print(node_slowdown(failpoints(), node_id='rollout-1', role='rollout').extra_s('denoise_step', 1))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "4.0"


def test_the_old_runtime_keys_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown key runtime\.slowdown"):
        load_config(None, ["runtime.slowdown=2"])


def test_slowdowns_stretch_a_rollouts_generation_and_a_trainers_training() -> None:
    faults = Failpoints(slowdown=3.0, trainer_slowdown=2.0)
    rollout = node_slowdown(faults, node_id="rollout-0", role="rollout")
    trainer = node_slowdown(faults, node_id="trainer-0", role="trainer")
    assert rollout.extra_s("denoise_step", 1.5) == 3.0 and rollout.extra_s("fragment_train", 1.0) == 0
    assert trainer.extra_s("fragment_train", 1.5) == 1.5 and trainer.extra_s("optimizer_step", 1.0) == 1
    assert trainer.extra_s("tag_generate", 1.0) == 0  # not named: its TAG work runs at full speed
    named = Failpoints(slowdown=5.0, slowdown_nodes=("rollout-1", "trainer-0"))
    assert node_slowdown(named, node_id="rollout-0", role="rollout") is NO_SLOWDOWN
    assert node_slowdown(named, node_id="rollout-1", role="rollout").extra_s("denoise_step", 1) == 4
    assert node_slowdown(named, node_id="trainer-0", role="trainer").extra_s("tag_generate", 1) == 4
    assert node_slowdown(NO_FAILPOINTS, node_id="rollout-0", role="rollout") is NO_SLOWDOWN


async def test_an_actor_idles_its_slowdown_after_the_compute_span() -> None:
    actor = Actor(node_id="trainer-0", recorder=SpanRecorder("trainer-0", "trainer"),
                  log=structlog.get_logger(), slowdown=Slowdown({"fragment_train": 3.0}))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await actor.in_thread("fragment_train", time.sleep, 0.05) is None
    waited = loop.time() - t0
    (span,) = actor.recorder.spans()
    span_s = (span.end - span.start) / 1e9
    # the span holds the work only; the actor then idles twice as long again (factor 3).
    # 5 ms of slack: an event loop's timer may fire up to a clock tick (1 ms on uvloop) early
    assert span_s >= 0.05 and waited >= 3 * span_s - 0.005
