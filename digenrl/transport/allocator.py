"""The C allocator's thresholds for a node that receives large messages all the time.

libzmq allocates every received message of more than a few KiB with ``malloc`` in its I/O
thread, and the tensors decoded from it free it once read. glibc's defaults return that
memory to the kernel as it goes: a block over the mmap threshold (128 KiB at first, raised
to the largest block freed, up to 32 MiB) is unmapped on free, and free space of more than
twice that at the top of a heap is trimmed. A node then page-faults and zeroes fresh pages
for most chunks it receives: perf showed ``clear_page_erms`` and page faults in the I/O
threads' receive copies, and ``bench/transport.py`` measured goodput with the thresholds
below against glibc's defaults (docs/benchmarks.md, Transport).

:func:`tune` fixes the thresholds so blocks of up to :data:`MMAP_THRESHOLD` come from the
heap and up to :data:`TRIM_THRESHOLD` of free heap is kept for the next messages. Nodes call
it at start. It does nothing off glibc, or where the operator has set the allocator
(``GLIBC_TUNABLES`` or ``MALLOC_*_`` in the environment), or with ``DIGENRL_MALLOC=default``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 32 << 20
"""Blocks under this come from the heap (a 16 MiB chunk, a 4 MiB weights part)."""
TRIM_THRESHOLD = 64 << 20
"""Free heap kept before any is returned to the kernel (per arena: a few chunks in flight fit;
a node that freed gigabytes of weights still gives them back)."""

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3


def tune() -> bool:
    """Set the thresholds; True when set (see the module docstring for when it is not)."""
    if os.environ.get("DIGENRL_MALLOC", "") == "default":
        return False
    if "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ):
        return False  # the operator chose
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
