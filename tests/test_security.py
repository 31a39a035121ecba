"""Node hardening on real sockets: CURVE allow-list, plain-text refusal, key errors."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import structlog
import zmq
import zmq.asyncio

from digenrl.actors.cluster import make_scheduler
from digenrl.actors.coordinator import CoordinatorActor
from digenrl.config import Config
from digenrl.data.prompts import load_prompts
from digenrl.telemetry.logging import get_logger
from digenrl.telemetry.metrics import MetricsWriter
from digenrl.telemetry.trace import SpanRecorder
from digenrl.transport import factory as zs
from digenrl.transport.curve import (
    CurveClient,
    CurveKeyError,
    generate_keys,
    load_keypair,
    load_public_key,
)
from digenrl.transport.protocol import Heartbeat, Hello, Welcome
from digenrl.transport.security import PlaintextRefused, node_security
from digenrl.transport.sockets import Dealer
from tests.conftest import wait_until_async
from tests.factories import tiny_config

SMALL = ["run.steps=2", "runtime.tag=\"never\""]  # over the suite's tiny run


def config(*extra: str) -> Config:
    return tiny_config(*SMALL, *extra)


def curve_config(keys: Path, curve: str = "on", *extra: str) -> Config:
    return config(f"transport.curve=\"{curve}\"", f"transport.keys_dir=\"{keys}\"", *extra)


def start_coordinator(ctx: zmq.asyncio.Context, cfg: Config, run_dir: Path) -> CoordinatorActor:
    """The real coordinator actor on loopback sockets opened the way serve_coordinator opens them."""
    control = zs.bind(ctx, "router", "tcp://127.0.0.1:*", cfg)
    pub = zs.bind(ctx, "pub", "tcp://127.0.0.1:*", cfg)
    prompts = load_prompts(cfg.prompts.file)
    return CoordinatorActor(
        cfg=cfg, scheduler=make_scheduler(cfg, len(prompts)), control=control, pub=pub,
        prompts=prompts, run_dir=run_dir, dist_endpoint="tcp://127.0.0.1:1",
        metrics=MetricsWriter(run_dir, tensorboard=False), expected_trainers=1,
        node_id="coordinator", recorder=SpanRecorder("coordinator", "coordinator"),
        log=get_logger("coordinator", "coordinator"))


def hello(node_id: str) -> Hello:
    return Hello(node_id=node_id, role="trainer", gpu="cpu", incarnation=1, pid=1, host="h",
                 data_endpoint="tcp://127.0.0.1:1", weights_endpoint="tcp://127.0.0.1:2")


async def test_a_client_without_an_allowed_key_cannot_make_the_coordinator_act(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys)
    generate_keys(tmp_path / "rogue", names=("rogue",))
    cfg = curve_config(keys)
    server_ctx, rogue_ctx, good_ctx = (zmq.asyncio.Context() for _ in range(3))
    actor = start_coordinator(server_ctx, cfg, tmp_path / "run")
    sec = node_security(server_ctx)
    rogue = Dealer(rogue_ctx, identity=b"rogue", security=CurveClient(
        keypair=load_keypair(tmp_path / "rogue", "rogue"), server_public=load_public_key(keys, "server")))
    rogue.connect(actor.control.endpoint)
    good = zs.connect(good_ctx, "dealer", actor.control.endpoint, cfg, identity=b"trainer-0")
    try:
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(actor.run())
            # queued on the TCP connection; the refused handshake means it is never delivered
            await rogue.send(hello("rogue-0"))
            await wait_until_async(lambda: sec.counters()["zap_rejected"] >= 1, "the ZAP rejection")
            await good.send(hello("trainer-0"))
            _, msg = await asyncio.wait_for(good.recv(), 20)
            assert isinstance(msg, Welcome) and msg.node_id == "trainer-0"
            assert list(actor.nodes) == ["trainer-0"]
            assert rogue.statistics().received == 0
            counters = sec.counters()
            assert counters["zap_rejected"] >= 1 and counters["zap_accepted"] >= 1
            run.cancel()
    finally:
        for s in (rogue, good, actor.control, actor.pub):
            s.close()
        actor.metrics.close()
        for c in (server_ctx, rogue_ctx, good_ctx):
            c.term()


def test_a_plaintext_bind_on_a_non_loopback_address_is_refused_without_the_flag() -> None:
    ctx = zmq.asyncio.Context()
    try:
        with pytest.raises(PlaintextRefused, match=r"0\.0\.0\.0.*--allow-plaintext"):
            zs.bind(ctx, "router", "tcp://0.0.0.0:*", config("transport.curve=\"off\""))
    finally:
        ctx.term()


def test_a_plaintext_bind_on_a_non_loopback_address_is_accepted_with_the_flag_and_warns() -> None:
    ctx = zmq.asyncio.Context()
    cfg = config("transport.curve=\"off\"", "transport.allow_plaintext=true")
    with structlog.testing.capture_logs() as logs:
        sock = zs.bind(ctx, "router", "tcp://0.0.0.0:*", cfg)
    try:
        assert sock.endpoint.startswith("tcp://0.0.0.0:")
        assert sock.zmq_socket.getsockopt(zmq.CURVE_SERVER) == 0
        assert [e for e in logs if e["event"] == "PLAINTEXT_ON_NETWORK"]
        assert node_security(ctx).counters()["plaintext_warnings"] == 1
    finally:
        sock.close()
        ctx.term()


def test_auto_curve_without_keys_on_a_non_loopback_bind_names_the_folder_and_command(tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    try:
        with pytest.raises(PlaintextRefused, match="digenrl keys generate"):
            zs.bind(ctx, "pull", "tcp://0.0.0.0:*", config())
        empty = tmp_path / "nokeys"
        empty.mkdir()
        other = zmq.asyncio.Context()
        try:
            with pytest.raises(CurveKeyError, match=f"{empty}.*digenrl keys generate {empty}"):
                zs.bind(other, "pull", "tcp://0.0.0.0:*", curve_config(empty, "auto"))
        finally:
            other.term()
    finally:
        ctx.term()


def test_auto_curve_is_on_for_a_non_loopback_bind_and_off_on_loopback(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys)
    ctx = zmq.asyncio.Context()
    cfg = curve_config(keys, "auto")
    wide = zs.bind(ctx, "pull", "tcp://0.0.0.0:*", cfg)
    local = zs.bind(ctx, "pull", "tcp://127.0.0.1:*", cfg)
    try:
        assert wide.zmq_socket.getsockopt(zmq.CURVE_SERVER) == 1
        assert local.zmq_socket.getsockopt(zmq.CURVE_SERVER) == 0
    finally:
        wide.close()
        local.close()
        ctx.term()  # returns only if closing the last socket stopped the ZAP handler


async def test_under_curve_a_node_id_is_bound_to_its_key(tmp_path: Path) -> None:
    # regression: an id bound only to the routing id the node chooses lets any holder of an
    # allowed key claim another node's id while that node is not connected. A key named after
    # a node id speaks only as that node and that node only with it; the shared client key
    # speaks as any other id; a later Hello of a bound id must bring the same key.
    keys = tmp_path / "keys"
    generate_keys(keys, names=("server", "client", "trainer-0", "rollout-5"))
    cfg = curve_config(keys)
    server_ctx = zmq.asyncio.Context()
    actor = start_coordinator(server_ctx, cfg, tmp_path / "run")
    ep = actor.control.endpoint
    ctxs: list[zmq.asyncio.Context] = []

    def dealer(key: str, identity: str) -> Dealer:
        ctx = zmq.asyncio.Context()
        ctxs.append(ctx)
        return zs.connect(ctx, "dealer", ep, curve_config(keys, "on", f"transport.client_key=\"{key}\""),
                          identity=identity.encode())

    shared_as_rollout5 = dealer("client", "rollout-5")   # the shared key claiming an id with its own
    rollout5_as_rollout6 = dealer("rollout-5", "rollout-6")  # a node's key claiming another id
    trainer = None
    try:
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(actor.run())
            await shared_as_rollout5.send(dataclasses.replace(hello("rollout-5"), role="rollout"))
            await wait_until_async(lambda: actor.refused.get("id_has_its_own_key") == 1, "refusal 1", 30)
            shared_as_rollout5.close()
            await rollout5_as_rollout6.send(dataclasses.replace(hello("rollout-6"), role="rollout"))
            await wait_until_async(lambda: actor.refused.get("key_of_another_node") == 1, "refusal 2", 30)
            rollout5_as_rollout6.close()
            assert actor.nodes == {}
            trainer = dealer("trainer-0", "trainer-0")  # its own key: welcomed
            await trainer.send(hello("trainer-0"))
            _, msg = await asyncio.wait_for(trainer.recv(), 30)
            assert isinstance(msg, Welcome) and list(actor.nodes) == ["trainer-0"]
            assert actor.gate.keys == {"trainer-0": "trainer-0"}
            run.cancel()
        # what a live connection cannot reach (one connection has one key): the gate's own rules
        later = Hello(node_id="trainer-0", role="trainer", gpu="cpu", incarnation=2, pid=1, host="h",
                      data_endpoint="", weights_endpoint="")
        assert actor._gate(b"trainer-0", later, "trainer-0") is None  # a restart with its key
        actor.gate.keys["rollout-1"] = "client"
        assert actor._gate(b"rollout-1", dataclasses.replace(later, node_id="rollout-1", role="rollout"),
                           None) == "hello_from_another_key"
        beat = Heartbeat(node_id="trainer-0", incarnation=1, policy_version=0, state="running", seq=0,
                         gpu={}, stats={})
        assert actor._gate(b"trainer-0", beat, "client") == "key_not_bound_to_id"
        assert actor._gate(b"trainer-0", beat, "trainer-0") is None
    finally:
        for s in (shared_as_rollout5, rollout5_as_rollout6, trainer, actor.control, actor.pub):
            if s is not None:
                s.close()
        actor.metrics.close()
        for c in (server_ctx, *ctxs):
            c.term()
