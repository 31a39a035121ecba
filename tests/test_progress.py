"""What a user sees while a run is live: the progress line and the structured logs."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest

from digenrl.telemetry.logging import configure_logging, get_logger, node_log_path
from digenrl.telemetry.progress import Progress, format_duration

CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")  # everything but "\n"


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def record(step: int, **extra) -> dict:
    return {"step": step, "policy_version": step + 1, "reward_mean": 0.5 + step / 10,
            "reward_std": 0.08, "samples_per_s": 3.25, "max_staleness": 1,
            "busy/rollout-0": 0.41, "busy/trainer-0": 0.93, "busy/trainer-1": 0.70, **extra}


def test_plain_stream_gets_one_line_per_step_without_control_characters():
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(4, out, clock=clock)
    for step in range(2):
        clock.t += 30
        progress.update(record(step, **{"busy/evil\x1b[31m-0": 0.0}))
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and not CONTROL.search(out.getvalue())
    assert lines[1].startswith("step 2/4  v2  reward 0.600±0.080  3.25 samples/s")
    assert "busiest trainer-0 93%" in lines[1] and "idlest evil[31m-0 0%" in lines[1]
    assert lines[1].endswith("stale≤1  ETA 1m00s")  # 60 s for 2 steps, 2 to go


def test_terminal_redraws_one_line_in_place_and_ends_it_on_close(monkeypatch):
    # a terminal wide enough for the whole line (the line is cut to the terminal's width,
    # which otherwise comes from wherever the suite runs: pytest-xdist workers see 80 columns)
    monkeypatch.setenv("COLUMNS", "200")
    out, clock = Terminal(), FakeClock()
    progress = Progress(3, out, clock=clock)
    for step in range(3):
        clock.t += 10
        progress.update(record(step))
    progress.close()
    text = out.getvalue()
    assert text.count("\r\x1b[2K") == 3 and text.count("\n") == 1 and text.endswith("ETA 0s\n")


def test_missing_values_show_as_dashes_not_errors():
    out = io.StringIO()
    line = Progress(10, out, tty=False, clock=FakeClock()).update({"step": 0})
    assert line == "step 1/10  v–  reward –±–  – samples/s  stale≤–  ETA 0s"


def test_message_clears_the_progress_line_on_a_terminal():
    out = Terminal()
    progress = Progress(3, out)
    progress.update(record(0))
    progress.message("node lost: rollout-1")
    assert out.getvalue().endswith("\r\x1b[2Knode lost: rollout-1\n")


def test_zero_total_steps_is_rejected():
    with pytest.raises(ValueError, match="total_steps = 0"):
        Progress(0, io.StringIO())


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (59.4, "59s"), (83.4, "1m23s"),
                                               (7300, "2h01m"), (float("nan"), "?")])
def test_durations_are_short(seconds, text):
    assert format_duration(seconds) == text


@pytest.fixture
def restore_logging():
    yield
    configure_logging(json=True, stream=io.StringIO())
    logging.getLogger().setLevel(logging.WARNING)


def test_non_terminal_logs_are_json_lines_with_role_node_and_version(tmp_path, restore_logging):
    out = io.StringIO()
    log_file = node_log_path(tmp_path, "trainer-0")
    configure_logging(stream=out, level="info", log_file=log_file)
    log = get_logger("trainer", "trainer-0", policy_version=0)
    log.info("fragment_trained", loss=0.25, note="\x1b[31mred\x07")
    log = log.bind(policy_version=1)
    log.debug("not shown at info")
    log.warning("optimizer_step")
    logging.getLogger("diffusers").warning("a foreign %s", "record")
    assert not CONTROL.search(out.getvalue())
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [(x["event"], x.get("policy_version")) for x in lines] == [
        ("fragment_trained", 0), ("optimizer_step", 1), ("a foreign record", None)]
    assert lines[0]["role"] == "trainer" and lines[0]["node_id"] == "trainer-0"
    assert lines[0]["note"] == "\x1b[31mred\x07"  # escaped on the wire, intact when read
    assert log_file == tmp_path / "logs" / "trainer-0.log"
    assert [json.loads(x)["event"] for x in log_file.read_text().splitlines()] == [
        "fragment_trained", "optimizer_step", "a foreign record"]


def test_terminal_logs_are_rendered_for_people(restore_logging):
    out = Terminal()
    configure_logging(stream=out)
    get_logger("rollout", "rollout-0").info("chunk_sent", t=3)
    text = out.getvalue()
    assert "chunk_sent" in text and "rollout-0" in text and not text.lstrip().startswith("{")


def test_unknown_log_level_is_rejected():
    with pytest.raises(ValueError, match="'loud'"):
        configure_logging(level="loud", stream=io.StringIO())
