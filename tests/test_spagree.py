"""The ranks of a sequence-parallel group agree on the attempt they train for a slot
(digenrl.actors.spagree): the verdicts, and two trainer ranks of a real gloo group replaying
the Revoke race (a Revoke that reaches one rank before an attempt's commit and the other rank
after it)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from digenrl.actors.spagree import DROP, TRAIN, WAIT, decide


@pytest.mark.parametrize(("mine", "round_", "verdict"), [
    (5, [(0, 5, False), (0, 5, False)], TRAIN),                  # the same unrevoked attempt everywhere
    (5, [(0, 5, False), (0, 5, True)], DROP),                    # revoked on one rank: dropped on all
    (5, [(0, 5, True), (0, 5, False)], DROP),
    (5, [(0, 5, False), (0, 7, False)], DROP),                   # a newer attempt exists: 5 was revoked
    (7, [(0, 5, False), (0, 7, False)], WAIT),                   # keep 7 until the other rank holds it
    (7, [(0, 5, False), (0, 7, True)], DROP),                    # 7 is revoked too: 8 will come
    (7, [(0, 7, False), (0, 7, False), (0, 5, False), (0, 7, False)], WAIT),
])
def test_each_rank_reads_its_verdict_from_the_round(mine: int, round_: list, verdict: str) -> None:
    assert decide(mine, round_) == verdict


def test_a_round_of_different_slots_is_an_invariant_violation() -> None:
    with pytest.raises(AssertionError, match="different slots"):
        decide(5, [(0, 5, False), (1, 6, False)])


def _trainer_worker(rank: int, store: str, out: str) -> None:
    """A trainer rank of a two-rank sequence-parallel group (real TrainerActor, real gloo group,
    its control DEALER to a ROUTER standing in for the coordinator) consuming slot (0, 0) of
    the race: rank 0 holds attempt 5's commit, rank 1 saw 5's Revoke first and holds attempt
    7's. Both commits are discarded fragments (a failed reward worker), so consuming one runs
    no training pass: what the test reads is which attempt each rank consumes and reports."""
    import asyncio

    import structlog
    import zmq.asyncio

    from digenrl.actors.peers import NodePeers
    from digenrl.actors.trainer import TrainerActor
    from digenrl.config import load_config
    from digenrl.models.seqpar import SequenceParallel
    from digenrl.rl.policy import build_policy
    from digenrl.telemetry.trace import SpanRecorder
    from digenrl.transport.sockets import Dealer, Router
    from tests.factories import commit

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)

    async def consume() -> dict:
        ctx = zmq.asyncio.Context()
        with Router(ctx) as coordinator, Dealer(ctx, identity=f"trainer-{rank}".encode()) as control:
            control.connect(coordinator.bind("tcp://127.0.0.1:*"))
            cfg = load_config(None, ['model.path="random"', "cluster.trainers=2", "train.sequence_parallel=2",
                                     "runtime.fragments_per_step=2", "train.prompts_per_step=2",
                                     "train.group_size=2"])
            policy = build_policy(cfg)
            policy.model.sp = SequenceParallel(torch.distributed.group.WORLD)  # the group node.py fits
            actor = TrainerActor(peers=NodePeers(node_id=f"trainer-{rank}", incarnation=1, cfg=cfg, control=control),
                                 cfg=cfg, policy=policy, rank=rank, world_size=2, run_dir=Path(out),
                                 reward_fn=None, node_id=f"trainer-{rank}",
                                 recorder=SpanRecorder(f"trainer-{rank}", "trainer"), log=structlog.get_logger())
            mine = {0: commit(5, discard="reward_failed"), 1: commit(7, discard="reward_failed")}[rank]
            if rank == 1:
                actor.revoked.add(5)  # its Revoke came first (its commit was dropped on arrival)
            actor.pending[0].append(mine)
            await actor._consume_ready(0, actor._ready(0))
            after_first = sorted(actor.consumed_slots[0])
            if rank == 0:  # attempt 7's commit reaches rank 0 now
                actor.pending[0].append(commit(7, discard="reward_failed"))
            await actor._consume_ready(0, actor._ready(0))
            if rank == 1:
                actor.revoked.add(9)
            actor.pending[0].append(commit(9, fragment=1, discard="reward_failed"))
            await actor._consume_ready(0, actor._ready(0))
            reports = []
            if rank == 0:  # the leader reports the group's Consumed
                _, msg = await asyncio.wait_for(coordinator.recv(), 10)
                reports.append([msg.task_id, msg.discarded])
            return {"after_first": after_first, "consumed": sorted(actor.consumed_slots[0]),
                    "revoked": sorted(actor.revoked), "discarded": dict(actor.learner.stats.discarded),
                    "reports": reports}

    try:
        got = asyncio.run(consume())
        Path(out, f"trainer{rank}.json").write_text(json.dumps(got))
    finally:
        torch.distributed.destroy_process_group()


def test_trainer_ranks_of_a_group_consume_the_same_attempt_when_a_revoke_reaches_them_apart(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(_trainer_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"trainer{r}.json").read_text()) for r in (0, 1))
    # the first round leaves the slot open on both ranks (rank 0 drops 5, rank 1 waits with 7)
    assert r0["after_first"] == r1["after_first"] == []
    # then both consume attempt 7, each counting its 2 trajectories once; 5 and (revoked on
    # one rank) 9 are dropped on both, and slot (0, 1) stays open on both
    assert r0["consumed"] == r1["consumed"] == [0]
    assert r0["revoked"] == r1["revoked"] == [5, 9]
    assert r0["discarded"] == r1["discarded"] == {"reward_failed": 2}
    assert r0["reports"] == [[7, {"reward_failed": 2}]] and r1["reports"] == []
