"""Prometheus exporters (optional ``metrics`` extra): a node's live counters, a run's last step.

Two servers share one mechanism, a collector that turns a callback's dict into gauges on
every scrape (so the numbers are never older than the scrape, and nothing is registered
globally):

* :func:`serve_node_metrics` -- what ``digenrl-node --prometheus-port`` serves for a rollout,
  trainer or reward node: its heartbeat counters (busy seconds, bad frames, refusals), policy
  version, sockets' messages and NVML readings, as ``digenrl_node_<name>`` gauges labelled
  with ``node``;
* :func:`start_prometheus` -- the latest ``metrics.jsonl`` record as ``digenrl_<name>``
  (``busy/<node>`` becomes ``digenrl_busy{node="..."}``): what a coordinator's
  ``--prometheus-port`` serves.

Flattening rules (:func:`flatten_stats`): numbers and booleans (0/1) become gauges; nested
mappings join their keys with ``_`` (``{"rx": {"bad_frames": 2}}`` -> ``rx_bad_frames``);
a list of mappings, like ``GpuProbe.read()["gpus"]``, is labelled by its items' ``index``
with the list's name minus a trailing ``s`` (``gpu_mem_used_mb{gpu="0"}``); strings and
``None`` (NVML's "unsupported") are left out. The names are in docs/metrics.md.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from digenrl.telemetry.metrics import MissingExtraError

__all__ = ["MetricsServer", "flatten_stats", "serve_node_metrics", "start_prometheus"]

_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")

Labels = tuple[tuple[str, str], ...]


def _name(*parts: str) -> str:
    return _UNSAFE.sub("_", "_".join(p for p in parts if p))


def flatten_stats(stats: Mapping[str, Any], prefix: str = "",
                  labels: Labels = ()) -> Iterator[tuple[str, Labels, float]]:
    """``(name, labels, value)`` for every number in ``stats`` (rules: module docstring)."""
    for key, value in stats.items():
        name = _name(prefix, str(key))
        if isinstance(value, int | float):  # bool is an int: 0 / 1
            yield name, labels, float(value)
        elif isinstance(value, Mapping):
            yield from flatten_stats(value, name, labels)
        elif isinstance(value, list | tuple):
            label = _name(str(key).removesuffix("s")) or "index"
            for pos, item in enumerate(value):
                if isinstance(item, Mapping):
                    # The item's own index, when it has one: positions shift if a GPU vanishes.
                    idx = item.get("index", pos)
                    yield from flatten_stats({k: v for k, v in item.items() if k != "index"},
                                             prefix, (*labels, (label, str(idx))))


class MetricsServer:
    """A running exporter: ``url`` to scrape, ``port`` it bound (useful with port 0), ``close()``."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.port: int = int(server.server_port)
        host = server.server_address[0]
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(what: str, port: int, addr: str,
           families_fn: Callable[[], Iterable[tuple[str, Labels, float]]],
           help_text: Callable[[str], str]) -> MetricsServer:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{what}: port = {port!r}: expected an integer in 0..65535 (0: any free port)")
    try:
        import prometheus_client
        from prometheus_client.core import GaugeMetricFamily
    except ImportError as e:
        raise MissingExtraError(
            f"{what}(port={port}) needs prometheus-client, which is not installed: "
            "pip install 'digenrl[metrics]'") from e

    class _Collector:
        def collect(self) -> Iterable[Any]:
            families: dict[str, tuple[Any, tuple[str, ...]]] = {}
            for name, labels, value in families_fn():
                keys = tuple(k for k, _ in labels)
                if name not in families:
                    families[name] = (GaugeMetricFamily(name, help_text(name), labels=list(keys)),
                                      keys)
                fam, fam_keys = families[name]
                if keys != fam_keys:  # one name with two label sets would be an invalid family
                    continue
                fam.add_metric([v for _, v in labels], value)
            yield from (fam for fam, _ in families.values())

    registry = prometheus_client.CollectorRegistry()
    registry.register(_Collector())
    server, thread = prometheus_client.start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, thread)


def serve_node_metrics(port: int, stats_fn: Callable[[], Mapping[str, Any]], *,
                       node_id: str = "", addr: str = "0.0.0.0") -> MetricsServer:
    """Serve one node's live counters on ``http://addr:port/metrics`` until ``close()``.

    ``stats_fn`` is called on every scrape from the server's thread, so it must not touch
    state the event loop mutates (``BusyClock.stats()`` iterates the recorder's spans):
    return a snapshot the loop made, such as the last heartbeat's fields, for example::

        {"policy_version": 3, "busy_s": 41.2, "wall_s": 60.0,
         "socket": {"sockets": [{"index": "data", "sent": 0, "received": 812, "bad_frames": 0}]},
         "gpu": GpuProbe().read()}

    Each number becomes a gauge ``digenrl_node_<flattened name>`` (see
    :func:`flatten_stats`) labelled ``node=node_id`` when one is given. ``addr`` defaults
    to every interface, as Prometheus scrapes from another host; pass ``127.0.0.1`` to keep
    it local. ``port=0`` takes a free port (``.port`` says which). Raises
    :class:`MissingExtraError` without ``prometheus-client`` and ``ValueError`` for a bad port.
    """
    node_label: Labels = (("node", node_id),) if node_id else ()

    def families() -> Iterator[tuple[str, Labels, float]]:
        for name, labels, value in flatten_stats(stats_fn()):
            yield "digenrl_node_" + name, (*node_label, *labels), value

    return _serve("serve_node_metrics", port, addr, families,
                  lambda name: f"DigenRL node counter {name.removeprefix('digenrl_node_')} "
                               "(docs/metrics.md, Prometheus)")


_RECORD_LABELS = {"reward": "term", "eval": "term", "staleness": "k"}
"""The label of a ``<name>/<sub>`` record key's ``sub`` (docs/metrics.md); any other: ``node``."""


def start_prometheus(port: int, registry_fn: Callable[[], Mapping[str, float]], *,
                     addr: str = "127.0.0.1") -> MetricsServer:
    """Serve the latest metrics record on ``http://addr:port/metrics`` until ``close()``.

    ``registry_fn`` returns the current record (e.g. the last ``StepMetrics.to_record()``);
    it is called on every scrape. ``busy/<node>`` becomes ``digenrl_busy{node="..."}``,
    ``reward/<term>`` ``digenrl_reward{term="..."}``, ``adv/<term>/std``
    ``digenrl_adv_std{term="..."}`` and ``staleness/<k>`` ``digenrl_staleness{k="..."}``. Raises :class:`MissingExtraError`
    without ``prometheus-client`` and ``ValueError`` for a bad port.
    """
    def families() -> Iterator[tuple[str, Labels, float]]:
        for key, value in registry_fn().items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            name, _, sub = key.partition("/")
            if name == "adv" and "/" in sub:  # adv/<term>/<stat> -> digenrl_adv_<stat>{term=...}
                term, _, stat = sub.rpartition("/")
                yield "digenrl_adv_" + _name(stat), (("term", term),), float(value)
                continue
            yield "digenrl_" + _name(name), ((_RECORD_LABELS.get(name, "node"), sub),) if sub else (), float(value)

    return _serve("start_prometheus", port, addr, families,
                  lambda name: f"DigenRL metric {name.removeprefix('digenrl_')} (docs/metrics.md)")
