"""The one child reaper of the agent (pid 1 of the sandbox).

Every child of the agent — commands, code contexts and orphans the kernel re-parents to pid 1 — is
reaped here with ``waitpid(-1, WNOHANG)`` on SIGCHLD. Nothing else in the agent may wait for a child
(asyncio subprocesses or ``Popen.wait`` would race with this loop and lose exit statuses).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

ExitCallback = Callable[[int], None]

# Go's names for signals (syscall.Signal.String() on linux), so end statuses read like envd's.
_GO_SIGNAL_NAMES = {
    1: "hangup", 2: "interrupt", 3: "quit", 4: "illegal instruction", 5: "trace/breakpoint trap",
    6: "aborted", 7: "bus error", 8: "floating point exception", 9: "killed",
    10: "user defined signal 1", 11: "segmentation fault", 12: "user defined signal 2",
    13: "broken pipe", 14: "alarm clock", 15: "terminated", 16: "stack fault", 17: "child exited",
    18: "continued", 19: "stopped (signal)", 20: "stopped", 21: "stopped (tty input)",
    22: "stopped (tty output)", 23: "urgent I/O condition", 24: "CPU time limit exceeded",
    25: "file size limit exceeded", 26: "virtual timer expired", 27: "profiling timer expired",
    28: "window changed", 29: "I/O possible", 30: "power failure", 31: "bad system call",
}  # fmt: skip


def describe_status(status: int) -> tuple[int, bool, str]:
    """(exit_code, exited, status text) of a wait status, as Go's os.ProcessState reports them."""
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        return code, True, f"exit status {code}"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        text = "signal: " + _GO_SIGNAL_NAMES.get(sig, f"signal {sig}")
        if os.WCOREDUMP(status):
            text += " (core dumped)"
        return -1, False, text
    return -1, False, f"unknown wait status {status:#x}"


class Reaper:
    """Routes the exit status of each reaped child to the callback registered for its pid."""

    def __init__(self) -> None:
        self._callbacks: dict[int, ExitCallback] = {}

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGCHLD, self.reap)
        self.reap()  # children that ended before the handler existed

    def watch(self, pid: int, callback: ExitCallback) -> None:
        """Call ``callback(wait_status)`` once `pid` ends. Register right after fork/spawn, before
        yielding to the loop, so the exit cannot be reaped first."""
        self._callbacks[pid] = callback

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            callback = self._callbacks.pop(pid, None)
            if callback is not None:  # orphans re-parented to pid 1 have none: reaping them is the job
                callback(status)
