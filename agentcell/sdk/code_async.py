"""run_code and code contexts for AsyncSandbox (POST /execute NDJSON on port 49999)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from agentcell.sdk import code as c
from agentcell.sdk import fast_async_http as fah
from agentcell.sdk.config import SandboxConnection
from agentcell.sdk.fast_http import JSON_HEADERS
from agentcell.sdk.models import Context, Execution
from agentcell.sdk.transport import error_from_http


class AsyncCodeInterpreter:
    def __init__(self, conn: SandboxConnection) -> None:
        self._conn = conn
        self._json_headers = {**conn.code_headers, **JSON_HEADERS}

    async def run_code(self, code: str, language: str | None = None, context: Context | None = None,
                       on_stdout: Callable | None = None, on_stderr: Callable | None = None,
                       on_result: Callable | None = None, on_error: Callable | None = None,
                       envs: dict[str, str] | None = None, timeout: float | None = None,
                       request_timeout: float | None = None) -> Execution:
        deadline = c.Deadline(c.exec_timeout(timeout))
        body = c.execute_body(code, language, context, envs, deadline.timeout)
        cbs = c.callbacks(on_stdout, on_stderr, on_result, on_error)
        execution = Execution()
        try:
            r = await fah.client(self._conn.config.endpoint).request(
                "POST", "/execute", body=fah.json_body(body), headers=self._json_headers,
                connect=request_timeout or self._conn.config.request_timeout or None,
                read=deadline.read_timeout(), stream=True)
            try:
                if r.status != 200:
                    raise error_from_http(r.status, await r.read(), self._conn.sandbox_id, "run_code")
                async for line in r.aiter_lines():
                    deadline.check()
                    due = c.parse_line(execution, line)
                    if due is not None and due[0] in cbs:
                        res = cbs[due[0]](due[1])
                        if inspect.isawaitable(res):
                            await res
                deadline.check()  # a run the server interrupted at the deadline ends this way
            finally:
                await r.aclose()
        except fah.ReadTimeout:
            raise c.execution_timeout_error() from None
        except fah.HTTPError as e:
            raise await fah.cut_off_error(fah.client(self._conn.config.endpoint), e, "run_code",
                                          self._conn.sandbox_id) from None
        return execution

    async def _json(self, method: str, path: str, body: dict[str, Any] | None, request_timeout: float | None) -> Any:
        rt = request_timeout or self._conn.config.request_timeout or None
        try:
            r = await fah.client(self._conn.config.endpoint).request(
                method, path, body=fah.json_body(body) if body is not None else None,
                headers=self._json_headers if body is not None else self._conn.code_headers, connect=rt, read=rt)
        except fah.HTTPError as e:
            raise fah.transport_error(e, path) from None
        if r.status >= 300:
            raise error_from_http(r.status, r.content, self._conn.sandbox_id, path)
        return r.json() if r.content else None

    async def create_code_context(self, cwd: str | None = None, language: str | None = None,
                                  request_timeout: float | None = None) -> Context:
        return Context.from_json(await self._json("POST", "/contexts", c.context_body(cwd, language), request_timeout))

    async def list_code_contexts(self, request_timeout: float | None = None) -> list[Context]:
        return [Context.from_json(x) for x in await self._json("GET", "/contexts", None, request_timeout)]

    async def remove_code_context(self, context: Context | str, request_timeout: float | None = None) -> None:
        await self._json("DELETE", f"/contexts/{c.context_id(context)}", None, request_timeout)

    async def restart_code_context(self, context: Context | str, request_timeout: float | None = None) -> None:
        await self._json("POST", f"/contexts/{c.context_id(context)}/restart", None, request_timeout)
