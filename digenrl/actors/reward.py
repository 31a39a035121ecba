"""Reward worker: hosts the reward models on its own process (and GPU); scores what rollouts send.

    rollouts / TAG helpers --Score (DEALER)--> [ROUTER]  reward worker  [DEALER control] <--> coordinator
    rollouts / TAG helpers <--Scored----------- [ROUTER]

| blocking call          | waits for                                  | unblocked by             |
|------------------------|--------------------------------------------|--------------------------|
| ``requests.get()``     | a Score request                            | a rollout sending one    |
| ``in_thread(score)``   | one batch of reward calls                  | the reward models        |
| router ``send``        | the requester's socket (DEALER, HWM)       | it reading its answers   |

Requests queue while a batch is scored; the next batch takes the waiting requests, oldest
first, up to ``reward.worker_batch`` images (at least one request), so samples of several
fragments and rollouts share one reward call. A reward's error (:class:`RewardError`) is
answered to every request of its batch: the rollouts commit those fragments as discarded
(``reward_failed``), never with made-up rewards. Any other exception is this process's bug
and stops it (the launcher restarts it).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import torch

from digenrl.actors.base import Actor, Loop
from digenrl.actors.peers import NodePeers
from digenrl.config import Config
from digenrl.rl.rewards import Reward, RewardError
from digenrl.transport.protocol import Heartbeat, Score, Scored, Shutdown
from digenrl.transport.socketio import Socket


class RewardActor(Actor):
    role = "reward"

    def __init__(self, *, peers: NodePeers, cfg: Config, router: Socket, reward_fn: Reward,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.peers = peers
        self.cfg = cfg
        self.router = router
        self.reward_fn = reward_fn
        self.requests: asyncio.Queue[tuple[bytes, Score]] = asyncio.Queue()
        self.scored = self.failed = self.batches = 0
        self.revoked: set[int] = set()  # a worker generates nothing: nothing to revoke

    @property
    def policy_version(self) -> int:
        """A worker holds no policy: its heartbeats say version 0."""
        return 0

    def background(self) -> list[Loop]:
        return [self.peers.heartbeat_loop(self), self._control_loop, self._recv_loop]

    async def _control_loop(self) -> None:
        while True:
            _, msg = await self.peers.control.recv()
            if isinstance(msg, Shutdown):
                self.request_stop(msg.reason)
            elif not isinstance(msg, Heartbeat):  # the coordinator's answer to a beat
                self.unexpected("control", msg)
            self.peers.heard_from_coordinator()

    async def _recv_loop(self) -> None:
        while True:
            peer, msg = await self.router.recv()
            if isinstance(msg, Score) and peer is not None:  # a ROUTER always names the peer
                self.requests.put_nowait((peer, msg))
            else:
                self.unexpected("requests", msg)

    async def main(self) -> None:
        while not self.stopping:
            first = await self.next_unless_stopped(self.requests)
            if first is None:
                break
            batch = [first]
            n = batch[0][1].images.shape[0]
            while not self.requests.empty():
                head: Score = self.requests._queue[0][1]  # type: ignore[attr-defined]  # a peek
                if n + head.images.shape[0] > self.cfg.reward.worker_batch:
                    break
                batch.append(self.requests.get_nowait())
                n += batch[-1][1].images.shape[0]
            await self._score(batch)

    async def _score(self, batch: list[tuple[bytes, Score]]) -> None:
        t0 = time.perf_counter()
        images = torch.cat([m.images for _, m in batch])
        prompts = [p for _, m in batch for p in m.prompts]
        try:
            metadata = [json.loads(x) for _, m in batch for x in m.metadata]
            total, terms = await self.in_thread("score", self.reward_fn, images, prompts, metadata,
                                                samples=images.shape[0])
            error = ""
        except (RewardError, ValueError) as e:  # a reward's failure, or a malformed request
            error = f"{type(e).__name__}: {e}".splitlines()[0]
            self.log.error("reward failed", error=error, tasks=[m.task_id for _, m in batch])
        seconds = time.perf_counter() - t0
        self.batches += 1
        lo = 0
        for peer, m in batch:
            k = m.images.shape[0]
            if error:
                self.failed += k
                reply = Scored(task_id=m.task_id, rewards=[], reward_terms={}, error=error, seconds=seconds)
            else:
                self.scored += k
                reply = Scored(task_id=m.task_id, rewards=[float(x) for x in total[lo:lo + k]],
                               reward_terms={n: [float(x) for x in v[lo:lo + k]] for n, v in terms.items()},
                               error="", seconds=seconds)
            lo += k
            await self.router.send(reply, to=peer)
