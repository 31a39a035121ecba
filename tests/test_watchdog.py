"""The coordinator's stall watchdog decides alone, from its clock and its view of the cluster.

The end-to-end recoveries (a trainer's compute thread hung on purpose, under the launcher and
under supervisord) are in tests/test_faults.py and tests/test_supervisor.py; these tests pin
when the watchdog fires and when it must not.
"""

from __future__ import annotations

from pathlib import Path

from digenrl.actors.coordinator import CoordinatorActor
from tests.conftest import bare_coordinator


def _coordinator(tmp_path: Path, timeout: float, trainers: int = 1,
                 whole: bool = True) -> tuple[CoordinatorActor, list[str]]:
    """A coordinator whose resets are recorded; ``whole``: trainer 0 and rollout 0 joined."""
    actor = bare_coordinator(tmp_path, [f"runtime.stall_timeout_s={timeout}"], trainers=trainers)
    resets: list[str] = []

    async def reset(reason: str) -> None:  # the rewind itself is tested end to end elsewhere
        resets.append(reason)

    actor.reset = reset  # type: ignore[method-assign]
    if whole:
        _join(actor, "trainer", 0)
        _join(actor, "rollout", 0)
    return actor, resets


def _join(actor: CoordinatorActor, role: str, *ids: int) -> None:
    for i in ids:
        actor.sched.node_joined(f"{role}-{i}", role, "cpu", 0.0,  # type: ignore[arg-type]
                                rank=i if role == "trainer" else None)


async def test_no_step_within_the_timeout_with_the_cluster_whole_resets_the_run(tmp_path: Path) -> None:
    actor, resets = _coordinator(tmp_path, timeout=10)
    actor.watchdog.t_progress = 100.0
    await actor._check_stall(109.0)
    assert resets == []  # within the timeout
    await actor._check_stall(111.0)
    assert len(resets) == 1 and "no optimizer step completed in 11 s" in resets[0]
    assert actor.recovery["stalls"] == 1


async def test_waiting_for_nodes_to_rejoin_is_not_a_stall(tmp_path: Path) -> None:
    actor, resets = _coordinator(tmp_path, timeout=10, trainers=2, whole=False)
    _join(actor, "trainer", 0)  # rank 1 not (yet) there, and no rollout (a rebooting machine)
    actor.watchdog.t_progress = 100.0
    await actor._check_stall(500.0)
    assert resets == [] and actor.watchdog.t_progress == 500.0  # the clock restarts when they are back
    _join(actor, "rollout", 0)
    await actor._check_stall(900.0)
    assert resets == [] and actor.watchdog.t_progress == 900.0  # still a trainer rank short
    _join(actor, "trainer", 1)
    await actor._check_stall(909.0)
    assert resets == []
    await actor._check_stall(911.0)
    assert len(resets) == 1
    actor.sched.node_lost("rollout-0", 912.0)  # lost by heartbeat timeout, not by the launcher
    actor.watchdog.t_progress = 912.0
    await actor._check_stall(1000.0)
    assert len(resets) == 1 and actor.watchdog.t_progress == 1000.0


async def test_the_watchdog_is_off_at_zero_and_before_any_work(tmp_path: Path) -> None:
    off, resets_off = _coordinator(tmp_path, timeout=0)
    off.watchdog.t_progress = 0.0
    await off._check_stall(1e9)
    idle, resets_idle = _coordinator(tmp_path, timeout=10)
    await idle._check_stall(1e9)  # no work handed out yet (nodes still loading models)
    assert resets_off == [] and resets_idle == [] and idle.watchdog.t_progress is None


async def test_every_rollout_lost_for_longer_than_the_timeout_resets_the_run(tmp_path: Path) -> None:
    # regression: a rollout paused past the heartbeat timeout was dropped by the scheduler and the
    # watchdog skipped for good (no live rollout), so the run never finished
    actor, resets = _coordinator(tmp_path, timeout=10)
    actor.watchdog.t_progress = 100.0
    actor.sched.node_lost("rollout-0", 101.0)
    await actor._check_stall(102.0)
    await actor._check_stall(111.0)
    assert resets == []  # lost for 9 s: a reboot may still end by itself
    await actor._check_stall(112.5)
    assert len(resets) == 1 and "no rollout live for 10 s" in resets[0]
    assert actor.recovery["stalls"] == 1


async def test_a_node_the_scheduler_lost_by_silence_rejoins_on_its_next_heartbeat(tmp_path: Path) -> None:
    actor, _ = _coordinator(tmp_path, timeout=0, whole=False)
    sent: list = []

    async def run(cmds: list) -> None:
        sent.extend(cmds)

    class Control:  # what the coordinator sends on a join (weight routes) is not under test
        async def send(self, msg: object, *, to: bytes | None = None) -> None:
            sent.append(msg)

    actor._run = run  # type: ignore[method-assign]
    actor.control = Control()
    actor.nodes["rollout-0"] = {"role": "rollout", "peer": b"rollout-0", "gpu": "cpu"}
    assert await actor._ensure_joined("rollout-0", 0.0)
    assert actor.sched.is_live("rollout-0")
    actor.sched.tick(10**6)  # silent past the heartbeat timeout (a SIGSTOP): lost
    assert not actor.sched.is_live("rollout-0")
    actor._fence_silent()
    assert actor.nodes["rollout-0"]["ready"] is False and actor.recovery["rollouts_lost"] == 1
    assert await actor._ensure_joined("rollout-0", 10**6 + 1)  # SIGCONT: its heartbeat
    assert actor.sched.is_live("rollout-0") and actor.recovery["rejoins"] == 1
