"""Spans: what each process was doing when, one timeline per run.

Each node records spans with a :class:`SpanRecorder` and appends them to
``run_dir/trace/<node_id>.jsonl`` (one JSON object per line, see :meth:`SpanRecorder.dump`).
At the end of a run :func:`merge_traces` turns every node's file into one
``run_dir/trace.json`` in the Chrome trace-event format, which https://ui.perfetto.dev and
``chrome://tracing`` open: one process track per node ("coordinator", "rollout-0",
"trainer-0", ...), complete ("X") events with ``ts``/``dur`` in microseconds.

Clocks. Every node stamps events with wall-clock nanoseconds (``time.time_ns`` read once
at construction, advanced by the monotonic ``perf_counter_ns`` so NTP steps cannot make a
span negative). The merge subtracts the global minimum, so t = 0 is the first event of the
run. Nodes on one host share a clock and line up exactly. Across hosts the clocks differ by
the hosts' NTP error; the coordinator can measure each node's offset when it answers
``Hello`` with ``Welcome`` and pass it to :func:`merge_traces` as ``offset_ns`` (node
clock + offset = coordinator clock).

Tracks. Spans on one ``tid`` of a recorder must nest (a span closes after every span
opened inside it). By default the ``tid`` is chosen per asyncio task (and per thread): code
outside any task and the first task get 0 ("main"), each further concurrently running task
gets the lowest free lane, and a lane is reused once its task has finished. A ``with``
block cannot interleave with itself inside one task, so spans nest without the caller doing
anything; concurrent tasks (a chunk sender beside the denoising loop) get their own lanes.
Pass ``tid=`` to choose a lane explicitly; :meth:`SpanRecorder.named_lane` gives work that
is not one task's (a node's chunk sends) a lane of its own.

Span names (documented in docs/metrics.md): see :data:`SPAN_NAMES`; :data:`BUSY_SPANS` are
those that count as busy in :func:`busy_fraction`, which metrics.jsonl, summary.json and the
report all use.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import structlog

__all__ = ["BUSY_SPANS", "SPAN_NAMES", "BusyClock", "Span", "SpanRecorder", "SpanToken", "TraceError",
           "busy_by_node", "busy_fraction", "busy_share", "merge_traces", "read_trace", "wall_clock_ns"]

SPAN_NAMES: tuple[str, ...] = (
    "denoise_step", "send_chunk", "reward", "fragment_train", "optimizer_step",
    "weight_publish", "weight_apply", "tag_generate", "generate", "weight_fetch",
    "weight_prefetch", "wait", "evaluate", "score")
BUSY_SPANS: frozenset[str] = frozenset({
    "denoise_step", "reward", "fragment_train", "optimizer_step", "weight_publish",
    "weight_apply", "tag_generate", "generate", "evaluate", "score"})
NAMED_LANES = 1000  # the first lane :meth:`SpanRecorder.named_lane` hands out (task lanes count from 0)
# Order of process tracks in the merged trace: the data flows top to bottom.
_ROLE_ORDER = {"coordinator": 0, "rollout": 1, "trainer": 2, "reward": 3}

_log = structlog.get_logger(__name__)


class TraceError(RuntimeError):
    """A recorder was used out of order (a span ended twice, or not innermost-first)."""


class Span(NamedTuple):
    """A finished span: ns of the recorder's clock, or µs when read from trace.json."""

    name: str
    start: float
    end: float
    node: str = ""
    tid: int = 0


@dataclass(frozen=True)
class SpanToken:
    """Handle :meth:`SpanRecorder.begin` returns and :meth:`SpanRecorder.end` takes."""

    serial: int
    name: str
    tid: int
    start_ns: int
    args: dict[str, Any] = field(default_factory=dict, compare=False)


def wall_clock_ns() -> Callable[[], int]:
    """A clock reading wall-time ns that never goes backwards (anchored once, then monotonic)."""
    wall0, mono0 = time.time_ns(), time.perf_counter_ns()
    return lambda: wall0 + (time.perf_counter_ns() - mono0)


class SpanRecorder:
    """Records spans, instants and counters of one node (one process track).

    ``clock`` returns nanoseconds since the epoch (default :func:`wall_clock_ns`); tests
    pass a fake. ``keep`` bounds the finished spans kept in memory for :meth:`spans`.
    """

    def __init__(self, node_id: str, role: str, clock: Callable[[], int] | None = None,
                 *, keep: int = 100_000) -> None:
        self.node_id = node_id
        self.role = role
        self._clock = clock or wall_clock_ns()
        self._serial = itertools.count()
        self._open: dict[int, list[SpanToken]] = {}
        self._pending: list[dict[str, Any]] = []  # events not yet dumped
        self._done: deque[Span] = deque(maxlen=keep)
        self._finished = 0  # spans ever finished (``_done`` keeps the last ``keep``)
        self._lanes: dict[Any, int] = {}  # live asyncio task / thread -> tid
        self._free: list[int] = []  # tids of finished tasks, for reuse
        self._next_tid = 0
        self._named: dict[str, int] = {}  # named_lane() lanes

    def _tid(self, tid: int | None) -> int:
        if tid is not None:
            return tid
        try:
            owner: Any = asyncio.current_task()
        except RuntimeError:  # no running loop in this thread
            owner = None
        if owner is None:
            thread = threading.current_thread()
            if thread is threading.main_thread():
                return 0
            owner = thread
        lane = self._lanes.get(owner)
        if lane is None:
            if self._free:
                lane = min(self._free)
                self._free.remove(lane)
            else:
                lane, self._next_tid = self._next_tid, self._next_tid + 1
            self._lanes[owner] = lane
            name = owner.get_name() if isinstance(owner, asyncio.Task) else owner.name
            self._name_lane(lane, "main" if lane == 0 else name)
            if isinstance(owner, asyncio.Task):
                owner.add_done_callback(self._release)
        return lane

    def _name_lane(self, lane: int, name: str) -> None:
        self._pending.append({"ph": "M", "name": "thread_name", "ts_ns": self._clock(),
                              "tid": lane, "args": {"name": name}})

    def named_lane(self, name: str) -> int:
        """A lane of its own, named ``name`` in the trace, for work that is not one task's
        (the same name gives the same lane; never lane 0, the main one)."""
        lane = self._named.get(name)
        if lane is None:
            lane = self._named[name] = NAMED_LANES + len(self._named)
            self._name_lane(lane, name)
        return lane

    def _release(self, task: Any) -> None:
        lane = self._lanes.pop(task, None)
        # A lane whose task died with spans open stays retired: reusing it would mis-nest.
        if lane is not None and not self._open.get(lane):
            self._free.append(lane)

    def now_ns(self) -> int:
        """The recorder's clock."""
        return self._clock()

    def begin(self, name: str, *, tid: int | None = None, **args: Any) -> SpanToken:
        """Open a span on track ``tid`` (default: the calling task's lane); close it with
        :meth:`end`. ``with`` :meth:`span` is the usual form; this one is for spans whose
        end is in a different function."""
        lane = self._tid(tid)
        token = SpanToken(next(self._serial), name, lane, self._clock(), args)
        self._open.setdefault(lane, []).append(token)
        return token

    def end(self, token: SpanToken, **args: Any) -> Span:
        """Close the innermost open span of its track; ``args`` are added to the span's."""
        end_ns = self._clock()
        stack = self._open.get(token.tid, [])
        if not stack or stack[-1].serial != token.serial:
            inner = stack[-1].name if stack else None
            raise TraceError(f"span {token.name!r} on tid {token.tid} ended out of order "
                             f"(innermost open span: {inner!r})")
        stack.pop()
        span = Span(token.name, token.start_ns, end_ns, self.node_id, token.tid)
        self._done.append(span)
        self._finished += 1
        self._pending.append({"ph": "X", "name": token.name, "ts_ns": token.start_ns,
                              "dur_ns": end_ns - token.start_ns, "tid": token.tid,
                              "args": {**token.args, **args}})
        return span

    def record(self, name: str, start_ns: int, end_ns: int, *, tid: int | None = None,
               **args: Any) -> Span:
        """Add a finished span timed elsewhere (by another thread, with :meth:`now_ns`) on
        lane ``tid`` (default: the calling task's); the caller keeps the lane's spans in order."""
        if end_ns < start_ns:
            raise TraceError(f"span {name!r} ends ({end_ns}) before it starts ({start_ns})")
        tid = self._tid(tid)
        span = Span(name, start_ns, end_ns, self.node_id, tid)
        self._done.append(span)
        self._finished += 1
        self._pending.append({"ph": "X", "name": name, "ts_ns": start_ns, "dur_ns": end_ns - start_ns,
                              "tid": tid, "args": args})
        return span

    @contextmanager
    def span(self, name: str, *, tid: int | None = None, **args: Any) -> Iterator[SpanToken]:
        """``with rec.span("denoise_step", step=3):`` records the block as one span."""
        token = self.begin(name, tid=tid, **args)
        try:
            yield token
        finally:
            self.end(token)

    def instant(self, name: str, *, tid: int | None = None, **args: Any) -> None:
        """A point event (a version announced, a node lost)."""
        self._pending.append({"ph": "i", "name": name, "ts_ns": self._clock(),
                              "tid": self._tid(tid), "args": args})

    def counter(self, name: str, value: float) -> None:
        """A sampled value drawn as a counter track (queue depth, bytes in flight)."""
        self._pending.append({"ph": "C", "name": name, "ts_ns": self._clock(), "tid": 0,
                              "args": {"value": value}})

    def finished_after(self, n: int) -> tuple[list[Span], int]:
        """(the spans finished after the first ``n`` ever finished, how many have finished):
        a reader that passes back the count it got sees every span once (as long as it reads
        before ``keep`` more finish)."""
        new = min(self._finished - n, len(self._done))
        spans = list(itertools.islice(reversed(self._done), new))  # from the newest: O(new)
        spans.reverse()
        return spans, self._finished

    def earliest_open_ns(self) -> int | None:
        """Start of the oldest span still open (None if none is)."""
        starts = [t.start_ns for stack in self._open.values() for t in stack]
        return min(starts) if starts else None

    def spans(self, since_ns: int | None = None) -> list[Span]:
        """Finished spans (the last ``keep``), optionally only those ending after ``since_ns``."""
        return [s for s in self._done if since_ns is None or s.end > since_ns]

    def dump(self, path: Path | str) -> int:
        """Append the events recorded since the last dump to ``path``; returns how many.

        Each line carries the node and role, so files can be appended to by restarts and
        read without a header. Open spans are written when they close (next dump).
        """
        path = Path(path)
        events, self._pending = self._pending, []
        if not events:
            return 0
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            for ev in events:
                f.write(json.dumps({**ev, "node": self.node_id, "role": self.role}) + "\n")
            f.flush()
        return len(events)


# ----------------------------------------------------------------------------- busy


def busy_fraction(spans: Iterable[Span], t0: int | float, t1: int | float,
                  busy_names: Iterable[str] = BUSY_SPANS) -> float:
    """Fraction of [t0, t1] covered by the union of spans whose name is in ``busy_names``.

    Overlapping or nested busy spans count once; spans are clipped to the window. Units
    are the spans' (ns from a recorder, µs from trace.json); t0 and t1 use the same.
    """
    if not t1 > t0:
        raise ValueError(f"busy_fraction window [{t0}, {t1}] is empty")
    names = set(busy_names)
    intervals = sorted((max(s.start, t0), min(s.end, t1)) for s in spans
                       if s.name in names and s.end > t0 and s.start < t1)
    covered = 0.0
    current: tuple[float, float] | None = None  # the union of overlapping intervals so far
    for start, end in intervals:
        if current is None or start > current[1]:
            if current is not None:
                covered += current[1] - current[0]
            current = (start, end)
        else:
            current = (current[0], max(current[1], end))
    if current is not None:
        covered += current[1] - current[0]
    return covered / (t1 - t0)


def busy_share(busy_s: float, wall_s: float) -> float:
    """Busy seconds over wall seconds, clamped to 0..1 (0 when no time passed): the busy
    fraction between two :meth:`BusyClock.stats` readings, or since the clock started."""
    return min(1.0, max(0.0, busy_s / wall_s)) if wall_s > 0 else 0.0


class BusyClock:
    """Busy seconds of one recorder's process since the clock was made: the union of its
    busy spans (as :func:`busy_fraction` counts them), kept up to date incrementally.

    Each :meth:`stats` reads only the spans finished since the last one, so its cost does
    not grow with the run. Busy time older than ``lag_s`` (and older than every span still
    open) is folded into a total; a span recorded after the fact (:meth:`SpanRecorder.record`)
    is counted from that fold on, so a single such span longer than ``lag_s`` is
    undercounted by its excess.
    """

    def __init__(self, recorder: SpanRecorder, *, lag_s: float = 600.0,
                 busy_names: Iterable[str] = BUSY_SPANS) -> None:
        self.recorder = recorder
        self.t0 = recorder.now_ns()
        self._names = frozenset(busy_names)
        self._lag_ns = int(lag_s * 1e9)
        self._seen = recorder.finished_after(0)[1]  # spans finished before t0 do not count
        self._fold = self.t0  # busy time before this is final ...
        self._folded = 0  # ... and this much of it was busy
        self._starts: list[int] = []  # disjoint busy intervals after the fold, sorted
        self._ends: list[int] = []
        self._live = 0  # their total length

    def _add(self, start: float, end: float) -> None:
        s, e = max(int(start), self._fold), int(end)
        if e <= s:
            return
        lo = bisect.bisect_left(self._ends, s)  # first interval ending at or after s
        hi = bisect.bisect_right(self._starts, e)  # first interval starting after e
        if lo < hi:
            s, e = min(s, self._starts[lo]), max(e, self._ends[hi - 1])
            self._live -= sum(b - a for a, b in zip(self._starts[lo:hi], self._ends[lo:hi], strict=True))
        self._starts[lo:hi] = [s]
        self._ends[lo:hi] = [e]
        self._live += e - s

    def busy_ns(self) -> int:
        """Busy ns since the clock was made."""
        spans, self._seen = self.recorder.finished_after(self._seen)
        for span in spans:
            if span.name in self._names:
                self._add(span.start, span.end)
        now = self.recorder.now_ns()
        horizon = now - self._lag_ns
        oldest_open = self.recorder.earliest_open_ns()
        if oldest_open is not None:
            horizon = min(horizon, oldest_open)
        if horizon > self._fold:
            k = bisect.bisect_right(self._ends, horizon)
            if k:
                done = sum(b - a for a, b in zip(self._starts[:k], self._ends[:k], strict=True))
                self._folded += done
                self._live -= done
                del self._starts[:k], self._ends[:k]
            self._fold = horizon
        return self._folded + self._live

    def stats(self) -> dict[str, float]:
        """``busy_s`` and ``wall_s`` since the clock was made (what heartbeats carry)."""
        busy = self.busy_ns()
        wall = self.recorder.now_ns() - self.t0
        if wall <= 0:
            return {"busy_s": 0.0, "wall_s": 0.0}
        return {"busy_s": min(busy, wall) / 1e9, "wall_s": wall / 1e9}


def busy_by_node(spans: Iterable[Span], t0: int | float, t1: int | float,
                 busy_names: Iterable[str] = BUSY_SPANS) -> dict[str, float]:
    """:func:`busy_fraction` for each node that has spans, keyed by node id."""
    per_node: dict[str, list[Span]] = {}
    for s in spans:
        per_node.setdefault(s.node, []).append(s)
    return {node: busy_fraction(ss, t0, t1, busy_names) for node, ss in sorted(per_node.items())}


# ----------------------------------------------------------------------------- merge


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    events = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            # A node killed mid-write leaves a torn last line; the rest is still good.
            _log.warning("trace_line_skipped", path=str(path), line=lineno)
    return events


def _track_key(node: str, role: str) -> tuple[int, str, int]:
    # "trainer-10" sorts after "trainer-2".
    prefix, _, suffix = node.rpartition("-")
    number = int(suffix) if suffix.isdigit() else -1
    return _ROLE_ORDER.get(role, 3), prefix or node, number


def merge_traces(run_dir: Path | str, *, offset_ns: Mapping[str, int] | None = None) -> Path:
    """Merge ``run_dir/trace/*.jsonl`` into ``run_dir/trace.json`` (Chrome trace-event JSON).

    ``offset_ns`` maps node id to the ns to add to that node's clock to reach the
    reference clock (multi-host runs; nodes on one host need none). Times are shifted so
    the earliest event is at 0. Returns the path written.
    """
    run_dir = Path(run_dir)
    offsets = dict(offset_ns or {})
    nodes: dict[str, str] = {}
    raw: list[dict[str, Any]] = []
    for path in sorted((run_dir / "trace").glob("*.jsonl")):
        for ev in _read_jsonl(path):
            node = str(ev.get("node", path.stem))
            nodes.setdefault(node, str(ev.get("role", "")))
            raw.append({**ev, "node": node, "ts_ns": int(ev["ts_ns"]) + offsets.get(node, 0)})
    t0 = min((ev["ts_ns"] for ev in raw), default=0)
    pids = {node: pid for pid, node in
            enumerate(sorted(nodes, key=lambda n: _track_key(n, nodes[n])), start=1)}
    out: list[dict[str, Any]] = []
    tids: dict[tuple[int, int], str] = {}
    for node, pid in pids.items():
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": node}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": pid}})
    # Lane names first (a reused lane keeps the name of its first task).
    for ev in sorted((e for e in raw if e["ph"] == "M"), key=lambda e: e["ts_ns"]):
        tids.setdefault((pids[ev["node"]], int(ev.get("tid", 0))),
                        str(ev.get("args", {}).get("name", "")))
    for ev in sorted((e for e in raw if e["ph"] != "M"),
                     key=lambda e: (e["ts_ns"], -e.get("dur_ns", 0))):
        pid, tid = pids[ev["node"]], int(ev.get("tid", 0))
        tids.setdefault((pid, tid), "main" if tid == 0 else f"task-{tid}")
        item = {"ph": ev["ph"], "name": ev["name"], "pid": pid, "tid": tid,
                "ts": (ev["ts_ns"] - t0) / 1000.0, "args": ev.get("args", {})}
        if ev["ph"] == "X":
            item["dur"] = ev["dur_ns"] / 1000.0
        elif ev["ph"] == "i":
            item["s"] = "t"
        elif ev["ph"] == "C":
            item["args"] = {ev["name"]: ev["args"]["value"]}
        out.append(item)
    for (pid, tid), name in sorted(tids.items()):
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": name}})
    target = run_dir / "trace.json"
    target.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms",
                                  "otherData": {"t0_ns": t0, "offset_ns": offsets}}),
                      encoding="utf-8")
    return target


def read_trace(path: Path | str) -> tuple[list[str], list[Span]]:
    """Process track names (in track order) and the "X" spans of a merged trace.json.

    Span times are the trace's microseconds since the run's first event.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {ev["pid"]: ev["args"]["name"] for ev in events
             if ev.get("ph") == "M" and ev.get("name") == "process_name"}
    spans = [Span(ev["name"], ev["ts"], ev["ts"] + ev["dur"], names.get(ev["pid"], str(ev["pid"])),
                  ev.get("tid", 0)) for ev in events if ev.get("ph") == "X"]
    return [names[pid] for pid in sorted(names)], spans
