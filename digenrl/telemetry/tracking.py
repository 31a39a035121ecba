"""Experiment trackers: TensorBoard, Weights & Biases, SwanLab and MLflow behind one interface.

Only the coordinator (in colocated mode, rank 0) opens trackers; nodes never do. Its
:class:`~digenrl.telemetry.metrics.MetricsWriter` hands them what it writes: the resolved
config once, every metrics.jsonl row (training steps at their ``step``, evaluation rows at
the evaluated version) and the sample grids that trainer rank 0 sends (``Samples``). Each
backend is one small class with four methods (:class:`Tracker`); ``tracking.backends``
chooses them (docs/observability.md has what each one writes where)::

    MetricsWriter.write / write_eval / write_samples
        -> Trackers (a bounded queue) -> its worker thread -> each open Tracker, in order

| blocking call               | waits for                         | unblocked by              |
|-----------------------------|-----------------------------------|---------------------------|
| ``Trackers.close()``        | the queue worked off, each closed | the worker (at most ``timeout_s``) |
| ``Trackers.wait_idle()``    | the queue worked off              | the worker                |

Nothing else blocks the caller: the packages' imports (seconds each), their start-up and
their I/O run on the worker thread, so the coordinator's event loop never waits for a
tracker. A tracker that raises (at start-up or later) is logged (``tracker_failed``, with its
name and the error) and dropped; the run and the other trackers go on. A queue that a hung
tracker lets fill drops new work and says so once (``tracker_backlog``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import structlog
from PIL import Image

from digenrl.config import TRACKERS, Config, TrackingConfig, to_dict, to_toml

__all__ = ["BACKLOG", "PACKAGE", "Tracker", "Trackers", "check_trackers", "grid_caption",
           "images_due", "open_trackers", "tracker_dir"]

_log = structlog.get_logger(__name__)

PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab", "mlflow": "mlflow"}
"""The module each backend imports (its pip package: the ``metrics`` extra for tensorboard,
``tracking`` for the others)."""
_EXTRA = {"tensorboard": "metrics", "wandb": "tracking", "swanlab": "tracking", "mlflow": "tracking"}

BACKLOG = 1024
"""Jobs (rows, grids) the queue holds before new ones are dropped (a hung tracker)."""

MAX_CAPTION = 1 << 16
"""Characters of a grid's caption (its prompts); longer ones are cut."""


class Tracker(Protocol):
    """One experiment tracker, opened with the run's config."""

    name: str

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Log numbers at ``step``."""

    def image(self, step: int, key: str, image: Image.Image, caption: str) -> None:
        """Log one picture (a sample grid) under ``key`` at ``step``, with its caption."""

    def close(self) -> None:
        """Finish the run in the tracker (flush, mark it finished)."""


def check_trackers(tracking: TrackingConfig) -> None:
    """Raise ValueError naming the first chosen tracker whose package is not installed. The
    default ``tensorboard`` is exempt: without it a run logs no TensorBoard, as it always did."""
    for name in tracking.backends:
        if name != "tensorboard" and importlib.util.find_spec(PACKAGE[name]) is None:
            raise ValueError(f"tracking.backends: {name!r} needs the {PACKAGE[name]} package: "
                             f"pip install 'digenrl[{_EXTRA[name]}]'")


def images_due(step: int, cfg: Config) -> bool:
    """Whether training step ``step``'s samples go to the trackers: some are chosen, and it is
    the first or last step or a multiple of ``tracking.images_every`` (0: never)."""
    every = cfg.tracking.images_every
    return bool(cfg.tracking.backends) and every > 0 and (step % every == 0 or step == cfg.run.steps - 1)


def tracker_dir(tracking: TrackingConfig, run_dir: Path | str) -> Path:
    """Where the trackers keep their local files: ``tracking.dir``, or the run dir."""
    return Path(tracking.dir) if tracking.dir else Path(run_dir)


def grid_caption(prompts: Sequence[str], nrow: int) -> str:
    """The prompts of a grid (one per sample, in grid order; ``nrow`` samples a row) as a
    caption: one line a row where a row shows one prompt, else one line a sample."""
    rows = [prompts[i:i + nrow] for i in range(0, len(prompts), max(nrow, 1))]
    if rows and all(len(set(r)) == 1 for r in rows):
        lines = [f"row {i + 1}: {r[0]}" for i, r in enumerate(rows)]
    else:
        lines = [f"{i + 1}: {p}" for i, p in enumerate(prompts)]
    text = "\n".join(lines)
    return text if len(text) <= MAX_CAPTION else text[:MAX_CAPTION - 1] + "…"


# ----------------------------------------------------------------------------- the backends

class TensorBoardTracker:
    """``<dir>/tb``: scalars under their keys, grids as images, the config and captions as text."""

    name = "tensorboard"

    def __init__(self, folder: Path, config_toml: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder / "tb"))
        # TensorBoard's text plugin reads markdown: four spaces make a code block
        self.writer.add_text("config", "\n".join("    " + line for line in config_toml.splitlines()))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def image(self, step: int, key: str, image: Image.Image, caption: str) -> None:
        self.writer.add_image(key, np.asarray(image), global_step=step, dataformats="HWC")
        self.writer.add_text(f"{key}/prompts", caption, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run in ``<dir>/wandb`` (offline: ``offline-run-*``, for ``wandb sync``). Every
    row carries ``step`` (the run's step, or the evaluated version), which is each key's x axis:
    evaluation rows of version v arrive before step v's own row, and wandb's own step must
    only grow."""

    name = "wandb"

    def __init__(self, tracking: TrackingConfig, folder: Path, run_name: str,
                 config: Mapping[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        folder.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", save_code=False, disable_git=True, silent=True,
                                  x_disable_stats=True)  # the coordinator's host is not the GPUs'
        self.run = wandb.init(project=tracking.project, name=run_name, dir=str(folder),
                              config=dict(config), settings=settings,
                              mode=None if tracking.mode == "auto" else cast(Any, tracking.mode))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({**values, "step": step})

    def image(self, step: int, key: str, image: Image.Image, caption: str) -> None:
        self.run.log({key: self.wandb.Image(image, caption=caption), "step": step})

    def close(self) -> None:
        self.run.finish()
        # finish() only hands the run to wandb's service process; teardown waits until that
        # has written it out (offline: the .wandb file is complete only then)
        self.wandb.teardown()


class SwanlabTracker:
    """A SwanLab run in ``<dir>/swanlog`` (offline: for ``swanlab sync``); no terminal capture,
    no hardware monitor, never an interactive login prompt."""

    name = "swanlab"

    def __init__(self, tracking: TrackingConfig, folder: Path, run_name: str,
                 config: Mapping[str, Any]) -> None:
        import swanlab

        self.swanlab = swanlab
        settings = swanlab.Settings(interactive=False,
                                    terminal=swanlab.Settings.Terminal(proxy_type="none"),
                                    probe=swanlab.Settings.Probe(monitor=False))
        mode = None if tracking.mode == "auto" else tracking.mode
        self.run = swanlab.init(project=tracking.project, name=run_name, log_dir=str(folder / "swanlog"),
                                mode=mode, config=dict(config), settings=settings, reinit=True)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def image(self, step: int, key: str, image: Image.Image, caption: str) -> None:
        self.run.log({key: self.swanlab.Image(image, caption=caption)}, step=step)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_KEY_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-. /")


def _mlflow_key(key: str) -> str:
    """``key`` with the characters MLflow refuses in a name made ``_``."""
    return "".join(c if c in _MLFLOW_KEY_OK else "_" for c in key)


def _flat(prefix: str, value: Any) -> list[tuple[str, str]]:
    if isinstance(value, Mapping):
        return [kv for k, v in value.items() for kv in _flat(f"{prefix}.{k}" if prefix else str(k), v)]
    return [(prefix, str(value))]


class MlflowTracker:
    """An MLflow run in experiment ``tracking.project``: metrics, the config as params (dotted
    keys) and ``config.json``, grids as images and their prompts as text artifacts.

    Without a URI the store is a local file store, ``<dir>/mlruns``: MLflow 3 keeps that
    backend in maintenance mode and opens it only with ``MLFLOW_ALLOW_FILE_STORE=true``, which
    this tracker then sets for its process (``mlflow ui --backend-store-uri <dir>/mlruns``
    reads it)."""

    name = "mlflow"
    MAX_PARAM = 6000  # characters of a param value MLflow accepts
    BATCH = 100       # params per log_batch call MLflow accepts

    def __init__(self, tracking: TrackingConfig, folder: Path, run_name: str,
                 config: Mapping[str, Any]) -> None:
        uri = tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            uri = (folder / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(tracking.project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(tracking.project)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self.client.log_dict(self.run_id, dict(config), "config.json")
        params = [Param(k, v[:self.MAX_PARAM]) for k, v in _flat("", config)]
        for lo in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[lo:lo + self.BATCH])

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(_mlflow_key(k), v, ms, step)
                                                    for k, v in values.items()])

    def image(self, step: int, key: str, image: Image.Image, caption: str) -> None:
        self.client.log_image(self.run_id, image, key=_mlflow_key(key), step=step)
        self.client.log_text(self.run_id, caption, f"{_mlflow_key(key)}/step_{step:06d}.txt")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _opener(name: str, tracking: TrackingConfig, folder: Path, run_name: str,
            cfg: Config | None) -> Callable[[], Tracker]:
    config = to_dict(cfg) if cfg is not None else {}
    if name == "tensorboard":
        return lambda: TensorBoardTracker(folder, to_toml(cfg) if cfg is not None else "")
    classes: dict[str, Callable[..., Tracker]] = {
        "wandb": WandbTracker, "swanlab": SwanlabTracker, "mlflow": MlflowTracker}
    cls = classes[name]
    return lambda: cls(tracking, folder, run_name, config)


# ----------------------------------------------------------------------------- the fan-out

class Trackers:
    """The run's open trackers behind one worker thread (see the module doc).

    ``openers``: (name, a function that opens that tracker); they run on the worker thread,
    first thing. Every method returns at once; :meth:`close` waits for the queue's end.
    """

    def __init__(self, openers: Sequence[tuple[str, Callable[[], Tracker]]]) -> None:
        self.live: list[Tracker] = []
        self.failed: dict[str, str] = {}  # name -> the error that dropped it
        self.dropped_jobs = 0
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=BACKLOG)
        self._thread: threading.Thread | None = None
        if openers:
            self._queue.put_nowait(lambda: self._open(openers))
            self._thread = threading.Thread(target=self._work, name="trackers", daemon=True)
            self._thread.start()

    @property
    def names(self) -> list[str]:
        """The trackers open now (after :meth:`wait_idle`: those that opened and still work)."""
        return [t.name for t in self.live]

    # ---- called by the writer (any thread), never blocking
    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        """Log the finite numbers among ``values`` (None, bools and text are skipped)."""
        numbers = {k: float(v) for k, v in values.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        if numbers:
            self._put(lambda: self._each("scalars", step, numbers))

    def image(self, step: int, key: str, image_HW3: np.ndarray, caption: str) -> None:
        """Log a uint8 (H, W, 3) picture under ``key`` with its caption."""
        if self._thread is None:
            return
        picture = Image.fromarray(np.array(image_HW3, dtype=np.uint8))  # a copy: the caller's may be reused
        caption = caption if len(caption) <= MAX_CAPTION else caption[:MAX_CAPTION - 1] + "…"
        self._put(lambda: self._each("image", step, key, picture, caption))

    def wait_idle(self) -> None:
        """Block until every job queued so far has run (tests, and before reading back)."""
        if self._thread is not None:
            self._queue.join()

    def close(self, timeout_s: float = 120.0) -> None:
        """Work off the queue, close each tracker; a tracker still busy after ``timeout_s`` is
        left to the daemon thread (logged: ``trackers_not_closed``)."""
        if self._thread is None:
            return
        with contextlib.suppress(queue.Full):  # a hung tracker: the join below times out too
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            _log.error("trackers_not_closed", trackers=self.names, waited_s=timeout_s)
        self._thread = None

    # ---- the worker thread
    def _put(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            return
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.dropped_jobs += 1
            if self.dropped_jobs == 1:
                _log.error("tracker_backlog", trackers=self.names, queued=BACKLOG,
                           hint="a tracker is not keeping up (network?); new rows are dropped")

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    for t in list(self.live):
                        self._call(t, "close")
                    self.live.clear()
                    return
                job()
            finally:
                self._queue.task_done()

    def _open(self, openers: Sequence[tuple[str, Callable[[], Tracker]]]) -> None:
        for name, opener in openers:
            try:
                self.live.append(opener())
            except Exception as e:  # any failure of a tracker's package: logged, never the run's
                self._fail(name, e, at="open")

    def _each(self, method: str, *args: Any) -> None:
        for t in list(self.live):
            try:
                getattr(t, method)(*args)
            except Exception as e:  # a tracker's failure mid-run: logged and dropped
                self.live.remove(t)
                self._fail(t.name, e, at=method)
                self._call(t, "close")

    def _call(self, t: Tracker, method: str) -> None:
        try:
            getattr(t, method)()
        except Exception as e:  # closing a failed (or any) tracker: logged, nothing else to do
            self._fail(t.name, e, at=method)

    def _fail(self, name: str, e: BaseException, *, at: str) -> None:
        error = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        self.failed.setdefault(name, error)
        _log.error("tracker_failed", tracker=name, at=at, error=error,
                   hint="dropped; the run goes on without it")


def open_trackers(cfg: Config | None, run_dir: Path | str,
                  backends: Sequence[str] | None = None) -> Trackers:
    """The trackers ``cfg.tracking.backends`` (or ``backends``) name, opening on their thread.

    TensorBoard without its package is left out quietly (``tensorboard_unavailable`` at debug
    level: it is the default, and a run without it logs as it always did); another missing
    package is logged as that tracker's failure (the launcher refuses it first:
    :func:`check_trackers`)."""
    tracking = cfg.tracking if cfg is not None else TrackingConfig()
    names = list(tracking.backends if backends is None else backends)
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"tracking.backends: {unknown[0]!r} is not one of {', '.join(TRACKERS)}")
    folder = tracker_dir(tracking, run_dir)
    run_name = tracking.run_name or Path(run_dir).resolve().name
    openers = []
    for name in names:
        if name == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
            _log.debug("tensorboard_unavailable", hint="pip install 'digenrl[metrics]'", path=str(folder))
            continue
        openers.append((name, _opener(name, tracking, folder, run_name, cfg)))
    return Trackers(openers)
