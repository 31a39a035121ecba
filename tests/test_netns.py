"""Multi-host over real TCP: coordinator, trainer and rollout in three network namespaces.

Each node gets its own namespace (tests/netns.py) with one veth into a bridge that lives in a fourth
namespace; the only addresses made are 10.213.N.1-3 inside those namespaces, so the host's
own network is never touched. Nodes bind those (non-loopback) addresses, so CurveZMQ is on
(transport.curve = "auto") with keys generated for the test. Needs root and ``ip netns``;
skipped otherwise, with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from digenrl.config import to_toml
from digenrl.transport.curve import generate_keys
from tests.factories import tiny_config
from tests.netns import Fabric, netns_unavailable

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
SMALL = ["run.steps=2", "runtime.tag=\"never\""]  # over the suite's tiny run


@pytest.fixture
def namespaces() -> Iterator[dict[str, tuple[str, str]]]:
    """role -> (namespace, address); all namespaces are deleted at teardown, even on failure."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    roles = ("coordinator", "trainer", "rollout")
    fabric = Fabric(len(roles), name="dg", net=213)
    try:
        yield {role: (host.ns, host.addr) for role, host in zip(roles, fabric.hosts, strict=True)}
    finally:
        fabric.close()


def node_final(log: Path) -> dict:
    finals = [json.loads(x) for x in log.read_text().splitlines() if '"node_final"' in x]
    assert finals, f"{log} has no node_final line"
    return finals[-1]


def test_three_namespaces_train_two_steps_over_tcp_with_curve(tmp_path: Path, namespaces) -> None:
    keys, run_dir = tmp_path / "keys", tmp_path / "run"
    generate_keys(keys)
    (c_ns, c_addr), (t_ns, t_addr), (r_ns, _) = (namespaces[r] for r in ("coordinator", "trainer", "rollout"))
    cfg = tiny_config(*SMALL, f"cluster.host=\"{c_addr}\"", f"transport.keys_dir=\"{keys}\"", mode="digenrl")
    assert cfg.transport.curve == "auto"
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(to_toml(cfg))
    endpoint = f"tcp://{c_addr}:5555"
    common = ["--config", str(cfg_path), "--run-dir", str(run_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run_dir.mkdir()

    def start(ns: str, *args: str) -> subprocess.Popen[bytes]:
        out = open(tmp_path / f"{ns}.out", "wb")  # noqa: SIM115 - the child owns it
        return subprocess.Popen(["ip", "netns", "exec", ns, str(BIN / "digenrl-node"), *args, *common],
                                stdout=out, stderr=out, env=env)

    procs = [start(c_ns, "--role", "coordinator", "--bind", endpoint, "--node-id", "coordinator")]
    procs.append(start(t_ns, "--role", "trainer", "--coordinator", endpoint, "--bind",
                       f"tcp://{t_addr}:*", "--node-id", "trainer-0"))
    procs.append(start(r_ns, "--role", "rollout", "--coordinator", endpoint, "--node-id", "rollout-0"))
    try:
        assert procs[0].wait(180) == 0, (tmp_path / f"{c_ns}.out").read_text()[-3000:]
        codes = [p.wait(60) for p in procs[1:]]
        assert codes == [0, 0], codes
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["stop_reason"] == "done"
    acc = summary["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) + acc["in_flight"]
    # CURVE handshakes happened: the trainer admitted the rollout's key, nobody was refused
    trainer = node_final(run_dir / "logs" / "trainer-0.log")
    assert trainer["zap_accepted"] >= 1 and trainer["zap_rejected"] == 0
    assert trainer["plaintext_warnings"] == 0
    coord = [json.loads(x) for x in (run_dir / "logs" / "coordinator.log").read_text().splitlines()
             if '"transport_security_final"' in x][-1]
    assert coord["zap_accepted"] >= 2 and coord["zap_rejected"] == 0
