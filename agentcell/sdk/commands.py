"""What the sync and async command APIs share: the Start request and the decoding of process events."""

from __future__ import annotations

import base64
import codecs
import time
from collections.abc import Iterable
from typing import Any

from agentcell.errors import (
    CommandExitException,
    InvalidArgumentException,
    SandboxException,
    TimeoutException,
)
from agentcell.sdk.models import CommandResult, ProcessInfo

START = "/process.Process/Start"
CONNECT = "/process.Process/Connect"
LIST = "/process.Process/List"
SEND_INPUT = "/process.Process/SendInput"
SEND_SIGNAL = "/process.Process/SendSignal"
CLOSE_STDIN = "/process.Process/CloseStdin"
STREAM_EXTRA_HEADERS = {"Keepalive-Ping-Interval": "50"}
# How much longer than the command's own timeout the client waits for a silent stream before giving up.
READ_SLACK_S = 5.0


def start_message(cmd: str, envs: dict[str, str] | None, cwd: str | None, stdin: bool, tag: str | None) -> dict[str, Any]:
    process: dict[str, Any] = {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}
    if envs:
        process["envs"] = envs
    if cwd:
        process["cwd"] = cwd
    msg: dict[str, Any] = {"process": process, "stdin": stdin}
    if tag:
        msg["tag"] = tag
    return msg


def input_chunks(data: Any) -> Iterable[str | bytes]:
    """stream_input's data: an iterable of chunks (one str or bytes value is a mistake e2b refuses)."""
    if isinstance(data, str | bytes | bytearray):
        raise InvalidArgumentException("stream_input takes an iterable of chunks, not one str/bytes value; "
                                       "use send_stdin() for a single value")
    return data


class InputDeadline:
    """stream_input's total timeout (None: none)."""

    def __init__(self, timeout: float | None) -> None:
        self._end = time.monotonic() + timeout if timeout else None

    def remaining(self) -> float | None:
        if self._end is None:
            return None
        left = self._end - time.monotonic()
        if left <= 0:
            raise TimeoutException("stream_input: the timeout passed before all the input was sent; "
                                   "raise timeout= (seconds, 0 = none)")
        return left


def timeout_ms(timeout: float | None) -> int:
    return int(timeout * 1000) if timeout else 0


def read_timeout(timeout: float | None) -> float | None:
    return timeout + READ_SLACK_S if timeout else None


def input_message(pid: int, data: str | bytes) -> dict[str, Any]:
    raw = data.encode() if isinstance(data, str) else data
    return {"process": {"pid": pid}, "input": {"stdin": base64.b64encode(raw).decode()}}


def process_info(p: dict[str, Any]) -> ProcessInfo:
    cfg = p.get("config") or {}
    return ProcessInfo(
        pid=int(p.get("pid", 0)), tag=p.get("tag"), cmd=cfg.get("cmd", ""), args=list(cfg.get("args", [])),
        envs=dict(cfg.get("envs", {})), cwd=cfg.get("cwd"),
    )


def first_pid(msg: dict[str, Any]) -> int:
    start = (msg.get("event") or {}).get("start")
    if start is None:
        raise SandboxException(f"the process stream did not begin with a start event: {msg!r}")
    return int(start.get("pid", 0))


class Output:
    """Accumulates one process's output; `feed` turns an event into (stdout, stderr, pty) or None."""

    def __init__(self, retain: bool = True) -> None:
        self.retain = retain  # False (e2b's retain_output=False): output goes to callbacks only
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._out = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._err = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.result: CommandResult | None = None
        self.killed = False  # ended by a signal, not by exiting
        self.status: str | None = None  # the end's wait status as text: "exit status 3", "signal: killed"

    def feed(self, msg: dict[str, Any]) -> tuple[str | None, str | None, bytes | None] | None:
        event = msg.get("event") or {}
        data = event.get("data")
        if data is not None:
            if "stdout" in data:
                text = self._out.decode(base64.b64decode(data["stdout"]))
                if text:
                    if self.retain:
                        self.stdout.append(text)
                    return text, None, None
            elif "stderr" in data:
                text = self._err.decode(base64.b64decode(data["stderr"]))
                if text:
                    if self.retain:
                        self.stderr.append(text)
                    return None, text, None
            elif "pty" in data:
                return None, None, base64.b64decode(data["pty"])
            return None
        end = event.get("end")
        if end is not None:
            tail_out = self._out.decode(b"", final=True)
            tail_err = self._err.decode(b"", final=True)
            if tail_out and self.retain:
                self.stdout.append(tail_out)
            if tail_err and self.retain:
                self.stderr.append(tail_err)
            self.killed = not end.get("exited", False)
            self.status = end.get("status") or None
            self.result = CommandResult(
                stderr="".join(self.stderr), stdout="".join(self.stdout),
                exit_code=int(end.get("exitCode", 0)), error=end.get("error") or None,
            )
        return None

    def finish(self, timeout: float | None = None, started: float | None = None) -> CommandResult:
        r = self.result
        if r is None:
            raise SandboxException("the command's stream ended without an end event (disconnected?)")
        if self.killed and timeout and started is not None and time.monotonic() - started >= timeout - 0.05:
            # The sandbox SIGKILLs a command at its deadline (Connect-Timeout-Ms); report it as e2b does.
            raise TimeoutException(
                f"the command timed out after {timeout:g} s and was killed; pass timeout= (seconds, 0 = none) "
                "to allow longer, or background=True for long-running commands"
            )
        if r.exit_code != 0:
            raise CommandExitException(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code, error=r.error)
        return r
