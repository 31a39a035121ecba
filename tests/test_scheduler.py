"""The scheduler: admission timing, placement by speed, TAG/BTS, liveness, fencing, restarts."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import msgpack
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from digenrl.config import load_config, resolve_mode
from digenrl.core.bts import StepForecast, helper_shortens_step, predict_step_finish
from digenrl.core.scheduler import (
    AssignCmd,
    RevokeCmd,
    Scheduler,
    SchedulerError,
    SchedulerParams,
    ShutdownCmd,
)

BASE = SchedulerParams(steps=4, prompts_per_step=4, group_size=2, fragments_per_step=2,
                       staleness=1, trainer_ranks=1, tsp=True, tag="never", lease_s=100.0,
                       heartbeat_timeout=10.0, byte_window=10**9, bytes_per_trajectory=1,
                       num_steps_T=4, seed=7, prompt_count=10)


def make(**kw) -> Scheduler:
    return Scheduler(replace(BASE, **kw))


def assigns(cmds) -> list[AssignCmd]:
    return [c for c in cmds if isinstance(c, AssignCmd)]


def finish(s: Scheduler, cmd: AssignCmd, now: float, version: int | None = None,
           gen_seconds: float = 1.0) -> list:
    """Commit ``cmd`` and have every owning rank consume it; returns the commands emitted."""
    out = s.fragment_committed(cmd.task_id, cmd.node_id, s.ledger.version if version is None
                               else version, gen_seconds, now)
    for rank in sorted(set(cmd.owners) or {0}):
        out += s.fragment_consumed(cmd.task_id, rank, len(cmd.seeds), {}, 0.1, now)
    return out


class Sim:
    """Virtual clock: each node generates its queue FIFO at a true seconds-per-trajectory;
    the trainer consumes committed fragments of step v in order and publishes v + 1."""

    def __init__(self, s: Scheduler, spt: dict[str, float], offer: tuple[str, ...] = ()):
        self.s, self.spt, self.offer = s, spt, offer
        self.now = 0.0
        self.queue: dict[str, list[AssignCmd]] = {n: [] for n in spt}
        self.started: dict[str, float] = dict.fromkeys(spt, 0.0)
        self.buffer: list[AssignCmd] = []
        self.done = False
        self.count: dict[str, int] = dict.fromkeys(spt, 0)

    def feed(self, cmds) -> None:
        for c in cmds:
            if isinstance(c, AssignCmd):
                assert c.version_floor <= self.s.ledger.version
                if not self.queue[c.node_id]:
                    self.started[c.node_id] = self.now
                self.queue[c.node_id].append(c)
                self.count[c.node_id] += 1
            elif isinstance(c, ShutdownCmd):
                assert c.reason == "done"
                self.done = True

    def train(self) -> None:
        s = self.s
        for c in [c for c in self.buffer if c.step == s.ledger.version]:
            self.buffer.remove(c)
            for rank in sorted(set(c.owners)):
                self.feed(s.fragment_consumed(c.task_id, rank, len(c.seeds), {}, 0.0, self.now))
        if s.ledger.step_consumed(s.ledger.version) == s.ledger.fragments_per_step:
            self.feed(s.version_published(s.ledger.version + 1, self.now))

    def run(self, max_events: int = 10_000) -> None:
        for _ in range(max_events):
            if self.done:
                return
            for n in self.offer:
                if not self.queue[n]:
                    self.feed(self.s.tag_offer(n, self.now))
            busy = [n for n in self.queue if self.queue[n]]
            assert busy, f"deadlock at t={self.now}: {self.s.statistics()}"
            node = min(busy, key=lambda n: (self.started[n] + len(self.queue[n][0].seeds) * self.spt[n], n))
            cmd = self.queue[node].pop(0)
            self.now = self.started[node] + len(cmd.seeds) * self.spt[node]
            self.started[node] = self.now
            for n in self.spt:
                self.s.heartbeat(n, self.now)
            self.feed(self.s.fragment_committed(cmd.task_id, node, self.s.ledger.version,
                                                len(cmd.seeds) * self.spt[node], self.now))
            self.buffer.append(cmd)
            self.train()
        raise AssertionError("simulation did not finish")


# ----------------------------------------------------------------------------- admission


def test_at_k1_next_step_is_assigned_while_current_step_trains():
    s = make(staleness=1)
    a, b = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    assert (a.step, b.step) == (0, 0)
    cmds = finish(s, a, 1.0) + finish(s, b, 1.0)
    assert s.ledger.version == 0  # step 0 is now training; version 1 not yet published
    assert {c.step for c in assigns(cmds)} == {1}


def test_at_k0_next_step_waits_for_the_published_version():
    s = make(staleness=0)
    first = assigns(s.node_joined("r0", "rollout", "H100", 0.0) + s.node_joined("r1", "rollout", "H100", 0.0))
    assert [c.step for c in first] == [0, 0]  # r1 gets nothing: step 1 is not admissible
    assert assigns(finish(s, first[0], 1.0) + finish(s, first[1], 1.0)) == []
    later = assigns(s.version_published(1, 2.0))
    assert [c.step for c in later] == [1, 1] and all(c.version_floor == 1 for c in later)


def test_assign_carries_floor_plan_owners_and_seeded_content():
    s = make(trainer_ranks=2, staleness=1)
    cmds = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    c = cmds[0]
    assert (c.version_floor, c.trained_steps, c.sde_steps, c.owners) == (0, (0, 1, 2, 3), (0, 1, 2, 3), (0, 0, 1, 1))
    assert len(c.prompt_ids) == 2 and len(c.seeds) == 4 and len(set(c.seeds)) == 4
    twin = make(trainer_ranks=2, staleness=1)
    assert twin.fragment_content(0, 0) == (c.prompt_ids, c.seeds)
    other = make(seed=8).fragment_content(0, 0)
    assert other[1] != c.seeds
    assert make(trainer_ranks=2, tsp=False).step_plan(0)[2] == (0, 0, 0, 0)


def test_prompts_cover_every_prompt_once_per_epoch():
    s = make(prompt_count=8, steps=4)
    ids = [p for step in range(2) for f in range(2) for p in s.fragment_content(step, f)[0]]
    assert sorted(ids) == list(range(8))


def test_custom_timestep_plan_is_validated_by_name():
    s = Scheduler(BASE, plan_timesteps=lambda step: ([5], [5]))
    with pytest.raises(ValueError, match=r"plan_timesteps\(0\) trained = \[5\]"):
        s.node_joined("r0", "rollout", "H100", 0.0)


# ----------------------------------------------------------------------------- placement


def test_node_with_three_times_the_measured_speed_gets_about_three_times_the_fragments():
    s = make(steps=30, fragments_per_step=4, prompts_per_step=4, staleness=1)
    sim = Sim(s, {"fast": 1.0, "slow": 3.0})
    sim.feed(s.node_joined("fast", "rollout", "H100", 0.0) + s.node_joined("slow", "rollout", "H100", 0.0))
    sim.run()
    ratio = sim.count["fast"] / sim.count["slow"]
    assert 2.4 <= ratio <= 3.6, sim.count
    assert s.node_spt("fast") == pytest.approx(1.0) and s.node_spt("slow") == pytest.approx(3.0)


def test_unmeasured_node_is_predicted_from_the_gpu_table_calibrated_on_measured_ones():
    s = make()
    s.node_joined("h", "rollout", "H100", 0.0)
    s.node_joined("a", "rollout", "A100", 0.0)
    assert s.node_spt("a") == pytest.approx(1 / 0.45)
    task = s.ledger.live_attempts()[0]
    s.fragment_committed(task.task_id, task.node_id, 0, 2.0 * task.trajectories, 1.0)
    assert s.node_spt(task.node_id) == pytest.approx(2.0)
    unmeasured = "a" if task.node_id == "h" else "h"
    expected = 2.0 * s.params.speeds[s._nodes[task.node_id].gpu] / s.params.speeds[s._nodes[unmeasured].gpu]
    assert s.node_spt(unmeasured) == pytest.approx(expected)


# ----------------------------------------------------------------------------- faults


def test_lost_node_fragments_are_reassigned_with_the_same_prompts_and_seeds():
    s = make()
    old = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    revokes = s.node_lost("r0", 1.0)
    assert {(r.task_id, r.reason) for r in revokes} == {(c.task_id, "node_lost") for c in old}
    new = assigns(s.node_joined("r1", "rollout", "H100", 2.0))
    assert [(c.step, c.fragment, c.prompt_ids, c.seeds) for c in new] == \
        [(c.step, c.fragment, c.prompt_ids, c.seeds) for c in old]
    assert min(c.task_id for c in new) > max(c.task_id for c in old)
    assert s.statistics()["discarded"] == {"node_lost": 8}


def test_expired_lease_is_revoked_and_its_slot_reassigned():
    s = make(lease_s=5.0, heartbeat_timeout=100.0)
    a, b = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    finish(s, a, 1.0)  # b, queued behind a, starts running now: its lease counts from 1.0
    assert not [c for c in s.tick(6.0) if isinstance(c, RevokeCmd)]
    cmds = s.tick(6.5)
    revoked = [c for c in cmds if isinstance(c, RevokeCmd)]
    assert [(r.task_id, r.reason) for r in revoked] == [(b.task_id, "lease_expired")]
    again = [c for c in assigns(cmds) if (c.step, c.fragment) == (b.step, b.fragment)]
    assert again and again[0].seeds == b.seeds and again[0].task_id != b.task_id


def test_a_queued_fragments_lease_starts_when_the_one_ahead_of_it_leaves():
    # a rollout holds one running and one queued fragment; each takes 4 s of a 5 s lease, so
    # the queued one is committed 8 s after its assignment: counted from there, it would expire
    s = make(lease_s=5.0, heartbeat_timeout=100.0)
    a, b = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    assert not [c for c in s.tick(4.5) if isinstance(c, RevokeCmd)]
    finish(s, a, 4.0)
    assert not [c for c in s.tick(8.0) if isinstance(c, RevokeCmd)]
    finish(s, b, 8.4)
    assert s.statistics()["discarded"] == {}
    # the running one still expires on its own clock; the one behind it then starts afresh
    s = make(lease_s=5.0, heartbeat_timeout=100.0)
    c, d = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    revoked = [x.task_id for x in s.tick(5.5) if isinstance(x, RevokeCmd)]
    assert revoked == [c.task_id]
    assert not [x for x in s.tick(10.4) if isinstance(x, RevokeCmd)]
    assert d.task_id in [x.task_id for x in s.tick(10.6) if isinstance(x, RevokeCmd)]


def test_a_batching_rollout_runs_several_fragments_whose_leases_count_together():
    # running_per_node = 2 (sampler.max_batch of two fragments): the node holds three, the
    # first two run at once and hold leases from their assignment, the third waits for room
    s = make(lease_s=5.0, heartbeat_timeout=100.0, fragments_per_step=4, byte_window=10**9,
             running_per_node=2, max_outstanding=3)
    a, b, c = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    revoked = [x.task_id for x in s.tick(5.5) if isinstance(x, RevokeCmd)]
    assert sorted(revoked) == sorted([a.task_id, b.task_id])  # c never started: no lease yet
    s = make(lease_s=5.0, heartbeat_timeout=100.0, fragments_per_step=4, byte_window=10**9,
             running_per_node=2, max_outstanding=3)
    a, b, c = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    finish(s, a, 3.0)  # room: c starts at 3.0
    assert [x.task_id for x in s.tick(5.5) if isinstance(x, RevokeCmd)] == [b.task_id]
    assert c.task_id in [x.task_id for x in s.tick(8.5) if isinstance(x, RevokeCmd)]
    with pytest.raises(SchedulerError, match="running_per_node = 3"):
        make(running_per_node=3, max_outstanding=2)


def test_scheduler_params_run_as_many_fragments_as_max_batch_holds():
    from tests.factories import tiny_config
    cfg = tiny_config(mode="digenrl")  # fragments of 1 prompt x 2 trajectories
    assert (SchedulerParams.from_config(cfg, prompt_count=4, bytes_per_trajectory=1).running_per_node,
            SchedulerParams.from_config(cfg, prompt_count=4, bytes_per_trajectory=1).max_outstanding) == (1, 2)
    cfg = tiny_config("sampler.max_batch=5", mode="digenrl")
    p = SchedulerParams.from_config(cfg, prompt_count=4, bytes_per_trajectory=1)
    assert (p.running_per_node, p.max_outstanding) == (2, 3)


def test_silent_node_is_lost_on_tick_and_its_late_commit_is_a_counted_zombie():
    s = make(heartbeat_timeout=3.0)
    (a, *_) = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    s.node_joined("r1", "rollout", "H100", 0.0)
    s.heartbeat("r1", 3.5)
    cmds = s.tick(3.5)
    assert any(isinstance(c, RevokeCmd) and c.node_id == "r0" for c in cmds)
    assert s.fragment_committed(a.task_id, "r0", 0, 1.0, 4.0) == []
    assert s.statistics()["zombie_commits"] == 1


def test_commit_from_a_node_that_does_not_hold_the_task_is_fenced():
    s = make()
    a = assigns(s.node_joined("r0", "rollout", "H100", 0.0))[0]
    s.node_joined("r1", "rollout", "H100", 0.0)
    assert s.fragment_committed(a.task_id, "r1", 0, 1.0, 1.0) == []
    assert s.statistics()["misdirected_commits"] == 1 and not s.ledger.attempt(a.task_id).committed


def test_one_commit_with_fragment_99_is_rejected_alone_and_the_run_trains_every_slot():
    # regression: one bad Commit left admitted 1488 = trained 592 + discarded 880 instead of 640 trained
    s = make(fragments_per_step=1, prompts_per_step=2)
    sim = Sim(s, {"r0": 1.0})
    sim.feed(s.node_joined("r0", "rollout", "H100", 0.0))
    live = s.ledger.live_attempts()[0]
    assert s.fragment_committed(live.task_id, "r0", 0, 1.0, 0.5, step=live.step, fragment=99) == []
    with pytest.raises(SchedulerError, match="expected"):
        s.fragment_consumed(live.task_id, 0, 4, {}, 0.1, 0.5, step=live.step, fragment=99)
    assert not s.ledger.attempt(live.task_id).committed
    sim.run()
    stats = s.statistics()
    assert stats["trained"] == stats["admitted"] == 4 * 4 and stats["discarded"] == {}
    assert stats["rejected_commits"] == 1


def test_a_report_for_a_never_issued_task_or_with_impossible_counts_is_refused():
    s = make()
    a = assigns(s.node_joined("r0", "rollout", "H100", 0.0))[0]
    s.fragment_committed(a.task_id, "r0", 0, 1.0, 1.0)
    with pytest.raises(SchedulerError, match="never issued"):
        s.fragment_consumed(10**6, 0, 4, {}, 0.1, 1.0)
    with pytest.raises(SchedulerError, match="fragment size"):
        s.fragment_consumed(a.task_id, 0, 2**63 - 1, {}, 0.1, 1.0)
    assert s.statistics()["trained"] == 0 and s.ledger.attempt(a.task_id) is not None


def test_stale_commit_is_revoked_and_requeued():
    s = make(staleness=0)
    s.version_published(2, 0.0)
    a = assigns(s.node_joined("r0", "rollout", "H100", 0.0))[0]
    cmds = s.fragment_committed(a.task_id, "r0", 1, 1.0, 1.0)  # floor was 2
    assert RevokeCmd(node_id="r0", task_id=a.task_id, reason="stale") in cmds
    assert [(c.step, c.fragment) for c in assigns(cmds)] == [(a.step, a.fragment)]


def test_fragment_is_consumed_only_when_every_owning_rank_reported():
    s = make(trainer_ranks=2)
    a = assigns(s.node_joined("r0", "rollout", "H100", 0.0))[0]
    s.fragment_committed(a.task_id, "r0", 0, 1.0, 1.0)
    s.fragment_consumed(a.task_id, 1, 3, {"zero_advantage": 1}, 0.5, 1.0)
    assert s.ledger.step_consumed(0) == 0
    s.fragment_consumed(a.task_id, 0, 2, {"zero_advantage": 2}, 0.2, 1.0)
    stats = s.statistics()
    assert (stats["trained"], stats["discarded"], stats["rank_disagreements"]) == (2, {"zero_advantage": 2}, 1)
    assert stats["train_s_per_traj"] == pytest.approx(0.5 / 4)  # the slowest rank sets the pace
    b = s.ledger.live_attempts()[0]
    with pytest.raises(SchedulerError, match="rank = 5"):
        s.fragment_consumed(b.task_id, 5, 4, {}, 0.1, 1.0)
    with pytest.raises(SchedulerError, match="trained 3 "):
        s.fragment_consumed(b.task_id, 0, 3, {}, 0.1, 1.0)


def test_losing_a_trainer_rank_shuts_the_run_down_once():
    s = make(trainer_ranks=2)
    s.node_joined("t0", "trainer", "H100", 0.0, rank=0)
    s.node_joined("t1", "trainer", "H100", 0.0, rank=1)
    assert s.node_lost("t1", 1.0, "exited with code 1") == [
        ShutdownCmd(reason="trainer_lost: rank 1 node t1 (exited with code 1)")]
    assert s.node_joined("r0", "rollout", "H100", 2.0) == []


def test_a_silent_node_is_reported_lost_for_no_heartbeat_for_so_many_seconds():
    s = make(trainer_ranks=1, heartbeat_timeout=3.0)
    s.node_joined("t0", "trainer", "H100", 0.0, rank=0)
    s.node_joined("r0", "rollout", "H100", 0.0)
    s.heartbeat("t0", 1.0)
    assert s.tick(4.25) == [ShutdownCmd(reason="trainer_lost: rank 0 node t0 (no heartbeat for 3.2 s)")]
    assert [n["lost_why"] for n in s.statistics()["nodes"].values() if n["lost"]] == ["no heartbeat for 3.2 s"]


def test_bad_joins_name_the_value():
    s = make(trainer_ranks=2)
    with pytest.raises(SchedulerError, match="rank = 2"):
        s.node_joined("t", "trainer", "H100", 0.0, rank=2)
    with pytest.raises(SchedulerError, match="role = 'gpu'"):
        s.node_joined("t", "gpu", "H100", 0.0)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- TAG / BTS


def forecast(**kw) -> StepForecast:
    base = dict(now=0.0, gen_remaining=16, rollout_rate=1.0, train_remaining=16, train_spt=0.1,
                trainer_gen_spt=0.5, switch_s=1.0, helper_traj=4)
    base.update(kw)
    return StepForecast(**base)


def test_bts_predictor_grants_when_a_helper_shortens_the_step():
    f = forecast()  # rollouts need 16 s; the helper takes 4 trajectories in 1 + 2 s
    assert predict_step_finish(f, with_helper=False) == pytest.approx(16.4)
    assert predict_step_finish(f, with_helper=True) == pytest.approx(12.4)
    assert helper_shortens_step(f)


def test_bts_predictor_refuses_when_the_helper_would_make_the_trainer_late():
    f = forecast(rollout_rate=10.0, trainer_gen_spt=2.0, switch_s=5.0, train_spt=0.5)
    assert predict_step_finish(f, with_helper=True) > predict_step_finish(f, with_helper=False)
    assert not helper_shortens_step(f)


def test_bts_predictor_counts_owner_groups_training_fragments_in_parallel():
    # 64 trajectories left to train at 0.5 s each: one group needs 32 s, longer than the
    # rollouts' 16 s, so a helper looks useless; four DP groups train it in 8 s, so the step
    # is generation-bound and the helper's 4 trajectories shorten it
    f = forecast(train_remaining=64, train_spt=0.5, switch_s=0.5, trainer_gen_spt=0.25)
    assert not helper_shortens_step(f)
    g = forecast(train_remaining=64, train_spt=0.5, switch_s=0.5, trainer_gen_spt=0.25, train_groups=4)
    assert predict_step_finish(g, with_helper=False) == pytest.approx(16 + 4 * 0.5)
    assert helper_shortens_step(g)


def test_train_groups_follow_the_owner_plan():
    from digenrl.core.plan import train_groups
    assert train_groups([0, 1], 8, True, 4) == 4     # 8 ranks, 4 fragments: 4 groups of 2
    assert train_groups([0, 1, 2, 3], 2, True, 1) == 1
    assert train_groups([0, 1], 3, False, 4) == 3    # TSP off: fragment f on rank f % 3
    assert train_groups([0, 1], 1, True, 4) == 1


def test_bts_predictor_without_rollout_capacity_always_helps():
    f = forecast(rollout_rate=0.0, gen_remaining=4)
    assert predict_step_finish(f, with_helper=False) == math.inf
    assert helper_shortens_step(f)


def offer_after_rollouts_are_full(tag: str, rollout_spt: float, trainer_spt: float) -> tuple[list, Scheduler]:
    s = make(tag=tag, fragments_per_step=4, switch_s=1.0)
    s.node_joined("t0", "trainer", "H100", 0.0, rank=0)
    s._nodes["t0"].spt = trainer_spt  # as if measured by an earlier TAG fragment
    s.node_joined("r0", "rollout", "H100", 0.0)
    s._nodes["r0"].spt = rollout_spt
    return s.tag_offer("t0", 1.0), s


def test_bts_grants_a_waiting_trainer_work_when_rollouts_are_slow():
    cmds, s = offer_after_rollouts_are_full("bts", rollout_spt=5.0, trainer_spt=0.5)
    (c,) = assigns(cmds)
    assert c.node_id == "t0" and s.statistics()["tag_granted"] == 1


def test_bts_refuses_when_generating_on_the_trainer_would_lengthen_the_step():
    cmds, s = offer_after_rollouts_are_full("bts", rollout_spt=0.1, trainer_spt=5.0)
    assert cmds == [] and s.statistics()["tag_refused"] == 1


def test_tag_never_drops_offers_and_always_grants_them():
    assert offer_after_rollouts_are_full("never", 5.0, 0.5)[0] == []
    assert assigns(offer_after_rollouts_are_full("always", 0.1, 5.0)[0])[0].node_id == "t0"


def test_tag_work_never_advances_the_version():
    s = make(tag="always", staleness=0)
    s.node_joined("t0", "trainer", "H100", 0.0, rank=0)
    for _ in range(2):
        (c,) = assigns(s.tag_offer("t0", 1.0))
        assert not assigns(finish(s, c, 2.0))
    assert s.ledger.version == 0 and s.ledger.step_consumed(0) == 2
    assert s.tag_offer("t0", 3.0) == []  # K = 0: step 1 waits for the trainer's publish
    assert s.statistics()["tag_dropped"] == 1


def test_colocated_mode_runs_to_completion_with_only_trainers():
    cfg = resolve_mode(load_config(overrides=["run.mode=colocated", "run.steps=3", "cluster.trainers=2"]))
    s = Scheduler(SchedulerParams.from_config(cfg, prompt_count=5, bytes_per_trajectory=100))
    assert (s.params.staleness, s.params.fragments_per_step, s.params.tag) == (0, 1, "always")
    sim = Sim(s, {"t0": 1.0, "t1": 1.0}, offer=("t0", "t1"))
    sim.feed(s.node_joined("t0", "trainer", "cpu", 0.0, rank=0)
             + s.node_joined("t1", "trainer", "cpu", 0.0, rank=1))
    sim.run()
    stats = s.statistics()
    assert stats["version"] == 3 and stats["trained"] == 3 * cfg.batch_size
    assert stats["tag_granted"] == stats["tag_consumed"] == 3


# ----------------------------------------------------------------------------- checkpoints


def test_snapshot_restore_requeues_in_flight_work_as_restart():
    s = make()
    a, b = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    finish(s, a, 1.0)
    snap = msgpack.unpackb(msgpack.packb(s.snapshot()), strict_map_key=False)
    fresh = make()
    fresh.restore(snap)
    stats = fresh.statistics()
    assert stats["discarded"] == {"restart": 8} and stats["trained"] == 4
    again = assigns(fresh.node_joined("r9", "rollout", "H100", 5.0))
    assert (again[0].step, again[0].fragment, again[0].seeds) == (b.step, b.fragment, b.seeds)
    with pytest.raises(SchedulerError, match="seed"):
        make(seed=1).restore(snap)


def test_done_emits_shutdown_exactly_once():
    s = make(steps=1, staleness=0)
    cmds = s.node_joined("r0", "rollout", "H100", 0.0)
    out = []
    for c in assigns(cmds):
        out += finish(s, c, 1.0)
    out += s.version_published(1, 2.0) + s.tick(3.0) + s.version_published(1, 4.0)
    assert [c for c in out if isinstance(c, ShutdownCmd)] == [ShutdownCmd(reason="done")]


# ----------------------------------------------------------------------------- state machine


ROLLOUTS = ("r0", "r1", "r2")
GPUS = ("H100", "A100", "L40S", "H200")


class SchedulerMachine(RuleBasedStateMachine):
    """Random joins, losses, commits, consumes (some with non-finite trajectories), publishes,
    heartbeats, offers and ticks."""

    @initialize(k=st.integers(0, 2), fragments=st.sampled_from([1, 2, 4]),
                ranks=st.integers(1, 2), tsp=st.booleans(),
                tag=st.sampled_from(["never", "always", "bts"]), window=st.integers(1, 40),
                fault_limit=st.integers(1, 3), fault_action=st.sampled_from(["drop", "stop"]),
                running=st.sampled_from([1, 1, 2, 3]))
    def setup(self, k, fragments, ranks, tsp, tag, window, fault_limit, fault_action, running):
        # running > 1: step-level batching (sampler.max_batch), several fragments in flight
        # on one node; the credit rule, the byte window and the one-step bound must not move
        self.s = make(steps=3, staleness=k, fragments_per_step=fragments, trainer_ranks=ranks,
                      tsp=tsp, tag=tag, byte_window=window, lease_s=20.0, heartbeat_timeout=8.0,
                      fault_limit=fault_limit, fault_action=fault_action,
                      running_per_node=running, max_outstanding=running + 1)
        self.now = 0.0
        self.assigned: dict[int, AssignCmd] = {}
        self.revoked: set[int] = set()
        self.reported: dict[int, set[int]] = {}
        self.shutdowns: list[ShutdownCmd] = []
        for r in range(ranks):
            self.record(self.s.node_joined(f"t{r}", "trainer", "H100", 0.0, rank=r))

    def record(self, cmds) -> None:
        v, k = self.s.ledger.version, self.s.params.staleness
        for c in cmds:
            if isinstance(c, AssignCmd):
                assert c.step <= v + k and c.version_floor == max(0, c.step - k)
                self.assigned[c.task_id] = c
            elif isinstance(c, RevokeCmd):
                assert self.assigned[c.task_id].node_id == c.node_id
                self.revoked.add(c.task_id)
            else:
                self.shutdowns.append(c)

    def uncommitted(self) -> list:
        return [a for a in self.s.ledger.live_attempts() if not a.committed]

    def trainable(self) -> list:
        return [a for a in self.s.ledger.live_attempts()
                if a.committed and a.step == self.s.ledger.version]

    @rule(name=st.sampled_from(ROLLOUTS), gpu=st.sampled_from(GPUS))
    def join(self, name, gpu):
        self.record(self.s.node_joined(name, "rollout", gpu, self.now))

    @precondition(lambda self: any(n in self.s._nodes for n in ROLLOUTS))
    @rule(data=st.data())
    def lose(self, data):
        name = data.draw(st.sampled_from([n for n in ROLLOUTS if n in self.s._nodes]))
        self.record(self.s.node_lost(name, self.now))

    @precondition(lambda self: self.uncommitted())
    @rule(data=st.data(), seconds=st.floats(0.0, 4.0))
    def commit(self, data, seconds):
        a = data.draw(st.sampled_from(self.uncommitted()))
        floor = max(0, a.step - self.s.params.staleness)
        version = data.draw(st.integers(floor, max(floor, self.s.ledger.version)))
        self.record(self.s.fragment_committed(a.task_id, a.node_id, version, seconds, self.now))

    @precondition(lambda self: self.revoked)
    @rule(data=st.data())
    def zombie_commit(self, data):
        task = data.draw(st.sampled_from(sorted(self.revoked)))
        trained = self.s.statistics()["trained"]
        assert self.s.fragment_committed(task, self.assigned[task].node_id, 0, 1.0, self.now) == []
        assert self.s.fragment_consumed(task, 0, self.s.ledger.fragment_size, {}, 0.0, self.now) == []
        assert self.s.statistics()["trained"] == trained

    @precondition(lambda self: self.trainable())
    @rule(data=st.data(), zero=st.integers(0, 2), bad=st.sampled_from([0, 0, 1, 9]),
          seconds=st.floats(0.0, 2.0))
    def consume_one_rank(self, data, zero, bad, seconds):
        a = data.draw(st.sampled_from(self.trainable()))
        ranks = sorted(set(self.assigned[a.task_id].owners))
        done = self.reported.setdefault(a.task_id, set())
        rank = data.draw(st.sampled_from([r for r in ranks if r not in done]))
        done.add(rank)
        zero = min(zero, a.trajectories)
        bad = min(bad, a.trajectories - zero)
        self.record(self.s.fragment_consumed(a.task_id, rank, a.trajectories - zero - bad,
                                             {"zero_advantage": zero, "nonfinite": bad}, seconds, self.now))

    @precondition(lambda self: not self.s.ledger.done and self.s.ledger.step_consumed(
        self.s.ledger.version) == self.s.ledger.fragments_per_step)
    @rule()
    def publish(self):
        self.record(self.s.version_published(self.s.ledger.version + 1, self.now))

    @rule(back=st.integers(0, 2))
    def publish_old(self, back):
        self.record(self.s.version_published(max(0, self.s.ledger.version - back), self.now))

    @rule(name=st.sampled_from(ROLLOUTS))
    def heartbeat(self, name):
        self.record(self.s.heartbeat(name, self.now))

    @rule(rank=st.integers(0, 1))
    def tag_offer(self, rank):
        if f"t{rank}" in self.s._nodes:
            self.record(self.s.tag_offer(f"t{rank}", self.now))

    @rule(dt=st.floats(0.0, 12.0))
    def tick(self, dt):
        self.now += dt
        for r in range(self.s.params.trainer_ranks):  # trainer ranks are reliable here
            self.s.heartbeat(f"t{r}", self.now)
        self.record(self.s.tick(self.now))

    @invariant()
    def counts_add_up(self):
        st_ = self.s.statistics()
        assert st_["admitted"] == st_["trained"] + sum(st_["discarded"].values()) + st_["in_flight"]
        assert sum(n["assigned"] for n in st_["nodes"].values()) == st_["attempts"]
        assert st_["max_trained_staleness"] <= self.s.params.staleness and st_["stale_commits"] == 0
        assert st_["bytes_in_flight"] <= max(self.s.params.byte_window, self.s.ledger.fragment_bytes)

    @invariant()
    def one_live_attempt_per_slot_held_by_a_live_node(self):
        live = self.s.ledger.live_attempts()
        assert len({a.slot for a in live}) == len(live)
        for a in live:
            assert a.committed or a.node_id in self.s._nodes
        for n in self.s._nodes.values():
            cap = self.s.params.max_outstanding if n.role == "rollout" else 1
            assert len(n.outstanding) <= cap
            # exactly the first running_per_node fragments of a queue run (hold a lease)
            assert set(n.started) == set(n.outstanding[:self.s.params.running_per_node])

    @invariant()
    def only_done_or_a_named_broken_node_shuts_down(self):
        reasons = [c.reason for c in self.shutdowns]
        if reasons and reasons[0].startswith("failed: node "):
            assert len(reasons) == 1 and self.s.is_broken(reasons[0].split()[2])
        else:
            assert reasons in ([], ["done"])
            assert bool(self.shutdowns) == self.s.ledger.done

    @invariant()
    def a_broken_node_holds_no_work_and_never_rejoins(self):
        for name in ROLLOUTS:
            if self.s.is_broken(name) and not self.shutdowns:
                assert name not in self.s._nodes
                assert not any(a.node_id == name and not a.committed for a in self.s.ledger.live_attempts())
        nonfinite = self.s.statistics()["discarded"].get("nonfinite", 0)
        assert sum(self.s.statistics()["nonfinite_by_node"].values()) >= nonfinite

    def teardown(self):
        if not hasattr(self, "s"):
            return
        s = self.s
        if self.shutdowns and self.shutdowns[0].reason.startswith("failed: "):
            stats = s.statistics()  # stopped naming a broken node: still exact
            assert stats["admitted"] == stats["trained"] + sum(stats["discarded"].values()) + stats["in_flight"]
            return
        self.record(s.node_joined("drain", "rollout", "H100", self.now))
        for _ in range(200):
            if self.shutdowns:
                break
            self.now += 1.0
            for n in list(s._nodes):
                s.heartbeat(n, self.now)
            for a in self.uncommitted():
                self.record(s.fragment_committed(a.task_id, a.node_id, s.ledger.version, 1.0, self.now))
            for a in self.trainable():
                for rank in sorted(set(self.assigned[a.task_id].owners) - self.reported.get(a.task_id, set())):
                    self.record(s.fragment_consumed(a.task_id, rank, a.trajectories, {}, 0.5, self.now))
            if s.ledger.step_consumed(s.ledger.version) == s.ledger.fragments_per_step:
                self.record(s.version_published(s.ledger.version + 1, self.now))
            self.record(s.tick(self.now))
        stats = s.statistics()
        assert [c.reason for c in self.shutdowns] == ["done"], stats
        assert stats["in_flight"] == 0
        assert stats["admitted"] == stats["trained"] + sum(stats["discarded"].values())


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_random_seeds_give_distinct_trajectory_seeds_across_a_run():
    s = make(steps=3, seed=random.Random(3).randrange(2**32))
    seeds = [x for step in range(3) for f in range(2) for x in s.fragment_content(step, f)[1]]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 2**63 for x in seeds)


def test_credits_and_scheduler_import_neither_torch_nor_asyncio_nor_zmq():
    import subprocess
    import sys
    code = ("import sys, digenrl.core.scheduler, digenrl.core.credits; "
            "print(sorted(m for m in ('torch', 'asyncio', 'zmq') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_slow_rollouts_lease_stretches_to_its_measured_fragment_time():
    # lease_s = 5 s, but r0 takes 10 s per fragment (measured on its first commit): its next
    # running fragment keeps its lease up to lease_factor x 10 s, not 5 s
    s = make(lease_s=5.0, heartbeat_timeout=100.0, lease_factor=2.0)
    a, b = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    assert [x.task_id for x in s.tick(5.5) if isinstance(x, RevokeCmd)] == [a.task_id]
    s = make(lease_s=5.0, heartbeat_timeout=100.0, lease_factor=2.0)
    a, b = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    s.fragment_committed(a.task_id, "r0", s.ledger.version, 4.9, 4.9)  # 4.9 s measured
    for t in (6.0, 9.8, 14.0):
        assert not [x for x in s.tick(t) if isinstance(x, RevokeCmd)], t  # 2 x 4.9 = 9.8 s from 4.9
    assert [x.task_id for x in s.tick(14.8) if isinstance(x, RevokeCmd)] == [b.task_id]
    # lease_factor 0: always lease_s
    s = make(lease_s=5.0, heartbeat_timeout=100.0, lease_factor=0.0)
    a, b = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    s.fragment_committed(a.task_id, "r0", s.ledger.version, 4.9, 4.9)
    assert [x.task_id for x in s.tick(10.0) if isinstance(x, RevokeCmd)] == [b.task_id]
    with pytest.raises(SchedulerError, match="lease_factor"):
        make(lease_factor=-1.0)


def _consume_bad(s: Scheduler, cmd: AssignCmd, now: float, bad: int) -> list:
    """Commit ``cmd``; every owning rank reports ``bad`` of its trajectories non-finite."""
    out = s.fragment_committed(cmd.task_id, cmd.node_id, s.ledger.version, 1.0, now)
    n = len(cmd.seeds)
    for rank in sorted(set(cmd.owners) or {0}):
        out += s.fragment_consumed(cmd.task_id, rank, n - bad, {"nonfinite": bad} if bad else {}, 0.1, now)
    return out


def test_nonfinite_fragments_are_counted_per_node_and_a_clean_one_resets_the_run_of_faults():
    s = make(fault_limit=2, staleness=0)
    a0, b0 = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    s.node_joined("r1", "rollout", "H100", 0.0)
    assert _consume_bad(s, a0, 1.0, 3) == []  # one fault: counted, nothing else
    _consume_bad(s, b0, 1.0, 0)  # clean: the run of faults starts again
    out = s.version_published(1, 2.0)
    a1 = next(c for c in assigns(out) if c.node_id == "r0")
    _consume_bad(s, a1, 3.0, 4)
    stats = s.statistics()
    assert stats["nodes"]["r0"]["nonfinite"] == 7 and stats["nonfinite_by_node"] == {"r0": 7}
    assert s.is_broken("r0") == "" and s.is_live("r0")  # 1 in a row, not 2
    assert stats["discarded"] == {"nonfinite": 7}


def test_after_fault_limit_fragments_in_a_row_the_node_is_lost_and_never_rejoins():
    s = make(fault_limit=2, staleness=0)
    (a0, b0) = assigns(s.node_joined("r0", "rollout", "H100", 0.0))  # step 0's two fragments
    assert assigns(s.node_joined("r1", "rollout", "H100", 0.0)) == []  # K = 0: step 1 waits
    assert _consume_bad(s, a0, 1.0, 1) == []
    assert s.statistics()["nodes"]["r0"]["nonfinite"] == 1
    out = _consume_bad(s, b0, 1.0, 4)
    assert s.is_broken("r0").startswith("2 fragments in a row held non-finite values (5 trajectories")
    assert not s.is_live("r0") and s.statistics()["nodes"]["r0#lost0"]["lost_why"].startswith("broken: ")
    assert not [c for c in out if isinstance(c, ShutdownCmd)]
    new = assigns(s.version_published(1, 2.0))
    assert new and {c.node_id for c in new} == {"r1"}  # the work goes to the healthy node
    assert s.node_joined("r0", "rollout", "H100", 3.0) == [] and not s.is_live("r0")
    stats = s.statistics()
    assert stats["nonfinite_by_node"] == {"r0": 5} and stats["broken_rejoins"] == 1
    assert stats["discarded"] == {"nonfinite": 5}
    assert stats["admitted"] == stats["trained"] + sum(stats["discarded"].values()) + stats["in_flight"]


def test_a_broken_nodes_uncommitted_work_is_revoked_as_a_lost_nodes_is():
    s = make(fault_limit=1)
    a, b = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    c, _ = assigns(s.node_joined("r1", "rollout", "H100", 0.0))
    out = _consume_bad(s, a, 1.0, 2)
    revoked = [c for c in out if isinstance(c, RevokeCmd)]
    assert [(r.node_id, r.task_id, r.reason) for r in revoked] == [("r0", b.task_id, "node_lost")]
    out = s.fragment_committed(c.task_id, "r1", 0, 1.0, 2.0)  # r1 has room again: b's slot
    again = [c for c in assigns(out) if (c.step, c.fragment) == (b.step, b.fragment)]
    assert [c.node_id for c in again] == ["r1"] and again[0].seeds == b.seeds


@pytest.mark.parametrize("action", ["drop", "stop"])
def test_the_run_stops_naming_a_broken_node_when_asked_or_when_it_is_the_last_rollout(action):
    s = make(fault_limit=1, fault_action=action)
    a, _ = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    if action == "stop":
        s.node_joined("r1", "rollout", "H100", 0.0)
    s.fragment_committed(a.task_id, "r0", 0, 1.0, 1.0)
    out = s.fragment_consumed(a.task_id, 0, 0, {"nonfinite": 4}, 0.1, 1.0)
    assert out == [ShutdownCmd(reason="failed: node r0 is broken: 1 fragments in a row held "
                                      "non-finite values (4 trajectories discarded)")]
    assert s.statistics()["closed"].startswith("failed: node r0 is broken")
    assert s.tick(2.0) == [] and s.node_joined("r2", "rollout", "H100", 2.0) == []  # closed


def test_fault_params_are_checked():
    with pytest.raises(SchedulerError, match="fault_limit = 0"):
        make(fault_limit=0)
    with pytest.raises(SchedulerError, match="fault_action = 'ignore'"):
        make(fault_action="ignore")


def test_a_broken_node_stays_out_after_a_restore_from_a_snapshot():
    s = make(fault_limit=1)
    a, _ = assigns(s.node_joined("r0", "rollout", "H100", 0.0))
    s.node_joined("r1", "rollout", "H100", 0.0)
    _consume_bad(s, a, 1.0, 4)
    snap = msgpack.unpackb(msgpack.packb(s.snapshot()))
    fresh = make(fault_limit=1)
    fresh.restore(snap)
    assert fresh.is_broken("r0") and fresh.node_joined("r0", "rollout", "H100", 2.0) == []
    assert assigns(fresh.node_joined("r1", "rollout", "H100", 2.0))
