"""Helpers shared by the test modules.

Exact float equality, the suite's rule
--------------------------------------
CI machines of this project's kind differ in CPU (AMD EPYC, Intel Xeon), and a kernel may
round differently with another CPU, another thread count, or another memory alignment of the
same data. So:

* **exact** (``torch.equal``, ``==``) where exactness is the point and the arithmetic is the
  same: bits that are stored and read back (weights, checkpoints, frames on the wire, RNG
  states), one instance on one input in one process (ratio == 1 on recompute), elementwise
  math with no reductions, and a resumed run against an uninterrupted one on the same machine
  with the same thread count (resume must replay the same arithmetic);
* **a tolerance** whenever two different module instances, two code paths, two processes
  that are not replaying each other, or thread counts are compared. Weights are then still
  compared exactly (:func:`assert_same_weights`), and the outputs with
  :func:`assert_close_across_instances`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import pytest
import torch

#: torch intra-op threads for the whole suite: in this process (an autouse fixture) and in
#: every run it launches (:data:`THREAD_SETS`). CPU kernels may round differently at another
#: thread count, so the suite is run once at 1 and once at 2 before a change of tolerances
#: lands: ``DIGENRL_TEST_THREADS=2 ./dev.sh test``.
TEST_THREADS = int(os.environ.get("DIGENRL_TEST_THREADS", "1"))

#: ``--set`` overrides that give a launched run the suite's thread count.
THREAD_SETS = [f"run.threads={TEST_THREADS}"]


@pytest.fixture(autouse=True)
def _torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(before)

#: Two instances holding identical float32 weights: differences seen are ~1e-7 relative (the
#: last bit or two of a matmul or conv); a real difference in weights or conventions moves
#: outputs by orders of magnitude more.
INSTANCE_RTOL = 1e-5
INSTANCE_ATOL = 1e-6


def assert_same_weights(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    """Two state dicts hold the same keys and bit-identical tensors."""
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_close_across_instances(a: torch.Tensor, b: torch.Tensor) -> None:
    """Outputs of two module instances with identical weights, on the same input."""
    torch.testing.assert_close(a, b, rtol=INSTANCE_RTOL, atol=INSTANCE_ATOL)
