"""A fragment's generation runs on the actor's compute thread apart from its sends: the
sampler never waits for a chunk to leave, a revoked task commits nothing, and an error in
the generation reaches the caller instead of hanging it. Real tiny model and sampler; the
trainer links are small recording stand-ins whose sends can be held, the way a full
high-water mark holds a real PUSH."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import structlog

from digenrl.actors.base import Actor
from digenrl.actors.streamer import FragmentStreamer
from digenrl.config import load_config
from digenrl.core.plan import plan_for_step
from digenrl.rl.policy import build_policy
from digenrl.rl.rewards import build_reward
from digenrl.telemetry.trace import SpanRecorder
from digenrl.transport.protocol import Assign, Chunk, Commit

SMALL = ["model.path=\"random\"", "train.prompts_per_step=1", "train.group_size=2",
         "sampler.num_steps=6"]
WAIT = 60.0


class _Link:
    """A trainer rank's PUSH: records what was sent; while ``hold`` is clear, sends wait."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.on_send: Any = None

    async def send(self, msg: Any, *, track: bool = False) -> None:
        await self.hold.wait()
        self.sent.append(msg)
        if self.on_send is not None:
            self.on_send(msg)
        # track: a real socket's tracker; None means done at once (the staged buffer is free)


class _Rollout(Actor):
    role = "rollout"

    def __init__(self) -> None:
        super().__init__(node_id="rollout-0", recorder=SpanRecorder("rollout-0", "rollout"),
                         log=structlog.get_logger())
        self.revoked: set[int] = set()


def _setup(reward_fn: Any = None) -> tuple[_Rollout, FragmentStreamer, _Link, _Link, Assign, Any, Any]:
    cfg = load_config(None, SMALL)
    policy = build_policy(cfg)
    trained, sde = plan_for_step(cfg, 0)
    assert len(trained) >= 2, trained
    push, control = _Link(), _Link()
    actor = _Rollout()
    streamer = FragmentStreamer(node_id="rollout-0", cfg=cfg, pushes={0: push}, control=control,
                                reward_fn=None, span="denoise_step", lane="rollout-chunk-sender",
                                recorder=actor.recorder, log=actor.log, submit=actor.submit,
                                revoked=actor.revoked, unexpected=actor.unexpected)
    task = Assign(task_id=7, step=0, fragment=0, prompt_ids=[0], prompts=["a red cube"], seeds=[1, 2],
                  group_size=2, version_floor=0, lease_s=60.0, sde_steps=sde,
                  owners={str(t): 0 for t in trained}, metadata=['{"prompt": "a red cube"}'])
    return actor, streamer, push, control, task, policy, reward_fn or build_reward(cfg.reward.terms)


async def _generate(actor: _Rollout, streamer: FragmentStreamer, task: Assign, policy: Any,
                    reward: Any) -> bool:
    streamer.reward_fn = reward
    return await streamer.generate_and_stream(task, policy.model, 0)


@pytest.mark.asyncio
async def test_the_sampler_runs_on_while_a_chunk_send_is_held() -> None:
    scored = threading.Event()
    actor, streamer, push, control, task, policy, reward = _setup()

    def scoring(images: Any, prompts: Any, *meta: Any) -> Any:
        scored.set()
        return reward(images, prompts, *meta)

    push.hold.clear()  # the trainer link takes nothing for now
    gen = asyncio.create_task(_generate(actor, streamer, task, policy, scoring))
    try:
        # the whole trajectory, up to decoding and scoring, runs with no chunk sent yet
        assert await asyncio.to_thread(scored.wait, WAIT)
        assert push.sent == [] and not gen.done()
        push.hold.set()
        assert await asyncio.wait_for(gen, WAIT) is True
    finally:
        gen.cancel()
    chunks = [m for m in push.sent if isinstance(m, Chunk)]
    assert [c.t_index for c in chunks] == sorted(int(t) for t in task.owners)
    assert all(c.task_id == 7 and c.policy_version == 0 for c in chunks)
    assert isinstance(push.sent[-1], Commit) and len(push.sent) == len(chunks) + 1
    assert [type(m) for m in control.sent] == [Commit]
    names = [s.name for s in actor.recorder.spans()]
    assert names.count("send_chunk") == len(chunks) and names.count("reward") == 1
    # one span per pull: each trained step, then the steps after the last one
    assert names.count("denoise_step") == len(chunks) + 1
    # the sampler's spans and the sends' are on different lanes of the trace
    lanes = {s.name: s.tid for s in actor.recorder.spans()}
    assert lanes["denoise_step"] == lanes["reward"] != lanes["send_chunk"]
    # every chunk was staged in a pooled host buffer, and every buffer came back (held sends
    # made the pool grow instead of stalling the sampler)
    pool = streamer._stager(policy.model).pool.statistics()
    assert pool["in_flight"] == 0 and pool["allocated"] + pool["reused"] == len(chunks)


@pytest.mark.asyncio
async def test_a_task_revoked_mid_way_commits_nothing_and_frees_the_compute_thread() -> None:
    actor, streamer, push, control, task, policy, reward = _setup()
    push.on_send = lambda msg: actor.revoked.add(msg.task_id)  # revoked as its first chunk leaves
    assert await asyncio.wait_for(_generate(actor, streamer, task, policy, reward), WAIT) is False
    assert [type(m) for m in push.sent] == [Chunk]  # only the chunk sent before the revocation
    assert control.sent == []
    assert actor._computing is not None and actor._computing[1].done()
    assert actor.compute_stuck() is None
    assert streamer._stager(policy.model).pool.statistics()["in_flight"] == 0  # unsent: returned


@pytest.mark.asyncio
async def test_an_error_in_the_generation_reaches_the_caller() -> None:
    def broken_reward(images: Any, prompts: Any, *meta: Any) -> Any:
        raise RuntimeError("reward model fell over")

    actor, streamer, push, control, task, policy, _ = _setup()
    with pytest.raises(RuntimeError, match="reward model fell over"):
        await asyncio.wait_for(_generate(actor, streamer, task, policy, broken_reward), WAIT)
    assert not any(isinstance(m, Commit) for m in push.sent) and control.sent == []
