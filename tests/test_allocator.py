"""agentcell/allocator.py: with glibc's thresholds pinned, a thread's freed buffers go back to the kernel.

The pattern is the soak's (docs/reliability.md): one large buffer freed (glibc then raises its thresholds),
then a few MiB of buffers in a worker thread, freed while something small allocated after them lives on.
Each case runs in a fresh interpreter, so that glibc starts from its defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentcell import allocator

CHILD = r"""
import sys, threading
from agentcell import allocator
if sys.argv[1] == "pin":
    assert allocator.pin_thresholds()

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024

def work():
    large = b"x" * (16 << 20)  # mmapped; freeing it raises glibc's thresholds to 16 and 32 MiB
    del large
    buffers = [b"x" * (2 << 20) for _ in range(20)]  # 40 MiB, from this thread's arena
    small = [b"y" * 1000 for _ in range(1000)]  # malloc'd (not pymalloc), and kept
    del buffers
    return small

kept = []
before = rss_mib()
thread = threading.Thread(target=lambda: kept.append(work()))
thread.start()
thread.join()
print(rss_mib() - before)
"""


def retained_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout)


pytestmark = pytest.mark.skipif(not allocator.pin_thresholds(), reason="the C library is not glibc")


def test_freed_buffers_stay_in_the_arena_without_pinning() -> None:
    # what the server did before allocator.py: the 40 MiB stays in its RSS
    assert retained_mib("default") >= 30


def test_pinned_thresholds_return_freed_buffers_to_the_kernel() -> None:
    assert retained_mib("pin") <= 4
