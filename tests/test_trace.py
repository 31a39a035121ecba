"""SpanRecorder, merge_traces and busy_fraction on a small scripted three-node run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from digenrl.telemetry.trace import (
    BUSY_SPANS,
    BusyClock,
    Span,
    SpanRecorder,
    TraceError,
    busy_by_node,
    busy_fraction,
    merge_traces,
    read_trace,
)

MS = 1_000_000  # ns
EPOCH = 1_700_000_000 * 1_000_000_000


class FakeClock:
    """A virtual wall clock in ns; tests advance it explicitly."""

    def __init__(self, start: int = EPOCH) -> None:
        self.t = start

    def __call__(self) -> int:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += int(ms * MS)


def scripted_run(clock: FakeClock, skew_ns: int = 0) -> list[SpanRecorder]:
    """Two steps of a 1-rollout, 2-trainer run; the rollout's clock is ``skew_ns`` off."""
    roll = SpanRecorder("rollout-0", "rollout", lambda: clock() + skew_ns)
    trainers = [SpanRecorder(f"trainer-{r}", "trainer", clock) for r in range(2)]
    for step in range(2):
        waits = [t.begin("wait") for t in trainers]
        for i in range(4):
            with roll.span("denoise_step", step=step, t=i):
                clock.advance(10)
            send = roll.begin("send_chunk", tid=1, t=i)  # overlaps the next denoise step
            clock.advance(2)
            roll.end(send)
        with roll.span("reward"):
            clock.advance(5)
        for t, w in zip(trainers, waits):
            t.end(w)
        for r, t in enumerate(trainers):
            with t.span("fragment_train", step=step):
                clock.advance(8 + 4 * r)
        roll.instant("version_applied", version=step + 1)
        with trainers[0].span("optimizer_step", step=step):
            clock.advance(3)
            with trainers[0].span("weight_publish"):
                clock.advance(1)
        trainers[1].counter("queue_depth", step)
    return [roll, *trainers]


def write_run(tmp_path: Path, recorders: list[SpanRecorder]) -> Path:
    for rec in recorders:
        rec.dump(tmp_path / "trace" / f"{rec.node_id}.jsonl")
    return merge_traces(tmp_path)


def test_trace_json_has_one_named_track_per_process(tmp_path):
    recs = scripted_run(FakeClock())
    trace = json.loads(write_run(tmp_path, recs).read_text())
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert [m["args"]["name"] for m in meta] == ["rollout-0", "trainer-0", "trainer-1"]
    assert len({m["pid"] for m in meta}) == 3
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert pids == {m["pid"] for m in meta}


def test_spans_nest_and_never_partially_overlap_within_a_track(tmp_path):
    _, spans = read_trace(write_run(tmp_path, scripted_run(FakeClock())))
    tracks: dict[tuple[str, int], list[Span]] = {}
    for s in spans:
        tracks.setdefault((s.node, s.tid), []).append(s)
    assert ("rollout-0", 1) in tracks  # the concurrent sender has its own track
    for track in tracks.values():
        track.sort(key=lambda s: (s.start, -s.end))
        open_spans: list[Span] = []
        for s in track:
            while open_spans and open_spans[-1].end <= s.start:
                open_spans.pop()
            # Whatever is still open must contain s entirely.
            assert not open_spans or s.end <= open_spans[-1].end, (open_spans[-1], s)
            open_spans.append(s)


def test_times_are_microseconds_from_the_first_event(tmp_path):
    _, spans = read_trace(write_run(tmp_path, scripted_run(FakeClock())))
    first = min(spans, key=lambda s: s.start)
    assert first.start == 0
    denoise = next(s for s in spans if s.name == "denoise_step")
    assert denoise.end - denoise.start == 10_000.0  # 10 ms


def test_busy_fractions_from_trace_equal_those_from_the_recorders(tmp_path):
    recs = scripted_run(FakeClock())
    direct_spans = [s for r in recs for s in r.spans()]
    t0 = min(s.start for s in direct_spans)
    t1 = max(s.end for s in direct_spans)
    direct = busy_by_node(direct_spans, t0, t1)
    _, spans = read_trace(write_run(tmp_path, recs))
    from_trace = busy_by_node(spans, 0, (t1 - t0) / 1000)
    assert from_trace == pytest.approx(direct, abs=1e-12)
    assert direct["trainer-0"] < direct["rollout-0"] < 1.0  # trainers idle while rollouts work


def test_offset_aligns_a_skewed_node_clock(tmp_path):
    aligned = json.loads(write_run(tmp_path / "a", scripted_run(FakeClock())).read_text())
    skew = 7_000 * MS
    recs = scripted_run(FakeClock(), skew_ns=skew)
    for rec in recs:
        rec.dump(tmp_path / "b" / "trace" / f"{rec.node_id}.jsonl")
    corrected = json.loads(merge_traces(tmp_path / "b", offset_ns={"rollout-0": -skew}).read_text())
    assert corrected["traceEvents"] == aligned["traceEvents"]


def test_busy_fraction_counts_overlaps_once_clips_to_the_window_and_ignores_wait():
    spans = [Span("denoise_step", 0, 50), Span("reward", 40, 60), Span("wait", 60, 100),
             Span("fragment_train", 90, 200)]
    assert busy_fraction(spans, 0, 100) == pytest.approx(0.7)
    assert busy_fraction(spans, 50, 200) == pytest.approx(0.8)
    assert "wait" not in BUSY_SPANS and "send_chunk" not in BUSY_SPANS


def test_busy_fraction_rejects_an_empty_window():
    with pytest.raises(ValueError, match=r"\[5, 5\]"):
        busy_fraction([], 5, 5)


def test_ending_a_span_out_of_order_is_an_error():
    rec = SpanRecorder("trainer-0", "trainer", FakeClock())
    outer = rec.begin("fragment_train")
    rec.begin("optimizer_step")
    with pytest.raises(TraceError, match="fragment_train"):
        rec.end(outer)


def test_dump_appends_only_new_events(tmp_path):
    clock = FakeClock()
    rec = SpanRecorder("rollout-0", "rollout", clock)
    path = tmp_path / "trace" / "rollout-0.jsonl"
    with rec.span("denoise_step"):
        clock.advance(1)
    open_span = rec.begin("reward")
    assert rec.dump(path) == 1
    rec.end(open_span)
    rec.instant("version_applied")
    assert rec.dump(path) == 2
    assert rec.dump(path) == 0
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(e["ph"], e["name"]) for e in lines] == [
        ("X", "denoise_step"), ("X", "reward"), ("i", "version_applied")]
    assert all(e["node"] == "rollout-0" and e["role"] == "rollout" for e in lines)


def test_a_torn_last_line_is_skipped(tmp_path):
    clock = FakeClock()
    rec = SpanRecorder("trainer-0", "trainer", clock)
    with rec.span("optimizer_step"):
        clock.advance(1)
    path = tmp_path / "trace" / "trainer-0.jsonl"
    rec.dump(path)
    with path.open("a") as f:
        f.write('{"ph": "X", "name": "fragm')
    names, spans = read_trace(merge_traces(tmp_path))
    assert names == ["trainer-0"] and [s.name for s in spans] == ["optimizer_step"]


async def test_concurrent_tasks_get_their_own_lanes_and_finished_lanes_are_reused(tmp_path):
    import asyncio

    clock = FakeClock()
    rec = SpanRecorder("rollout-0", "rollout", clock)
    sent, denoised = asyncio.Event(), asyncio.Event()

    async def sender() -> None:
        with rec.span("send_chunk"):  # opens inside denoise_step, closes after it
            denoised.set()
            await sent.wait()
            clock.advance(1)

    async def denoiser() -> None:
        with rec.span("denoise_step"):
            clock.advance(10)
            task = asyncio.create_task(sender(), name="chunk-sender")
            await denoised.wait()
        sent.set()
        await task

    await asyncio.create_task(denoiser(), name="denoise-loop")
    await asyncio.create_task(sender(), name="second-sender")  # after both finished
    lanes = {s.name: s.tid for s in rec.spans()}
    assert lanes == {"denoise_step": 0, "send_chunk": 0}  # second sender reused lane 0
    assert sorted({s.tid for s in rec.spans()[:2]}) == [0, 1]
    rec.dump(tmp_path / "trace" / "rollout-0.jsonl")
    trace = json.loads(merge_traces(tmp_path).read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "main", 1: "chunk-sender"}


@pytest.mark.asyncio
async def test_spans_timed_on_another_thread_are_recorded_on_the_waiting_task_lane(tmp_path):
    clock = FakeClock()
    rec = SpanRecorder("rollout-0", "rollout", clock)
    sender = rec.named_lane("rollout-chunk-sender")
    assert rec.named_lane("rollout-chunk-sender") == sender  # same name, same lane
    t0 = clock()
    clock.advance(10)
    rec.record("denoise_step", t0, clock(), step=0, task=3)  # timed by the compute thread
    with rec.span("send_chunk", tid=sender, t=1):
        clock.advance(1)
    with pytest.raises(TraceError, match=r"ends .* before it starts"):
        rec.record("reward", clock(), clock() - 1)
    spans = rec.spans()
    assert [(s.name, s.end - s.start) for s in spans] == [("denoise_step", 10 * MS), ("send_chunk", 1 * MS)]
    assert spans[0].tid != sender and busy_fraction(spans, t0, clock()) == pytest.approx(10 / 11)
    rec.dump(tmp_path / "trace" / "rollout-0.jsonl")
    trace = json.loads(merge_traces(tmp_path).read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[sender] == "rollout-chunk-sender"
    x = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "denoise_step"]
    assert x[0]["args"] == {"step": 0, "task": 3} and x[0]["dur"] == pytest.approx(10_000)


# One recorded span: (ms from the previous span's end to this one's end, duration in ms,
# busy?, read the clock's stats right after it?)
_SPANS = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 80), st.booleans(), st.booleans()),
                  max_size=60)


@settings(max_examples=200, deadline=None)
@given(spans=_SPANS, lag_ms=st.integers(81, 400))
def test_busy_clock_keeps_the_exact_union_of_busy_spans_while_folding_old_time(spans, lag_ms):
    """Spans recorded after the fact (as the compute thread's are), overlapping freely: the
    incremental clock equals busy_fraction over every span, whenever it is read, as long as
    no span is longer than the lag."""
    clock = FakeClock()
    rec = SpanRecorder("rollout-0", "rollout", clock)
    clock.advance(100)  # spans may start before the clock was made: counted from t0 on
    busy = BusyClock(rec, lag_s=lag_ms / 1000)
    t0 = clock()
    for gap, dur, is_busy, read in spans:
        clock.advance(gap)
        rec.record("denoise_step" if is_busy else "send_chunk", clock() - dur * MS, clock())
        if read:
            expected = busy_fraction(rec.spans(), t0, clock()) * (clock() - t0) if clock() > t0 else 0
            assert busy.busy_ns() == pytest.approx(expected, abs=2)
    clock.advance(1000)
    expected = busy_fraction(rec.spans(), t0, clock()) * (clock() - t0)
    assert busy.busy_ns() == pytest.approx(expected, abs=2)
    assert busy._starts == []  # everything older than the lag is folded into one number


def test_busy_clock_waits_for_an_open_span_longer_than_the_lag():
    clock = FakeClock()
    rec = SpanRecorder("trainer-0", "trainer", clock)
    busy = BusyClock(rec, lag_s=0.01)
    with rec.span("checkpoint_write"):  # not busy, but open: nothing before it may be folded
        with rec.span("fragment_train"):
            clock.advance(50)
            with rec.span("optimizer_step"):  # nested in a busy span: counted once
                clock.advance(30)
            assert busy.busy_ns() == 30 * MS  # only the finished span so far
        clock.advance(20)
    clock.advance(100)
    assert busy.busy_ns() == 80 * MS
    assert busy.stats() == {"busy_s": pytest.approx(0.08), "wall_s": pytest.approx(0.2)}


@pytest.mark.asyncio
async def test_an_actor_appends_its_trace_while_it_runs(tmp_path):
    """A node's events reach its trace file every trace_flush_s, not only when it stops: a
    long run's events do not pile up in memory, and a killed node keeps what it wrote."""
    import asyncio

    import structlog

    from digenrl.actors.base import Actor

    path = tmp_path / "trace" / "rollout-0.jsonl"
    recorder = SpanRecorder("rollout-0", "rollout")
    flushed = asyncio.Event()
    dump = recorder.dump

    def dump_and_tell(where):  # the flush loop's writes, observed
        n = dump(where)
        flushed.set()
        return n

    recorder.dump = dump_and_tell  # type: ignore[method-assign]
    on_disk: list[list[int]] = []

    class Worker(Actor):
        async def main(self) -> None:
            for step in range(3):
                with self.recorder.span("denoise_step", step=step):
                    pass
                flushed.clear()
                await asyncio.wait_for(flushed.wait(), 10)  # the next periodic flush
                on_disk.append([json.loads(x)["args"]["step"] for x in path.read_text().splitlines()
                                if '"ph": "X"' in x])

    actor = Worker(node_id="rollout-0", recorder=recorder, log=structlog.get_logger(),
                   trace_path=path, trace_flush_s=0.01)
    await asyncio.wait_for(actor.run(), 30)
    assert on_disk == [[0], [0, 1], [0, 1, 2]]  # each span on disk while the actor still ran
    assert dump(path) == 0  # nothing was left for the end
