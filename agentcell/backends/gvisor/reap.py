"""The server as a subreaper of runsc's detached processes.

`runsc run --detach` leaves the sandbox (sentry) and gofer processes behind when it exits; without a
subreaper they become init's children, and a host init that reaps lazily keeps them as zombies for
seconds (runsc delete then waits on them). With PR_SET_CHILD_SUBREAPER they become the server's
children, and `reap()` collects those that exited. It reaps only runsc's own leftovers (by name),
never a child some other part of the server waits for.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os

_PR_SET_CHILD_SUBREAPER = 36
_OURS = ("runsc-sandbox", "runsc-gofer", "exe")


def become_subreaper() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap() -> int:
    """waitpid the exited runsc processes among our children; how many."""
    n = 0
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with contextlib.suppress(OSError), open(path) as f:
            pids = [int(p) for p in f.read().split()]
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            state = stat[stat.rindex(")") + 2:][:1]
            if state == "Z" and comm.startswith(_OURS):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                    n += 1
    return n
