"""Fuzzing running nodes: random and mutated frames, and decodable messages with hostile values, at every listening socket.

A real coordinator actor (in this process) and a real trainer node (a child process) take a
storm of undecodable messages on the coordinator's ROUTER and the trainer's PULL (the PUB
only sends). Both stay up, answer their peers afterwards, and count exactly what was sent.
``bench/fuzz_node.py`` runs the same storm with 100,000 messages per socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import random
import socket as pysocket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from digenrl.actors.coordinator import CoordinatorActor
from digenrl.config import Config
from digenrl.transport import factory as zs
from digenrl.transport.endpoints import free_port
from digenrl.transport.errors import ProtocolError
from digenrl.transport.protocol import Heartbeat, Welcome, decode, encode
from tests import hostile
from tests.conftest import wait_until_async
from tests.test_security import config, start_coordinator

STORM = 20_000


def _seeds() -> list[list[bytes]]:
    """Valid messages of every shape a socket sees, as frames to mutate."""
    x = torch.arange(32, dtype=torch.float32).reshape(2, 16)
    msgs = [
        hostile.hello("fuzz-0"),
        hostile.heartbeat("n", seq=3, gpu={"gpus": []}, stats={"busy_s": 1.0}),
        hostile.chunk(x_t=x, x_next=x + 1, sigma=1.0, sigma_next=0.5),
        hostile.commit(node_id="n", prompt_ids=[1], reward_terms={"a": [1.0, 2.0]}, cond={"e": x}),
    ]
    return [[bytes(f) for f in encode(m)] for m in msgs]


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    out = [bytearray(f) for f in frames]
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(out))
        op = rng.randrange(6)
        if op == 0 and out[i]:  # flip a byte
            j = rng.randrange(len(out[i]))
            out[i][j] ^= rng.randint(1, 255)
        elif op == 1:  # truncate
            out[i] = out[i][: rng.randrange(len(out[i]) + 1)]
        elif op == 2 and len(out) > 1:  # drop a frame
            del out[i]
        elif op == 3:  # duplicate a frame
            out.insert(i, bytearray(out[i]))
        elif op == 4:  # garbage appended
            out[i] += rng.randbytes(rng.randint(1, 16))
        else:  # a random frame in its place
            out[i] = bytearray(rng.randbytes(rng.randint(0, 48)))
    return [bytes(f) for f in out]


def bad_messages(rng: random.Random, n: int, max_frame_bytes: int) -> Iterator[list[bytes]]:
    """``n`` messages that the codec must refuse: half random, half mutated valid ones.

    A mutation that still decodes (a flipped byte inside a string, say) is a valid message
    and would be acted on, so it is replaced; any exception other than ProtocolError fails.
    """
    seeds = _seeds()
    made = 0
    while made < n:
        if rng.random() < 0.5:
            frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 3))]
        else:
            frames = _mutate(rng, rng.choice(seeds))
        try:
            decode(frames, max_frame_bytes=max_frame_bytes)
        except ProtocolError:
            made += 1
            yield frames


def send_storm(kind: int, endpoint: str, messages: list[list[bytes]], counted: threading.Event) -> None:
    """Blocking sends from a plain zmq socket (run in a thread).

    The connection stays open until ``counted`` is set: messages still queued at the
    receiver when a peer disconnects are dropped by libzmq, and would never be counted.
    """
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.connect(endpoint)
    for frames in messages:
        sock.send_multipart(frames)
    counted.wait(300)
    sock.close(linger=0)
    ctx.term()


class RecordingCoordinator(CoordinatorActor):
    """The coordinator, remembering each node's latest heartbeat stats."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.heartbeats: dict[str, Heartbeat] = {}

    async def _handle(self, peer: bytes, msg: Any) -> None:
        if isinstance(msg, Heartbeat):
            self.heartbeats[msg.node_id] = msg
        await super()._handle(peer, msg)


def spawn_trainer(endpoint: str, run_dir: Path, notify: Path, prometheus_port: int) -> subprocess.Popen[bytes]:
    """A trainer node under a fake service manager (sd_notify datagrams go to ``notify``),
    serving its counters for Prometheus on ``prometheus_port`` (loopback)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NOTIFY_SOCKET=str(notify),
               WATCHDOG_USEC="400000")
    env.pop("WATCHDOG_PID", None)
    log = open(run_dir / "trainer.stderr", "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, "-m", "digenrl.cli", "node", "--role", "trainer", "--coordinator", endpoint,
         "--node-id", "trainer-0", "--run-dir", str(run_dir), "--prometheus-port", str(prometheus_port),
         "--prometheus-addr", "127.0.0.1"], stdout=log, stderr=log, env=env)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus scrape of ``http://127.0.0.1:port/metrics``, parsed by prometheus-client's
    own parser: {(gauge name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


def _trainer_counted(stats: dict[str, Any]) -> float:
    """What the trainer counted as dropped: undecodable or out-of-bounds frames, refusals."""
    return stats.get("bad_frames", 0) + sum(v for k, v in stats.items() if k.startswith("refused_"))


async def run_storm(tmp_path: Path, n: int, cfg: Config | None = None,
                    storms: tuple[list[list[bytes]], list[list[bytes]]] | None = None) -> dict[str, Any]:
    """Storm both listening sockets with ``n`` bad messages each; returns what was observed.

    ``storms``: (coordinator's, trainer's) messages to send instead of random bad frames.
    Liveness is not under test here: on a shared 2-core box the storm can delay a heartbeat
    by seconds, so a peer is declared lost only after 100 silent intervals.
    """
    cfg = cfg or config("runtime.heartbeat_s=0.2", "runtime.heartbeat_misses=100")
    rng = random.Random(1234)
    if storms is None:
        coord_msgs = list(bad_messages(rng, n, cfg.transport.max_frame_bytes))
        trainer_msgs = list(bad_messages(rng, n, cfg.transport.max_frame_bytes))
    else:
        coord_msgs, trainer_msgs = storms
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    ctx = zmq.asyncio.Context()
    probe_ctx = zmq.asyncio.Context()
    base = start_coordinator(ctx, cfg, run_dir)
    actor = RecordingCoordinator(**{k: getattr(base, k) for k in (
        "cfg", "control", "pub", "prompts", "run_dir", "dist_endpoint", "metrics",
        "expected_trainers", "node_id", "recorder", "log")}, scheduler=base.sched)
    manager = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_DGRAM)
    manager.bind(str(run_dir / "notify.sock"))
    manager.setblocking(False)
    notices: list[str] = []

    def read_notices() -> None:
        # read as systemd does, at once: a full datagram queue (10 by default) blocks sd_notify
        with contextlib.suppress(BlockingIOError):
            while True:
                notices.append(manager.recv(4096).decode())

    asyncio.get_running_loop().add_reader(manager.fileno(), read_notices)
    prometheus_port = free_port()
    trainer = spawn_trainer(actor.control.endpoint, run_dir, run_dir / "notify.sock", prometheus_port)
    counted = threading.Event()
    probe = zs.connect(probe_ctx, "dealer", actor.control.endpoint, cfg, identity=b"rollout-9")
    try:
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(actor.run())
            await wait_until_async(lambda: "trainer-0" in actor.heartbeats, "the trainer's first heartbeat", 120)
            data_endpoint = actor.trainers[0]["data_endpoint"]
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            senders = [tg.create_task(asyncio.to_thread(send_storm, zmq.DEALER, actor.control.endpoint,
                                                        coord_msgs, counted)),
                       tg.create_task(asyncio.to_thread(send_storm, zmq.PUSH, data_endpoint,
                                                        trainer_msgs, counted))]
            try:
                await wait_until_async(lambda: actor.control.statistics().bad_frames + actor.refused.total() >= n,
                                       "coordinator count", 120)
                await wait_until_async(lambda: _trainer_counted(actor.heartbeats["trainer-0"].stats) >= n,
                                       "trainer count", 120)
            finally:
                counted.set()
            seconds = loop.time() - t0
            await asyncio.gather(*senders)
            seq_after_storm = actor.heartbeats["trainer-0"].seq
            # peers are still answered: a new node's Hello gets its Welcome ...
            await probe.send(hostile.hello("rollout-9", "rollout"))
            _, welcome = await asyncio.wait_for(probe.recv(), 30)
            # ... and the trainer keeps heartbeating
            await wait_until_async(lambda: actor.heartbeats["trainer-0"].seq > seq_after_storm + 1,
                             "heartbeats after the storm", 30)
            scraped = await asyncio.to_thread(scrape, prometheus_port)  # what an operator's Prometheus sees
            run.cancel()
        trainer.terminate()  # SIGTERM: a graceful drain, exit code 0
        code = await asyncio.to_thread(trainer.wait, 60)
        read_notices()
        return {"notices": notices, "coordinator_bad": actor.control.statistics().bad_frames,
                "coordinator_refused": actor.refused.total(), "coordinator_rejected": actor.rejected,
                "coordinator_by_reason": actor.control.statistics().bad_by_reason,
                "trainer_bad": actor.heartbeats["trainer-0"].stats["bad_frames"],
                "trainer_counted": _trainer_counted(actor.heartbeats["trainer-0"].stats),
                "welcome": welcome, "trainer_exit": code, "seconds": seconds, "scraped": scraped}
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for s in (probe, actor.control, actor.pub):
            s.close()
        actor.metrics.close()
        asyncio.get_running_loop().remove_reader(manager.fileno())
        manager.close()
        ctx.term()
        probe_ctx.term()


async def test_a_storm_of_bad_frames_is_counted_exactly_and_the_nodes_keep_answering(tmp_path: Path) -> None:
    seen = await run_storm(tmp_path, STORM)
    assert seen["coordinator_bad"] == STORM
    assert seen["trainer_bad"] == STORM
    assert isinstance(seen["welcome"], Welcome) and seen["welcome"].node_id == "rollout-9"
    assert seen["trainer_exit"] == 0


async def test_a_node_tells_its_service_manager_ready_alive_and_stopping(tmp_path: Path) -> None:
    seen = await run_storm(tmp_path, 10)
    notices = seen["notices"]
    assert notices[0] == "READY=1"  # after Welcome and the model build, before any ping
    assert notices.count("WATCHDOG=1") >= 2
    assert notices[-1] == "STOPPING=1" and seen["trainer_exit"] == 0
    # its Prometheus endpoint, scraped after the storm (gauges as docs/metrics.md names them)
    got, node = seen["scraped"], (("node", "trainer-0"),)

    def sock(counter: str, name: str) -> float:
        return got[(f"digenrl_node_socket_{counter}", (("node", "trainer-0"), ("socket", name)))]

    assert sock("bad_frames", "data") == 10 and got[("digenrl_node_bad_frames", node)] == 10
    assert sock("bad_frames", "control") == 0 and sock("received", "control") >= 2  # Welcome, replies
    assert sock("sent", "control") >= 3 and sock("waits", "control") >= 1  # Hello, heartbeats
    assert got[("digenrl_node_policy_version", node)] == 0  # no step was trained
    assert got[("digenrl_node_gpu_available", node)] == 0  # this machine has no NVML
    assert got[("digenrl_node_busy_s", node)] >= 0 and got[("digenrl_node_rss_mb", node)] > 0


def test_mutated_frames_never_raise_anything_but_protocol_error() -> None:
    rng = random.Random(7)
    refused = sum(1 for _ in bad_messages(rng, 2000, 1 << 20))
    assert refused == 2000


# ----------------------------------------------------------------------------- semantic fuzzing
# Decodable messages with hostile field values (tests/hostile.py): each one has at least one value no
# honest peer sends, so each must be refused (the schema, the identity gate, the trainer's
# arrival checks) and counted, and the nodes must stay up.

SEMANTIC = 300
_huge = st.integers(1 << 62, (1 << 63) - 1)
_neg = st.integers(-(1 << 63), -1)
_bad_float = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e300])
_bad_dict = st.dictionaries(st.text(max_size=4), st.text(max_size=4), min_size=1, max_size=3)  # not numbers
_bad_gpu = st.sampled_from([{"gpus": [[1, 2]]}, {"gpus": ["x"]}, {"nested": {"a": 1}}])


def _hostile(base: Any, fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """``base`` with one to three of ``fields`` replaced by a hostile value."""
    return st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({k: fields[k] for k in names})).map(
        lambda over: dataclasses.replace(base, **over))


def _coordinator_storm() -> st.SearchStrategy[Any]:
    """Messages a node sends the coordinator, from a peer that never said a valid Hello."""
    hb = hostile.heartbeat("trainer-0", seq=1, stats={"busy_s": 1.0})
    return st.one_of(
        _hostile(hb, {"stats": _bad_dict, "gpu": _bad_gpu, "incarnation": _neg, "seq": _neg}),
        # well-formed but from nobody: before any Hello (once seen: StepDone from an unknown peer,
        # Consumed with trained = 2**63-1, a VersionAnnounce of 10**6)
        st.builds(hostile.step_done, step=st.integers(0, 10**6), version=st.integers(0, 10**6),
                  metrics=st.just({}) | st.just({"reward_mean": 99.0})),
        st.builds(hostile.consumed, task_id=st.integers(0, 10**6), step=st.integers(0, 10),
                  fragment=st.integers(0, 99), rank=st.integers(0, 3),
                  trained=st.just(hostile.INT64_MAX) | st.integers(0, 64), train_seconds=st.floats(0, 10)),
        st.builds(hostile.version_announce, version=st.just(10**6) | _huge, step=st.integers(0, 10)),
        st.builds(hostile.hello, node_id=st.just("trainer-0") | st.just("rollout-0"),
                  incarnation=st.integers(0, 1 << 40), data_endpoint=st.just("tcp://garbage"),
                  weights_endpoint=st.just("")),
        st.builds(hostile.commit, task_id=st.integers(1, 100), step=st.integers(0, 10**12),
                  fragment=st.just(hostile.BAD_FRAGMENT), policy_version=st.integers(0, 5),
                  prompt_ids=st.just([1])))


def _trainer_storm() -> st.SearchStrategy[Any]:
    """Chunks and commits with values the trainer can tell are not work (it holds no list of
    assignments: a task id alone is not among them, see docs/deployment.md)."""
    chunk = hostile.chunk()
    commit = hostile.commit(prompt_ids=[1])
    where = {"step": st.integers(3, 1 << 40) | _neg, "fragment": st.integers(64, 1 << 19) | _neg,
             "task_id": _neg, "policy_version": _neg}
    return st.one_of(
        _hostile(chunk, {**where, "t_index": st.integers(1000, 1 << 19) | _neg, "sigma": _bad_float,
                         "x_next": st.just(torch.zeros(3, 4)), "log_prob": st.just(torch.zeros(7))}),
        _hostile(commit, {**where, "gen_seconds": _bad_float, "reward_terms": _bad_dict,
                          "rewards": st.just([])}))


@settings(max_examples=1, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(coordinator=st.lists(_coordinator_storm(), min_size=SEMANTIC, max_size=SEMANTIC),
       trainer=st.lists(_trainer_storm(), min_size=SEMANTIC, max_size=SEMANTIC))
def test_decodable_messages_with_hostile_values_are_refused_and_counted_by_live_nodes(
        tmp_path_factory: pytest.TempPathFactory, coordinator: list[Any], trainer: list[Any]) -> None:
    frames = ([[bytes(f) for f in encode(m)] for m in coordinator],
              [[bytes(f) for f in encode(m)] for m in trainer])
    seen = asyncio.run(run_storm(tmp_path_factory.mktemp("semantic"), SEMANTIC, storms=frames))
    # every one refused and counted: by the schema (bad frames, reason invalid) or by identity
    assert seen["coordinator_bad"] + seen["coordinator_refused"] == SEMANTIC
    assert seen["coordinator_rejected"] == 0  # none got as far as the scheduler
    assert seen["trainer_counted"] == SEMANTIC
    assert isinstance(seen["welcome"], Welcome) and seen["trainer_exit"] == 0
