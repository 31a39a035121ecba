"""Per-step metrics: one typed record, one writer, one file that documents every key.

The trainer (rank 0) reduces a step's numbers into a :class:`StepMetrics` and hands it to a
:class:`MetricsWriter`, which appends one JSON line to ``run_dir/metrics.jsonl`` (flushed
per line, so ``tail -f`` and a crashed run both see every finished step) and hands it to the
run's experiment trackers (:mod:`digenrl.telemetry.tracking`; by default TensorBoard under
``run_dir/tb`` when the ``metrics`` extra is installed). Every key a record can produce is
documented in ``docs/metrics.md``;
:func:`documented_keys` parses that file so a test can hold the two together.

Busy fractions come from :func:`digenrl.telemetry.trace.busy_fraction` over the step's
window, the same function the report applies to ``trace.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from digenrl.fileio import read_jsonl, write_text_atomic
from digenrl.telemetry.tracking import Trackers, grid_caption, open_trackers

__all__ = ["DOCS_PATH", "MetricsWriter", "MissingExtraError", "StepMetrics", "documented_keys",
           "finite_only", "is_documented", "is_eval_row", "read_metrics"]

DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
# Dict-valued fields -> the key prefix of their entries: busy={"trainer-0": .9} -> "busy/trainer-0".
_DICT_PREFIX = {"reward_terms": "reward", "adv_terms": "adv", "busy": "busy", "batch": "batch",
                "gpu_util": "gpu_util",
                "gpu_mem_used_mb": "gpu_mem_used_mb", "staleness_hist": "staleness"}
_warned: set[str] = set()  # extra keys already logged (once per process is enough)

_log = structlog.get_logger(__name__)


class MissingExtraError(ImportError):
    """An optional feature was asked for but its package is not installed."""


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one optimizer step did. Meanings and units: docs/metrics.md.

    Dict-valued fields become one key per entry (``busy={"trainer-0": .9}`` ->
    ``busy/trainer-0``, ``reward_terms={"aesthetic": .4}`` -> ``reward/aesthetic``).
    ``extra`` holds keys a newer peer sent that this class does not know yet: they are
    written as they are (never dropped) and logged once as ``undocumented_metric``.
    """

    step: int
    policy_version: int
    wall_time: float
    step_seconds: float
    samples_per_s: float
    reward_mean: float
    reward_std: float
    loss: float
    kl: float
    clipfrac: float
    ratio_max_dev: float
    grad_norm: float
    max_staleness: int
    mean_staleness: float
    zero_adv_groups: int
    trained: int
    discarded: int
    train_seconds: float = 0.0
    rejected_stale: int = 0
    discarded_nonfinite: int = 0
    skipped_steps: int = 0
    net_messages: float = 0.0
    net_bytes: float = 0.0
    reward_terms: dict[str, float] = field(default_factory=dict)
    adv_terms: dict[str, float] = field(default_factory=dict)  # "<term>/std" -> adv/<term>/std
    busy: dict[str, float] = field(default_factory=dict)
    batch: dict[str, float] = field(default_factory=dict)  # batching rollouts' rows per forward
    gpu_util: dict[str, float] = field(default_factory=dict)
    gpu_mem_used_mb: dict[str, float] = field(default_factory=dict)
    staleness_hist: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        """The flat JSON-line form: scalars as they are, dict fields as ``prefix/<name>``."""
        record: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _DICT_PREFIX:
                prefix = _DICT_PREFIX[f.name]
                record.update({f"{prefix}/{k}": _number(v) for k, v in sorted(value.items())})
            elif f.name != "extra":
                record[f.name] = value
        record.update(self.extra)
        return record

    @classmethod
    def from_record(cls, row: Mapping[str, Any]) -> StepMetrics:
        """The inverse of :meth:`to_record`: a flat row (``busy/<node>``, ``reward/<term>``,
        ...) as a record. Keys of no field go to ``extra`` (logged once each), so a key the
        trainer adds is written, never silently dropped. Raises ``ValueError`` naming the
        missing keys when a required one is absent."""
        names = {f.name for f in dataclasses.fields(cls)} - set(_DICT_PREFIX) - {"extra"}
        by_prefix = {p: f for f, p in _DICT_PREFIX.items()}
        scalars: dict[str, Any] = {}
        dicts: dict[str, dict[str, Any]] = {f: {} for f in _DICT_PREFIX}
        extra: dict[str, Any] = {}
        for key, value in row.items():
            prefix, sep, sub = key.partition("/")
            if key in names:
                scalars[key] = value
            elif sep and sub and prefix in by_prefix:
                dicts[by_prefix[prefix]][sub] = _number(value)
            else:
                extra[key] = value
                if key not in _warned:
                    _warned.add(key)
                    _log.warning("undocumented_metric", key=key, hint="document it in docs/metrics.md")
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        if missing := sorted(required - set(scalars)):
            raise ValueError(f"metrics row of step {row.get('step')!r} lacks {missing}")
        fields: dict[str, Any] = {**scalars, **dicts}  # checked by name above, typed by the class
        return cls(**fields, extra=extra)


def _number(v: Any) -> int | float | None:
    """Counts stay integers (``staleness/<k>``); everything else is a float (None: absent)."""
    return v if v is None or (isinstance(v, int) and not isinstance(v, bool)) else float(v)


def finite_only(record: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``record`` with every non-finite number (NaN, +-inf, also inside lists and maps) made
    None (JSON null: no value), and the keys where that happened. Nothing downstream of the
    writer (metrics.jsonl, TensorBoard, Prometheus, the report) then sees a NaN: a diverged
    loss reads as missing and is counted (``nonfinite_metrics``), never as a number."""
    bad: list[str] = []

    def clean(key: str, v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            bad.append(key)
            return None
        if isinstance(v, Mapping):
            return {k: clean(f"{key}/{k}", x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(key, x) for x in v]
        return v

    return {k: clean(k, v) for k, v in record.items()}, bad


class MetricsWriter:
    """Appends :class:`StepMetrics` to ``run_dir/metrics.jsonl`` and hands every row (and the
    sample grids of :meth:`write_samples`) to the run's experiment trackers.

    ``trackers``: :func:`digenrl.telemetry.tracking.open_trackers` of the run's config (the
    coordinator's writer); None with ``tensorboard=True`` opens TensorBoard alone when the
    ``tensorboard`` package is importable (logged once, ``tensorboard_unavailable``, when not).
    """

    def __init__(self, run_dir: Path | str, *, tensorboard: bool = True,
                 sink: Callable[[dict[str, Any]], None] | None = None,
                 trackers: Trackers | None = None) -> None:
        self.sink = sink  # sees every step record written (digenrl-node's Prometheus endpoint)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        if trackers is None:
            trackers = open_trackers(None, run_dir, ["tensorboard"] if tensorboard else [])
        self.trackers = trackers

    def _finite(self, record: Mapping[str, Any], step: Any, *, count: bool = True) -> dict[str, Any]:
        """:func:`finite_only`, counting (``nonfinite_metrics``: in every row with ``count``,
        else only where some value was nulled) and logging what it nulled."""
        record, bad = finite_only(record)
        if bad or count:
            record["nonfinite_metrics"] = len(bad)
        if bad:
            _log.warning("nonfinite_metrics", step=step, keys=sorted(set(bad)),
                         hint="written as null; see docs/operations.md")
        return record

    def write(self, metrics: StepMetrics) -> dict[str, Any]:
        """Append one step; returns the record written (non-finite numbers as None, counted)."""
        record = self._finite(metrics.to_record(), metrics.step)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        self.trackers.scalars(metrics.step, {k: v for k, v in record.items() if k != "step"})
        if self.sink is not None:
            self.sink(record)
        return record

    def write_eval(self, version: int, wall_time: float, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one evaluation row: ``step`` and ``policy_version`` are the evaluated
        version, ``metrics`` its ``eval/`` entries (:mod:`digenrl.rl.evaluate`)."""
        bad = sorted(k for k in metrics if not is_eval_key(k))
        if bad:
            raise ValueError(f"evaluation row of version {version}: keys {bad} lack the eval/ "
                             "(or eval_ema/) prefix")
        record = self._finite({"step": version, "policy_version": version, "wall_time": wall_time,
                               **metrics}, version, count=False)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        self.trackers.scalars(version, {k: v for k, v in record.items()
                                        if k not in ("step", "policy_version", "wall_time")})
        return record

    def write_samples(self, step: int, kind: str, grid_HW3: Any, caption: str = "",
                      row_prompts: Sequence[str] = ()) -> None:
        """A sample grid (uint8 (H, W, 3)) to the trackers as ``samples/<kind>`` at ``step``
        (``train``: a training step; ``eval``, ``eval_ema``: the evaluated version) with its
        prompts: ``caption``, or one line per grid row from ``row_prompts``."""
        caption = caption or grid_caption(list(row_prompts), 1)
        self.trackers.image(step, f"samples/{kind}", np.asarray(grid_HW3), caption)

    def close(self) -> None:
        """Close the file, then the trackers (they finish what was queued first)."""
        self._file.close()
        self.trackers.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


EVAL_PREFIXES = ("eval/", "eval_ema/")
"""Key prefixes of evaluation metrics: the trained policy's, and its EMA's (rl/evaluate.py)."""


def is_eval_key(key: str) -> bool:
    """Whether a metric key is an evaluation's (``eval/...`` or ``eval_ema/...``)."""
    return key.startswith(EVAL_PREFIXES)


def is_eval_row(row: Mapping[str, Any]) -> bool:
    """Whether a metrics.jsonl row is an evaluation row (its keys are ``eval/...`` or
    ``eval_ema/...``)."""
    return any(is_eval_key(k) for k in row)


def read_metrics(run_dir: Path | str, kind: str = "train") -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` in order (a torn last line is ignored, damage
    before the last line is :class:`~digenrl.fileio.DamagedFile`):
    ``kind`` "train" (one per optimizer step), "eval" (one per evaluation) or "all"."""
    if kind not in ("train", "eval", "all"):
        raise ValueError(f"kind {kind!r}: expected 'train', 'eval' or 'all'")
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [row for _, row in read_jsonl(path)[0]
            if kind == "all" or is_eval_row(row) == (kind == "eval")]


def repair_metrics(run_dir: Path | str) -> str | None:
    """Drop a torn last line of ``run_dir/metrics.jsonl`` (a crash mid-write), rewriting the
    file; returns what was dropped (for the operator's warning) or None. Damage with rows
    after it raises :class:`~digenrl.fileio.DamagedFile`."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    rows, dropped = read_jsonl(path)
    if dropped is not None:
        write_text_atomic(path, "".join(line + "\n" for line, _ in rows))
        _log.warning("metrics_torn_line_dropped", detail=dropped)
    return dropped


# ----------------------------------------------------------------------------- documentation

_DOC_KEY = re.compile(r"^\|\s*`([^`]+)`\s*\|")
_PLACEHOLDER = re.compile(r"<[^<>]*>")


def documented_keys(path: Path | str = DOCS_PATH) -> set[str]:
    """Keys documented in docs/metrics.md: the backticked first cell of each table row
    between the ``<!-- keys:begin -->`` and ``<!-- keys:end -->`` markers.

    Per-node keys are written with a placeholder, e.g. ``busy/<node>``.
    """
    keys: set[str] = set()
    inside = False
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip() == "<!-- keys:begin -->":
            inside = True
        elif line.strip() == "<!-- keys:end -->":
            inside = False
        elif inside and (m := _DOC_KEY.match(line)):
            keys.add(m.group(1))
    if not keys:
        raise ValueError(f"{path}: no documented metric keys between the keys:begin/end markers")
    return keys


def is_documented(key: str, documented: Iterable[str]) -> bool:
    """Whether ``key`` is documented, where a placeholder matches any non-empty text:
    ``name/<node>`` matches ``name/`` + any node id, ``adv/<term>/std`` ``adv/jpeg/std``."""
    for doc in documented:
        if key == doc:
            return True
        pieces = _PLACEHOLDER.split(doc)
        if len(pieces) > 1 and re.fullmatch(".+".join(map(re.escape, pieces)), key):
            return True
    return False

