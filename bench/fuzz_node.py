"""Fuzz storm at full size: 100,000 bad messages at the coordinator ROUTER and at a trainer's PULL.

    .venv/bin/python bench/fuzz_node.py [N]

Same storm as tests/test_fuzz_node.py (which sends 20,000 to stay fast on CI); prints the
counts each node reports and the seconds from the first send to the last message counted.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_fuzz_node import run_storm


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    with tempfile.TemporaryDirectory() as tmp:
        seen = asyncio.run(run_storm(Path(tmp), n))
    print(f"sent {n} bad messages to each socket; coordinator counted {seen['coordinator_bad']}, "
          f"trainer counted {seen['trainer_bad']}; {seen['seconds']:.1f} s for both storms "
          f"({2 * n / seen['seconds']:,.0f} msg/s); trainer exit code {seen['trainer_exit']}")


if __name__ == "__main__":
    main()
