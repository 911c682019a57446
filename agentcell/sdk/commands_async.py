"""`sbx.commands` for AsyncSandbox: process.Process over Connect-RPC."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any

from agentcell.errors import NotFoundException
from agentcell.sdk import commands as c
from agentcell.sdk import fast_async_http
from agentcell.sdk.config import SandboxConnection
from agentcell.sdk.connect_rpc import astream, aunary
from agentcell.sdk.methods import call_back
from agentcell.sdk.models import CommandResult, ProcessInfo

OnOutput = Callable[[str], Any] | None


class AsyncCommandHandle:
    """A running command. Its output is consumed in a background task (calling on_stdout/on_stderr);
    `await wait()` returns the result, `kill()` / `disconnect()` end it."""

    def __init__(self, pid: int, events: AsyncIterator[dict[str, Any]], commands: AsyncCommands,
                 on_stdout: OnOutput = None, on_stderr: OnOutput = None, on_pty: Callable[[bytes], Any] | None = None,
                 retain_output: bool = True) -> None:
        self._pid = pid
        self._events = events
        self._commands = commands
        self._output = c.Output(retain_output)
        self._timeout: float | None = None
        self._started = time.monotonic()
        self._on = (on_stdout, on_stderr, on_pty)
        self._task = asyncio.create_task(self._consume())

    async def _consume(self) -> None:
        on_stdout, on_stderr, on_pty = self._on
        feed = self._output.feed
        try:
            async for msg in self._events:
                chunk = feed(msg)
                if chunk is None:
                    continue
                out, err, pty = chunk
                if out is not None:
                    await call_back(on_stdout, out)
                elif err is not None:
                    await call_back(on_stderr, err)
                elif pty is not None:
                    await call_back(on_pty, pty)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def stdout(self) -> str:
        return "".join(self._output.stdout)

    @property
    def stderr(self) -> str:
        return "".join(self._output.stderr)

    @property
    def exit_code(self) -> int | None:
        return self._output.result.exit_code if self._output.result else None

    @property
    def error(self) -> str | None:
        return self._output.result.error if self._output.result else None

    async def wait(self) -> CommandResult:
        """Wait for the end; raises CommandExitException on a non-zero exit code."""
        await asyncio.shield(self._task)
        return self._output.finish(self._timeout, self._started)

    async def kill(self) -> bool:
        return await self._commands.kill(self._pid)

    async def disconnect(self) -> None:
        """Stop receiving output; the command keeps running."""
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def send_stdin(self, data: str | bytes, request_timeout: float | None = None) -> None:
        await self._commands.send_stdin(self._pid, data, request_timeout)

    async def close_stdin(self, request_timeout: float | None = None) -> None:
        await self._commands.close_stdin(self._pid, request_timeout)


class AsyncCommands:
    def __init__(self, conn: SandboxConnection) -> None:
        self._conn = conn

    async def _unary(self, path: str, msg: dict[str, Any], request_timeout: float | None) -> dict[str, Any]:
        rt = request_timeout or self._conn.config.request_timeout or None
        return await aunary(fast_async_http.client(self._conn.config.endpoint), path, msg, self._conn.envd_headers,
                            (rt, rt), self._conn.sandbox_id)

    async def _stream(self, path: str, msg: dict[str, Any], user: str | None, t: float | None,
                      request_timeout: float | None) -> tuple[int, AsyncIterator[dict[str, Any]]]:
        rt = request_timeout or self._conn.config.request_timeout or None
        headers = {**self._conn.envd_user_headers(user), **c.STREAM_EXTRA_HEADERS}
        events = astream(fast_async_http.client(self._conn.config.endpoint), path, msg, headers,
                         (rt, c.read_timeout(t)), self._conn.sandbox_id, c.timeout_ms(t))
        try:
            pid = c.first_pid(await anext(events))
        except StopAsyncIteration:
            raise NotFoundException(f"{path}: the stream ended before the process started") from None
        except BaseException:
            await events.aclose()  # type: ignore[attr-defined]
            raise
        return pid, events

    async def run(self, cmd: str, background: bool = False, envs: dict[str, str] | None = None,
                  user: str | None = None, cwd: str | None = None, on_stdout: OnOutput = None,
                  on_stderr: OnOutput = None, stdin: bool = False, timeout: float | None = 60,
                  request_timeout: float | None = None, tag: str | None = None,
            retain_output: bool = True) -> CommandResult | AsyncCommandHandle:
        """Like Sandbox.commands.run; background=True returns an AsyncCommandHandle."""
        started = time.monotonic()
        pid, events = await self._stream(c.START, c.start_message(cmd, envs, cwd, stdin, tag), user, timeout,
                                         request_timeout)
        handle = AsyncCommandHandle(pid, events, self, on_stdout, on_stderr, retain_output=retain_output)
        handle._timeout, handle._started = timeout, started
        return handle if background else await handle.wait()

    async def connect(self, pid: int, timeout: float | None = 60, request_timeout: float | None = None,
                      on_stdout: OnOutput = None, on_stderr: OnOutput = None,
                      retain_output: bool = True) -> AsyncCommandHandle:
        p, events = await self._stream(c.CONNECT, {"process": {"pid": pid}}, None, timeout, request_timeout)
        return AsyncCommandHandle(p, events, self, on_stdout, on_stderr, retain_output=retain_output)

    async def list(self, request_timeout: float | None = None) -> list[ProcessInfo]:
        res = await self._unary(c.LIST, {}, request_timeout)
        return [c.process_info(p) for p in res.get("processes", [])]

    async def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        try:
            await self._unary(c.SEND_SIGNAL, {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}, request_timeout)
        except NotFoundException:
            return False
        return True

    async def send_stdin(self, pid: int, data: str | bytes, request_timeout: float | None = None) -> None:
        await self._unary(c.SEND_INPUT, c.input_message(pid, data), request_timeout)

    async def stream_input(self, pid: int, data: Iterable[str | bytes] | AsyncIterable[str | bytes], *,
                     timeout: float | None = 60.0) -> None:
        """Send `data`'s chunks to the process's stdin as they come, within `timeout` seconds in all
        (0 / None: no limit); as e2b's stream_input (agentcell sends one SendInput per chunk)."""
        deadline = c.InputDeadline(timeout)
        chunks = c.input_chunks(data)
        if isinstance(chunks, AsyncIterable):
            async for chunk in chunks:
                await self.send_stdin(pid, chunk, deadline.remaining())
            return
        for chunk in chunks:  # type: ignore[union-attr]
            await self.send_stdin(pid, chunk, deadline.remaining())

    async def close_stdin(self, pid: int, request_timeout: float | None = None) -> None:
        await self._unary(c.CLOSE_STDIN, {"process": {"pid": pid}}, request_timeout)
