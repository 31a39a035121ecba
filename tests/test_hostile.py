"""Hostile and broken peers, in process: each message the issue-20 adversary sent, at its actor.

The end-to-end versions (live launches, SIGSTOP/SIGCONT, a full disk) are in
tests/test_pauses.py and tests/test_cli_errors.py; these drive one actor with fakes for the
sockets it reads, so each case takes milliseconds and names exactly what is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from digenrl.transport.protocol import Chunk, CleanSample, Commit
from tests import hostile
from tests.factories import clean_sample


class FakeSocket:
    """A socket whose ``recv`` hands out queued messages; ``send`` records."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.sent: list[Any] = []

    async def recv(self) -> tuple[bytes | None, Any]:
        return None, await self.inbox.get()

    async def send(self, msg: Any, *, to: bytes | None = None) -> None:
        self.sent.append(msg)


def _trainer(tmp_path: Path, *sets: str, restored: bool = True) -> tuple[TrainerActor, FakeSocket]:
    """A rank 0 trainer on fake sockets; ``restored``: as after its (empty) restore."""
    from digenrl.rl.policy import build_policy
    cfg = resolve_mode(load_config(None, ["model.path=\"random\"", "train.prompts_per_step=2",
                                          "sampler.num_steps=4", "run.steps=4", *sets]), "digenrl")
    data = FakeSocket()
    peers = NodePeers(node_id="trainer-0", incarnation=1, cfg=cfg, control=FakeSocket(), data=data)
    actor = TrainerActor(peers=peers, cfg=cfg, policy=build_policy(cfg), rank=0, world_size=1,
                         run_dir=tmp_path, reward_fn=None, node_id="trainer-0",
                         recorder=SpanRecorder("trainer-0", "trainer"), log=structlog.get_logger())
    if restored:
        actor.restored.set()
    return actor, data


def _commit(step: int = 0, fragment: int = 0, task_id: int = 1, n: int = 4) -> Commit:
    return hostile.commit(task_id, step, fragment, n=n)


def _chunk(step: int = 0, fragment: int = 0, t_index: int = 0, task_id: int = 1) -> Chunk:
    return hostile.chunk(task_id, step, fragment, t_index, x_t=torch.zeros(4, 2), sigma=1.0, sigma_next=0.5)


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
    # regression: Commit(fragment = 99) with one fragment per step finished the step on its own
    actor, data = _trainer(tmp_path, "runtime.fragments_per_step=1")
    trained = plan_for_step(actor.cfg, 0)[0]
    await _feed(actor, data, [
        _commit(fragment=hostile.BAD_FRAGMENT), _commit(step=hostile.FAR_STEP, task_id=7), _commit(step=-1, task_id=8),
        _chunk(step=3, t_index=trained[0], task_id=9),  # beyond v + K + 1
        _chunk(t_index=99, task_id=10),                 # a timestep no plan trains
        _chunk(t_index=trained[0]), _commit()])
    assert actor.refused == {"bad_fragment": 1, "step_out_of_window": 3, "not_owner": 1}
    assert [c.fragment for c in actor.pending[0]] == [0] and list(actor.pending) == [0]
    assert set(actor.staged) == {1} and actor.consumed_slots[0] == set()


async def test_work_that_arrives_while_a_rank_restores_is_judged_at_the_restored_version(tmp_path: Path) -> None:
    """Two ranks resume from version 2: rank 0 restores and announces, rollouts send step 2's
    work, and this rank is still loading. Judged against version 0, step 2 is out of the
    window at K = 0: the commit was refused, the step never completed, the resumed run hung
    (seen by hand with cluster.trainers=2). It must wait in the socket until the restore."""
    from digenrl.rl.checkpoint import commit_checkpoint, save_trainer_state
    actor, data = _trainer(tmp_path, "runtime.staleness=0", restored=False)
    actor.policy.version = 2
    save_trainer_state(tmp_path, actor.policy, {})
    commit_checkpoint(tmp_path, 2, {"scheduler": {}})
    actor.policy.version = 0  # as a freshly started rank
    loop = asyncio.create_task(actor._data_loop())
    commit = _commit(step=2)
    data.inbox.put_nowait(commit)
    for _ in range(20):
        await asyncio.sleep(0)
    assert not actor.refused and not actor.pending  # not judged yet
    await actor.restore()
    while not data.inbox.empty():
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    loop.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await loop
    assert actor.policy.version == 2 and not actor.refused
    assert actor.pending[2] == [commit]


async def test_a_rank_whose_peer_alone_voted_to_stop_leaves_for_its_supervisor(tmp_path: Path) -> None:
    """Only the peer was stopped (its own SIGTERM): this rank's stop never comes, so after a
    heartbeat-miss period it leaves as "a trainer rank stopped" (not a drain: exit 1, so its
    supervisor restarts it). When the run's stop does come, its reason is kept (a drain)."""
    from digenrl.actors.base import DRAINED
    from digenrl.actors.resume import TRAINER_RANK_STOPPED
    alone, _ = _trainer(tmp_path, "runtime.heartbeat_s=0.01", "runtime.heartbeat_misses=2")
    await alone.resume.peer_voted_to_stop(3)
    assert alone.stop_reason == TRAINER_RANK_STOPPED and TRAINER_RANK_STOPPED not in DRAINED
    whole, _ = _trainer(tmp_path, "runtime.heartbeat_s=5")
    waiting = asyncio.create_task(whole.resume.peer_voted_to_stop(3))
    await asyncio.sleep(0)
    whole.request_stop("SIGTERM")  # the same stop reaches this rank a moment later
    await asyncio.wait_for(waiting, 1.0)
    assert whole.stop_reason == "SIGTERM"


async def test_a_sharded_drain_write_a_rank_never_joins_gives_up_and_marks_the_node_for_a_hard_exit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharded ranks write a drain checkpoint together, after the actor's run (no stop grace
    applies there). A rank killed meanwhile leaves the others in the collective write, in a
    thread nothing can interrupt: the write is given up after DRAIN_SAVE_TIMEOUT_S and the
    node is marked to exit hard (actors/node.py) instead of waiting for the group's timeout."""
    import threading

    import digenrl.actors.resume as resume
    release = threading.Event()
    monkeypatch.setattr(resume, "DRAIN_SAVE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(resume, "save_trainer_state", lambda *a, **k: release.wait(30))
    actor, _ = _trainer(tmp_path)
    actor.policy.sharded = True
    actor.resume.boundary = (actor.policy.version, {}, {})
    try:
        assert await asyncio.wait_for(actor.drain_checkpoint(), 5.0) is None  # the vote said no drain
        assert not actor.resume.drain_stuck
        actor.resume.drain_voted = True
        assert await asyncio.wait_for(actor.drain_checkpoint(), 5.0) is None
        assert actor.resume.drain_stuck
    finally:
        release.set()


def test_a_stopped_coordinator_waits_for_the_drain_parts_as_long_as_their_write_may_take() -> None:
    """A coordinator started by hand (digenrl-node) and stopped by a signal waits for the drain
    checkpoint's parts: a sharded write is bounded by DRAIN_SAVE_TIMEOUT_S, and the coordinator
    must not give up before the ranks do (it would leave their shards uncommitted). A launch
    has waited for its children to exit already and waits no more."""
    from digenrl.actors.resume import DRAIN_CHECKPOINT_WAIT_S, DRAIN_SAVE_TIMEOUT_S, drain_wait_s
    unsharded = load_config(None, ["model.path=\"random\""])
    sharded = load_config(None, ["model.path=\"random\"", "model.fsdp=true"])
    assert drain_wait_s(sharded, spawned_nodes=False) == DRAIN_SAVE_TIMEOUT_S
    assert drain_wait_s(unsharded, spawned_nodes=False) == DRAIN_CHECKPOINT_WAIT_S
    assert DRAIN_SAVE_TIMEOUT_S > DRAIN_CHECKPOINT_WAIT_S > 0
    assert drain_wait_s(sharded, spawned_nodes=True) == drain_wait_s(unsharded, spawned_nodes=True) == 0


async def test_an_unsharded_rank_0_writes_a_drain_checkpoint_only_after_a_signal(tmp_path: Path) -> None:
    """The drain checkpoint is of a stop someone asked for (a signal, or a coordinator stopped
    by one): a rank stopped by a failure or a rewind writes none, and none is written twice."""
    from digenrl.rl.checkpoint import capture_rng, trainer_part_ready
    actor, _ = _trainer(tmp_path)
    actor.policy.version = 3
    actor.resume.boundary = (3, capture_rng(), {})
    actor.request_stop("restart: trainer_lost: rank 1")
    assert await actor.drain_checkpoint() is None and not trainer_part_ready(tmp_path, 3)
    actor.stop_reason = "SIGTERM"
    assert await actor.drain_checkpoint() == 3 and trainer_part_ready(tmp_path, 3)
    assert await actor.drain_checkpoint() is None  # the boundary's part is there already


async def test_chunks_of_a_revoked_attempt_are_refused_at_arrival(tmp_path: Path) -> None:
    actor, data = _trainer(tmp_path)
    actor.revoked.add(5)
    t = plan_for_step(actor.cfg, 0)[0][0]
    await _feed(actor, data, [_chunk(t_index=t, task_id=5), _commit(task_id=5)])
    assert actor.refused == {"revoked": 1} and 5 not in actor.staged and not actor.pending


async def test_clean_samples_for_another_step_shape_or_revoked_attempt_are_refused_at_arrival(
        tmp_path: Path) -> None:
    # DiffusionNFT: a fragment's final latents are staged until its commit, so what can never
    # be trained (a trained step, a wrong batch, a revoked attempt) is refused on arrival
    actor, data = _trainer(tmp_path, "train.algorithm=nft", "runtime.fragments_per_step=1")
    actor.revoked.add(5)

    shape = actor.policy.model.latent_shape

    def clean(task_id: int, step: int = 0, n: int = 8, *latent: int) -> CleanSample:  # 2 prompts x 4
        return clean_sample(task_id, step, x0=torch.zeros(n, *(latent or shape)))

    actor.policy.version = 1
    await _feed(actor, data, [clean(1), clean(2, step=1, n=3), clean(3, 1, 8, *shape[:-1], shape[-1] + 1),
                              clean(5, step=1), clean(6, step=1), clean(7, step=9)])
    assert actor.refused == {"stale_chunk": 1, "bad_shape": 2, "revoked": 1, "step_out_of_window": 1}
    assert set(actor.staged) == {6}


async def test_clean_samples_are_staged_within_the_same_bounds_as_chunks(tmp_path: Path) -> None:
    # a flood of clean samples (forward-process fragments) is charged like chunks: two attempts
    # of a slot at most, and bytes within the byte window plus one fragment
    actor, data = _trainer(tmp_path, "train.algorithm=nft", "runtime.fragments_per_step=1",
                           "runtime.byte_window_mb=0.1")
    x0 = torch.zeros(8, *actor.policy.model.latent_shape)  # 2 prompts x group 4, float32: 96 KiB
    window = int(0.1 * 2**20)
    assert 2 * x0.nbytes <= window + x0.nbytes < 3 * x0.nbytes  # room for two, not three

    def clean(task_id: int, step: int) -> CleanSample:
        return clean_sample(task_id, step, x0=x0)

    await _feed(actor, data, [*(clean(100 + i, 0) for i in range(10)), clean(200, 1)])
    assert actor.refused == {"too_many_attempts_of_a_slot": 8, "staging_over_the_byte_window": 1}
    assert set(actor.staged) == {100, 101} and actor.staged_bytes == 2 * x0.nbytes
    for task in list(actor.staged):  # unstaging gives every byte back
        actor._unstage(task)
    assert actor.staged_bytes == 0 and not actor.staged and not actor._staged_slot


# ----------------------------------------------------------------------------- the coordinator


async def test_identity_is_bound_at_hello_and_spoofed_reports_are_dropped_and_counted(tmp_path: Path) -> None:
    import zmq.asyncio

    from digenrl.transport.protocol import Heartbeat, Samples, Welcome
    from digenrl.transport.sockets import Dealer
    from tests.conftest import wait_until_async
    from tests.test_security import config, start_coordinator

    cfg = config("runtime.heartbeat_s=0.2", "runtime.heartbeat_misses=100")
    ctx = zmq.asyncio.Context()
    actor = start_coordinator(ctx, cfg, tmp_path)
    ep = actor.control.endpoint
    socks = {name: Dealer(ctx, identity=name.encode()) for name in ("trainer-0", "evil", "rollout-7")}
    for s in socks.values():
        s.connect(ep)
    thief = Dealer(ctx, identity=b"trainer-0")  # the live trainer's routing id, a second connection

    try:
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(actor.run())
            await socks["trainer-0"].send(hostile.hello("trainer-0"))
            _, welcome = await asyncio.wait_for(socks["trainer-0"].recv(), 30)
            assert isinstance(welcome, Welcome)
            thief.connect(ep)
            # regression: a routing id trainer-0 announcing version 10**6 killed the coordinator
            await thief.send(hostile.future_announce())
            await socks["evil"].send(hostile.heartbeat("trainer-0"))                      # before any Hello
            await socks["evil"].send(hostile.hello("trainer-0"))                          # another routing id
            await socks["trainer-0"].send(hostile.hello("trainer-0"))                     # the live incarnation again
            await socks["trainer-0"].send(hostile.heartbeat("rollout-0"))                 # claims another id
            await socks["trainer-0"].send(hostile.heartbeat("trainer-0", incarnation=9))  # not its incarnation
            # regression: 20 StepDones for steps 1000-1019 added rows to metrics.jsonl
            await socks["trainer-0"].send(hostile.future_step_done())
            await socks["trainer-0"].send(hostile.consumed(rank=3, trained=4))
            await socks["rollout-7"].send(hostile.hello("rollout-7", "rollout"))
            await socks["rollout-7"].send(hostile.step_done())  # not a trainer
            grid = torch.zeros(2, 2, 3, dtype=torch.uint8)  # sample grids: from trainer rank 0, within the run
            await socks["rollout-7"].send(Samples(step=0, kind="train", grid=grid, prompt_ids=[], caption=""))
            await socks["trainer-0"].send(Samples(step=10**6, kind="eval", grid=grid, prompt_ids=[], caption=""))
            # regression: stats.busy_s a string (refused by the schema, counted as a bad frame)
            await socks["trainer-0"].send(hostile.bad_stats_heartbeat())
            await wait_until_async(lambda: actor.refused.total() >= 10, "the refusals", 30)
            await wait_until_async(lambda: actor.control.statistics().bad_by_reason.get("invalid") == 1,
                             "the schema's refusal", 30)
            await socks["trainer-0"].send(hostile.heartbeat())  # the real trainer is still answered
            _, answer = await asyncio.wait_for(socks["trainer-0"].recv(), 30)
            assert isinstance(answer, Heartbeat)
            run.cancel()
        assert actor.refused == {"before_hello": 1, "hello_id_not_routing_id": 1,
                                 "hello_of_a_live_incarnation": 1, "claims_another_id": 1,
                                 "another_incarnation": 1, "step_outside_the_run": 2,
                                 "not_its_rank": 1, "not_a_trainer": 2}
        # the thief's VersionAnnounce never reached the actor: ZeroMQ keeps the live connection
        assert actor.latest_announce is None and actor.sched.ledger.version == 0
        assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()
    finally:
        for s in (*socks.values(), thief, actor.control, actor.pub):
            s.close()
        actor.metrics.close()
        ctx.term()


async def test_the_pub_socket_neither_keeps_big_subscriptions_nor_queues_small_ones(tmp_path: Path) -> None:
    # regression: 20 subscription messages of 8 MiB took the coordinator from 384 MB to 4.9 GB
    import subprocess
    import sys

    import zmq.asyncio

    from digenrl.actors.node import rss_mb
    from digenrl.transport.protocol import Shutdown
    from digenrl.transport.sockets import Pub, Sub

    ctx = zmq.asyncio.Context()
    pub = Pub(ctx)
    ep = pub.bind("tcp://127.0.0.1:*")
    drain = asyncio.create_task(pub.drain_subscriptions())
    sub = Sub(ctx)
    sub.connect(ep)
    # the attacker in its own process: libzmq 4.3.5's XSUB itself crashes closing such a socket
    attack = (f"import zmq, time; c = zmq.Context(); s = c.socket(zmq.XSUB); s.connect({ep!r})\n"
              "for i in range(20): s.send(b'\\x01' + b'x' * (8 << 20))\n"
              "for i in range(5000): s.send(b'\\x01' + str(i).encode())\n"
              "time.sleep(1.5)\nprint('sent', flush=True)\nimport os; os._exit(0)")
    try:
        before = rss_mb()
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", attack], capture_output=True,
                                       text=True, timeout=120)
        assert done.stdout.strip() == "sent", done.stderr[-2000:]
        grown = rss_mb() - before
        assert grown < 64, f"the PUB's process grew {grown:.0f} MiB"  # 160 MiB if they were kept
        for _ in range(200):  # the PUB still serves an honest subscriber (the SUB joins late)
            await pub.send(Shutdown(reason="done"))
            with contextlib.suppress(TimeoutError):
                _, msg = await asyncio.wait_for(sub.recv(), 0.05)
                assert isinstance(msg, Shutdown)
                break
        else:
            raise AssertionError("the subscriber never heard the PUB")
    finally:
        drain.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drain
        for s in (pub, sub):
            s.close()
        ctx.term()


async def test_staging_is_bounded_by_the_byte_window_and_attempts_per_slot(tmp_path: Path) -> None:
    # regression: 300 chunks (600 MiB) for never-assigned tasks grew the trainer by 620 MB
    actor, data = _trainer(tmp_path, "runtime.byte_window_mb=1")
    t = plan_for_step(actor.cfg, 0)[0][0]
    big = torch.zeros(4, 64, 256)  # 256 KiB a tensor: 512 KiB a chunk
    flood = [hostile.chunk(100 + i, t_index=t, x_t=big, sigma=1.0, sigma_next=0.5) for i in range(300)]
    trained = plan_for_step(actor.cfg, 0)[0]
    full = [hostile.chunk(100 + i, t_index=tt, x_t=big, sigma=1.0, sigma_next=0.5)
            for i in range(2) for tt in trained]  # two whole attempts: over the 1 MiB window
    commits = [_commit(task_id=500 + i, fragment=0) for i in range(10)]
    await _feed(actor, data, [*flood, *full, *commits])
    chunk = 2 * big.nbytes + 16
    assert actor.staged_bytes <= (1 << 20) + chunk * len(trained)  # the window plus one fragment
    assert actor.refused["staging_over_the_byte_window"] >= 1
    assert len(actor._staged_slot) == 2 and actor.refused["too_many_attempts_of_a_slot"] == 298
    assert len(actor.pending[0]) == 2 and actor.refused["too_many_commits_of_a_slot"] == 8
    for task in list(actor.staged):  # unstaging gives every byte back
        actor._unstage(task)
    assert actor.staged_bytes == 0
