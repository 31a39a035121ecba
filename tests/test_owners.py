"""TSP x data parallelism: who trains which timestep of which fragment."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from digenrl.sched_plan import owners_for


def test_tsp_spreads_timesteps_over_ranks_contiguously() -> None:
    assert owners_for(list(range(8)), 2, True) == (0, 0, 0, 0, 1, 1, 1, 1)


def test_extra_ranks_train_other_fragments_instead_of_idling() -> None:
    # 2 trained timesteps, 4 ranks: two TSP groups of 2, fragments alternate between them
    assert owners_for([0, 1], 4, True, fragment=0) == (0, 1)
    assert owners_for([0, 1], 4, True, fragment=1) == (2, 3)
    assert owners_for([0, 1], 4, True, fragment=2) == (0, 1)


def test_without_tsp_each_fragment_is_trained_whole_by_one_rank() -> None:
    assert owners_for([0, 1, 2], 3, False, fragment=4) == (1, 1, 1)


@given(n=st.integers(1, 12), ranks=st.integers(1, 9), tsp=st.booleans(), frag=st.integers(0, 20))
def test_owners_are_valid_ranks_and_balanced_within_a_fragment(n: int, ranks: int, tsp: bool,
                                                              frag: int) -> None:
    owners = owners_for(list(range(n)), ranks, tsp, frag)
    assert len(owners) == n and all(0 <= r < ranks for r in owners)
    counts = [owners.count(r) for r in set(owners)]
    assert max(counts) - min(counts) <= 1
    assert list(owners) == sorted(owners)  # contiguous blocks of timesteps


@given(n=st.integers(1, 8), ranks=st.integers(2, 8), frags=st.integers(1, 8))
def test_every_rank_gets_work_when_fragments_and_timesteps_suffice(n: int, ranks: int,
                                                                   frags: int) -> None:
    g = min(ranks, n)
    used = {r for f in range(frags) for r in owners_for(list(range(n)), ranks, True, f)}
    assert len(used) == g * min(frags, ranks // g)
