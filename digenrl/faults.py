"""TEST-ONLY fault injection and slowdowns, in one place: a production run uses none of it.

Every knob here is a *failpoint* set by the environment of the processes meant to misbehave,
never by the run's config: a spawned node inherits its launcher's environment, and a run
resumed from its checkpoint reads the same config but not the same faults.

* **Slowdowns**, from ``DIGENRL_FAILPOINTS`` (:data:`FAILPOINTS_ENV`), ``name=value`` pairs
  separated by ``;`` (e.g. ``slowdown=5;slowdown_nodes=rollout-1,trainer-0``), read once per
  process (:func:`failpoints`); tests in one process call :func:`set_failpoints` instead.
  :func:`node_slowdown` turns them into a :class:`Slowdown`: per kind of compute span, how
  many times longer the work takes. The actor sleeps ``(factor - 1) x`` the span's own time
  after each such span, outside the span, so a slowed node looks like a slower GPU that idles
  the difference. Generating spans (``denoise_step``, ``tag_generate``) are stretched on the
  compute thread, between two pulls of the sampler; training spans (``fragment_train``,
  ``optimizer_step``) after the compute thread returns.

  | failpoint          | value                | what it does                                    |
  |--------------------|----------------------|-------------------------------------------------|
  | ``slowdown``         | factor >= 1          | a generating node sleeps (factor-1)x its denoising work |
  | ``slowdown_nodes``   | node ids, comma-separated | the nodes ``slowdown`` applies to (none: every rollout; a trainer named here is slowed when it generates for TAG) |
  | ``trainer_slowdown`` | factor >= 1          | a trainer rank sleeps (factor-1)x its training work (fragment train, optimizer step) |

* **Crash and hang points**, from the environment of the process meant to fail:
  ``DIGENRL_TEST_CRASH=point:N``, ``DIGENRL_TEST_HANG=point:N`` and
  ``DIGENRL_TEST_SIGTERM=point:N`` fire at ``point`` once the step (or version) reaches ``N``.

| point      | hook          | where                                           | what happens                      |
|------------|---------------|-------------------------------------------------|-----------------------------------|
| ``commit``   | crash_point | coordinator, a Commit of step >= N arrives      | SIGKILL of its process group (a power loss mid-step, work in flight) |
| ``trainer``  | crash_point | trainer rank, about to train a step >= N fragment | SIGKILL, once per run (marker file) |
| ``trainer``  | hang_point  | trainer compute thread, training step >= N      | blocks for good, once per run: a wedged GPU or collective |
| ``generate`` | crash_point | colocated loop, after generating step >= N      | SIGKILL |
| ``teardown`` | crash_point | colocated rank >= N, its run done, before the group's teardown | SIGKILL (a rank aborting as it exits) |
| ``stepdone`` | signal_point | coordinator, trainer rank 0's StepDone of version >= N | SIGTERM to itself: a stop while that version's announcement is still on its way |

* **A GPU computing NaN**: ``DIGENRL_TEST_NAN=<node id>:N`` makes that node's sampler output
  NaN for every fragment of step >= N (:func:`nan_point`, :func:`poison`): from the first
  trained timestep on, its latents and log-probs are NaN, and so is everything the sampler
  computes after them, as on a GPU that started to fail. The variable names the node, so the
  whole launch may carry it.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from digenrl.config import ConfigError

FAILPOINTS_ENV = "DIGENRL_FAILPOINTS"
CRASH_ENV = "DIGENRL_TEST_CRASH"
HANG_ENV = "DIGENRL_TEST_HANG"
SIGNAL_ENV = "DIGENRL_TEST_SIGTERM"
NAN_ENV = "DIGENRL_TEST_NAN"

GENERATION_SPANS = ("denoise_step", "tag_generate")
"""Spans of generating work: a rollout's pulls of the sampler, a trainer's TAG pulls."""
TRAINING_SPANS = ("fragment_train", "optimizer_step")
"""Spans of a trainer rank's training work."""


@dataclass(frozen=True, kw_only=True)
class Failpoints:
    """The slowdown failpoints of this process (the module doc's table); the defaults do nothing."""

    slowdown: float = 1.0
    slowdown_nodes: tuple[str, ...] = ()
    trainer_slowdown: float = 1.0

    def to_env(self) -> str:
        """The ``DIGENRL_FAILPOINTS`` text that :func:`parse_failpoints` reads back as these."""
        out = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                out.append(f"{f.name}={','.join(v) if isinstance(v, tuple) else v}")
        return ";".join(out)


NO_FAILPOINTS = Failpoints()


def parse_failpoints(text: str) -> Failpoints:
    """``name=value`` pairs separated by ``;`` (blank ones ignored); a ConfigError naming the
    variable, the failpoint and the bad value otherwise."""
    known = {f.name for f in fields(Failpoints)}
    factors: dict[str, float] = {}
    nodes: tuple[str, ...] = ()
    for item in filter(None, (p.strip() for p in text.split(";"))):
        name, eq, raw = (x.strip() for x in item.partition("="))
        if not eq or name not in known:
            raise ConfigError(f"{FAILPOINTS_ENV}: {item!r}: expected name=value with a name among "
                             f"{', '.join(sorted(known))}")
        if name == "slowdown_nodes":
            nodes = tuple(n for n in (x.strip() for x in raw.split(",")) if n)
            continue
        try:
            factor = float(raw)
        except ValueError:
            factor = math.nan
        if not 1.0 <= factor < math.inf:
            raise ConfigError(f"{FAILPOINTS_ENV}: {name} = {raw!r}: expected a finite factor >= 1")
        factors[name] = factor
    return Failpoints(slowdown=factors.get("slowdown", 1.0), slowdown_nodes=nodes,
                      trainer_slowdown=factors.get("trainer_slowdown", 1.0))


_active: Failpoints | None = None  # read from the environment on first use, once per process


def failpoints() -> Failpoints:
    """This process's failpoints: :func:`set_failpoints`'s, else ``$DIGENRL_FAILPOINTS`` as it
    was when first asked (read once: the process's start, for a node)."""
    global _active
    if _active is None:
        _active = parse_failpoints(os.environ.get(FAILPOINTS_ENV, ""))
    return _active


def set_failpoints(fp: Failpoints | None) -> None:
    """Set this process's failpoints (a test in one process); None: read the environment
    again at the next :func:`failpoints`. Processes it spawns read their environment: to
    reach them, set ``DIGENRL_FAILPOINTS`` (``fp.to_env()``) there."""
    global _active
    _active = fp


@dataclass(frozen=True)
class Slowdown:
    """How many times longer each kind of compute span takes: span name -> factor (>= 1)."""

    factors: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    def extra_s(self, span: str, seconds: float) -> float:
        """Seconds to sleep after ``span`` took ``seconds``: ``(factor - 1) x seconds``."""
        return (self.factors.get(span, 1.0) - 1.0) * seconds


NO_SLOWDOWN = Slowdown()


def node_slowdown(fp: Failpoints, *, node_id: str, role: str) -> Slowdown:
    """The node's slowdown: ``fp.slowdown`` for its generating spans when it is named in
    ``fp.slowdown_nodes`` (every rollout when that list is empty), and on a trainer rank
    ``fp.trainer_slowdown`` for its training spans."""
    factors: dict[str, float] = {}
    generates_slowly = node_id in fp.slowdown_nodes if fp.slowdown_nodes else role == "rollout"
    if generates_slowly and fp.slowdown > 1.0:
        factors.update(dict.fromkeys(GENERATION_SPANS, fp.slowdown))
    if role == "trainer" and fp.trainer_slowdown > 1.0:
        factors.update(dict.fromkeys(TRAINING_SPANS, fp.trainer_slowdown))
    return Slowdown(MappingProxyType(factors)) if factors else NO_SLOWDOWN


def _fault_due(env: str, point: str, version: int, once: Path | None) -> bool:
    """Whether ``$env`` (``point:N``) asks for a fault here: ``point`` matches and
    ``version >= N``; with ``once`` (a marker file), only the first time in a run."""
    spec = os.environ.get(env, "")
    if not spec:
        return False
    name, _, at = spec.partition(":")
    if name != point or version < int(at):
        return False
    if once is not None:
        if once.exists():
            return False
        once.write_text(f"{point}:{version}\n")
    return True


def crash_point(point: str, version: int, once: Path | None = None) -> None:
    """SIGKILL this process (and its group if it leads one) at ``point:version``.

    ``DIGENRL_TEST_CRASH=commit:2`` kills the coordinator when the first commit of step >= 2
    arrives, i.e. mid-step with work in flight, as a power loss would. With ``once`` (a
    marker file) it fires a single time per run, so a restarted process does not crash
    again. Unset: a no-op.
    """
    if not _fault_due(CRASH_ENV, point, version, once):
        return
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def hang_point(point: str, version: int, once: Path | None = None) -> None:
    """Block the calling thread for good at ``point:version`` (a wedged GPU or collective:
    the process and its event loop live on, the work never returns).

    ``DIGENRL_TEST_HANG=trainer:2`` hangs a trainer's compute thread as it starts training
    step >= 2. With ``once`` (a marker file) it fires a single time per run. Unset: a no-op.
    """
    if not _fault_due(HANG_ENV, point, version, once):
        return
    while True:
        time.sleep(3600)


def signal_point(point: str, version: int, once: Path | None = None) -> None:
    """SIGTERM this process at ``point:version``: a stop (``kill``, ``docker stop``) that lands
    at an exact moment of the protocol instead of whenever a test's poll notices a version.

    ``DIGENRL_TEST_SIGTERM=stepdone:2`` stops a coordinator as it handles the StepDone of
    version 2, before trainer rank 0's announcement of that version arrives. The process's
    own handler (``actors/base.py``, stop_on_signals) drains as for any SIGTERM. With
    ``once`` (a marker file) it fires a single time per run. Unset: a no-op.
    """
    if _fault_due(SIGNAL_ENV, point, version, once):
        os.kill(os.getpid(), signal.SIGTERM)


def nan_point(node_id: str, step: int) -> bool:
    """Whether ``DIGENRL_TEST_NAN=<node_id>:N`` asks this node to emit NaN for step ``step``
    (``step >= N``). Unset, or another node named: False."""
    return _fault_due(NAN_ENV, node_id, step, None)


def poison(record: Any) -> None:
    """Fill a sampler record's ``x_next`` and ``log_prob`` with NaN, in place: the sampler
    continues from this ``x_next``, so every later step is NaN too."""
    record.x_next.fill_(float("nan"))
    record.log_prob.fill_(float("nan"))
