"""Cost of a heartbeat's busy reading as a run's span history grows: recomputing the union
of every busy span since start (what heartbeats once did) against the
incremental ``BusyClock``, side by side on the same recorder.

    .venv/bin/python bench/busy.py [--spans 1000 10000 100000] [--per-beat 20]

Each size: that many spans recorded (two busy for one send, ~1 ms apart), a reading every
``--per-beat`` spans; then the median of 20 readings, each after ``--per-beat`` new spans (both readings checked equal).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from digenrl.telemetry.trace import BusyClock, SpanRecorder, busy_fraction


def one(n: int, per_beat: int) -> tuple[float, float]:
    now = [1_700_000_000 * 10**9]  # a virtual clock (ns) so that span times are exact
    rec = SpanRecorder("rollout-0", "rollout", lambda: now[0], keep=n + 25 * per_beat)
    clock = BusyClock(rec)
    added = 0

    def add(k: int) -> None:
        nonlocal added
        for _ in range(k):  # 1 ms apart; recorded after they end, as the compute thread's are
            start = now[0]
            now[0] += 1_000_000
            rec.record("send_chunk" if added % 3 == 0 else "denoise_step", start, start + 900_000)
            added += 1

    while added < n:
        add(per_beat)
        clock.stats()
    full, incr = [], []
    for _ in range(20):
        add(per_beat)
        a = time.perf_counter()
        expected = busy_fraction(rec.spans(), clock.t0, now[0]) * (now[0] - clock.t0)
        b = time.perf_counter()
        got = clock.busy_ns()
        c = time.perf_counter()
        if abs(got - expected) > 1e-6 * expected:
            raise SystemExit(f"BusyClock {got} ns != union {expected} ns at {added} spans")
        full.append(b - a)
        incr.append(c - b)
    return statistics.median(full), statistics.median(incr)
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spans", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--per-beat", type=int, default=20)
    args = ap.parse_args()
    print(f"{'spans':>8} {'union of all (ms)':>18} {'BusyClock (ms)':>15} {'ratio':>8}")
    for n in args.spans:
        full, incr = one(n, args.per_beat)
        print(f"{n:>8} {full * 1e3:>18.3f} {incr * 1e3:>15.4f} {full / incr:>8.0f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
