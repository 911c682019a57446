"""A client of QEMU's machine protocol (QMP) on one end of a socketpair the VMM got as its monitor.

QMP is JSON lines: a greeting, `qmp_capabilities`, then commands answered in order, with events
interleaved. The VMM is jailed and treated as hostile after a guest escape: every line it sends is
size-bounded and parsed as data, never trusted to be well-formed.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

MAX_LINE = 1 << 20  # a QMP answer larger than this is a broken (or hostile) VMM


class QmpError(Exception):
    """The VMM refused a command or broke the protocol."""


class Qmp:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.events: list[dict[str, Any]] = []
        self._lock = asyncio.Lock()

    async def connect(self, timeout: float = 30.0) -> None:
        self._sock.setblocking(False)
        self._reader, self._writer = await asyncio.open_unix_connection(sock=self._sock, limit=MAX_LINE)
        async with asyncio.timeout(timeout):
            greeting = await self._line()
            if "QMP" not in greeting:
                raise QmpError(f"not a QMP greeting: {str(greeting)[:200]}")
        await self.call("qmp_capabilities", timeout=timeout)

    async def _line(self) -> dict[str, Any]:
        assert self._reader is not None
        try:
            line = await self._reader.readline()
        except (ValueError, asyncio.LimitOverrunError) as e:
            raise QmpError("QMP line too long") from e
        if not line:
            raise QmpError("the VMM closed its monitor (it exited)")
        try:
            msg = json.loads(line)
        except ValueError as e:
            raise QmpError(f"QMP sent something that is not JSON: {line[:200]!r}") from e
        if not isinstance(msg, dict):
            raise QmpError("QMP sent a non-object")
        return msg

    async def call(self, command: str, timeout: float = 30.0, **arguments: Any) -> Any:
        """Run `command`; its "return", or QmpError with QEMU's description."""
        assert self._writer is not None, "connect() first"
        async with self._lock, asyncio.timeout(timeout):
            msg: dict[str, Any] = {"execute": command}
            if arguments:
                msg["arguments"] = arguments
            self._writer.write(json.dumps(msg).encode() + b"\n")
            await self._writer.drain()
            return await self._answer(command)

    async def send_fd(self, name: str, fd: int, timeout: float = 30.0) -> None:
        """Give the VMM `fd` under `name` (QMP's getfd, the fd in SCM_RIGHTS): how a jailed VMM that sees
        no host files gets the one file a migration reads or writes."""
        assert self._writer is not None, "connect() first"
        async with self._lock, asyncio.timeout(timeout):
            await self._writer.drain()
            msg = json.dumps({"execute": "getfd", "arguments": {"fdname": name}}).encode() + b"\n"
            socket.send_fds(self._sock, [msg], [fd])
            await self._answer("getfd")

    async def _answer(self, command: str) -> Any:
        """The answer to the command just sent (events before it kept aside): its "return", or QmpError."""
        while True:
            answer = await self._line()
            if "event" in answer:
                self._keep(answer)
                continue
            if "error" in answer:
                err = answer["error"]
                desc = err.get("desc") if isinstance(err, dict) else err
                raise QmpError(f"{command}: {desc}")
            return answer.get("return")

    def _keep(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        del self.events[:-64]  # bounded: only recent ones matter

    async def wait_migration(self, timeout: float = 120.0) -> None:
        """Until the running migration (save or load) completes; QmpError if it fails."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            info = await self.call("query-migrate")
            status = (info or {}).get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise QmpError(f"migration {status}: {(info or {}).get('error-desc', '')}")
            if asyncio.get_running_loop().time() > deadline:
                raise QmpError(f"migration did not complete within {timeout:g} s (status {status})")
            await asyncio.sleep(0.002)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        else:
            self._sock.close()
