"""glibc's malloc, set for a process that runs for weeks (the server, the gateway, their helpers).

glibc starts with an mmap threshold of 128 KiB: a larger block is mmapped, and returned to the kernel when
freed. But each time such a block is freed, glibc raises the threshold to its size (up to 32 MiB), and the
trim threshold to twice that (up to 64 MiB). After a few large buffers (a file up or down, a command's output,
a template's layer), blocks of a few MiB come from the arenas instead, and an arena keeps the free top of its
heap until it is 64 MiB. Measured in a soak (docs/reliability.md): two thread arenas held 30 MiB, of which
93 KiB was in use, and the server's RSS stepped up with each new largest buffer. Pinning both thresholds at
glibc's starting values keeps that memory returned. Where the C library is not glibc, this does nothing.
"""

from __future__ import annotations

import ctypes

# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's defaults (DEFAULT_MMAP_THRESHOLD_MIN, DEFAULT_TRIM_THRESHOLD); setting them turns the raising off
MMAP_THRESHOLD = 128 * 1024
TRIM_THRESHOLD = 128 * 1024


def pin_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds at their starting values; True if glibc took them."""
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on (find_library would spawn ldconfig)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
