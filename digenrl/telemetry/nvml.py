"""GPU readings for heartbeats, through NVML (module ``pynvml`` from ``nvidia-ml-py``).

TAG needs to know whether a trainer GPU has memory headroom and is idle; the coordinator
learns it from the readings each node puts in its heartbeats. A :class:`GpuProbe` calls
``nvmlInit`` once, lazily, and caches whether NVML is available and, if not, why (on a
machine without a driver: ``"NVMLError_LibraryNotFound: NVML Shared Library Not Found"``).
A reading is a plain dict that msgpack serialises::

    {"available": True, "reason": "",
     "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "mem_used_mb": 1024.0,
               "mem_free_mb": 80000.0, "mem_total_mb": 81559.0, "util_pct": 37.0,
               "power_w": 412.5, "temp_c": 61.0},
              {"index": 1, "error": "NVMLError_GpuIsLost: GPU is lost"}]}

Every device is queried on its own, so one failing GPU becomes an ``error`` entry instead
of losing the whole reading. Power and temperature are ``None`` where the device does not
support the query (MIG instances, some boards). NVML calls take tens of microseconds to
milliseconds; :meth:`GpuProbe.read_async` runs them in a worker thread so an actor's event
loop never waits on the driver.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["GpuProbe", "visible_devices"]

_MB = 1024 * 1024
# NVML_ERROR_NOT_SUPPORTED: the device has no such sensor; not a failure of the GPU.
_NOT_SUPPORTED = 3


def visible_devices(env: str | None) -> list[int | str] | None:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value names, or None for "all of them".

    Entries are integer indices or UUIDs (``GPU-...``, ``MIG-...``). ``""`` and a leading
    ``-1`` hide every GPU (CUDA stops at the first invalid entry, so do we).
    """
    if env is None:
        return None
    devices: list[int | str] = []
    for raw in env.split(","):
        item = raw.strip()
        if not item:
            continue
        if item.lstrip("-").isdigit():
            index = int(item)
            if index < 0:
                break
            devices.append(index)
        else:
            devices.append(item)
    return devices


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _text(value: Any) -> str:
    # pynvml returned bytes before 11.5 and str since.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class GpuProbe:
    """Reads per-GPU memory, utilisation, power and temperature through NVML.

    ``nvml`` injects the module (tests pass a fake); by default ``pynvml`` is imported on
    first use. ``devices`` restricts readings to these indices/UUIDs; by default they come
    from ``CUDA_VISIBLE_DEVICES`` (every GPU when it is unset). Thread-safe.
    """

    def __init__(self, *, nvml: ModuleType | None = None,
                 devices: Sequence[int | str] | None = None) -> None:
        self._nvml = nvml
        self._devices = (list(devices) if devices is not None
                         else visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")))
        self._lock = threading.Lock()
        self._initialised = False  # nvmlInit was attempted
        self._available = False
        self._reason = ""

    def _init(self) -> None:
        with self._lock:
            if self._initialised:
                return
            self._initialised = True
            try:
                nvml = self._nvml if self._nvml is not None else importlib.import_module("pynvml")
            except ImportError as e:
                self._reason = _describe(e)
                return
            self._nvml = nvml
            try:
                nvml.nvmlInit()
            except (nvml.NVMLError, OSError) as e:
                self._reason = _describe(e)
                return
            self._available = True

    def _lib(self) -> ModuleType:
        """The NVML module (a fake in tests); only called once it initialised."""
        assert self._nvml is not None, "NVML is read only after a successful init"
        return self._nvml

    @property
    def available(self) -> bool:
        """Whether NVML initialised (initialises on first access)."""
        self._init()
        return self._available

    @property
    def reason(self) -> str:
        """Why NVML is unavailable, as ``"ExceptionName: message"``; empty when available."""
        self._init()
        return self._reason

    def read(self) -> dict[str, Any]:
        """One reading of the visible GPUs (blocking; see :meth:`read_async`)."""
        self._init()
        if not self._available:
            return {"available": False, "reason": self._reason, "gpus": []}
        nvml = self._lib()
        try:
            devices = (self._devices if self._devices is not None
                       else list(range(nvml.nvmlDeviceGetCount())))
        except nvml.NVMLError as e:
            return {"available": False, "reason": _describe(e), "gpus": []}
        return {"available": True, "reason": "", "gpus": [self._read_one(d) for d in devices]}

    async def read_async(self) -> dict[str, Any]:
        """:meth:`read` in a worker thread, so the event loop never blocks on NVML."""
        return await asyncio.to_thread(self.read)

    def close(self) -> None:
        """Shut NVML down if, and only if, it initialised (shutdown after a failed init raises)."""
        with self._lock:
            if self._available:
                self._lib().nvmlShutdown()
            self._available = False

    def _read_one(self, device: int | str) -> dict[str, Any]:
        nvml = self._lib()
        index: int | str = device
        try:
            if isinstance(device, int):
                handle = nvml.nvmlDeviceGetHandleByIndex(device)
            else:
                handle = nvml.nvmlDeviceGetHandleByUUID(device)
                index = int(nvml.nvmlDeviceGetIndex(handle))
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            return {
                "index": index,
                "name": _text(nvml.nvmlDeviceGetName(handle)),
                "mem_used_mb": mem.used / _MB,
                "mem_free_mb": mem.free / _MB,
                "mem_total_mb": mem.total / _MB,
                "util_pct": float(util.gpu),
                "power_w": self._optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
                "temp_c": self._optional(lambda: float(
                    nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))),
            }
        except nvml.NVMLError as e:
            return {"index": index, "error": _describe(e)}

    def _optional(self, query: Callable[[], float]) -> float | None:
        try:
            return float(query())
        except self._lib().NVMLError as e:
            if getattr(e, "value", None) == _NOT_SUPPORTED:
                return None
            raise
