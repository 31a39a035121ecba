"""The trainer-rank layout of sequence parallelism (``train.sequence_parallel = N``): groups of
N consecutive ranks, planned over as one rank each (TSP x data parallelism over the groups),
each owner a group's leader; and the group's commit order."""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest

from digenrl.actors.trainer import TrainerActor
from digenrl.core.plan import owners_for
from digenrl.rl.sharding import pass_count, step_passes
from tests.factories import tiny_config


@pytest.mark.parametrize(("ranks", "sp", "tsp", "fragments"), [
    (2, 2, True, 1), (4, 2, True, 1), (4, 2, True, 2), (4, 2, False, 4), (8, 4, True, 2), (6, 3, False, 3),
])
def test_owners_are_the_leaders_of_the_groups_planned_as_single_ranks(ranks: int, sp: int, tsp: bool,
                                                                      fragments: int) -> None:
    trained = [0, 1, 2, 3]
    for f in range(fragments):
        got = owners_for(trained, ranks, tsp, f, fragments, sp)
        assert got == tuple(sp * o for o in owners_for(trained, ranks // sp, tsp, f, fragments))
        assert all(o % sp == 0 for o in got)
        for r in range(ranks):  # a follower runs its leader's passes, pass for pass
            assert pass_count(trained, ranks, tsp, f, fragments, r, sp) == \
                pass_count(trained, ranks, tsp, f, fragments, r - r % sp, sp)
    assert step_passes(trained, ranks, tsp, fragments, sp) == step_passes(trained, ranks // sp, tsp, fragments)


def test_four_ranks_in_two_groups_split_a_fragments_timesteps_between_the_groups() -> None:
    # TSP over two groups of two: group 0 (ranks 0, 1) trains t0, t1; group 1 (ranks 2, 3) t2, t3
    assert owners_for([0, 1, 2, 3], 4, True, 0, 1, 2) == (0, 0, 2, 2)
    assert [pass_count([0, 1, 2, 3], 4, True, 0, 1, r, 2) for r in range(4)] == [2, 2, 2, 2]


def test_a_group_takes_its_commits_in_fragment_order_whatever_order_they_arrived_in() -> None:
    cfg = tiny_config("runtime.fragments_per_step=2", "train.prompts_per_step=2", "cluster.trainers=2",
                      "train.sequence_parallel=2")
    c0, c1 = SimpleNamespace(fragment=0), SimpleNamespace(fragment=1)
    me = SimpleNamespace(sp=2, cfg=cfg, pending=defaultdict(list, {0: [c1]}), consumed_slots=defaultdict(set))
    assert TrainerActor._ready(me, 0) == []        # fragment 1 waits for fragment 0
    assert me.pending[0] == [c1]
    me.pending[0].append(c0)
    assert TrainerActor._ready(me, 0) == [c0, c1]  # then both, in order
    me.sp = 1
    me.pending[0] = [c1]
    assert TrainerActor._ready(me, 0) == [c1]      # without SP: as they came
