"""A node pointed at the wrong place says what answers there, within seconds of
``--connect-timeout``: nothing (refused), not ZeroMQ (an HTTP server, random bytes), a ZeroMQ
peer that sends no Welcome (a silent ROUTER, a socket of another type) or a coordinator of
another protocol version (docs/operations.md). Real sockets on loopback, short timeouts.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from digenrl.actors.connect import probe
from digenrl.cli import node_main
from digenrl.config import load_config, to_toml
from digenrl.transport.codec import PROTOCOL_VERSION, encode
from digenrl.transport.protocol import Welcome


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


@contextlib.contextmanager
def http_server() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@contextlib.contextmanager
def random_bytes_server() -> Iterator[str]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn, contextlib.suppress(OSError):
                conn.sendall(os.urandom(2048))
                time.sleep(0.2)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join()
        srv.close()


@contextlib.contextmanager
def zmq_peer(kind: int, answer: bytes | None = None) -> Iterator[str]:
    """A bound ZeroMQ socket of ``kind``; a ROUTER with ``answer`` replies it to every message."""
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if answer is not None and sock.poll(50):
                peer, *_ = sock.recv_multipart()
                sock.send_multipart([peer, answer])
            else:
                time.sleep(0.05)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        t.join()
        sock.close()
        ctx.term()


def _welcome(config_toml: str) -> list[bytes]:
    msg = Welcome(node_id="n", run_id="r", rank=0, world_size=1, config_toml=config_toml, endpoints={})
    return [bytes(f) for f in encode(msg)]


@contextlib.contextmanager
def welcome_router(config_toml: str) -> Iterator[str]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                peer, *_ = sock.recv_multipart()
                sock.send_multipart([peer, *_welcome(config_toml)])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        t.join()
        sock.close()
        ctx.term()


OTHER_VERSION = msgpack.packb({"t": "welcome", "v": PROTOCOL_VERSION + 1, "run_id": "r"})

PEERS = [
    ("a closed port", lambda: contextlib.nullcontext(f"tcp://127.0.0.1:{_closed_port()}"), "refused"),
    ("an HTTP server", http_server, "not ZeroMQ: an HTTP server"),
    ("a random-bytes server", random_bytes_server, "not ZeroMQ"),
    ("a silent ZeroMQ ROUTER", lambda: zmq_peer(zmq.ROUTER), "no Welcome: a ZeroMQ ROUTER"),
    ("a ZeroMQ PUB", lambda: zmq_peer(zmq.PUB), "no Welcome: a ZeroMQ PUB socket"),
    ("a ZeroMQ PULL", lambda: zmq_peer(zmq.PULL), "no Welcome: a ZeroMQ PULL socket"),
]


@pytest.mark.parametrize(("peer", "phrase"), [p[1:] for p in PEERS], ids=[p[0] for p in PEERS])
def test_a_node_with_no_welcome_says_what_answers_and_exits_when_asked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], peer: object, phrase: str) -> None:
    with peer() as endpoint:  # type: ignore[operator]
        capsys.readouterr()
        t0 = time.monotonic()
        code = node_main(["--role", "rollout", "--coordinator", endpoint, "--connect-timeout", "0.5",
                          "--exit-on-connect-failure", "--run-dir", str(tmp_path)])
        took = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1, err
    assert err and err[-1].startswith("digenrl-node: no Welcome from the coordinator at "), err
    assert phrase in err[-1] and endpoint in err[-1], err[-1]
    assert not any("Traceback" in line for line in err), err
    assert took < 10, took


def test_a_coordinator_of_another_protocol_version_stops_the_node_naming_both(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with zmq_peer(zmq.ROUTER, answer=OTHER_VERSION) as endpoint:
        capsys.readouterr()
        t0 = time.monotonic()
        code = node_main(["--role", "rollout", "--coordinator", endpoint, "--connect-timeout", "30",
                          "--run-dir", str(tmp_path)])
        took = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3, err
    assert f"protocol version {PROTOCOL_VERSION + 1}" in err[-1], err[-1]
    assert f"this node speaks {PROTOCOL_VERSION}" in err[-1] and endpoint in err[-1], err[-1]
    assert took < 10, took  # not the 30 s connect timeout: the first frame says enough


def test_a_welcome_whose_config_does_not_validate_names_the_coordinator(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = to_toml(load_config()).replace("group_size = 4", "group_size = 1")
    assert "group_size = 1" in bad
    with welcome_router(bad) as endpoint:
        capsys.readouterr()
        code = node_main(["--role", "rollout", "--coordinator", endpoint, "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert "the coordinator at " + endpoint + " sent a config that does not validate here" in err[-1], err[-1]
    assert "train.group_size = 1" in err[-1]


def test_without_exit_the_node_keeps_waiting_and_repeats_what_it_saw(tmp_path: Path) -> None:
    port = _closed_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "digenrl.cli", "node", "--role", "rollout",
                             "--coordinator", f"tcp://127.0.0.1:{port}", "--connect-timeout", "0.3",
                             "--run-dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 60
        assert proc.stderr is not None
        while sum("no_welcome" in line for line in lines) < 2 and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
        seen = [line for line in lines if "no_welcome" in line]
        assert len(seen) >= 2 and all("refused" in line for line in seen), lines
        assert proc.poll() is None  # still waiting for its coordinator
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_probe_sees_a_real_coordinator_socket_as_a_router() -> None:
    with zmq_peer(zmq.ROUTER) as endpoint:
        assert "ZeroMQ ROUTER" in probe(endpoint, timeout_s=1.0)
