"""Real ZeroMQ sockets on loopback (ipc in a temp dir, tcp on random ports), CURVE included."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from digenrl.transport.curve import (
    Authenticator,
    CurveClient,
    CurveKeyError,
    CurveServer,
    generate_keys,
    load_keypair,
    load_public_key,
)
from digenrl.transport.endpoints import Endpoint, is_loopback
from digenrl.transport.errors import Closed, EndpointError, PeerLost
from digenrl.transport.options import SocketOptions, node_context
from digenrl.transport.protocol import (
    PROTOCOL_VERSION,
    Chunk,
    Commit,
    Heartbeat,
    Hello,
    Shutdown,
    StepDone,
    Welcome,
    decode,
    encode,
    messages_equal,
)
from digenrl.transport.socketio import Socket
from digenrl.transport.sockets import Dealer, Pub, Pull, Push, Router, Sub
from tests.factories import chunk

WAIT = 10.0  # bound on every wait; a healthy loopback answers in milliseconds
OPTS = SocketOptions(max_frame_bytes=8 << 20, hwm=16)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)  # closes whatever a failing test left open, then terminates


@pytest.fixture
def make(ctx: zmq.asyncio.Context) -> Iterator[Callable[..., Socket]]:
    made: list[Socket] = []

    def factory(cls: type[Socket], **kwargs: object) -> Socket:
        sock = cls(ctx, options=kwargs.pop("options", OPTS), **kwargs)  # type: ignore[arg-type]
        made.append(sock)
        return sock

    yield factory
    for sock in made:
        sock.close()


@pytest.fixture(params=["ipc", "tcp"])
def address(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "tcp":
        yield "tcp://127.0.0.1:*"
        return
    with tempfile.TemporaryDirectory(dir="/tmp") as d:  # ipc paths must stay under ~100 chars
        yield f"ipc://{d}/s"


def _raw(ctx: zmq.asyncio.Context, kind: int, endpoint: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _chunk(x_t: torch.Tensor, x_next: torch.Tensor, task_id: int = 1) -> Chunk:
    return chunk(task_id, t_index=3, sigma=0.7, sigma_next=0.6, policy_version=2, x_t=x_t, x_next=x_next,
                 log_prob=torch.randn(x_t.shape[:1]))


async def test_tensors_of_every_dtype_and_shape_arrive_bit_identical(make, address: str) -> None:
    g = torch.Generator().manual_seed(0)
    pull = make(Pull)
    push = make(Push)
    push.connect(pull.bind(address))
    big = torch.randn(2, 4, 128, 128, generator=g)  # 512 KiB: above pyzmq's copy threshold
    sent = [
        _chunk(big, big.to(torch.bfloat16)),
        _chunk(torch.randn(3, 4, generator=g).half(), torch.randn(3, 4, generator=g).bfloat16()),
        Commit(task_id=2, step=0, fragment=0, node_id="r0", policy_version=2, prompt_ids=[4, 5],
               rewards=[0.25, -1.0], reward_terms={"aesthetic": [0.1, 0.2]}, gen_seconds=1.5,
               cond={"prompt_embeds": torch.randn(2, 8, 32, generator=g).bfloat16(),
                     "mask": torch.tensor([[True, False]]),
                     "ids": torch.arange(6, dtype=torch.int64),
                     "tok": torch.arange(6, dtype=torch.int32), "empty": torch.zeros(3, 0, 2)},
               images=torch.randint(0, 256, (2, 3, 8, 8), generator=g, dtype=torch.uint8), discard=""),
    ]
    for msg in sent:
        await push.send(msg)
    for msg in sent:
        peer, got = await asyncio.wait_for(pull.recv(), WAIT)
        assert peer is None and messages_equal(got, msg)
    assert push.statistics().sent == 3 and pull.statistics().received == 3


async def test_dealer_and_router_talk_by_identity(make, address: str) -> None:
    router = make(Router)
    dealer = make(Dealer, identity=b"rollout-0")
    dealer.connect(router.bind(address))
    hello = Hello(node_id="rollout-0", role="rollout", gpu="cpu", incarnation=1, pid=42, host="h",
                  data_endpoint="", weights_endpoint="")
    await dealer.send(hello)
    peer, got = await asyncio.wait_for(router.recv(), WAIT)
    assert peer == b"rollout-0" and messages_equal(got, hello)
    welcome = Welcome(node_id="rollout-0", run_id="run", config_toml="[run]\n", rank=0,
                      world_size=1, endpoints={"trainer/0": "tcp://127.0.0.1:1"})
    await router.send(welcome, to=peer)
    assert messages_equal((await asyncio.wait_for(dealer.recv(), WAIT))[1], welcome)


async def test_router_sending_to_an_unknown_peer_raises_peer_lost(make) -> None:
    router = make(Router)
    router.bind("tcp://127.0.0.1:*")
    with pytest.raises(PeerLost, match="b'ghost'"):
        await router.send(Shutdown(reason="x"), to=b"ghost")
    with pytest.raises(ValueError, match="needs to="):
        await router.send(Shutdown(reason="x"))


async def test_a_subscriber_gets_what_is_published_after_wait_subscribed(make, address) -> None:
    pub = make(Pub)
    sub = make(Sub)
    sub.connect(pub.bind(address))
    assert await asyncio.wait_for(pub.wait_subscribed(), WAIT) == b""
    done = StepDone(step=3, version=4, metrics={"train/loss": 0.5})
    await pub.send(done)
    assert messages_equal((await asyncio.wait_for(sub.recv(), WAIT))[1], done)


async def test_bad_frames_are_counted_by_reason_and_the_socket_keeps_working(make, ctx) -> None:
    pull = make(Pull)
    raw = _raw(ctx, zmq.PUSH, pull.bind("tcp://127.0.0.1:*"))
    try:
        await raw.send_multipart([b"\xc1 not msgpack"])
        header = msgpack.unpackb(encode(_chunk(torch.zeros(2, 2), torch.zeros(2, 2)))[0])
        header["_tensors"][0][3] = [1 << 40]  # lies about the shape
        await raw.send_multipart([msgpack.packb(header), b"", b"", b""])
        await raw.send_multipart(encode(Shutdown(reason="still here")))
        _, got = await asyncio.wait_for(pull.recv(), WAIT)
    finally:
        raw.close(linger=0)
    assert got == Shutdown(reason="still here")
    stats = pull.statistics()
    assert (stats.received, stats.bad_frames) == (1, 2)
    assert stats.bad_by_reason == {"header": 1, "too_large": 1}


async def test_a_peer_speaking_another_version_is_refused_with_a_clear_shutdown(make, ctx) -> None:
    router = make(Router)
    raw = _raw(ctx, zmq.DEALER, router.bind("tcp://127.0.0.1:*"))
    try:
        await raw.send_multipart([msgpack.packb({"t": "hello", "v": 99, "_tensors": []})])
        await raw.send_multipart(encode(Shutdown(reason="after")))
        _, got = await asyncio.wait_for(router.recv(), WAIT)  # the v99 one was dropped first
        reply = decode(await asyncio.wait_for(raw.recv_multipart(), WAIT), max_frame_bytes=1 << 20)
    finally:
        raw.close(linger=0)
    assert got == Shutdown(reason="after")
    assert reply == Shutdown(reason="protocol version mismatch: peer speaks protocol version 99, "
                                    f"this node speaks {PROTOCOL_VERSION}")
    assert router.statistics().bad_by_reason == {"version": 1}


async def test_an_old_node_hears_its_refusal_in_its_own_protocol_version(make, ctx) -> None:
    """A version-2 node's Hello (host = "data|weights", no endpoint fields) is refused with a
    Shutdown that a version-2 decoder reads: the same four header keys, its version number."""
    router = make(Router)
    raw = _raw(ctx, zmq.DEALER, router.bind("tcp://127.0.0.1:*"))
    old_hello = {"t": "hello", "v": 2, "node_id": "trainer-0", "role": "trainer", "gpu": "cpu",
                 "incarnation": 1, "pid": 1, "host": "tcp://127.0.0.1:1|tcp://127.0.0.1:2",
                 "_tensors": []}
    try:
        await raw.send_multipart([msgpack.packb(old_hello)])
        await raw.send_multipart(encode(Shutdown(reason="after")))
        await asyncio.wait_for(router.recv(), WAIT)  # the Hello is dropped (and refused) first
        frames = await asyncio.wait_for(raw.recv_multipart(), WAIT)
    finally:
        raw.close(linger=0)
    assert len(frames) == 1
    assert msgpack.unpackb(frames[0]) == {
        "t": "shutdown", "v": 2, "_tensors": [],
        "reason": f"protocol version mismatch: peer speaks protocol version 2, this node speaks "
                  f"{PROTOCOL_VERSION}"}
    assert router.statistics().bad_by_reason == {"version": 1}


async def test_a_closed_socket_raises_closed(make) -> None:
    push = make(Push)
    push.close()
    push.close()  # idempotent
    with pytest.raises(Closed):
        await push.send(Shutdown(reason="x"))
    with pytest.raises(Closed):
        push.bind("tcp://127.0.0.1:*")


@pytest.mark.parametrize(("endpoint", "loopback"), [
    ("ipc:///tmp/x", True), ("inproc://a", True), ("tcp://127.0.0.1:5555", True),
    ("tcp://127.1.2.3:*", True), ("tcp://[::1]:5", True), ("tcp://localhost:5", True),
    ("tcp://10.0.0.2:5", False), ("tcp://*:5", False), ("tcp://0.0.0.0:5", False),
    ("tcp://10.0.0.1;127.0.0.1:5", True), ("tcp://[2001:db8::1]:5", False),
])
def test_is_loopback_knows_which_addresses_stay_on_the_machine(endpoint: str, loopback) -> None:
    assert is_loopback(endpoint) is loopback


@pytest.mark.parametrize("bad", ["127.0.0.1:5", "udp://x:1", "tcp://nohostport", "ipc://"])
def test_bad_endpoints_are_named_in_the_error(bad: str) -> None:
    with pytest.raises(EndpointError, match=bad.replace("/", ".")):
        Endpoint.parse(bad)


def test_key_files_round_trip_and_secrets_are_private(tmp_path: Path) -> None:
    paths = generate_keys(tmp_path / "keys")
    pair = load_keypair(tmp_path / "keys", "client")
    assert load_public_key(tmp_path / "keys", "client") == pair.public and len(pair.secret) == 40
    assert stat.S_IMODE(paths["server"][1].stat().st_mode) == 0o600
    with pytest.raises(CurveKeyError, match=r"nobody\.key_secret"):
        load_keypair(tmp_path / "keys", "nobody")
    with pytest.raises(CurveKeyError, match="holds no secret"):
        # a public key file renamed as a secret one has no secret half
        (tmp_path / "keys" / "pub.key_secret").write_bytes(paths["server"][0].read_bytes())
        load_keypair(tmp_path / "keys", "pub")


async def _next_event(sock: Socket, monitor: zmq.asyncio.Socket) -> dict:
    """The first monitor event, then the monitor is detached and closed."""
    try:
        return parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), WAIT))
    finally:
        sock.zmq_socket.disable_monitor()
        monitor.close(linger=0)


async def test_a_curve_server_refuses_unknown_keys_and_accepts_allowed_ones(
        make, ctx, tmp_path: Path) -> None:
    generate_keys(tmp_path, names=("server", "good", "bad"))
    server = load_keypair(tmp_path, "server")
    good, bad = load_keypair(tmp_path, "good"), load_keypair(tmp_path, "bad")
    auth = Authenticator(ctx, allowed=[good.public])
    serving = asyncio.ensure_future(auth.serve())
    try:
        pull = make(Pull, security=CurveServer(keypair=server))
        endpoint = pull.bind("tcp://127.0.0.1:*")
        intruder = make(Push, security=CurveClient(keypair=bad, server_public=server.public))
        monitor = intruder.zmq_socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        intruder.connect(endpoint)
        # Queued locally (PUSH queues before a connection exists) but never delivered.
        await asyncio.wait_for(intruder.send(Shutdown(reason="from intruder")), WAIT)
        event = await _next_event(intruder, monitor)
        assert event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH

        friend = make(Push, security=CurveClient(keypair=good, server_public=server.public))
        friend.connect(endpoint)
        for i in range(2):
            await asyncio.wait_for(friend.send(Shutdown(reason=f"from friend {i}")), WAIT)
        got = [(await asyncio.wait_for(pull.recv(), WAIT))[1] for _ in range(2)]
        # PULL queues fairly across connections: the intruder's earlier message would have
        # come first had its connection been admitted.
        assert got == [Shutdown(reason="from friend 0"), Shutdown(reason="from friend 1")]
        assert auth.accepted == 1 and auth.rejected >= 1
    finally:
        serving.cancel()
        auth.close()


async def test_a_curve_server_without_an_authenticator_admits_nobody(make, tmp_path) -> None:
    generate_keys(tmp_path, names=("server", "client"))
    server, client = load_keypair(tmp_path, "server"), load_keypair(tmp_path, "client")
    pull = make(Pull, security=CurveServer(keypair=server))
    push = make(Push, security=CurveClient(keypair=client, server_public=server.public))
    monitor = push.zmq_socket.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    push.connect(pull.bind("tcp://127.0.0.1:*"))
    event = await _next_event(push, monitor)
    # ZAP_ENFORCE_DOMAIN: with no handler to ask, the handshake fails (libzmq's default
    # would have admitted any client knowing the server's public key).
    assert event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL



async def test_a_recv_waiting_while_the_same_socket_sends_is_never_left_asleep(make, address) -> None:
    """A node's control DEALER: one task waits in ``recv`` while another sends heartbeats on
    the same socket. ZeroMQ's readiness signal is edge-like: a send processes the socket's
    pending commands, which clears the signal of a message that landed meanwhile. If the
    event loop had not polled yet (it was busy: a GIL-heavy forward, a long callback), the
    waiting ``recv`` slept on with the message queued, forever. The rollout then declared a
    live coordinator lost and was restarted (the rare ~10 s stall in launches)."""
    router = make(Router)
    dealer = make(Dealer, identity=b"node")
    dealer.connect(router.bind(address))

    def beat(seq: int) -> Heartbeat:
        return Heartbeat(node_id="node", incarnation=1, policy_version=0, state="running", seq=seq,
                         gpu={}, stats={})

    await dealer.send(beat(0))
    peer, _ = await asyncio.wait_for(router.recv(), WAIT)
    waiting = asyncio.ensure_future(dealer.recv())
    await asyncio.sleep(0.01)  # the receiver is parked on the socket's readiness
    await router.send(beat(1), to=peer)
    time.sleep(0.05)  # the loop is held up while the reply lands (no poll in between)
    await dealer.send(beat(2))  # > 1 ms since the last command check: the send processes them
    _, got = await asyncio.wait_for(waiting, WAIT)
    assert got.seq == 1


async def _until(condition: Callable[[], bool]) -> None:
    """Let the loop turn until ``condition`` holds (bounded by WAIT)."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


async def test_sends_at_the_high_water_mark_wait_in_order_and_go_when_the_peer_reads(ctx) -> None:
    tight = SocketOptions(max_frame_bytes=1 << 20, hwm=2)
    pull, push = Pull(ctx, options=tight), Push(ctx, options=tight)
    try:
        pull.bind("inproc://hwm")
        push.connect("inproc://hwm")
        n = 20

        async def send_all() -> None:
            for i in range(n):
                await push.send(Shutdown(reason=str(i)))

        sender = asyncio.ensure_future(send_all())
        await _until(lambda: bool(push._send_waiters))  # the pipe is full: a send is parked
        assert push.statistics().sent < n and not sender.done()
        got = [(await asyncio.wait_for(pull.recv(), WAIT))[1] for _ in range(n)]
        await asyncio.wait_for(sender, WAIT)
        assert got == [Shutdown(reason=str(i)) for i in range(n)]
        assert push.statistics().waits >= 1  # each parked send counted as a wait
        # a receive that finds a message waits for nothing; one that finds none is counted
        before = pull.statistics().waits
        await push.send(Shutdown(reason="queued"))
        await _until(lambda: bool(pull.zmq_socket.getsockopt(zmq.EVENTS) & zmq.POLLIN))
        await asyncio.wait_for(pull.recv(), WAIT)
        assert pull.statistics().waits == before
        later = asyncio.ensure_future(pull.recv())
        await _until(lambda: bool(pull._recv_waiters))
        await push.send(Shutdown(reason="awaited"))
        assert (await asyncio.wait_for(later, WAIT))[1] == Shutdown(reason="awaited")
        assert pull.statistics().waits == before + 1
    finally:
        push.close()
        pull.close()


async def test_a_router_drops_and_counts_sends_to_a_peer_that_does_not_read(ctx) -> None:
    tight = SocketOptions(max_frame_bytes=1 << 20, hwm=2)
    router, dealer = Router(ctx, options=tight), Dealer(ctx, options=tight, identity=b"slow")
    try:
        router.bind("inproc://drop")
        dealer.connect("inproc://drop")
        await dealer.send(Shutdown(reason="hello"))
        peer, _ = await asyncio.wait_for(router.recv(), WAIT)
        for i in range(20):  # never blocks, never raises: the slow peer's excess is dropped
            await asyncio.wait_for(router.send(Shutdown(reason=str(i)), to=peer), WAIT)
        stats = router.statistics()
        assert stats.dropped > 0 and stats.sent + stats.dropped == 20
        got = [(await asyncio.wait_for(dealer.recv(), WAIT))[1] for _ in range(stats.sent)]
        assert got == [Shutdown(reason=str(i)) for i in range(stats.sent)]  # the first ones
    finally:
        router.close()
        dealer.close()


async def test_a_heartbeat_round_trip_goes_through_while_bulk_data_is_stuck(make) -> None:
    """Control and bulk data travel on separate sockets (ZeroMQ has no priorities within
    one): a data PUSH parked at its high-water mark holds up nothing on the control pair."""
    big = SocketOptions(max_frame_bytes=8 << 20, hwm=1)
    # The stuck PUSH lives in its own context, closed and terminated before the PULL closes:
    # libzmq 4.3.5 aborts the process (errno_assert in session_base_t::clean_pipes) when a
    # TCP peer disconnects while a socket is closing with a multipart message half-written,
    # which closing the PULL first raced into (1 run in ~10 here, once in CI).
    push_ctx = zmq.asyncio.Context()
    pull, push = make(Pull, options=big), Push(push_ctx, options=big)
    push.connect(pull.bind("tcp://127.0.0.1:*"))
    router, dealer = make(Router), make(Dealer, identity=b"node")
    dealer.connect(router.bind("tcp://127.0.0.1:*"))
    x = torch.zeros(2, 1 << 18)  # 2 MiB a tensor

    async def flood() -> None:
        while True:
            await push.send(_chunk(x, x))

    flooding = asyncio.ensure_future(flood())
    try:
        await _until(lambda: bool(push._send_waiters))  # nobody reads the data: it is stuck
        beat = Heartbeat(node_id="node", incarnation=1, policy_version=0, state="running",
                         seq=1, gpu={}, stats={})
        await asyncio.wait_for(dealer.send(beat), WAIT)
        peer, got = await asyncio.wait_for(router.recv(), WAIT)
        await router.send(got, to=peer)
        assert messages_equal((await asyncio.wait_for(dealer.recv(), WAIT))[1], beat)
        assert not flooding.done()
    finally:
        flooding.cancel()
        await asyncio.gather(flooding, return_exceptions=True)
        push.close()
        push_ctx.term()  # returns once the PUSH's connection is torn down (linger 0)


async def test_a_receive_parked_on_a_socket_raises_closed_when_it_closes(make) -> None:
    pull = make(Pull)
    pull.bind("tcp://127.0.0.1:*")
    waiting = asyncio.ensure_future(pull.recv())
    await _until(lambda: bool(pull._recv_waiters))
    pull.close()
    with pytest.raises(Closed):
        await asyncio.wait_for(waiting, WAIT)


async def test_a_router_send_is_tracked_and_a_dropped_message_is_done_at_once(ctx) -> None:
    """A staged buffer sent through a ROUTER is reused only when ZeroMQ is done with it."""
    tight = SocketOptions(max_frame_bytes=1 << 20, hwm=1)
    router, dealer = Router(ctx, options=tight), Dealer(ctx, options=tight, identity=b"slow")
    try:
        router.bind("inproc://tracked")
        dealer.connect("inproc://tracked")
        await dealer.send(Shutdown(reason="hello"))
        peer, _ = await asyncio.wait_for(router.recv(), WAIT)
        trackers = [await router.send(Shutdown(reason=str(i)), to=peer, track=True) for i in range(8)]
        assert all(isinstance(t, zmq.MessageTracker) for t in trackers)
        assert router.statistics().dropped > 0  # the slow peer's excess: dropped, and done
        assert trackers[-1].done
    finally:
        router.close()
        dealer.close()


# ----------------------------------------------------------------------------- cancelled receives
# A main loop races its receive against a stop (Actor.unless_stopped) and cancels the loser:
# a cancelled receive must neither leave a waiter that takes the next message nor lose one
# it had already read.


async def test_a_cancelled_parked_receive_leaves_no_waiter_that_takes_the_next_message(make) -> None:
    router, dealer = make(Router), make(Dealer, identity=b"node")
    dealer.connect(router.bind("tcp://127.0.0.1:*"))
    for seq in range(3):
        waiting = asyncio.ensure_future(router.recv_authenticated())
        await _until(lambda: bool(router._recv_waiters))  # parked on the socket's readiness
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await dealer.send(Shutdown(reason=str(seq)))
        peer, _, got = await asyncio.wait_for(router.recv_authenticated(), WAIT)
        assert peer == b"node" and got == Shutdown(reason=str(seq))


class _CancelOnDelivery(Pull):
    """A Pull that cancels ``victim`` right after handing it a message: the cancellation
    reaches the receive after its message did and before it could return it."""

    victim: asyncio.Task[Any] | None = None

    def _service(self) -> None:
        super()._service()
        if self.victim is not None and not self._recv_waiters:  # the victim's wait got its message
            self.victim.cancel()
            self.victim = None


async def test_a_receive_cancelled_as_its_message_arrives_loses_nothing(ctx) -> None:
    pull, push = _CancelOnDelivery(ctx, options=OPTS), Push(ctx, options=OPTS)
    try:
        push.connect(pull.bind("inproc://cancel-on-delivery"))
        victim = asyncio.ensure_future(pull.recv())
        pull.victim = victim
        await _until(lambda: bool(pull._recv_waiters))
        await push.send(Shutdown(reason="first"))
        await asyncio.wait({victim}, timeout=WAIT)
        assert victim.cancelled()
        await push.send(Shutdown(reason="second"))
        got = [(await asyncio.wait_for(pull.recv(), WAIT))[1] for _ in range(2)]
        assert got == [Shutdown(reason="first"), Shutdown(reason="second")]  # held, in order
    finally:
        push.close()
        pull.close()


async def test_a_receive_cancelled_in_its_yield_after_a_direct_read_loses_nothing(make) -> None:
    pull, push = make(Pull), make(Push)
    pull.YIELD_EVERY = 1  # every direct read yields to the loop: a point where a cancel lands
    push.connect(pull.bind("tcp://127.0.0.1:*"))
    await push.send(Shutdown(reason="first"))
    await push.send(Shutdown(reason="second"))
    await _until(lambda: bool(pull.zmq_socket.getsockopt(zmq.EVENTS) & zmq.POLLIN))
    reading = asyncio.ensure_future(pull.recv())
    await asyncio.sleep(0)  # it reads "first" at once and yields
    assert pull._rx_hot and not reading.done()
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    got = [(await asyncio.wait_for(pull.recv(), WAIT))[1] for _ in range(2)]
    assert got == [Shutdown(reason="first"), Shutdown(reason="second")]


async def test_a_main_loop_parked_on_a_socket_wakes_for_a_stop_and_leaves_the_message_for_later(make) -> None:
    # the coordinator's main loop: before, it noticed a stop only at its next message or after
    # the stop grace (30 s); here the grace is an hour, so only the wake can end the run
    import structlog

    from digenrl.actors.base import Actor
    from digenrl.telemetry.trace import SpanRecorder

    pull, push = make(Pull), make(Push)
    push.connect(pull.bind("tcp://127.0.0.1:*"))

    class Reader(Actor):
        async def main(self) -> None:
            while not self.stopping:
                got = await self.unless_stopped(pull.recv())
                if got is not None:
                    seen.append(got[1])

    seen: list[Any] = []
    actor = Reader(node_id="coordinator", recorder=SpanRecorder("coordinator", "coordinator"),
                   log=structlog.get_logger(), stop_grace_s=3600.0)
    running = asyncio.ensure_future(actor.run())
    await push.send(Shutdown(reason="before"))
    await _until(lambda: bool(seen) and bool(pull._recv_waiters))  # handled, parked for the next
    actor.request_stop("done")
    await asyncio.wait_for(running, WAIT)
    assert seen == [Shutdown(reason="before")]
    await push.send(Shutdown(reason="after"))
    assert (await asyncio.wait_for(pull.recv(), WAIT))[1] == Shutdown(reason="after")


async def test_a_node_context_gives_control_and_bulk_sockets_their_own_io_thread() -> None:
    # the heartbeat-under-bulk fix (docs/benchmarks.md, Transport): control sockets on libzmq
    # I/O thread 0, bulk sockets on thread 1; a one-thread context leaves the choice to libzmq
    ctx = node_context()
    plain = zmq.asyncio.Context()
    try:
        assert ctx.get(zmq.IO_THREADS) == 2
        with Router(ctx) as router, Dealer(ctx, identity=b"n") as dealer, \
                Pull(ctx, lane="bulk") as pull, Push(ctx, lane="bulk") as push, Push(plain, lane="bulk") as other:
            assert [s.zmq_socket.getsockopt(zmq.AFFINITY) for s in (router, dealer, pull, push)] == [1, 1, 2, 2]
            assert other.zmq_socket.getsockopt(zmq.AFFINITY) == 0
            ep, data_ep = router.bind("tcp://127.0.0.1:*"), pull.bind("tcp://127.0.0.1:*")
            dealer.connect(ep)
            push.connect(data_ep)
            x = torch.arange(1 << 16, dtype=torch.float32).reshape(4, -1)
            await push.send(Chunk(task_id=1, step=0, fragment=0, t_index=0, sigma=1.0, sigma_next=0.5,
                                  policy_version=0, x_t=x, x_next=x, log_prob=torch.zeros(4)))
            await dealer.send(Heartbeat(node_id="n", incarnation=1, policy_version=0, state="running",
                                        seq=1, gpu={}, stats={}))
            peer, beat = await asyncio.wait_for(router.recv(), 10)
            _, chunk = await asyncio.wait_for(pull.recv(), 10)
            # exact on purpose: the tensor's bytes travel unchanged (same process, no arithmetic)
            assert peer == b"n" and isinstance(beat, Heartbeat) and torch.equal(chunk.x_t, x)
        with pytest.raises(ValueError, match="lane = 'fast'"):
            Push(ctx, lane="fast")  # type: ignore[arg-type]
    finally:
        ctx.term()
        plain.term()


FLOOD_AND_LEAVE = """
import sys, time, zmq
from digenrl.transport.options import SocketOptions, node_context
from digenrl.transport.sockets import Pull
ctx = node_context()
pull = Pull(ctx, options=SocketOptions(hwm=4, heartbeat_s=0.1), lane=sys.argv[1])
sock = zmq.Socket.shadow(pull.zmq_socket.underlying)  # blocking view: this script has no loop
ep = pull.bind("tcp://127.0.0.1:*")
peer_ctx = zmq.Context()
push = peer_ctx.socket(zmq.PUSH)
push.setsockopt(zmq.SNDHWM, 1000)
push.setsockopt(zmq.LINGER, 2000)
push.connect(ep)
for _ in range(200):
    push.send(b"x" * 65536)
time.sleep(0.5)   # the receiver's pipe is full: libzmq stops reading that connection
push.close()
peer_ctx.destroy(0)  # the peer goes away (a rollout dies, a hostile sender leaves)
time.sleep(0.5)
n = 0
while sock.poll(500):
    sock.recv()
    n += 1
time.sleep(0.5)
pull.close()
ctx.term()
print("read", n)
"""


def test_a_bulk_socket_survives_a_peer_that_fills_its_pipe_and_leaves() -> None:
    # libzmq 4.3.5 aborts (assertion !_io_error, stream_engine_base.cpp:310) when a socket with
    # ZMTP heartbeats loses a peer while its input is stopped at the high-water mark (a raw
    # pyzmq version of this script aborted in 3 of 4 runs with heartbeats, 0 of 4 without; found
    # by bench/faults.py's hostile peer killing a trainer). Bulk-lane sockets run without them:
    # the IVL check pins that; the child process (the failure is SIGABRT) checks the scenario.
    # Through this class the abort is rarer (0 of 4 runs on the control lane), so the child
    # alone would not catch a regression reliably.
    ctx = node_context()
    try:
        with Pull(ctx, options=SocketOptions(heartbeat_s=0.1), lane="bulk") as bulk, \
                Pull(ctx, options=SocketOptions(heartbeat_s=0.1)) as control:
            assert bulk.zmq_socket.getsockopt(zmq.HEARTBEAT_IVL) == 0
            assert control.zmq_socket.getsockopt(zmq.HEARTBEAT_IVL) == 100
    finally:
        ctx.term()
    out = subprocess.run([sys.executable, "-c", FLOOD_AND_LEAVE, "bulk"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0 and out.stdout.startswith("read "), (out.returncode, out.stderr[-500:])
