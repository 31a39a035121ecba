"""TSP x data parallelism: who trains which timestep of which fragment."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from digenrl.core.plan import owners_for


def test_tsp_spreads_timesteps_over_ranks_contiguously() -> None:
    assert owners_for(list(range(8)), 2, True) == (0, 0, 0, 0, 1, 1, 1, 1)


def test_extra_ranks_train_other_fragments_instead_of_idling() -> None:
    # 2 trained timesteps, 4 ranks, 2 fragments: two TSP groups of 2, one fragment each
    assert owners_for([0, 1], 4, True, fragment=0, fragments=2) == (0, 1)
    assert owners_for([0, 1], 4, True, fragment=1, fragments=2) == (2, 3)
    # 4 fragments: two groups of 2 tie with four groups of 1 (2 units each); the wider wins
    assert [owners_for([0, 1], 4, True, f, 4) for f in range(4)] == [(0, 1), (2, 3), (0, 1), (2, 3)]


def test_one_fragment_per_step_keeps_every_timestep_on_its_own_rank() -> None:
    assert owners_for(list(range(10)), 16, True, 0, 1) == tuple(range(10))
    # 10 timesteps, 16 ranks, 16 fragments: one group of 10 would take 16 x 1 units, eight
    # groups of 2 take 2 x 5 = 10; none of the 16 ranks idles
    used = {r for f in range(16) for r in owners_for(list(range(10)), 16, True, f, 16)}
    assert used == set(range(16))


def test_without_tsp_each_fragment_is_trained_whole_by_one_rank() -> None:
    assert owners_for([0, 1, 2], 3, False, fragment=4) == (1, 1, 1)


@given(n=st.integers(1, 12), ranks=st.integers(1, 9), tsp=st.booleans(), frag=st.integers(0, 20),
       frags=st.integers(1, 8))
def test_owners_are_valid_ranks_and_balanced_within_a_fragment(n: int, ranks: int, tsp: bool,
                                                              frag: int, frags: int) -> None:
    owners = owners_for(list(range(n)), ranks, tsp, frag, frags)
    assert len(owners) == n and all(0 <= r < ranks for r in owners)
    counts = [owners.count(r) for r in set(owners)]
    assert max(counts) - min(counts) <= 1
    assert list(owners) == sorted(owners)  # contiguous blocks of timesteps


@given(n=st.integers(1, 8), ranks=st.integers(2, 8), frags=st.integers(1, 8))
def test_no_split_of_the_ranks_trains_a_step_faster(n: int, ranks: int, frags: int) -> None:
    def step_time(owner_sets: list[tuple[int, ...]]) -> float:
        load = [0] * ranks  # timestep-trainings per rank over the step's fragments
        for owners in owner_sets:
            for r in owners:
                load[r] += 1
        return max(load)
    ours = step_time([owners_for(list(range(n)), ranks, True, f, frags) for f in range(frags)])
    pure_tsp = step_time([owners_for(list(range(n)), min(ranks, n), True, 0, 1)] * frags)
    pure_dp = step_time([owners_for(list(range(n)), ranks, False, f, frags) for f in range(frags)])
    assert ours <= min(pure_tsp, pure_dp)
