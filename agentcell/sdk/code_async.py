"""run_code and code contexts for AsyncSandbox (POST /execute NDJSON on port 49999)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import httpx

from agentcell.sdk import code as c
from agentcell.sdk.config import SandboxConnection
from agentcell.sdk.models import Context, Execution
from agentcell.sdk.transport import async_client, error_from_http, error_from_transport, timeout


class AsyncCodeInterpreter:
    def __init__(self, conn: SandboxConnection) -> None:
        self._conn = conn

    async def run_code(self, code: str, language: str | None = None, context: Context | None = None,
                       on_stdout: Callable | None = None, on_stderr: Callable | None = None,
                       on_result: Callable | None = None, on_error: Callable | None = None,
                       envs: dict[str, str] | None = None, timeout: float | None = None,
                       request_timeout: float | None = None) -> Execution:
        deadline = c.Deadline(c.exec_timeout(timeout))
        body = c.execute_body(code, language, context, envs, deadline.timeout)
        cbs = c.callbacks(on_stdout, on_stderr, on_result, on_error)
        t = httpx.Timeout(deadline.read_timeout(), connect=request_timeout or self._conn.config.request_timeout)
        client = async_client(self._conn.config.endpoint)
        execution = Execution()
        try:
            req = client.build_request("POST", "/execute", json=body, headers=self._conn.code_headers, timeout=t)
            r = await client.send(req, stream=True)
            try:
                if r.status_code != 200:
                    raise error_from_http(r.status_code, await r.aread(), self._conn.sandbox_id, "run_code")
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
        except httpx.ReadTimeout:
            raise c.execution_timeout_error() from None
        except httpx.HTTPError as e:
            raise error_from_transport(e, "run_code") from None
        return execution

    async def _json(self, method: str, path: str, body: dict[str, Any] | None, request_timeout: float | None) -> Any:
        try:
            r = await async_client(self._conn.config.endpoint).request(
                method, path, json=body, headers=self._conn.code_headers,
                timeout=timeout(request_timeout or self._conn.config.request_timeout))
        except httpx.HTTPError as e:
            raise error_from_transport(e, path) from None
        if r.status_code >= 300:
            raise error_from_http(r.status_code, r.content, self._conn.sandbox_id, path)
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
