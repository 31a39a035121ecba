"""The coordinator's rows of metrics.jsonl: one per optimizer step, written in step order.

A row is trainer rank 0's StepDone metrics plus what only the coordinator sees: the run's
wall time, the whole cluster's traffic, each node's busy share since the previous row (from
the nodes' heartbeat stats), each batching rollout's rows per denoiser forward since the
previous row (``batch/<node>``) and ``staleness/<k>``, the credit ledger's count of the step's
trained trajectories by staleness (docs/metrics.md). A row waits until the ledger has every
fragment of its step consumed: another rank's Consumed may arrive after rank 0's StepDone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from digenrl.telemetry.metrics import StepMetrics, is_eval_key
from digenrl.telemetry.trace import busy_share


class StepLedger(Protocol):
    """What the rows read of the credit ledger (:class:`digenrl.core.credits.CreditLedger`)."""

    def step_consumed(self, step: int) -> int: ...

    def pop_trained_staleness(self, step: int) -> dict[int, int]: ...


class StepRows:
    """Step rows on their way to ``metrics`` (a MetricsWriter) and ``progress`` (or None)."""

    def __init__(self, metrics: Any, progress: Any = None) -> None:
        self.metrics = metrics
        self.progress = progress
        self.busy_last: dict[str, tuple[float, float]] = {}   # node -> (busy_s, wall_s) at the last row
        self.busy_total: dict[str, tuple[float, float]] = {}  # node -> (busy_s, wall_s) of its latest beat
        self.net_total: dict[str, tuple[float, float]] = {}   # node -> (messages, bytes) sent
        self.batch_last: dict[str, tuple[float, float]] = {}  # node -> (forwards, rows) at the last row
        self.batch_total: dict[str, tuple[float, float]] = {}  # node -> (forwards, rows) of its latest beat
        self.waiting: dict[int, dict[str, Any]] = {}          # step -> metrics row not yet written

    def node_stats(self, node_id: str, stats: Mapping[str, Any]) -> None:
        """A node's heartbeat stats: its busy and wall seconds and what it sent, so far."""
        busy, wall = float(stats.get("busy_s", 0.0)), float(stats.get("wall_s", 0.0))
        self.busy_total[node_id] = (busy, wall)
        self.net_total[node_id] = (float(stats.get("net_messages", 0.0)),
                                   float(stats.get("net_bytes", 0.0)))
        if "batch_forwards" in stats:  # a rollout with step-level batching (sampler.max_batch > 0)
            self.batch_total[node_id] = (float(stats["batch_forwards"]), float(stats.get("batch_rows", 0.0)))

    def traffic(self, own: Iterable[tuple[int, int]]) -> tuple[float, float]:
        """(messages, frame bytes) the whole cluster sent so far: ``own``, the (messages,
        bytes) of the coordinator's sockets now, and each node's as of its latest heartbeat."""
        own = list(own)
        return (sum(m for m, _ in self.net_total.values()) + sum(m for m, _ in own),
                sum(b for _, b in self.net_total.values()) + sum(b for _, b in own))

    def busy(self) -> dict[str, float]:
        """Each node's busy share over its whole run (summary.json ``busy``)."""
        return {n: busy_share(b, w) for n, (b, w) in self.busy_total.items()}

    def batch_occupancy(self) -> dict[str, float]:
        """Each batching rollout's trajectory rows per denoiser forward over its whole run
        (summary.json ``batch_rows_per_forward``)."""
        return {n: r / f for n, (f, r) in self.batch_total.items() if f > 0}

    def step_done(self, step: int, version: int, metrics: Mapping[str, Any], *, wall_time: float,
                  traffic: tuple[float, float]) -> None:
        """Rank 0's StepDone: its row waits for :meth:`flush`. An evaluation that rode on it
        (``eval/`` keys, rl/evaluate.py) is written at once, as its own row."""
        metrics = dict(metrics)
        evaluated = {k: metrics.pop(k) for k in [k for k in metrics if is_eval_key(k)]}
        if evaluated:
            self.metrics.write_eval(int(evaluated.pop("eval/policy_version")), wall_time, evaluated)
        messages, nbytes = traffic
        # the ledger's count of what the step trained, by staleness, replaces rank 0's own view
        row: dict[str, Any] = {"step": step, "policy_version": version,
                               **{k: v for k, v in metrics.items() if not k.startswith("staleness/")},
                               "wall_time": wall_time, "net_messages": messages, "net_bytes": nbytes}
        for node, (busy, wall) in self.busy_total.items():
            b0, w0 = self.busy_last.get(node, (0.0, 0.0))
            if wall > w0:
                row[f"busy/{node}"] = busy_share(busy - b0, wall - w0)
            self.busy_last[node] = (busy, wall)
        for node, (forwards, rows) in self.batch_total.items():
            f0, r0 = self.batch_last.get(node, (0.0, 0.0))
            if forwards > f0:
                row[f"batch/{node}"] = (rows - r0) / (forwards - f0)
            self.batch_last[node] = (forwards, rows)
        self.waiting[step] = row

    def flush(self, ledger: StepLedger, fragments_per_step: int, *, final: bool = False) -> None:
        """Write finished steps' rows in order, each once ``ledger`` has every one of its
        fragments consumed, so ``staleness/<k>`` counts every trained trajectory of the
        step. ``final``: write the rest as they are (the run is over, or being rewound)."""
        while self.waiting:
            step = min(self.waiting)
            if not final and ledger.step_consumed(step) < fragments_per_step:
                return
            row = self.waiting.pop(step)
            row.update({f"staleness/{k}": n for k, n in sorted(ledger.pop_trained_staleness(step).items())})
            self.metrics.write(StepMetrics.from_record(row))
            if self.progress is not None:
                self.progress.update(row)
