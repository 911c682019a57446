"""What the sync and async code-interpreter APIs share: the request and the NDJSON line parser."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from agentcell.errors import InvalidArgumentException, SandboxException, TimeoutException
from agentcell.sdk.models import Context, Execution, ExecutionError, OutputMessage, Result

DEFAULT_TIMEOUT = 300.0  # seconds, like e2b-code-interpreter


def execute_body(code: str, language: str | None, context: Context | str | None,
                 envs: dict[str, str] | None, timeout: float | None) -> dict[str, Any]:
    if language and context:
        raise InvalidArgumentException("You can provide context or language, but not both at the same time.")
    context_id = context.id if isinstance(context, Context) else context
    body = {"code": code, "context_id": context_id, "language": language, "env_vars": envs}
    if timeout is not None:
        body["timeout"] = timeout  # agentcell: the sandbox interrupts the run at this total deadline
    return body


def exec_timeout(timeout: float | None) -> float | None:
    return None if timeout == 0 else (timeout or DEFAULT_TIMEOUT)


class Deadline:
    """The run's total deadline. The server interrupts the run at it (keepalive lines would keep a
    read timeout from ever firing); the client raises TimeoutException once it is past."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self._end = time.monotonic() + timeout if timeout is not None else None

    def read_timeout(self) -> float | None:
        # a backstop for servers that do not enforce the deadline and send no keepalives
        return self.timeout + 10 if self.timeout is not None else None

    def check(self) -> None:
        if self._end is not None and time.monotonic() >= self._end:
            raise execution_timeout_error()


def execution_timeout_error() -> TimeoutException:
    return TimeoutException("Execution timed out — the 'timeout' option (seconds, 0 = none) can be used to increase it")


def context_body(cwd: str | None, language: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if language:
        body["language"] = language
    if cwd:
        body["cwd"] = cwd
    return body


def context_id(context: Context | str) -> str:
    return context.id if isinstance(context, Context) else context


def parse_line(execution: Execution, raw: str | bytes) -> tuple[str, Any] | None:
    """Apply one NDJSON line to `execution`; returns (callback kind, value) when a callback is due."""
    if not raw:
        return None
    data = json.loads(raw)
    kind = data.pop("type", None)
    if kind == "result":
        result = Result(**data)
        execution.results.append(result)
        return "result", result
    if kind == "stdout":
        execution.logs.stdout.append(data["text"])
        return "stdout", OutputMessage(data["text"], data.get("timestamp", 0), False)
    if kind == "stderr":
        execution.logs.stderr.append(data["text"])
        return "stderr", OutputMessage(data["text"], data.get("timestamp", 0), True)
    if kind == "error":
        execution.error = ExecutionError(data.get("name", ""), data.get("value", ""), data.get("traceback", ""))
        return "error", execution.error
    if kind == "number_of_executions":
        execution.execution_count = data.get("execution_count")
    return None  # keepalive, end_of_execution, unknown


def callbacks(on_stdout: Callable | None, on_stderr: Callable | None, on_result: Callable | None,
              on_error: Callable | None) -> dict[str, Callable]:
    return {k: v for k, v in (("stdout", on_stdout), ("stderr", on_stderr), ("result", on_result),
                              ("error", on_error)) if v is not None}


def not_json_error(e: ValueError) -> SandboxException:
    return SandboxException(f"the code interpreter sent a line that is not JSON: {e}")
