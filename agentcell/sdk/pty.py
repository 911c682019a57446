"""`sbx.pty`: interactive terminals (e2b's Pty / AsyncPty), process.Process with a PTY attached.

A PTY is a login bash (`bash -i -l`) whose output comes as raw bytes (`on_pty` / `on_data`); input goes
in as bytes (`send_stdin`), and `resize` changes its window size.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from agentcell.sdk import commands as c
from agentcell.sdk.commands_async import AsyncCommandHandle, AsyncCommands
from agentcell.sdk.commands_sync import CommandHandle, Commands
from agentcell.sdk.models import PtySize

UPDATE = "/process.Process/Update"


def start_message(size: PtySize, cwd: str | None, envs: dict[str, str] | None) -> dict[str, Any]:
    env = dict(envs or {})
    for key, value in (("TERM", "xterm-256color"), ("LANG", "C.UTF-8"), ("LC_ALL", "C.UTF-8")):
        env.setdefault(key, value)  # as e2b's SDK: a usable terminal unless told otherwise
    process: dict[str, Any] = {"cmd": "/bin/bash", "args": ["-i", "-l"], "envs": env}
    if cwd:
        process["cwd"] = cwd
    return {"process": process, "pty": {"size": _size(size)}}


def _size(size: PtySize) -> dict[str, int]:
    return {"rows": int(size.rows), "cols": int(size.cols)}


def input_message(pid: int, data: bytes) -> dict[str, Any]:
    return {"process": {"pid": pid}, "input": {"pty": base64.b64encode(data).decode()}}


def resize_message(pid: int, size: PtySize) -> dict[str, Any]:
    return {"process": {"pid": pid}, "pty": {"size": _size(size)}}


class Pty:
    def __init__(self, commands: Commands) -> None:
        self._commands = commands

    def create(self, size: PtySize, user: str | None = None, cwd: str | None = None,
               envs: dict[str, str] | None = None, timeout: float | None = 60,
               request_timeout: float | None = None) -> CommandHandle:
        """Start a terminal; iterate the handle (or `wait(on_pty=...)`) for its output bytes."""
        pid, events = self._commands._stream(c.START, start_message(size, cwd, envs), user, timeout, request_timeout)
        return CommandHandle(pid, events, self._commands)

    def connect(self, pid: int, timeout: float | None = 60, request_timeout: float | None = None) -> CommandHandle:
        return self._commands.connect(pid, timeout, request_timeout)

    def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        return self._commands.kill(pid, request_timeout)

    def send_stdin(self, pid: int, data: bytes, request_timeout: float | None = None) -> None:
        self._commands._unary(c.SEND_INPUT, input_message(pid, data), request_timeout)

    def resize(self, pid: int, size: PtySize, request_timeout: float | None = None) -> None:
        self._commands._unary(UPDATE, resize_message(pid, size), request_timeout)


class AsyncPty:
    def __init__(self, commands: AsyncCommands) -> None:
        self._commands = commands

    async def create(self, size: PtySize, on_data: Callable[[bytes], Any], user: str | None = None,
                     cwd: str | None = None, envs: dict[str, str] | None = None, timeout: float | None = 60,
                     request_timeout: float | None = None) -> AsyncCommandHandle:
        """Start a terminal; `on_data` gets its output bytes (a coroutine function is awaited)."""
        pid, events = await self._commands._stream(c.START, start_message(size, cwd, envs), user, timeout,
                                                   request_timeout)
        return AsyncCommandHandle(pid, events, self._commands, on_pty=on_data)

    async def connect(self, pid: int, on_data: Callable[[bytes], Any], timeout: float | None = 60,
                      request_timeout: float | None = None) -> AsyncCommandHandle:
        p, events = await self._commands._stream(c.CONNECT, {"process": {"pid": pid}}, None, timeout, request_timeout)
        return AsyncCommandHandle(p, events, self._commands, on_pty=on_data)

    async def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        return await self._commands.kill(pid, request_timeout)

    async def send_stdin(self, pid: int, data: bytes, request_timeout: float | None = None) -> None:
        await self._commands._unary(c.SEND_INPUT, input_message(pid, data), request_timeout)

    async def resize(self, pid: int, size: PtySize, request_timeout: float | None = None) -> None:
        await self._commands._unary(UPDATE, resize_message(pid, size), request_timeout)
