"""Kills a server's sandboxes once the server is gone, whatever way it went (kill -9 included).

A running sandbox dies with its server by itself (its agent exits on its socket's EOF and on a pidfd
of the server), but a paused one is frozen by the cgroup freezer and notices nothing: without this it
would hold its memory until the next server on the host removes what dead servers left (found by
benchmarks/chaos.py). The backend starts the watchdog with a pipe on stdin and keeps the other end;
the kernel closes that end when the server exits, and the watchdog then kills every task in the
instance's cgroups (frozen ones thawed first) and removes them. After a clean stop there is nothing
left to kill. Run as ``python -m agentcell.backends.linux.watchdog <cgroup rel>``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from agentcell.backends.linux import cgroups


def start(module: str, *args: str) -> subprocess.Popen[bytes]:
    """`python -m module args` as a watchdog: its stdin a pipe only this server holds, its own session
    (a Ctrl-C meant for the server does not reach it)."""
    return subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                            start_new_session=True, close_fds=True)


def wait_for_server() -> None:
    """Until the server is gone: its end of our stdin closed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.read(0, 4096):
        pass


def clear(rel: str) -> None:
    cgroups.kill_tree(rel)
    cgroups.remove_tree(rel, timeout=10)


def main(rel: str) -> int:
    wait_for_server()
    clear(rel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
