"""The sandbox's own channel into its behaviour record (issue 10): code in the sandbox may send a JSON
object to the abstract unix socket ``@agentcell-report`` (a datagram, at most 4 KiB; or call
``report()`` below), and it is recorded as a ``self.report`` event with ``source: "self"``. The
record marks these as the sandbox's own word: nothing host-side vouches for them, and they are rate
limited by the server like everything else the sandbox causes.

The socket lives in the sandbox's network namespace (abstract names are per namespace), so a
sandbox can only ever report into its own record. The sender's pid comes from the kernel
(SCM_CREDENTIALS), not from the datagram.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import Callable
from typing import Any

ADDRESS = "\0agentcell-report"
MAX_DATAGRAM = 4096
MAX_FIELDS = 32
_UCRED = struct.Struct("3i")


def report(what: str, **data: Any) -> bool:
    """From code in the sandbox: add a self-reported event to this sandbox's record; False if the
    channel is not there (not in an agentcell sandbox) or the report is too big."""
    payload = json.dumps({"what": what, **data}, default=str).encode()
    if len(payload) > MAX_DATAGRAM:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(payload, ADDRESS)
        except OSError:
            return False
    return True


class SelfReports:
    """The agent's end: reads the datagrams and hands each as a dict to `send` (a frame to the server)."""

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        self.send = send
        self.sock: socket.socket | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(ADDRESS)
        except OSError:
            sock.close()  # taken already (by the sandbox's code, before the claim: nothing of ours to lose)
            return
        self.sock = sock
        loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        assert self.sock is not None
        for _ in range(64):  # a burst at a time; the loop serves the rest later
            try:
                data, ancdata, _, _ = self.sock.recvmsg(MAX_DATAGRAM + 1, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            pid = None
            for level, kind, value in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(value) >= _UCRED.size:
                    pid = _UCRED.unpack(value[:_UCRED.size])[0]
            if len(data) > MAX_DATAGRAM:
                continue
            try:
                body = json.loads(data)
            except ValueError:
                continue
            if not isinstance(body, dict):
                continue
            fields = dict(list(body.items())[:MAX_FIELDS])
            self.send({"pid": pid, "what": str(fields.pop("what", ""))[:200], "data": fields})

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
