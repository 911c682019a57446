"""`sbx.commands` for the sync Sandbox: process.Process over Connect-RPC."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from agentcell.errors import NotFoundException
from agentcell.sdk import commands as c
from agentcell.sdk import fast_http
from agentcell.sdk.config import SandboxConnection
from agentcell.sdk.connect_rpc import stream, unary
from agentcell.sdk.models import CommandResult, ProcessInfo

OnOutput = Callable[[str], Any] | None


class CommandHandle:
    """A running command: iterate it for (stdout, stderr, pty) chunks, or wait(), kill(), disconnect()."""

    def __init__(self, pid: int, events: Iterator[dict[str, Any]], commands: Commands,
                 on_stdout: OnOutput = None, on_stderr: OnOutput = None, retain_output: bool = True) -> None:
        self._pid = pid
        self._events = events
        self._commands = commands
        self._output = c.Output(retain_output)
        self._timeout: float | None = None
        self._started = time.monotonic()
        self._on_stdout = on_stdout
        self._on_stderr = on_stderr

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

    def __iter__(self) -> Iterator[tuple[str | None, str | None, bytes | None]]:
        feed = self._output.feed
        for msg in self._events:
            chunk = feed(msg)
            if chunk is not None:
                yield chunk

    def wait(self, on_pty: Callable[[bytes], Any] | None = None, on_stdout: OnOutput = None,
             on_stderr: OnOutput = None) -> CommandResult:
        """Wait for the end; raises CommandExitException on a non-zero exit code."""
        on_stdout = on_stdout or self._on_stdout
        on_stderr = on_stderr or self._on_stderr
        for out, err, pty in self:
            if out is not None:
                if on_stdout:
                    on_stdout(out)
            elif err is not None:
                if on_stderr:
                    on_stderr(err)
            elif pty is not None and on_pty:
                on_pty(pty)
        return self._output.finish(self._timeout, self._started)

    def kill(self) -> bool:
        """SIGKILL the command; False if it already ended."""
        return self._commands.kill(self._pid)

    def disconnect(self) -> None:
        """Stop receiving output; the command keeps running (reattach with commands.connect(pid))."""
        self._events.close()  # type: ignore[attr-defined]

    def send_stdin(self, data: str | bytes, request_timeout: float | None = None) -> None:
        self._commands.send_stdin(self._pid, data, request_timeout)

    def close_stdin(self, request_timeout: float | None = None) -> None:
        self._commands.close_stdin(self._pid, request_timeout)


class Commands:
    def __init__(self, conn: SandboxConnection) -> None:
        self._conn = conn
        self._fast = fast_http.client(conn.config.endpoint)

    def _unary(self, path: str, msg: dict[str, Any], request_timeout: float | None) -> dict[str, Any]:
        rt = request_timeout or self._conn.config.request_timeout or None
        return unary(self._fast, path, msg, self._conn.envd_headers, (rt, rt), self._conn.sandbox_id)

    def _stream(self, path: str, msg: dict[str, Any], user: str | None, t: float | None,
                request_timeout: float | None) -> tuple[int, Iterator[dict[str, Any]]]:
        rt = request_timeout or self._conn.config.request_timeout or None
        headers = {**self._conn.envd_user_headers(user), **c.STREAM_EXTRA_HEADERS}
        events = stream(self._fast, path, msg, headers, (rt, c.read_timeout(t)), self._conn.sandbox_id,
                        c.timeout_ms(t))
        try:
            pid = c.first_pid(next(events))
        except StopIteration:
            raise NotFoundException(f"{path}: the stream ended before the process started") from None
        except BaseException:
            events.close()
            raise
        return pid, events

    def run(self, cmd: str, background: bool = False, envs: dict[str, str] | None = None, user: str | None = None,
            cwd: str | None = None, on_stdout: OnOutput = None, on_stderr: OnOutput = None, stdin: bool = False,
            timeout: float | None = 60, request_timeout: float | None = None, tag: str | None = None,
            retain_output: bool = True,
            ) -> CommandResult | CommandHandle:
        """Run `cmd` with bash -l -c. Foreground: the CommandResult (CommandExitException on non-zero exit).
        background=True: a CommandHandle at once. `timeout` seconds (0 = none) kills the command."""
        started = time.monotonic()
        pid, events = self._stream(c.START, c.start_message(cmd, envs, cwd, stdin, tag), user, timeout, request_timeout)
        handle = CommandHandle(pid, events, self, on_stdout, on_stderr, retain_output=retain_output)
        handle._timeout, handle._started = timeout, started
        return handle if background else handle.wait()

    def connect(self, pid: int, timeout: float | None = 60, request_timeout: float | None = None,
                on_stdout: OnOutput = None, on_stderr: OnOutput = None,
                retain_output: bool = True) -> CommandHandle:
        """Attach to a running command (output from now on)."""
        p, events = self._stream(c.CONNECT, {"process": {"pid": pid}}, None, timeout, request_timeout)
        return CommandHandle(p, events, self, on_stdout, on_stderr, retain_output=retain_output)

    def list(self, request_timeout: float | None = None) -> list[ProcessInfo]:
        res = self._unary(c.LIST, {}, request_timeout)
        return [c.process_info(p) for p in res.get("processes", [])]

    def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        try:
            self._unary(c.SEND_SIGNAL, {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}, request_timeout)
        except NotFoundException:
            return False
        return True

    def send_stdin(self, pid: int, data: str | bytes, request_timeout: float | None = None) -> None:
        self._unary(c.SEND_INPUT, c.input_message(pid, data), request_timeout)

    def stream_input(self, pid: int, data: Iterable[str | bytes], *,
                     timeout: float | None = 60.0) -> None:
        """Send `data`'s chunks to the process's stdin as they come, within `timeout` seconds in all
        (0 / None: no limit); as e2b's stream_input (agentcell sends one SendInput per chunk)."""
        deadline = c.InputDeadline(timeout)
        chunks = c.input_chunks(data)
        for chunk in chunks:
            self.send_stdin(pid, chunk, deadline.remaining())

    def close_stdin(self, pid: int, request_timeout: float | None = None) -> None:
        self._unary(c.CLOSE_STDIN, {"process": {"pid": pid}}, request_timeout)
