"""A dependency-free ``sd_notify`` client: readiness, status, watchdog and stop notices.

Under systemd (``Type=notify``) a node tells the service manager when it is ready, what it
is doing and that it is still alive, by sending a datagram of newline-separated
``KEY=VALUE`` assignments to the unix socket named in ``$NOTIFY_SOCKET``. Outside systemd
(supervisord, a terminal, tests) the variable is unset and every call here is a no-op that
returns ``False``, so the node code calls these unconditionally.

When a node sends what (see docs/deployment.md)::

    ready()            after the model is loaded and the coordinator handshake is done
    status(text)       on state changes ("step 12, policy v12, 3 fragments in flight")
    Watchdog.ping()    from the main loop, every ``interval_s`` (half of WatchdogSec)
    extend_timeout(s)  before a long phase (drain, checkpoint) that may outlast the unit's timeout
    stopping()         when a drain begins (SIGTERM)

The wire format is systemd's ``sd_notify(3)``; an address starting with ``@`` names the
Linux abstract socket namespace.

Why not a library: the protocol is one datagram per notice, which this module sends in a few
lines; ``systemd-python`` needs libsystemd headers to build (not on every machine, nor in
slim containers), and a minimal pure-Python client (``sdnotify`` on PyPI) sends a notice and
no more: the watchdog's period and PID checks below would still be ours. A dependency would
add more than it removes.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable, Mapping

__all__ = [
    "NotifyError",
    "Watchdog",
    "extend_timeout",
    "notify",
    "ready",
    "status",
    "stopping",
]


class NotifyError(ValueError):
    """``$NOTIFY_SOCKET``, ``$WATCHDOG_USEC`` or a state string is malformed; the message names it."""


def _address(value: str) -> str:
    """The ``AF_UNIX`` address for a ``$NOTIFY_SOCKET`` value."""
    if value.startswith("@"):
        # Abstract namespace: systemd writes '@', the kernel wants a leading NUL byte.
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    # systemd >= 254 may also hand out "vsock:CID:PORT" (VMs); nodes never run that way.
    raise NotifyError(
        f"NOTIFY_SOCKET={value!r} is not supported: expected an absolute path or '@abstract-name'"
    )


def notify(state: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (``"KEY=VALUE"`` lines, e.g. ``"READY=1"``) to ``$NOTIFY_SOCKET``.

    Returns ``True`` when the datagram was sent and ``False`` when ``$NOTIFY_SOCKET`` is unset
    or empty (not running under a notify-type systemd service). Raises :class:`NotifyError`
    for an empty state or an unusable socket address, and ``OSError`` when the send fails:
    a service manager that cannot be told we are alive will kill us, so this is not hidden.
    ``environ`` defaults to ``os.environ`` and exists for tests.
    """
    env = os.environ if environ is None else environ
    target = env.get("NOTIFY_SOCKET", "")
    if not target:
        return False
    if not state or "=" not in state:
        raise NotifyError(f"sd_notify state {state!r} is not KEY=VALUE")
    address = _address(target)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            # never block the event loop on a service manager that is not reading
            sock.sendto(state.encode("utf-8"), socket.MSG_DONTWAIT, address)
        except BlockingIOError:
            return False  # its queue is full: this notice is dropped, the next one may pass
    return True


def ready(*, environ: Mapping[str, str] | None = None) -> bool:
    """Tell systemd start-up is complete (``READY=1``); a ``Type=notify`` unit waits for this."""
    return notify("READY=1", environ=environ)


def stopping(*, environ: Mapping[str, str] | None = None) -> bool:
    """Tell systemd a graceful shutdown (drain) has begun (``STOPPING=1``)."""
    return notify("STOPPING=1", environ=environ)


def status(text: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Set the one-line status ``systemctl status`` shows (``STATUS=...``).

    Newlines would start a new assignment in the datagram, so they are folded into spaces.
    """
    one_line = " ".join(text.splitlines())
    return notify(f"STATUS={one_line}", environ=environ)


def extend_timeout(seconds: float, *, environ: Mapping[str, str] | None = None) -> bool:
    """Ask for ``seconds`` more before the start/stop timeout fires (``EXTEND_TIMEOUT_USEC``).

    Sent before a drain or a checkpoint write that may outlast ``TimeoutStopSec``; systemd
    honours it only while the unit is starting or stopping.
    """
    if not seconds > 0:
        raise NotifyError(f"extend_timeout seconds={seconds!r} must be > 0")
    return notify(f"EXTEND_TIMEOUT_USEC={round(seconds * 1e6)}", environ=environ)


class Watchdog:
    """The systemd watchdog (``WatchdogSec=``) as seen from the service.

    Reads ``$WATCHDOG_USEC`` (the period) and ``$WATCHDOG_PID`` (the process it is meant
    for; when set and not ours, the watchdog belongs to another process and this one is
    disabled). ``interval_s`` is half the period, systemd's recommended ping interval, or
    ``None`` when no watchdog is armed. Either call :meth:`ping` from a loop that runs at
    least every ``interval_s``, or run :meth:`run` as a task next to the actor's loops.
    """

    def __init__(self, *, environ: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        env = os.environ if environ is None else environ
        self._environ = env
        self.interval_s: float | None = None
        """Half the watchdog period in seconds; ``None`` when the watchdog is off."""
        self.pings = 0
        """Pings actually sent (for ``statistics()`` and tests)."""
        self.missed = 0
        """Intervals in which :meth:`run` found the process not alive and withheld the ping."""

        raw_usec = env.get("WATCHDOG_USEC", "")
        if not raw_usec:
            return
        raw_pid = env.get("WATCHDOG_PID", "")
        if raw_pid:
            if not raw_pid.isdigit():
                raise NotifyError(f"WATCHDOG_PID={raw_pid!r} is not a process id")
            if int(raw_pid) != (os.getpid() if pid is None else pid):
                return  # armed for a parent or a sibling process, not for us
        if not raw_usec.isdigit():
            raise NotifyError(f"WATCHDOG_USEC={raw_usec!r} is not a whole number of microseconds")
        usec = int(raw_usec)
        if usec > 0:
            self.interval_s = usec / 2e6

    @property
    def enabled(self) -> bool:
        """Whether systemd expects pings from this process."""
        return self.interval_s is not None

    def ping(self) -> bool:
        """Send ``WATCHDOG=1``; ``False`` (and nothing sent) when the watchdog is off."""
        if not self.enabled:
            return False
        sent = notify("WATCHDOG=1", environ=self._environ)
        self.pings += int(sent)
        return sent

    async def run(
        self,
        alive: Callable[[], bool],
        *,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        """Ping every ``interval_s`` while ``alive()`` is true; return at once when off.

        ``alive`` must say whether the actor made progress since it was last asked (e.g. a
        heartbeat was handled); a plain "the loop is running" would keep a wedged node alive,
        because this task itself runs on that loop. When ``alive()`` is false the ping is
        withheld and systemd restarts the node after the full period. Runs until cancelled.
        ``sleep`` is injectable so tests drive it on a virtual clock.
        """
        if self.interval_s is None:
            return
        while True:
            if alive():
                self.ping()
            else:
                self.missed += 1
            await sleep(self.interval_s)

    def statistics(self) -> dict[str, float | int | None]:
        """Interval, pings sent and pings withheld, for telemetry."""
        return {"interval_s": self.interval_s, "pings": self.pings, "missed": self.missed}
