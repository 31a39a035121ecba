"""The coordinator's stall watchdog: when a run that lives no longer progresses (sans-I/O).

Heartbeats prove a process lives, not that it progresses: a GPU or a collective that hangs
leaves the node's event loop beating while its compute thread never returns. No optimizer
step within ``runtime.stall_timeout_s`` of the last one (or of the first work) is treated
like a lost trainer: the coordinator rewinds to the checkpoint and restarts every node
(``CoordinatorActor.reset``). The clock is the caller's (monotonic seconds).
"""

from __future__ import annotations


class StallWatchdog:
    """``limit_s``: ``runtime.stall_timeout_s``; 0 (or less) turns the watchdog off."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.t_progress: float | None = None    # work assigned or a step done; None: no work yet
        self.t_no_rollout: float | None = None  # since when no rollout is live

    def work_assigned(self, now: float) -> None:
        """Work was handed out: the watchdog starts with the first (again after a restart)."""
        if self.t_progress is None:
            self.t_progress = now

    def step_done(self, now: float) -> None:
        self.t_progress = now

    def restart(self) -> None:
        """The run is rewound: restarted nodes load their models first, so counting starts
        again at new work."""
        self.t_progress = None
        self.t_no_rollout = None

    def check(self, now: float, *, rollouts_live: int, trainers_live: int,
              trainers_expected: int) -> str | None:
        """Why the run must be rewound now, or None."""
        limit = self.limit_s
        if limit <= 0 or self.t_progress is None:
            return None
        if rollouts_live == 0:
            # every rollout lost (paused, partitioned, wedged while its process lives on): a
            # reboot ends by itself, but past the timeout a reset restarts them
            if self.t_no_rollout is None:
                self.t_no_rollout = now
            if now - self.t_no_rollout > limit:
                return (f"no rollout live for {now - self.t_no_rollout:.0f} s "
                        f"(runtime.stall_timeout_s = {limit:g})")
        else:
            self.t_no_rollout = None
        if rollouts_live == 0 or trainers_live < trainers_expected:
            # waiting for nodes to (re)join (a rebooting machine) is not a wedge yet: count
            # progress from the moment the cluster is whole again
            self.t_progress = now
            return None
        if now - self.t_progress <= limit:
            return None
        return (f"no optimizer step completed in {now - self.t_progress:.0f} s "
                f"(runtime.stall_timeout_s = {limit:g}): a node is wedged")
