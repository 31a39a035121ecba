"""GpuProbe: the GPU-present path on a fake NVML, the real module's absence, msgpack heartbeats."""

from __future__ import annotations

import asyncio
import types
import typing

import msgpack
import pytest

from digenrl.telemetry.nvml import GpuProbe, visible_devices

MB = 1024 * 1024


class FakeNVMLError(Exception):
    """Like pynvml.NVMLError: carries the NVML return code in ``value``."""

    _messages: typing.ClassVar = {3: "Not Supported", 15: "GPU is lost", 999: "Unknown Error"}

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._messages[self.value]


def fake_nvml(*, power_supported: bool = True) -> types.ModuleType:
    """Two GPUs; GPU 1's utilisation query fails with an NVML error. Counts init/shutdown."""
    m = types.ModuleType("fake_pynvml")
    m.NVMLError = FakeNVMLError
    m.NVML_TEMPERATURE_GPU = 0
    m.calls = {"init": 0, "shutdown": 0}
    uuids = {"GPU-aaaa": 0, "GPU-bbbb": 1}

    def init() -> None:
        m.calls["init"] += 1

    def shutdown() -> None:
        m.calls["shutdown"] += 1

    def utilisation(h: int) -> types.SimpleNamespace:
        if h == 1:
            raise FakeNVMLError(999)
        return types.SimpleNamespace(gpu=37, memory=12)

    def power(h: int) -> int:
        if not power_supported:
            raise FakeNVMLError(3)
        return 412_500  # milliwatts

    m.nvmlInit = init
    m.nvmlShutdown = shutdown
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetHandleByUUID = lambda u: uuids[u]
    m.nvmlDeviceGetIndex = lambda h: h
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"  # old pynvml returns bytes
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        used=1024 * MB, free=(81559 - 1024) * MB, total=81559 * MB)
    m.nvmlDeviceGetUtilizationRates = utilisation
    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetTemperature = lambda h, sensor: 61
    return m


def test_present_gpus_are_read_and_a_failing_gpu_becomes_an_error_entry(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # every GPU
    reading = GpuProbe(nvml=fake_nvml()).read()
    assert reading["available"] is True and reading["reason"] == ""
    good, bad = reading["gpus"]
    assert good == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "mem_used_mb": 1024.0,
                    "mem_free_mb": 80535.0, "mem_total_mb": 81559.0, "util_pct": 37.0,
                    "power_w": 412.5, "temp_c": 61.0}
    assert bad == {"index": 1, "error": "FakeNVMLError: Unknown Error"}


def test_nvml_is_initialised_once_and_shut_down_once():
    nvml = fake_nvml()
    probe = GpuProbe(nvml=nvml, devices=[0])
    probe.read()
    probe.read()
    probe.close()
    probe.close()
    assert nvml.calls == {"init": 1, "shutdown": 1}


def test_unsupported_power_sensor_reads_none_not_error():
    probe = GpuProbe(nvml=fake_nvml(power_supported=False), devices=[0])
    (gpu,) = probe.read()["gpus"]
    assert gpu["power_w"] is None and gpu["mem_free_mb"] == 80535.0


def test_readings_are_restricted_to_visible_devices_by_index_or_uuid():
    probe = GpuProbe(nvml=fake_nvml(), devices=visible_devices("GPU-bbbb"))
    assert [g["index"] for g in probe.read()["gpus"]] == [1]
    probe = GpuProbe(nvml=fake_nvml(), devices=visible_devices("0"))
    assert [g["index"] for g in probe.read()["gpus"]] == [0]


def test_cuda_visible_devices_parsing_follows_cuda():
    assert visible_devices(None) is None
    assert visible_devices("") == []
    assert visible_devices("1, 0") == [1, 0]
    assert visible_devices("0,-1,1") == [0]
    assert visible_devices("GPU-aaaa,MIG-x") == ["GPU-aaaa", "MIG-x"]


def test_environment_restricts_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g["index"] for g in GpuProbe(nvml=fake_nvml()).read()["gpus"]] == [1]


def test_missing_nvml_library_reads_unavailable_with_the_reason_and_never_shuts_down():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML")
    probe = GpuProbe()
    reading = probe.read()
    assert reading == {"available": False,
                       "reason": "NVMLError_LibraryNotFound: NVML Shared Library Not Found",
                       "gpus": []}
    assert probe.available is False
    probe.close()  # would raise NVMLError_Uninitialized if it called nvmlShutdown


def test_missing_module_reads_unavailable(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    reading = GpuProbe().read()
    assert reading["available"] is False and reading["reason"].startswith("ModuleNotFoundError")


@pytest.mark.parametrize("make", [lambda: GpuProbe(nvml=fake_nvml(), devices=[0, 1]),
                                  lambda: GpuProbe(devices=[0])])
def test_heartbeat_reading_round_trips_through_msgpack(make):
    reading = make().read()
    assert msgpack.unpackb(msgpack.packb(reading)) == reading


def test_read_async_returns_the_same_reading_from_a_worker_thread():
    probe = GpuProbe(nvml=fake_nvml(), devices=[0, 1])
    assert asyncio.run(probe.read_async()) == probe.read()
