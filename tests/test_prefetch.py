"""Weight prefetch over real sockets: a rollout's WeightFollower fetches each announced version in
the background and applies it only at a trajectory boundary (TCSS), from a ROUTER that
serves published parts the way trainer rank 0 does."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog
import torch
import zmq.asyncio

from digenrl.actors.following import WeightFollower
from digenrl.config import load_config
from digenrl.telemetry.trace import SpanRecorder
from digenrl.transport.options import SocketOptions
from digenrl.transport.protocol import VersionAnnounce, WeightsPart, WeightsRequest
from digenrl.transport.sockets import Dealer, Router
from digenrl.transport.weights import publish_parts

OPTS = SocketOptions(max_frame_bytes=8 << 20, hwm=16)
WAIT = 10.0


class _Model:
    """Records what was applied."""

    def __init__(self) -> None:
        self.applied: list[dict[str, torch.Tensor]] = []


class _Actor:
    """What a WeightFollower is given by its rollout: the trace, log, compute thread and load."""

    role = "rollout"

    def __init__(self) -> None:
        self.recorder = SpanRecorder("rollout-0", "rollout")
        self.log = structlog.get_logger()
        self.model = _Model()
        self.unexpected_messages: list[str] = []

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        self.model.applied.append(sd)

    def unexpected(self, socket: str, msg: object, why: str = "no handler") -> None:
        self.unexpected_messages.append(f"{socket}:{type(msg).__name__}")

    def working(self, name: str, **args: Any) -> Any:
        return self.recorder.span(name, **args)

    async def in_thread(self, name: str, fn: Any, *a: Any, **args: Any) -> Any:
        with self.working(name, **args):
            return await asyncio.to_thread(fn, *a)


def _weights(version: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((256, 256), float(version * 10 + i)) for i in range(3)}


class _Server:
    """Trainer rank 0's weights loop: serves published parts; versions in ``held`` wait until
    released, so a test decides exactly when a fetch is in flight."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.served: dict[int, Any] = {}
        self.requests: list[int] = []
        self.held: set[int] = set()
        self.released = asyncio.Event()
        self.seen: dict[int, asyncio.Event] = defaultdict(asyncio.Event)

    def release(self, version: int) -> None:
        self.held.discard(version)
        self.released.set()

    async def run(self) -> None:
        while True:
            peer, msg = await self.router.recv()
            assert isinstance(msg, WeightsRequest)
            self.requests.append(msg.version)
            self.seen[msg.version].set()
            while msg.version in self.held:
                self.released.clear()
                await self.released.wait()
            parts, _ = self.served[msg.version]
            tensors, checksum = parts[msg.part]
            await self.router.send(WeightsPart(version=msg.version, part=msg.part, nparts=len(parts),
                                               checksum=checksum, tensors=tensors), to=peer)


@pytest.fixture
async def wired() -> AsyncIterator[tuple[WeightFollower, _Actor, _Server, Router]]:
    ctx = zmq.asyncio.Context()
    router, control_srv = Router(ctx, options=OPTS), Router(ctx, options=OPTS)
    wdealer, control = Dealer(ctx, options=OPTS), Dealer(ctx, options=OPTS)
    wdealer.connect(router.bind("tcp://127.0.0.1:*"))
    control.connect(control_srv.bind("tcp://127.0.0.1:*"))
    server = _Server(router)
    task = asyncio.ensure_future(server.run())
    actor = _Actor()
    follower = WeightFollower(node_id="rollout-0", cfg=load_config(None, []), control=control,
                           weights=wdealer, load=actor.load_weights, in_thread=actor.in_thread,
                           recorder=actor.recorder, log=actor.log, unexpected=actor.unexpected)
    fetching = asyncio.ensure_future(follower.prefetch_loop())  # one of the rollout's background loops
    yield follower, actor, server, control_srv
    for t in (task, fetching):
        t.cancel()
    await asyncio.gather(task, fetching, return_exceptions=True)
    for s in (router, control_srv, wdealer, control):
        s.close()
    ctx.destroy(linger=0)


def _announce(server: _Server, version: int) -> VersionAnnounce:
    parts, whole = publish_parts(_weights(version), part_bytes=300_000)  # 3 parts of 256 kB
    server.served[version] = (parts, whole)
    return VersionAnnounce(version=version, step=version, nparts=len(parts),
                           nbytes=3 * 256 * 256 * 4, checksum=whole, segments=[], segment_since=[], segment_parts=[], segment_sums=[])


async def _prefetch_done(follower: WeightFollower) -> None:
    assert follower._prefetching is not None
    await asyncio.wait_for(asyncio.shield(follower._prefetching), WAIT)


async def test_an_announced_version_is_fetched_in_the_background_and_applied_at_the_boundary(
        wired: Any) -> None:
    follower, actor, server, _ = wired
    follower.on_announce(_announce(server, 1))
    follower.prefetch()
    await _prefetch_done(follower)
    assert follower._ready is not None and follower._ready[0] == 1
    assert actor.model.applied == []  # nothing touches the model until the boundary
    await follower.catch_up(floor=1)
    assert follower.version == 1 and len(actor.model.applied) == 1
    assert all(torch.equal(actor.model.applied[0][k], v) for k, v in _weights(1).items())
    names = [s.name for s in actor.recorder.spans()]
    assert "weight_prefetch" in names and "weight_fetch" not in names
    assert server.requests == [1, 1, 1]  # one request per part, once


async def test_a_boundary_reached_mid_prefetch_waits_for_it_and_the_newest_version_wins(
        wired: Any) -> None:
    follower, actor, server, _ = wired
    server.held = {1, 2}
    follower.on_announce(_announce(server, 1))
    follower.prefetch()
    await asyncio.wait_for(server.seen[1].wait(), WAIT)  # version 1 is in flight
    follower.on_announce(_announce(server, 2))
    follower.prefetch()  # one fetch at a time: 2 follows when 1 is done
    boundary = asyncio.ensure_future(follower.catch_up(floor=1))
    await asyncio.sleep(0)
    assert not boundary.done()  # below its floor, the boundary waits for the fetch in flight
    server.release(1)
    await asyncio.wait_for(boundary, WAIT)
    # it applied version 1, which meets the floor, without waiting for version 2; version 2's
    # background fetch starts once version 1's is done (possibly after the apply), held back
    assert follower.version == 1 and len(actor.model.applied) == 1
    await asyncio.wait_for(server.seen[2].wait(), WAIT)
    assert follower.version == 1 and follower._ready is None
    server.release(2)
    await follower.catch_up(floor=2)  # the next boundary needs 2: waits for its prefetch
    assert follower.version == 2
    assert [sd["w0"][0, 0].item() for sd in actor.model.applied] == [10.0, 20.0]
    assert "weight_fetch" not in [s.name for s in actor.recorder.spans()]
    assert server.requests.count(1) == 3 and server.requests.count(2) == 3  # each part once


async def test_a_failed_prefetch_is_fetched_again_in_the_foreground(wired: Any) -> None:
    follower, actor, server, _ = wired
    ann = _announce(server, 1)
    good = server.served[1]
    parts, whole = good
    bad = [({k: v + 1 for k, v in parts[0][0].items()}, parts[0][1]), *parts[1:]]
    server.served[1] = (bad, whole)  # part 0 arrives corrupted: its checksum fails
    follower.on_announce(ann)
    follower.prefetch()
    await _prefetch_done(follower)
    assert follower._prefetch_failed == 1 and follower._ready is None
    follower.prefetch()
    assert follower._prefetching.done()  # not retried in the background
    server.served[1] = good
    await follower.catch_up(floor=1)
    assert follower.version == 1 and torch.equal(actor.model.applied[0]["w1"], _weights(1)["w1"])
    assert [s.name for s in actor.recorder.spans()].count("weight_fetch") == 1
