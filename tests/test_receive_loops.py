"""Every receive loop handles each message it can get, or counts and logs the one it cannot.

A message no branch handles used to vanish without a trace. Now it is counted per socket and
type (``Actor.unexpected_messages``, sent in the heartbeat stats) and logged, the first ten
and then every power of two, so a misbehaving peer is visible but cannot flood the log.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import structlog
from structlog.testing import capture_logs

from digenrl.actors.cluster import make_scheduler
from digenrl.actors.coordinator import CoordinatorActor
from digenrl.actors.peers import NodePeers
from digenrl.actors.rollout import RolloutActor
from digenrl.config import load_config
from digenrl.telemetry.trace import SpanRecorder
from digenrl.transport.protocol import Consumed, Heartbeat, Revoke, VersionAnnounce

WAIT = 10.0


def _coordinator(tmp_path: Path) -> CoordinatorActor:
    cfg = load_config(None, [])
    return CoordinatorActor(cfg=cfg, scheduler=make_scheduler(cfg, prompt_count=8), control=None,
                            pub=None, prompts=[], run_dir=tmp_path, dist_endpoint="tcp://127.0.0.1:1",
                            metrics=None, expected_trainers=1, node_id="coordinator",
                            recorder=SpanRecorder("coordinator", "coordinator"),
                            log=structlog.get_logger())


async def test_a_message_the_coordinator_has_no_branch_for_is_counted_and_logged_rate_limited(
        tmp_path: Path) -> None:
    with capture_logs() as logs:
        actor = _coordinator(tmp_path)
        for _ in range(100):
            await actor._handle(b"peer", Revoke(task_id=1, reason="x"))
    assert actor.unexpected_messages == {"control:Revoke": 100}
    warned = [e["total_unexpected"] for e in logs if e["event"] == "unexpected_message"]
    assert warned == [*range(1, 11), 16, 32, 64]
    assert actor.heartbeat_stats()["unexpected_messages"] == 100.0


class _Control:
    """A control DEALER fed by the test."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()

    async def recv(self) -> tuple[None, Any]:
        return None, await self.inbox.get()

    async def send(self, msg: Any) -> None:
        raise AssertionError(f"the control loop sent {msg!r}")


async def test_the_rollout_control_loop_handles_beats_and_announcements_and_counts_the_rest() -> None:
    cfg = load_config(None, [])
    control = _Control()
    peers = NodePeers(node_id="rollout-0", incarnation=1, cfg=cfg, control=control)
    actor = RolloutActor(peers=peers, cfg=cfg, model=None, reward_fn=None, node_id="rollout-0",
                         recorder=SpanRecorder("rollout-0", "rollout"), log=structlog.get_logger())
    loop = asyncio.ensure_future(actor._control_loop())
    try:
        peers.unanswered = 5
        for msg in (Heartbeat(node_id="coordinator", incarnation=0, policy_version=0, state="running",
                              seq=1, gpu={}, stats={}),
                    VersionAnnounce(version=1, step=1, nparts=1, nbytes=4, checksum="c",
                                    segments=[], segment_since=[], segment_parts=[], segment_sums=[]),
                    Consumed(task_id=1, step=0, fragment=0, rank=0, policy_version=0, trained=1, discarded={},
                             train_seconds=0.0)):
            control.inbox.put_nowait(msg)
        async with asyncio.timeout(WAIT):
            while not control.inbox.empty() or not actor.unexpected_messages:
                await asyncio.sleep(0)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert peers.unanswered == 0  # every control message proves the coordinator alive
    assert actor.follower.announced is not None and actor.follower.announced.version == 1
    assert actor.unexpected_messages == {"control:Consumed": 1}
