"""What the server's helper processes (the record's collectors, the egress proxy) have in common: the
socketpair they talk over, dying with the server, finding them in /proc, and how often one that died
is started again."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from typing import Any

import orjson

_PR_SET_PDEATHSIG = 1


def socketpair(buffer: int) -> tuple[socket.socket, socket.socket]:
    """A SOCK_SEQPACKET pair (one message a packet) whose queues hold `buffer` bytes each way."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (ours, theirs):
        for opt, force in ((socket.SO_SNDBUF, 32), (socket.SO_RCVBUF, 33)):  # SO_*BUFFORCE: past wmem_max
            try:
                s.setsockopt(socket.SOL_SOCKET, force, buffer)
            except OSError:  # without CAP_NET_ADMIN: as much as the host's maximum allows
                s.setsockopt(socket.SOL_SOCKET, opt, buffer)
    return ours, theirs


def die_with_parent() -> bool:
    """SIGTERM when the server dies; False if it is already gone (nothing to do then)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    return os.getppid() != 1


def processes_of(server_pid: int, module: str) -> list[int]:
    """The pids of a server's children started as `python -m module`, from /proc."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if ppid == server_pid and module.encode() in f.read():
                    found.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return found


class RestartBudget:
    """At most `times` restarts in `period_s`: a child that keeps dying is left dead (and said so)."""

    def __init__(self, times: int, period_s: float) -> None:
        self.times, self.period_s = times, period_s
        self._at: list[float] = []

    def take(self) -> bool:
        now = time.monotonic()
        self._at = [t for t in self._at if now - t < self.period_s] + [now]
        return len(self._at) <= self.times


class ChildGone(Exception):
    """The child closed its end (it exited, or was killed); the message says how."""


SKIP = object()  # receive(): nothing waiting, or a packet that is no message (skipped)


def receive(sock: socket.socket, buffer: bytearray, proc: subprocess.Popen[bytes] | None) -> Any:
    """The next packet's message (an orjson array), SKIP when none is waiting or it is not JSON;
    ChildGone when the child's end is closed."""
    try:
        n = sock.recv_into(buffer)
    except BlockingIOError:
        return SKIP
    except OSError as e:
        n, why = 0, str(e)
    else:
        why = "it exited"
    if not n:
        code = proc.poll() if proc is not None else None
        raise ChildGone(f"{why}{'' if code is None else f' with status {code}'}")
    try:
        return orjson.loads(memoryview(buffer)[:n])
    except orjson.JSONDecodeError:
        return SKIP
