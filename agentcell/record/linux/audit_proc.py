"""Process exits from the kernel's proc connector (NETLINK_CONNECTOR, CN_IDX_PROC): the exit status
or the killing signal of every process, which the audit stream does not carry (a process killed by a
signal makes no exit_group call). Kernels 6.6+ filter by event type, so this socket only gets exits.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import NamedTuple

NETLINK_CONNECTOR = 11
CN_IDX_PROC, CN_VAL_PROC = 1, 1
PROC_CN_MCAST_LISTEN, PROC_CN_MCAST_IGNORE = 1, 2
PROC_EVENT_EXIT = 0x80000000

_NLMSG = struct.Struct("=IHHII")
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT_HEAD = struct.Struct("=IIQ")  # what, cpu, timestamp_ns (CLOCK_MONOTONIC)
_EXIT = struct.Struct("=IIIIII")  # pid, tgid, exit_code, exit_signal, parent_pid, parent_tgid
NLMSG_DONE = 3


class Exit(NamedTuple):
    host_pid: int
    status: int  # as wait(2) reports it: code << 8, or the signal number
    monotonic_ns: int

    @property
    def code(self) -> int | None:
        return None if self.status & 0x7F else self.status >> 8 & 0xFF

    @property
    def signal(self) -> int | None:
        return self.status & 0x7F or None


class ProcConnector:
    """A listener for process exits (needs CAP_NET_ADMIN)."""

    def __init__(self, rcvbuf: int = 4 << 20) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_CONNECTOR)
        self.sock.bind((0, CN_IDX_PROC))
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 33, rcvbuf)  # SO_RCVBUFFORCE
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self._send(PROC_CN_MCAST_LISTEN)
        self.sock.setblocking(False)

    def _send(self, op: int) -> None:
        payload = struct.pack("=II", op, PROC_EVENT_EXIT)  # struct proc_input: older kernels read the op only
        cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(payload), 0) + payload
        self.sock.send(_NLMSG.pack(_NLMSG.size + len(cn), NLMSG_DONE, 0, 0, os.getpid()) + cn)

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[Exit]:
        """The exits queued now (raises BlockingIOError when none; ENOBUFS when some were lost)."""
        data = self.sock.recv(1 << 16)
        exits = []
        at = 0
        while at + _NLMSG.size <= len(data):
            length = _NLMSG.unpack_from(data, at)[0]
            if length < _NLMSG.size:
                break
            body = at + _NLMSG.size + _CN_MSG.size
            if length >= _NLMSG.size + _CN_MSG.size + _EVENT_HEAD.size + _EXIT.size:
                what, _cpu, ts = _EVENT_HEAD.unpack_from(data, body)
                if what == PROC_EVENT_EXIT:
                    pid, tgid, status, _sig, _ppid, _ptgid = _EXIT.unpack_from(data, body + _EVENT_HEAD.size)
                    if pid == tgid:  # the process, not one of its threads
                        exits.append(Exit(tgid, status, ts))
            at += (length + 3) & ~3
        return exits

    def close(self) -> None:
        try:
            self._send(PROC_CN_MCAST_IGNORE)
        except OSError:
            pass
        self.sock.close()
