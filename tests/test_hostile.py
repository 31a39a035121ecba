"""Hostile and broken peers, in process: each message the issue-20 adversary sent, at its actor.

The end-to-end versions (live launches, SIGSTOP/SIGCONT, a full disk) are in
tests/test_pauses.py and tests/test_cli_errors.py; these drive one actor with fakes for the
sockets it reads, so each case takes milliseconds and names exactly what is refused.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from digenrl.actors.peers import NodePeers
from digenrl.actors.trainer import TrainerActor
from digenrl.config import load_config, resolve_mode
from digenrl.core.plan import plan_for_step
from digenrl.telemetry.trace import SpanRecorder
from digenrl.transport.protocol import Chunk, Commit


class FakeSocket:
    """A socket whose ``recv`` hands out queued messages; ``send`` records."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.sent: list[Any] = []

    async def recv(self) -> tuple[bytes | None, Any]:
        return None, await self.inbox.get()

    async def send(self, msg: Any, *, to: bytes | None = None) -> None:
        self.sent.append(msg)


def _trainer(tmp_path: Path, *sets: str) -> tuple[TrainerActor, FakeSocket]:
    from digenrl.rl.policy import build_policy
    cfg = resolve_mode(load_config(None, ["model.path=\"random\"", "train.prompts_per_step=2",
                                          "sampler.num_steps=4", "run.steps=4", *sets]), "digenrl")
    data = FakeSocket()
    peers = NodePeers(node_id="trainer-0", incarnation=1, cfg=cfg, control=FakeSocket(), data=data)
    actor = TrainerActor(peers=peers, cfg=cfg, policy=build_policy(cfg), rank=0, world_size=1,
                         run_dir=tmp_path, reward_fn=None, node_id="trainer-0",
                         recorder=SpanRecorder("trainer-0", "trainer"), log=structlog.get_logger())
    return actor, data


def _commit(step: int = 0, fragment: int = 0, task_id: int = 1, n: int = 4) -> Commit:
    return Commit(task_id=task_id, step=step, fragment=fragment, node_id="rollout-0", policy_version=0,
                  prompt_ids=[0], rewards=[0.5] * n, reward_terms={}, gen_seconds=0.1, cond={},
                  images=torch.zeros(0, dtype=torch.uint8))


def _chunk(step: int = 0, fragment: int = 0, t_index: int = 0, task_id: int = 1) -> Chunk:
    x = torch.zeros(4, 2)
    return Chunk(task_id=task_id, step=step, fragment=fragment, t_index=t_index, sigma=1.0,
                 sigma_next=0.5, policy_version=0, x_t=x, x_next=x, log_prob=torch.zeros(4))


async def _feed(actor: TrainerActor, data: FakeSocket, msgs: list[Any]) -> None:
    loop = asyncio.create_task(actor._data_loop())
    for m in msgs:
        data.inbox.put_nowait(m)
    while not data.inbox.empty():
        await asyncio.sleep(0)
    await asyncio.sleep(0)  # the last message is handled before the loop waits again
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop


async def test_a_commit_for_a_slot_outside_the_run_never_reaches_training(tmp_path: Path) -> None:
    # issue 20: Commit(fragment = 99) with one fragment per step finished the step on its own
    actor, data = _trainer(tmp_path, "runtime.fragments_per_step=1")
    trained = plan_for_step(actor.cfg, 0)[0]
    await _feed(actor, data, [
        _commit(fragment=99), _commit(step=10**12, task_id=7), _commit(step=-1, task_id=8),
        _chunk(step=3, t_index=trained[0], task_id=9),  # beyond v + K + 1
        _chunk(t_index=99, task_id=10),                 # a timestep no plan trains
        _chunk(t_index=trained[0]), _commit()])
    assert actor.refused == {"bad_fragment": 1, "step_out_of_window": 3, "not_owner": 1}
    assert [c.fragment for c in actor.pending[0]] == [0] and list(actor.pending) == [0]
    assert set(actor.staged) == {1} and actor.consumed_slots[0] == set()


async def test_chunks_of_a_revoked_attempt_are_refused_at_arrival(tmp_path: Path) -> None:
    actor, data = _trainer(tmp_path)
    actor.revoked.add(5)
    t = plan_for_step(actor.cfg, 0)[0][0]
    await _feed(actor, data, [_chunk(t_index=t, task_id=5), _commit(task_id=5)])
    assert actor.refused == {"revoked": 1} and 5 not in actor.staged and not actor.pending
