"""Deployment: the sd_notify client over a real unix datagram socket, and the ops/ files.

The systemd units are checked twice: a key-level parse that always runs, and
``systemd-analyze verify`` when the tool exists (CI containers usually lack it; the test
then skips and says why). The supervisord config is parsed by supervisor's own options
parser when the ``supervisor`` package (test extra) is installed.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from digenrl.telemetry import sdnotify
from digenrl.telemetry.sdnotify import NotifyError, Watchdog

ROOT = Path(__file__).resolve().parents[1]
OPS = ROOT / "ops"
UNITS = OPS / "systemd"
SERVICES = ("digenrl-coordinator.service", "digenrl-rollout@.service", "digenrl-trainer@.service")


# --------------------------------------------------------------------------- sd_notify


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, dict[str, str]]]:
    """A bound datagram socket standing in for systemd, and the environ that points at it."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)  # a missing datagram fails the test instead of hanging it
    try:
        yield sock, {"NOTIFY_SOCKET": str(path)}
    finally:
        sock.close()


def _received(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def test_ready_status_and_stopping_arrive_as_datagrams(notify_socket) -> None:
    sock, env = notify_socket
    assert sdnotify.ready(environ=env) is True
    assert sdnotify.status("step 3\npolicy v3", environ=env) is True
    assert sdnotify.extend_timeout(90, environ=env) is True
    assert sdnotify.stopping(environ=env) is True
    assert _received(sock) == [
        "READY=1", "STATUS=step 3 policy v3", "EXTEND_TIMEOUT_USEC=90000000", "STOPPING=1",
    ]


def test_abstract_namespace_address_reaches_the_socket(tmp_path: Path) -> None:
    name = f"digenrl-test-{os.getpid()}-{tmp_path.name}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.setblocking(False)
        assert sdnotify.notify("READY=1", environ={"NOTIFY_SOCKET": "@" + name}) is True
        assert _received(sock) == ["READY=1"]


def test_without_notify_socket_every_call_is_a_noop_returning_false() -> None:
    env: dict[str, str] = {}
    assert sdnotify.notify("READY=1", environ=env) is False
    assert sdnotify.ready(environ=env) is False
    assert sdnotify.stopping(environ=env) is False
    assert sdnotify.status("idle", environ=env) is False
    dog = Watchdog(environ={"WATCHDOG_USEC": "60000000"}, pid=os.getpid())
    assert dog.enabled and dog.ping() is False and dog.pings == 0


def test_relative_or_vsock_notify_socket_is_rejected_by_name() -> None:
    for bad in ("relative/notify.sock", "vsock:2:1234"):
        with pytest.raises(NotifyError, match="NOTIFY_SOCKET"):
            sdnotify.notify("READY=1", environ={"NOTIFY_SOCKET": bad})


def test_state_without_assignment_is_rejected(notify_socket) -> None:
    _, env = notify_socket
    with pytest.raises(NotifyError, match="'READY'"):
        sdnotify.notify("READY", environ=env)


def test_vanished_notify_socket_raises_instead_of_silently_missing_pings(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        sdnotify.notify("WATCHDOG=1", environ={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})


def test_watchdog_interval_is_half_the_period_and_ping_sends_watchdog(notify_socket) -> None:
    sock, env = notify_socket
    dog = Watchdog(environ={**env, "WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "4242"}, pid=4242)
    assert dog.interval_s == 30.0
    assert dog.ping() is True
    assert _received(sock) == ["WATCHDOG=1"]
    assert dog.statistics() == {"interval_s": 30.0, "pings": 1, "missed": 0}


def test_watchdog_armed_for_another_pid_or_unset_is_disabled(notify_socket) -> None:
    sock, env = notify_socket
    other = Watchdog(environ={**env, "WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}, pid=4242)
    unset = Watchdog(environ=env)
    zero = Watchdog(environ={**env, "WATCHDOG_USEC": "0"})
    for dog in (other, unset, zero):
        assert dog.interval_s is None and not dog.enabled
        assert dog.ping() is False
    assert _received(sock) == []


def test_malformed_watchdog_variables_are_named_in_the_error() -> None:
    with pytest.raises(NotifyError, match="WATCHDOG_USEC='60s'"):
        Watchdog(environ={"WATCHDOG_USEC": "60s"})
    with pytest.raises(NotifyError, match="WATCHDOG_PID='me'"):
        Watchdog(environ={"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "me"})


async def test_watchdog_run_pings_while_alive_and_withholds_when_wedged(notify_socket) -> None:
    sock, env = notify_socket
    dog = Watchdog(environ={**env, "WATCHDOG_USEC": "2000000"}, pid=os.getpid())
    health = iter([True, True, False, True])
    sleeps: list[float] = []

    class _Done(Exception):
        pass

    async def virtual_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 4:
            raise _Done

    with pytest.raises(_Done):
        await dog.run(lambda: next(health), sleep=virtual_sleep)
    assert sleeps == [1.0, 1.0, 1.0, 1.0]
    assert _received(sock) == ["WATCHDOG=1"] * 3
    assert (dog.pings, dog.missed) == (3, 1)


async def test_watchdog_run_returns_at_once_when_disabled() -> None:
    async def forbidden_sleep(seconds: float) -> None:
        raise AssertionError("a disabled watchdog must not loop")

    await asyncio.wait_for(Watchdog(environ={}).run(lambda: True, sleep=forbidden_sleep), 5)
