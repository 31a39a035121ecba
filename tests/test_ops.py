"""Deployment: the sd_notify client over a real unix datagram socket, and the ops/ files.

The systemd units are checked twice: a key-level parse that always runs, and
``systemd-analyze verify`` when the tool exists (CI containers usually lack it; the test
then skips and says why). The supervisord config is parsed by supervisor's own options
parser when the ``supervisor`` package (test extra) is installed.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from digenrl.telemetry import sdnotify
from digenrl.telemetry.sdnotify import NotifyError, Watchdog
from tests.conftest import datagrams

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


def test_ready_status_and_stopping_arrive_as_datagrams(notify_socket) -> None:
    sock, env = notify_socket
    assert sdnotify.ready(environ=env) is True
    assert sdnotify.status("step 3\npolicy v3", environ=env) is True
    assert sdnotify.extend_timeout(90, environ=env) is True
    assert sdnotify.stopping(environ=env) is True
    assert datagrams(sock) == [
        "READY=1", "STATUS=step 3 policy v3", "EXTEND_TIMEOUT_USEC=90000000", "STOPPING=1",
    ]


def test_abstract_namespace_address_reaches_the_socket(tmp_path: Path) -> None:
    name = f"digenrl-test-{os.getpid()}-{tmp_path.name}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.setblocking(False)
        assert sdnotify.notify("READY=1", environ={"NOTIFY_SOCKET": "@" + name}) is True
        assert datagrams(sock) == ["READY=1"]


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
    assert datagrams(sock) == ["WATCHDOG=1"]
    assert dog.statistics() == {"interval_s": 30.0, "pings": 1, "missed": 0}


def test_watchdog_armed_for_another_pid_or_unset_is_disabled(notify_socket) -> None:
    sock, env = notify_socket
    other = Watchdog(environ={**env, "WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}, pid=4242)
    unset = Watchdog(environ=env)
    zero = Watchdog(environ={**env, "WATCHDOG_USEC": "0"})
    for dog in (other, unset, zero):
        assert dog.interval_s is None and not dog.enabled
        assert dog.ping() is False
    assert datagrams(sock) == []


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
    assert datagrams(sock) == ["WATCHDOG=1"] * 3
    assert (dog.pings, dog.missed) == (3, 1)


async def test_watchdog_run_returns_at_once_when_disabled() -> None:
    async def forbidden_sleep(seconds: float) -> None:
        raise AssertionError("a disabled watchdog must not loop")

    await asyncio.wait_for(Watchdog(environ={}).run(lambda: True, sleep=forbidden_sleep), 5)


# --------------------------------------------------------------------------- ops/ files


def _read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (comments, optional quotes)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: line without '=': {line!r}"
        env[key.strip()] = value.strip().strip("\"'")
    return env


def _read_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}}; keys may repeat in systemd."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"{path.name}:{n}: keep directives on one line"
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"{path.name}:{n}: directive before any [section]"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}:{n}: not KEY=VALUE: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


ENV_EXAMPLE = _read_env_file(OPS / "digenrl.env.example")


def _node_argv_from_exec_start(exec_start: str, instance: str) -> list[str]:
    """The argv systemd would run: specifiers, then ${VAR} (one word) and $VAR (split)."""
    line = exec_start.replace("%i", instance).replace("%H", "host-a")
    words = []
    for word in shlex.split(line):
        if word.startswith("$") and not word.startswith("${"):
            words.extend(ENV_EXAMPLE[word[1:]].split())
            continue
        for key, value in ENV_EXAMPLE.items():
            word = word.replace("${" + key + "}", value)
        assert "$" not in word, f"variable not in digenrl.env.example: {word}"
        words.append(word)
    return words


def _assert_node_cli_accepts(argv: list[str]) -> None:
    """The node's own argument parser takes these arguments (skips until the CLI exists)."""
    cli = pytest.importorskip("digenrl.cli", reason="digenrl.cli (the node CLI) is not importable")
    parser = cli.build_node_parser()  # private on purpose: the units must track the real CLI
    assert Path(argv[0]).name == "digenrl-node", argv
    try:
        parser.parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"digenrl-node rejects the arguments the deployment files pass: {argv[1:]}")


def test_every_service_is_a_notify_unit_with_watchdog_restart_and_drain_time() -> None:
    for name in SERVICES:
        unit = _read_unit(UNITS / name)
        service, install = unit["Service"], unit["Install"]
        for key, value in {
            "Type": "notify", "NotifyAccess": "main", "WatchdogSec": "60",
            "Restart": "on-failure", "RestartSec": "5", "KillMode": "mixed", "User": "digenrl",
            "RestartPreventExitStatus": "2",  # a configuration error would only recur
        }.items():
            assert service[key] == [value], (name, key, service.get(key))
        assert int(service["TimeoutStopSec"][0]) >= 120, name
        assert service["EnvironmentFile"][0] == "/etc/digenrl/digenrl.env", name
        assert install["WantedBy"] == ["digenrl.target"], name
        assert unit["Unit"]["PartOf"] == ["digenrl.target"], name
    assert "Install" in _read_unit(UNITS / "digenrl.target")


def test_worker_templates_pin_their_gpu_and_start_after_the_coordinator() -> None:
    for name in ("digenrl-rollout@.service", "digenrl-trainer@.service"):
        unit = _read_unit(UNITS / name)
        assert "CUDA_VISIBLE_DEVICES=%i" in unit["Service"]["Environment"], name
        assert "digenrl-coordinator.service" in unit["Unit"]["After"][0].split(), name
        # Wants= would start a second coordinator on a rollout-only machine.
        assert "digenrl-coordinator.service" not in " ".join(unit["Unit"].get("Wants", [])), name


def test_units_and_supervisor_only_use_variables_the_env_example_defines() -> None:
    import re

    def code(path: Path) -> str:
        return "\n".join(ln for ln in path.read_text().splitlines() if not ln.startswith(("#", ";")))

    used = set()
    for name in SERVICES:
        used |= set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", code(UNITS / name)))
    used |= set(re.findall(r"%\(ENV_([A-Z0-9_]+)\)s", code(OPS / "supervisor/digenrl.conf")))
    assert used and used <= set(ENV_EXAMPLE), sorted(used - set(ENV_EXAMPLE))


@pytest.mark.parametrize("name", SERVICES)
def test_unit_exec_start_is_accepted_by_the_node_cli(name: str) -> None:
    exec_start = _read_unit(UNITS / name)["Service"]["ExecStart"]
    assert len(exec_start) == 1, name
    argv = _node_argv_from_exec_start(exec_start[0], instance="3")
    if "trainer" in name:
        assert argv[argv.index("--rank") + 1] == "3"
        assert argv[argv.index("--bind") + 1] == ENV_EXAMPLE["DIGENRL_TRAINER_BIND"]
    _assert_node_cli_accepts(argv)


def _systemd_verify(folder: Path, names: list[str]) -> tuple[int, list[str]]:
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *(str(folder / n) for n in names)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    # Other units on the host may warn too; only complaints about ours count.
    ours = [line for line in proc.stderr.splitlines() if "digenrl" in line]
    return proc.returncode, ours


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze not installed (usual in CI containers)")
def test_systemd_analyze_verify_accepts_the_units(tmp_path: Path) -> None:
    # verify checks that ExecStart's binary exists, so point it at an executable stub.
    stub = tmp_path / "digenrl-node"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    for path in UNITS.iterdir():
        text = path.read_text().replace("/opt/digenrl/venv/bin/digenrl-node", str(stub))
        (tmp_path / path.name).write_text(text)
    names = ["digenrl-coordinator.service", "digenrl-rollout@0.service",
             "digenrl-trainer@1.service", "digenrl.target"]
    assert _systemd_verify(tmp_path, names) == (0, [])

    # The check can fail: a misspelt directive is reported (as a warning, exit code 0).
    broken = tmp_path / "broken"
    broken.mkdir()
    text = (tmp_path / "digenrl-rollout@.service").read_text()
    (broken / "digenrl-rollout@.service").write_text(text.replace("KillMode=", "KilMode="))
    _, complaints = _systemd_verify(broken, ["digenrl-rollout@0.service"])
    assert any("KilMode" in line for line in complaints), complaints


def test_supervisor_config_parses_with_supervisors_own_parser(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("supervisor", reason="supervisor not installed (pip install -e .[test])")
    from supervisor.datatypes import RestartWhenExitUnexpected
    from supervisor.options import ServerOptions

    env = {**ENV_EXAMPLE, "DIGENRL_STATE_DIR": str(tmp_path),
           "DIGENRL_LOCAL_COORDINATOR": "1", "DIGENRL_LOCAL_TRAINERS": "2",
           "DIGENRL_LOCAL_ROLLOUTS": "3"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    options = ServerOptions()
    options.realize(args=["-c", str(OPS / "supervisor/digenrl.conf")])

    (group,) = options.process_group_configs
    assert group.name == "digenrl"
    procs = {p.name: p for p in group.process_configs}
    assert sorted(procs) == ["digenrl-coordinator", "digenrl-rollout-0", "digenrl-rollout-1",
                             "digenrl-rollout-2", "digenrl-trainer-0", "digenrl-trainer-1"]
    for p in procs.values():
        assert p.autorestart is RestartWhenExitUnexpected and p.exitcodes == [0, 2], p.name
        assert (p.stopwaitsecs, p.stopasgroup, p.killasgroup) == (120, True, True), p.name
        assert p.startsecs > 0 and p.stopsignal == signal.SIGTERM, p.name
    assert procs["digenrl-coordinator"].priority < procs["digenrl-trainer-0"].priority \
        < procs["digenrl-rollout-0"].priority
    assert procs["digenrl-trainer-1"].environment["CUDA_VISIBLE_DEVICES"] == "1"
    assert procs["digenrl-rollout-2"].environment["CUDA_VISIBLE_DEVICES"] == "2"
    assert procs["digenrl-coordinator"].environment["CUDA_VISIBLE_DEVICES"] == ""
    trainer_argv = shlex.split(procs["digenrl-trainer-1"].command)
    assert trainer_argv[trainer_argv.index("--rank") + 1] == "1"
    assert trainer_argv[trainer_argv.index("--bind") + 1] == env["DIGENRL_TRAINER_BIND"]
    for p in procs.values():
        _assert_node_cli_accepts(shlex.split(p.command))
