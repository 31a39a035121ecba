"""The weights relay: tree membership (sans-I/O), and rollouts relaying parts over real sockets.

Rollouts here are real :class:`WeightsRelay` fetchers with their own weights ROUTER, fetching from trainer
rank 0's ROUTER (a :class:`WeightStore` served by :func:`serve_weights`, as the trainer does)
or from each other, on loopback. Egress is read from the sockets' own byte counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog
import torch
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from digenrl.actors.weightsfetch import WeightsRelay, WeightsSuperseded
from digenrl.config import load_config
from digenrl.core.relay import RelayTree
from digenrl.telemetry.trace import SpanRecorder
from digenrl.transport.options import SocketOptions
from digenrl.transport.protocol import (
    VersionAnnounce,
    WeightsHeld,
    WeightsPart,
    WeightsPending,
    WeightsRequest,
    WeightsRoute,
)
from digenrl.transport.sockets import Dealer, Router
from digenrl.transport.weights import WeightAssembly, WeightStore, publish_parts, serve_weights

OPTS = SocketOptions(max_frame_bytes=8 << 20, hwm=16)
WAIT = 20.0


# ----------------------------------------------------------------------------- the tree

@settings(max_examples=60, deadline=None)
@given(fanout=st.integers(0, 3), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 50)), max_size=60))
def test_the_tree_stays_a_tree_and_every_change_is_reported(fanout: int, ops: list[tuple[bool, int]]) -> None:
    tree, told = RelayTree(fanout), {}
    for join, n in ops:
        node = f"r{n}"
        changed = tree.join(node) if join else tree.leave(node)
        if not join:
            told.pop(node, None)
        told.update(changed)
        for m in tree.members:
            assert told.get(m) == tree.upstream(m)  # a node is told whenever its upstream moves
            assert len(tree.downstream(m)) <= fanout
            seen, x = set(), m
            while x is not None:  # every path ends at rank 0
                assert x not in seen
                seen.add(x)
                x = tree.upstream(x)
        from_rank0 = [m for m in tree.members if tree.upstream(m) is None]
        assert len(from_rank0) == (len(tree.members) if fanout == 0 else min(1, len(tree.members)))


def test_a_chain_relinks_only_the_moved_node_and_the_leavers_child() -> None:
    tree = RelayTree(1)
    for n in "abcd":
        tree.join(n)
    assert [tree.upstream(n) for n in "abcd"] == [None, "a", "b", "c"]
    assert tree.leave("b") == {"d": "a", "c": "d"}  # d takes b's place; c now fetches from d
    assert tree.leave("c") == {}  # the tail leaves: nobody re-links


# ----------------------------------------------------------------------------- the store

async def test_a_request_waits_for_its_part_and_an_abandoned_version_is_missing() -> None:
    store = WeightStore()
    parts, whole = publish_parts({f"w{i}": torch.full((4,), float(i)) for i in range(3)}, part_bytes=16)
    asm = WeightAssembly(1, len(parts), whole)
    store.begin(asm)
    waiting = asyncio.ensure_future(store.part(1, 2))
    future = asyncio.ensure_future(store.part(2, 0))  # not begun yet: waits too
    await asyncio.sleep(0)
    assert not waiting.done() and not future.done()
    asm.add(2, *parts[2])
    store.landed()
    assert await asyncio.wait_for(waiting, WAIT) is asm
    store.abandon(1)
    assert await store.part(1, 0) is None  # will never land
    store.begin(WeightAssembly(3, 1, whole))
    assert await asyncio.wait_for(future, WAIT) is None  # superseded by version 3


# ----------------------------------------------------------------------------- real sockets

class _Actor:
    role = "rollout"

    def __init__(self, name: str) -> None:
        self.recorder = SpanRecorder(name, "rollout")
        self.log = structlog.get_logger()
        self.unexpected_seen: list[Any] = []

    def working(self, name: str, **args: Any) -> Any:
        return self.recorder.span(name, **args)

    def unexpected(self, socket: str, msg: object, why: str = "") -> None:
        self.unexpected_seen.append(msg)


class _Cluster:
    """Trainer rank 0's weights ROUTER and N rollouts' WeightsRelay with relay ROUTERs."""

    def __init__(self, n: int, **overrides: Any) -> None:
        self.ctx = zmq.asyncio.Context()
        self.cfg = load_config(None, [f"runtime.{k}={v}" for k, v in overrides.items()])
        self.rank0 = Router(self.ctx, options=OPTS)
        self.rank0_ep = self.rank0.bind("tcp://127.0.0.1:*")
        self.rank0_store = WeightStore()
        self.coordinator = Router(self.ctx, options=OPTS)
        coord_ep = self.coordinator.bind("tcp://127.0.0.1:*")
        self.sockets: list[Any] = [self.rank0, self.coordinator]
        self.relays: list[WeightsRelay] = []
        self.relay_eps: list[str] = []
        for i in range(n):
            relay = Router(self.ctx, options=OPTS)
            self.relay_eps.append(relay.bind("tcp://127.0.0.1:*"))
            control, to_rank0 = Dealer(self.ctx, options=OPTS), Dealer(self.ctx, options=OPTS)
            control.connect(coord_ep)
            to_rank0.connect(self.rank0_ep)
            self.sockets += [relay, control, to_rank0]
            self.relays.append(WeightsRelay(node_id=f"rollout-{i}", cfg=self.cfg, control=control,
                                           weights=to_rank0, store=WeightStore(), relay=relay,
                                           connect=self._dealer))
        self.actors = [_Actor(f"rollout-{i}") for i in range(n)]
        self.tasks = [asyncio.ensure_future(serve_weights(self.rank0, self.rank0_store))]
        self.tasks += [asyncio.ensure_future(p.serve_loop(a)()) for p, a in zip(self.relays, self.actors)]

    def _dealer(self, endpoint: str) -> Dealer:
        d = Dealer(self.ctx, options=OPTS)
        d.connect(endpoint)
        self.sockets.append(d)
        return d

    def publish(self, version: int, mib: int = 1) -> tuple[VersionAnnounce, dict[str, torch.Tensor]]:
        sd = {f"w{i}": torch.full((64 * 1024,), float(version * 100 + i)) for i in range(4 * mib)}  # 256 KiB each
        parts, whole = publish_parts(sd, part_bytes=300_000)
        self.rank0_store.publish(version, parts, whole)
        return VersionAnnounce(version=version, step=version, nparts=len(parts), nbytes=mib << 20,
                               checksum=whole, segments=[], segment_since=[], segment_parts=[], segment_sums=[]), sd

    def chain(self) -> None:
        for i in range(1, len(self.relays)):
            self.relays[i].on_route(WeightsRoute(upstream=self.relay_eps[i - 1], upstream_node=f"rollout-{i - 1}"))

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for s in self.sockets:
            s.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
async def cluster() -> AsyncIterator[Any]:
    made: list[_Cluster] = []

    def make(n: int, **overrides: Any) -> _Cluster:
        made.append(_Cluster(n, **overrides))
        return made[-1]

    yield make
    for c in made:
        await c.close()


async def test_a_chain_of_rollouts_holds_a_version_that_rank_0_sent_once(cluster: Any) -> None:
    c = cluster(4)
    c.chain()
    ann, sd = c.publish(1, mib=2)
    got = await asyncio.wait_for(asyncio.gather(*(p.fetch(a, ann, "weight_prefetch")
                                                  for p, a in zip(c.relays, c.actors))), WAIT)
    for held in got:
        assert held.keys() == sd.keys() and all(torch.equal(held[k], sd[k]) for k in sd)
    set_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    # rank 0 sent the set once (frames add a few headers); each relay the set once, the tail none
    assert set_bytes <= c.rank0.statistics().bytes_sent <= 1.01 * set_bytes
    relays = [p.relay for p in c.relays]
    relayed = [r.statistics().bytes_sent for r in relays if r is not None]
    assert len(relayed) == len(c.relays)  # every rollout serves (the tail serves nobody)
    assert all(set_bytes <= b <= 1.01 * set_bytes for b in relayed[:-1]) and relayed[-1] == 0
    for _ in c.relays:  # each rollout told the coordinator it holds the version
        _, msg = await asyncio.wait_for(c.coordinator.recv(), WAIT)
        assert isinstance(msg, WeightsHeld) and msg.version == 1


async def test_a_route_change_mid_fetch_asks_the_new_upstream_for_the_parts_in_flight(cluster: Any) -> None:
    c = cluster(2)
    ann, sd = c.publish(1)
    mute = Router(c.ctx, options=OPTS)  # an upstream that takes requests and never answers
    c.sockets.append(mute)
    c.relays[1].on_route(WeightsRoute(upstream=mute.bind("tcp://127.0.0.1:*"), upstream_node="mute"))
    fetch = asyncio.ensure_future(c.relays[1].fetch(c.actors[1], ann, "weight_prefetch"))
    await asyncio.wait_for(mute.recv(), WAIT)  # a request is in flight there
    c.relays[1].on_route(WeightsRoute(upstream="", upstream_node=""))  # re-linked to rank 0
    held = await asyncio.wait_for(fetch, WAIT)
    assert all(torch.equal(held[k], sd[k]) for k in sd) and c.relays[1].fallbacks == 0


async def test_an_upstream_silent_for_the_liveness_timeout_is_bypassed_for_rank_0(cluster: Any) -> None:
    c = cluster(1, heartbeat_s=0.05, heartbeat_misses=2)
    ann, sd = c.publish(1)
    mute = Router(c.ctx, options=OPTS)
    c.sockets.append(mute)
    c.relays[0].on_route(WeightsRoute(upstream=mute.bind("tcp://127.0.0.1:*"), upstream_node="mute"))
    held = await asyncio.wait_for(c.relays[0].fetch(c.actors[0], ann, "weight_prefetch"), WAIT)
    assert all(torch.equal(held[k], sd[k]) for k in sd) and c.relays[0].fallbacks == 1


def _landing_upstream(c: _Cluster, ann: VersionAnnounce, sd: dict[str, torch.Tensor]) -> tuple[Any, list[Any]]:
    """Rollout 0 as a relay still receiving ``ann`` (its parts land when the test says) and
    rollout 1 fetching from it."""
    parts, _ = publish_parts(sd, part_bytes=300_000)  # the same split rank 0 published
    asm = WeightAssembly(ann.version, ann.nparts, ann.checksum)
    c.relays[0].store.begin(asm)
    c.relays[1].on_route(WeightsRoute(upstream=c.relay_eps[0], upstream_node="rollout-0"))
    return asm, parts


async def test_a_rollout_deep_in_a_chain_waits_for_parts_still_on_their_way(cluster: Any) -> None:
    """The upstream holds nothing for six liveness timeouts (as a relay 16 hops down a slow
    link does) but says WeightsPending meanwhile: the rollout waits instead of bypassing."""
    c = cluster(2, heartbeat_s=0.05, heartbeat_misses=2)  # silent after 0.1 s
    ann, sd = c.publish(1)
    asm, parts = _landing_upstream(c, ann, sd)
    fetch = asyncio.ensure_future(c.relays[1].fetch(c.actors[1], ann, "weight_prefetch"))
    await asyncio.sleep(0.6)  # the duration is what is under test: six liveness timeouts
    assert not fetch.done()
    for i, (tensors, checksum) in enumerate(parts):
        asm.add(i, tensors, checksum)
    c.relays[0].store.landed()
    held = await asyncio.wait_for(fetch, WAIT)
    # exact: the same process's bytes, relayed and checksummed, never computed on
    assert all(torch.equal(held[k], sd[k]) for k in sd)
    assert c.relays[1].fallbacks == 0 and c.rank0.statistics().bytes_sent == 0


async def test_an_upstream_that_only_ever_says_pending_is_bypassed_for_rank_0(cluster: Any) -> None:
    from digenrl.actors.weightsfetch import STALL_SILENCES
    c = cluster(2, heartbeat_s=0.05, heartbeat_misses=2)
    silent_s = c.cfg.runtime.heartbeat_s * c.cfg.runtime.heartbeat_misses
    ann, sd = c.publish(1)
    _landing_upstream(c, ann, sd)  # whose parts never land
    t0 = asyncio.get_running_loop().time()
    held = await asyncio.wait_for(c.relays[1].fetch(c.actors[1], ann, "weight_prefetch"), WAIT)
    # exact: the same process's bytes, fetched from rank 0 after the bypass, never computed on
    assert all(torch.equal(held[k], sd[k]) for k in sd) and c.relays[1].fallbacks == 1
    assert asyncio.get_running_loop().time() - t0 >= STALL_SILENCES * silent_s  # it waited the stall limit


async def test_pending_is_said_only_for_a_version_being_received() -> None:
    """A request for a version this node has not begun hears nothing (no chatter a peer could
    solicit for versions that may never come); once the version is landing, it hears
    WeightsPending with how many parts are in."""
    ctx = zmq.asyncio.Context()
    router, dealer = Router(ctx, options=OPTS), Dealer(ctx, options=OPTS)
    dealer.connect(router.bind("tcp://127.0.0.1:*"))
    store = WeightStore()
    server = asyncio.ensure_future(serve_weights(router, store, keepalive_s=0.05))
    try:
        await dealer.send(WeightsRequest(version=5, part=1))
        with pytest.raises(TimeoutError):  # six keep-alive intervals of silence
            await asyncio.wait_for(dealer.recv(), 0.3)
        parts, whole = publish_parts({f"w{i}": torch.full((4,), float(i)) for i in range(2)}, part_bytes=16)
        asm = WeightAssembly(5, len(parts), whole)
        store.begin(asm)
        asm.add(0, *parts[0])
        store.landed()
        _, msg = await asyncio.wait_for(dealer.recv(), WAIT)
        assert msg == WeightsPending(version=5, part=1, landed=1)
        asm.add(1, *parts[1])
        store.landed()
        while isinstance(msg, WeightsPending):
            _, msg = await asyncio.wait_for(dealer.recv(), WAIT)
        assert isinstance(msg, WeightsPart) and msg.part == 1 and msg.checksum == parts[1][1]
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        router.close()
        dealer.close()
        ctx.destroy(linger=0)


async def test_a_version_the_upstream_moved_past_ends_the_fetch_as_superseded(cluster: Any) -> None:
    c = cluster(2)
    c.chain()
    old, _ = c.publish(1)
    new, _ = c.publish(2)
    await asyncio.wait_for(c.relays[0].fetch(c.actors[0], new, "weight_prefetch"), WAIT)
    with pytest.raises(WeightsSuperseded, match="v1"):  # rollout-0 holds v2: v1 will never be there
        await asyncio.wait_for(c.relays[1].fetch(c.actors[1], old, "weight_prefetch"), WAIT)
    assert c.relays[1].store.get(1) is None  # the abandoned version is not served on
