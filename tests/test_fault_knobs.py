"""The TEST-ONLY knobs live in one place: the ``[faults]`` section and ``digenrl/faults.py``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import structlog

from digenrl.actors.base import Actor
from digenrl.config import ConfigError, FaultsConfig, load_config
from digenrl.faults import NO_SLOWDOWN, Slowdown, node_slowdown
from digenrl.telemetry.trace import SpanRecorder

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", [None, *sorted((ROOT / "configs" / "models").glob("*.toml"))],
                         ids=lambda p: p.name if p else "embedded")
def test_no_shipped_config_sets_a_fault_knob(path: Path | None) -> None:
    assert load_config(path).faults == FaultsConfig()


def test_the_old_runtime_keys_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown key runtime\.slowdown"):
        load_config(None, ["runtime.slowdown=2"])


def test_slowdowns_stretch_a_rollouts_generation_and_a_trainers_training() -> None:
    faults = FaultsConfig(slowdown=3.0, trainer_slowdown=2.0)
    rollout = node_slowdown(faults, node_id="rollout-0", role="rollout")
    trainer = node_slowdown(faults, node_id="trainer-0", role="trainer")
    assert rollout.extra_s("denoise_step", 1.5) == 3.0 and rollout.extra_s("fragment_train", 1.0) == 0
    assert trainer.extra_s("fragment_train", 1.5) == 1.5 and trainer.extra_s("optimizer_step", 1.0) == 1
    assert trainer.extra_s("tag_generate", 1.0) == 0  # not named: its TAG work runs at full speed
    named = FaultsConfig(slowdown=5.0, slowdown_nodes=["rollout-1", "trainer-0"])
    assert node_slowdown(named, node_id="rollout-0", role="rollout") is NO_SLOWDOWN
    assert node_slowdown(named, node_id="rollout-1", role="rollout").extra_s("denoise_step", 1) == 4
    assert node_slowdown(named, node_id="trainer-0", role="trainer").extra_s("tag_generate", 1) == 4
    assert node_slowdown(FaultsConfig(), node_id="rollout-0", role="rollout") is NO_SLOWDOWN


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
