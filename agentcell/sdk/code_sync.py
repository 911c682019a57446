"""run_code and code contexts for the sync Sandbox (POST /execute NDJSON on port 49999)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from urllib3.exceptions import HTTPError, ReadTimeoutError

from agentcell.sdk import code as c
from agentcell.sdk import fast_http
from agentcell.sdk.config import SandboxConnection
from agentcell.sdk.fast_http import JSON_HEADERS
from agentcell.sdk.models import Context, Execution
from agentcell.sdk.transport import error_from_http, error_from_transport, sync_client, timeout


class CodeInterpreter:
    def __init__(self, conn: SandboxConnection) -> None:
        self._conn = conn
        self._client = sync_client(conn.config.endpoint)
        self._fast = fast_http.client(conn.config.endpoint)
        self._execute_headers = {**conn.code_headers, **JSON_HEADERS}

    def run_code(self, code: str, language: str | None = None, context: Context | None = None,
                 on_stdout: Callable | None = None, on_stderr: Callable | None = None,
                 on_result: Callable | None = None, on_error: Callable | None = None,
                 envs: dict[str, str] | None = None, timeout: float | None = None,
                 request_timeout: float | None = None) -> Execution:
        deadline = c.Deadline(c.exec_timeout(timeout))
        body = c.execute_body(code, language, context, envs, deadline.timeout)
        cbs = c.callbacks(on_stdout, on_stderr, on_result, on_error)
        execution = Execution()
        try:
            r = self._fast.request("POST", "/execute", body=fast_http.json_body(body), headers=self._execute_headers,
                                   connect=request_timeout or self._conn.config.request_timeout,
                                   read=deadline.read_timeout(), stream=True)
            complete = False
            try:
                if r.status != 200:
                    raise error_from_http(r.status, r.read(), self._conn.sandbox_id, "run_code")
                for line in fast_http.lines(r):
                    deadline.check()
                    due = c.parse_line(execution, line)
                    if due is not None and due[0] in cbs:
                        cbs[due[0]](due[1])
                complete = True
                deadline.check()  # a run the server interrupted at the deadline ends this way
            finally:
                fast_http.finish(r, complete)
        except ReadTimeoutError:
            raise c.execution_timeout_error() from None
        except HTTPError as e:
            raise fast_http.cut_off_error(self._fast, e, "run_code", self._conn.sandbox_id) from None
        return execution

    def _json(self, method: str, path: str, body: dict[str, Any] | None, request_timeout: float | None) -> Any:
        try:
            r = self._client.request(method, path, json=body, headers=self._conn.code_headers,
                                     timeout=timeout(request_timeout or self._conn.config.request_timeout))
        except httpx.HTTPError as e:
            raise error_from_transport(e, path) from None
        if r.status_code >= 300:
            raise error_from_http(r.status_code, r.content, self._conn.sandbox_id, path)
        return r.json() if r.content else None

    def create_code_context(self, cwd: str | None = None, language: str | None = None,
                            request_timeout: float | None = None) -> Context:
        return Context.from_json(self._json("POST", "/contexts", c.context_body(cwd, language), request_timeout))

    def list_code_contexts(self, request_timeout: float | None = None) -> list[Context]:
        return [Context.from_json(x) for x in self._json("GET", "/contexts", None, request_timeout)]

    def remove_code_context(self, context: Context | str, request_timeout: float | None = None) -> None:
        self._json("DELETE", f"/contexts/{c.context_id(context)}", None, request_timeout)

    def restart_code_context(self, context: Context | str, request_timeout: float | None = None) -> None:
        self._json("POST", f"/contexts/{c.context_id(context)}/restart", None, request_timeout)
