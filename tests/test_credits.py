"""The credit ledger: admission by version, the byte window, attempts and exactly-once counts."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from digenrl.core.credits import CreditError, CreditLedger, untrainable_version


def ledger(**kw: int) -> CreditLedger:
    args = dict(steps=4, prompts_per_step=4, group_size=2, fragments_per_step=2, staleness=1,
                byte_window=10**9, bytes_per_trajectory=10)
    args.update(kw)
    return CreditLedger(**args)


def admit_all(led: CreditLedger, node: str = "r0", now: float = 0.0) -> list:
    out = []
    while led.peek() is not None:
        out.append(led.admit(node, now))
    return out


def balanced(led: CreditLedger) -> bool:
    s = led.statistics()
    return s["admitted"] == s["trained"] + sum(s["discarded"].values()) + s["in_flight"]


def test_staleness_one_admits_two_steps_ahead_of_version_zero_then_blocks():
    led = ledger(staleness=1)
    got = admit_all(led)
    assert [a.slot for a in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert led.blocked_by() == "staleness"
    assert led.publish(1) is True
    assert [a.slot for a in admit_all(led)] == [(2, 0), (2, 1)]


def test_staleness_zero_admits_only_the_step_being_trained():
    led = ledger(staleness=0)
    assert [a.step for a in admit_all(led)] == [0, 0]
    assert led.blocked_by() == "staleness"


def test_every_admitted_trajectory_number_is_below_the_absolute_limit():
    led = ledger(staleness=1, steps=6)
    for v in range(0, 4):
        led.publish(v)
        for a in admit_all(led):
            last = led.sequence_number(a.step, a.fragment, a.trajectories - 1)
            assert last < (led.version + led.staleness + 1) * led.batch_size


def test_duplicate_and_older_publishes_are_harmless():
    led = ledger()
    assert led.publish(2) is True
    assert led.publish(2) is False
    assert led.publish(1) is False
    assert led.version == 2
    with pytest.raises(CreditError, match="version = 5"):
        led.publish(5)


def test_byte_window_holds_until_consumed_not_when_committed():
    led = ledger(byte_window=2 * 40)  # two fragments of 4 trajectories x 10 bytes
    a, _ = admit_all(led)
    assert led.blocked_by() == "bytes"
    led.commit(a.task_id, 0, 1.0)
    assert led.peek() is None  # a commit does not return bytes
    assert led.consume(a.task_id, trained=4) == "ok"
    assert led.bytes_in_flight == 40
    assert led.peek() == (1, 0)


def test_fragment_larger_than_the_window_is_admitted_when_nothing_is_in_flight():
    led = ledger(byte_window=1)
    (a,) = admit_all(led)
    assert led.bytes_in_flight == 40 and led.blocked_by() == "bytes"
    led.commit(a.task_id, 0, 0.0)
    led.consume(a.task_id, trained=4)
    assert led.peek() == (0, 1)


def test_requeued_earlier_step_fits_in_the_room_its_discard_freed():
    led = ledger(byte_window=2 * 40)
    a, b = admit_all(led)  # (0, 0), (0, 1): the window is full
    led.commit(a.task_id, 0, 0.0)
    led.consume(a.task_id, trained=4)
    c = led.admit("r1", 0.0)
    assert c.slot == (1, 0)
    led.commit(c.task_id, 0, 0.0)  # waits at the trainer for step 0 to finish
    led.discard(b.task_id, "node_lost")
    assert led.peek() == (0, 1)


def test_discarded_attempt_requeues_the_same_slot_under_a_new_task_id():
    led = ledger()
    first = led.admit("r0", 0.0)
    assert led.discard(first.task_id, "node_lost") is first
    assert led.bytes_in_flight == 0
    again = led.admit("r1", 1.0)
    assert again.slot == first.slot and again.task_id > first.task_id
    assert led.statistics()["discarded"] == {"node_lost": 4}
    assert balanced(led)


def test_zombie_commit_and_consume_are_ignored_and_counted():
    led = ledger()
    dead = led.admit("r0", 0.0)
    led.discard(dead.task_id, "lease_expired")
    assert led.commit(dead.task_id, 0, 2.0) == "zombie"
    assert led.consume(dead.task_id, trained=4) == "zombie"
    stats = led.statistics()
    assert (stats["zombie_commits"], stats["zombie_consumes"], stats["trained"]) == (1, 1, 0)


def test_second_commit_of_a_live_attempt_is_a_counted_duplicate():
    led = ledger()
    a = led.admit("r0", 0.0)
    assert led.commit(a.task_id, 0, 1.0) == "ok"
    assert led.commit(a.task_id, 0, 2.0) == "duplicate"
    assert led.attempt(a.task_id).committed_at == 1.0
    assert led.statistics()["duplicate_commits"] == 1


def test_commit_with_a_too_old_version_is_discarded_as_stale_and_requeued():
    led = ledger(staleness=1)
    led.publish(2)
    a = led.admit("r0", 0.0)
    assert a.step == 0
    led.discard(a.task_id, "node_lost")
    led.publish(3)
    admit_all(led)
    late = next(x for x in led.live_attempts() if x.step == 3)
    assert led.commit(late.task_id, 1, 1.0) == "stale"  # 3 - 1 > K
    assert led.attempt(late.task_id) is None
    assert (3, late.fragment) in led.pending_slots()
    assert led.statistics()["stale_commits"] == 1


def test_a_commit_naming_an_unpublished_version_is_rejected_alone():
    led = ledger()
    a = led.admit("r0", 0.0)
    assert led.commit(a.task_id, 1, 0.0) == "rejected"  # version 1 does not exist yet
    assert led.commit(a.task_id, -1, 0.0) == "rejected"
    assert led.attempt(a.task_id) is a and not a.committed  # the honest attempt lives on
    assert led.commit(a.task_id, 0, 1.0) == "ok"
    stats = led.statistics()
    assert stats["rejected_commits"] == 2 and stats["stale_commits"] == 0 and stats["discarded"] == {}


def test_a_commit_whose_slot_is_not_the_attempts_is_rejected_alone_never_discarding_honest_work():
    # regression: a Commit with fragment = 99 (one fragment per step) cascaded into 880 discards
    led = ledger(prompts_per_step=2, fragments_per_step=1, steps=3)
    a = led.admit("r0", 0.0)
    assert led.commit(a.task_id, 0, 0.5, step=0, fragment=99) == "rejected"
    assert led.commit(a.task_id, 0, 0.5, step=2, fragment=0) == "rejected"
    assert led.attempt(a.task_id) is a and not a.committed
    assert led.commit(a.task_id, 0, 1.0, step=0, fragment=0) == "ok"
    assert led.consume(a.task_id, trained=4, step=0, fragment=0) == "ok"
    stats = led.statistics()
    assert (stats["trained"], stats["discarded"], stats["rejected_commits"]) == (4, {}, 2)
    assert balanced(led)


def test_a_consume_that_cannot_be_the_tasks_is_refused_and_changes_nothing():
    # regression: a spoofed Consumed with trained = 2**63-1 was believed
    led = ledger()
    a = led.admit("r0", 0.0)
    led.commit(a.task_id, 0, 0.0)
    before = led.statistics()
    with pytest.raises(CreditError, match="expected the fragment size 4"):
        led.consume(a.task_id, trained=2**63 - 1)
    with pytest.raises(CreditError, match="never issued"):
        led.consume(10**6, trained=4)  # a zombie-looking id that was never handed out
    with pytest.raises(CreditError, match=r"expected its slot \(0, 0\)"):
        led.consume(a.task_id, trained=4, step=0, fragment=1)
    assert led.statistics() == before


def test_consume_whose_counts_do_not_add_up_is_rejected_with_the_numbers():
    led = ledger()
    a = led.admit("r0", 0.0)
    led.commit(a.task_id, 0, 0.0)
    with pytest.raises(CreditError, match=r"trained 3 \+ discarded 0 = 3: expected the fragment size 4"):
        led.consume(a.task_id, trained=3)
    with pytest.raises(CreditError, match="non-negative"):
        led.consume(a.task_id, trained=6, discarded={"zero_advantage": -2})


def test_consume_splits_trained_and_zero_advantage_counts():
    led = ledger()
    a = led.admit("r0", 0.0)
    led.commit(a.task_id, 0, 0.0)
    led.consume(a.task_id, trained=2, discarded={"zero_advantage": 2})
    stats = led.statistics()
    assert stats["trained"] == 2 and stats["discarded"] == {"zero_advantage": 2}
    assert led.step_consumed(0) == 1 and led.is_consumed(0, 0)


def test_invalid_shape_names_the_field():
    with pytest.raises(CreditError, match="fragments_per_step = 3"):
        ledger(fragments_per_step=3)
    with pytest.raises(CreditError, match="staleness = -1"):
        ledger(staleness=-1)


def test_snapshot_discards_in_flight_as_restart_and_restore_requeues_them():
    led = ledger()
    a, b, *_ = admit_all(led)
    led.commit(a.task_id, 0, 0.0)
    led.consume(a.task_id, trained=4)
    led.commit(b.task_id, 0, 0.0)
    snap = msgpack.unpackb(msgpack.packb(led.snapshot()), strict_map_key=False)
    fresh = ledger()
    fresh.restore(snap)
    stats = fresh.statistics()
    assert stats["discarded"] == {"restart": 12} and stats["in_flight"] == 0
    assert balanced(fresh)
    assert fresh.pending_slots()[:3] == [(0, 1), (1, 0), (1, 1)]
    assert fresh.admit("r0", 0.0).task_id > 4  # fencing survives the restart


def test_restore_into_a_different_shape_is_rejected():
    snap = ledger().snapshot()
    with pytest.raises(CreditError, match="shape"):
        ledger(group_size=3).restore(snap)


def test_restore_into_a_longer_run_continues_it_and_a_shorter_one_than_trained_is_refused():
    led = ledger(steps=4)
    for v in range(3):  # train steps 0-2
        for a in admit_all(led):
            if a.step == v:
                led.commit(a.task_id, v, 0.0)
                led.consume(a.task_id, trained=4)
        led.publish(v + 1)
    snap = led.snapshot()
    longer = ledger(steps=6)
    longer.restore(snap)
    assert longer.version == 3 and not longer.done and (5, 1) in longer.pending_slots()
    with pytest.raises(CreditError, match="beyond steps = 2"):
        ledger(steps=2).restore(snap)


# ----------------------------------------------------------------------------- state machine


NODES = ("r0", "r1", "r2")


class LedgerMachine(RuleBasedStateMachine):
    """Random admits, commits, consumes, publishes, losses, expiries and late events.

    The model plays a correct rollout (generates with a version in [floor, v]) and a
    trainer that trains step v only and publishes v+1 once all of step v is consumed.
    """

    @initialize(steps=st.integers(1, 6), fragments=st.sampled_from([1, 2, 4]),
                group=st.integers(2, 3), k=st.sampled_from([0, 1, 2, 4]), window_frags=st.integers(0, 4),
                bpt=st.integers(1, 5))
    def setup(self, steps, fragments, group, k, window_frags, bpt):
        self.led = CreditLedger(steps=steps, prompts_per_step=4, group_size=group,
                                fragments_per_step=fragments, staleness=k,
                                byte_window=max(1, window_frags * (4 // fragments) * group * bpt),
                                bytes_per_trajectory=bpt)
        self.now = 0.0
        self.dead: list[int] = []
        self.trained_slots: set[tuple[int, int]] = set()

    def live(self, committed: bool | None = None) -> list:
        return [a for a in self.led.live_attempts() if committed is None or a.committed == committed]

    @precondition(lambda self: self.led.peek() is not None)
    @rule(node=st.sampled_from(NODES))
    def admit(self, node):
        a = self.led.admit(node, self.now)
        assert a.step <= self.led.version + self.led.staleness

    @precondition(lambda self: self.live(committed=False))
    @rule(data=st.data())
    def commit(self, data):
        a = data.draw(st.sampled_from(self.live(committed=False)))
        floor = max(0, a.step - self.led.staleness)
        version = data.draw(st.integers(floor, max(floor, self.led.version)))
        assert self.led.commit(a.task_id, version, self.now) == "ok"

    def ready(self) -> list:
        return [a for a in self.live(committed=True) if a.step == self.led.version]

    @precondition(lambda self: self.ready())
    @rule(data=st.data(), zero=st.integers(0, 4))
    def consume(self, data, zero):
        a = data.draw(st.sampled_from(self.ready()))
        zero = min(zero, a.trajectories)
        assert a.slot not in self.trained_slots
        self.trained_slots.add(a.slot)
        self.led.consume(a.task_id, a.trajectories - zero, {"zero_advantage": zero})
        self.dead.append(a.task_id)

    def uncommitted_ready(self) -> list:
        return [a for a in self.live(committed=False) if a.step == self.led.version]

    @precondition(lambda self: self.uncommitted_ready())
    @rule(data=st.data())
    def consume_overtaking_its_commit(self, data):
        """The trainer's report arrives before the rollout's commit: it dates the trajectories."""
        a = data.draw(st.sampled_from(self.uncommitted_ready()))
        floor = max(0, a.step - self.led.staleness)
        version = data.draw(st.integers(floor, max(floor, self.led.version)))
        assert a.slot not in self.trained_slots
        self.trained_slots.add(a.slot)
        self.led.consume(a.task_id, a.trajectories, gen_version=version)
        self.dead.append(a.task_id)

    @precondition(lambda self: self.led.version > 0)
    @rule(data=st.data())
    def report_a_finished_step(self, data):
        step = data.draw(st.integers(0, self.led.version - 1))
        hist = self.led.pop_trained_staleness(step)
        assert all(0 <= k <= self.led.staleness for k in hist)

    @precondition(lambda self: not self.led.done
                  and self.led.step_consumed(self.led.version) == self.led.fragments_per_step)
    @rule()
    def publish_next(self):
        assert self.led.publish(self.led.version + 1)

    @rule(back=st.integers(0, 3))
    def publish_duplicate_or_older(self, back):
        assert self.led.publish(max(0, self.led.version - back)) is False

    @rule(node=st.sampled_from(NODES))
    def lose_node(self, node):
        for a in self.live(committed=False):
            if a.node_id == node:
                self.led.discard(a.task_id, "node_lost")
                self.dead.append(a.task_id)

    @precondition(lambda self: self.live(committed=False))
    @rule(data=st.data())
    def expire_lease(self, data):
        a = data.draw(st.sampled_from(self.live(committed=False)))
        self.led.discard(a.task_id, "lease_expired")
        self.dead.append(a.task_id)

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def zombie_events(self, data):
        task = data.draw(st.sampled_from(self.dead))
        before = self.led.statistics()
        assert self.led.commit(task, self.led.version, self.now) == "zombie"
        assert self.led.consume(task, trained=self.led.fragment_size) == "zombie"
        with pytest.raises(CreditError):  # a zombie's counts are checked all the same
            self.led.consume(task, trained=self.led.fragment_size + 1)
        after = self.led.statistics()
        assert after["trained"] == before["trained"]
        assert after["zombie_commits"] == before["zombie_commits"] + 1

    @rule(dt=st.floats(0.0, 5.0))
    def advance(self, dt):
        self.now += dt

    @invariant()
    def live_attempts_respect_the_admission_limit(self):
        for a in self.led.live_attempts():
            assert a.step <= self.led.version + self.led.staleness

    @invariant()
    def counts_add_up(self):
        assert balanced(self.led)

    @invariant()
    def nothing_trained_stale(self):
        s = self.led.statistics()
        assert s["max_trained_staleness"] <= self.led.staleness
        assert s["stale_commits"] == 0

    @invariant()
    def every_trained_trajectory_is_dated_once_within_the_bound(self):
        hist = self.led.trained_staleness()
        assert all(0 <= k <= self.led.staleness for k in hist)
        assert sum(hist.values()) + self.led.statistics()["reported_trained"] == \
            self.led.statistics()["trained"]

    @invariant()
    def bytes_stay_in_the_window_except_for_a_lone_fragment(self):
        led = self.led
        assert led.bytes_in_flight == sum(a.nbytes for a in led.live_attempts())
        assert led.bytes_in_flight <= max(led.byte_window, led.fragment_bytes)
        if led.bytes_in_flight > led.byte_window:
            assert len(led.live_attempts()) == 1

    def teardown(self):
        if not hasattr(self, "led"):
            return
        led = self.led
        for _ in range(10 * led.steps * led.fragments_per_step + 10):
            if led.done:
                break
            while led.peek() is not None:
                led.admit("r0", self.now)
            for a in self.live(committed=False):
                led.commit(a.task_id, led.version, self.now)
            for a in self.live(committed=True):
                if a.step == led.version:
                    assert a.slot not in self.trained_slots
                    self.trained_slots.add(a.slot)
                    led.consume(a.task_id, a.trajectories)
            if led.step_consumed(led.version) == led.fragments_per_step:
                led.publish(led.version + 1)
        stats = led.statistics()
        assert led.done, stats
        assert stats["in_flight"] == 0 and balanced(led)
        assert len(self.trained_slots) == led.steps * led.fragments_per_step


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=120, stateful_step_count=50, deadline=None,
                                      derandomize=True, database=None,
                                      suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_staleness_k_admits_exactly_k_steps_ahead_and_dates_what_it_trains(k):
    led = ledger(staleness=k, steps=8, fragments_per_step=1, prompts_per_step=2)
    got = admit_all(led)
    assert [a.step for a in got] == list(range(k + 1))  # steps 0..K with version 0
    assert led.blocked_by() == "staleness"
    for v in range(8):
        for a in [x for x in led.live_attempts() if x.step == v]:
            gen = max(0, a.step - k)  # the stalest a correct rollout may be
            assert led.commit(a.task_id, gen, 0.0) == "ok"
            led.consume(a.task_id, trained=a.trajectories)
        assert led.pop_trained_staleness(v) == {v - max(0, v - k): led.batch_size}
        led.publish(v + 1)
        admit_all(led)
        assert all(a.step <= led.version + k for a in led.live_attempts())
    s = led.statistics()
    assert s["trained"] == s["reported_trained"] == 8 * led.batch_size
    assert s["max_trained_staleness"] == k


def test_a_consume_that_overtakes_its_commit_must_say_which_version_generated_it():
    led = ledger(staleness=1)
    a = led.admit("r0", 0.0)
    with pytest.raises(CreditError, match="generated by version None"):
        led.consume(a.task_id, trained=4)
    assert led.consume(a.task_id, trained=4, gen_version=0) == "ok"
    assert led.trained_staleness(0) == {0: 4}


def test_a_snapshot_keeps_the_staleness_of_steps_not_yet_reported():
    led = ledger(staleness=1)
    a, b, c, *_ = admit_all(led)
    for x, gen in ((a, 0), (b, 0)):
        led.commit(x.task_id, gen, 0.0)
        led.consume(x.task_id, trained=4)
    led.publish(1)
    led.commit(c.task_id, 0, 0.0)
    led.consume(c.task_id, trained=3, discarded={"zero_advantage": 1})
    assert led.pop_trained_staleness(0) == {0: 8}
    fresh = ledger(staleness=1)
    fresh.restore(msgpack.unpackb(msgpack.packb(led.snapshot()), strict_map_key=False))
    assert fresh.trained_staleness(1) == {1: 3}
    assert fresh.statistics()["reported_trained"] + 3 == fresh.statistics()["trained"] == 11


def test_the_trained_version_window_is_step_minus_k_to_step_and_names_both_ends():
    assert [untrainable_version(5, v, 2) for v in (3, 4, 5)] == [None, None, None]
    for bad in (2, 6, None, True, 4.0):
        assert untrainable_version(5, bad, 2) == f"generated by version {bad!r}: expected a version in [3, 5]"
