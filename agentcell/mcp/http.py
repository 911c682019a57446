"""MCP over streamable HTTP: one endpoint (`/mcp`), its sessions bounded in number and idle time.

The same endpoint serves `agentcell mcp --http` (standalone.py) and `/mcp` of `agentcell serve`
(mounted.py). It speaks the MCP handshake era (protocol versions up to 2025-11-25), where a client holds
a session (`Mcp-Session-Id`) and its sandboxes belong to that session. A request of the 2026-07-28
stateless era has no session to own a sandbox: it is answered 400, and the official clients' "auto" mode
falls back to the handshake on that answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from mcp.server.transport_security import TransportSecuritySettings
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.responses import JSONResponse

from agentcell.mcp.bounds import Bounds
from agentcell.mcp.server import build
from agentcell.mcp.sessions import Sessions
from agentcell.mcp.upstream import Upstream, as_user
from agentcell.server.asgi import header
from agentcell.server.auth import key_presented, presented_keys

PATH = "/mcp"
MISSING_KEY = "Invalid or missing API key: send it as X-API-KEY or 'Authorization: Bearer KEY'"
_NEEDS_SESSION = ("this MCP endpoint serves the initialize handshake (protocol 2025-11-25 and earlier): its "
                  "sandboxes belong to a session, which the stateless 2026-07-28 protocol has not")


def jsonrpc_error(status: int, message: str, code: int = -32600) -> JSONResponse:
    """An error as MCP clients read one: a JSON-RPC error body (no request id) with the HTTP status."""
    return JSONResponse({"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}, status_code=status)


class McpHttp:
    """The ASGI endpoint. `api_key`: the key a request must present (X-API-KEY or Bearer), None to let the
    agentcell server behind judge the key it is given. Run `start()` and `stop()` from one task (the
    ASGI lifespan's): the SDK's session manager keeps its sessions in a task group opened there."""

    def __init__(self, upstream: Upstream, bounds: Bounds, api_key: str | None = None,
                 security: TransportSecuritySettings | None = None) -> None:
        self.api_key = api_key
        self.sessions = Sessions(upstream, bounds, single=False)
        self.server = build(self.sessions)
        self.server.streamable_http_app(
            streamable_http_path=PATH, session_idle_timeout=bounds.session_idle_timeout,
            max_sessions=bounds.max_sessions,
            # one JSON answer per POST instead of an SSE stream: ~2 ms less a tool call (benchmarks/mcp.py); the
            # tools send no progress or server requests that would need the stream
            json_response=True,
            transport_security=security or TransportSecuritySettings(enable_dns_rebinding_protection=False))
        self.manager = self.server.session_manager
        self._running: AsyncExitStack | None = None
        self._live = False

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Serve while inside; leaving ends every session (each kills its sandboxes)."""
        async with self.manager.run():
            self._live = True
            try:
                yield
            finally:
                self._live = False

    async def start(self) -> None:
        stack = AsyncExitStack()
        await stack.enter_async_context(self.running())
        self._running = stack

    async def stop(self) -> None:
        """Ends every session (each kills its sandboxes, within Bounds.cleanup_timeout)."""
        if self._running is not None:
            running, self._running = self._running, None
            await running.aclose()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not self._live:
            await jsonrpc_error(503, "the MCP endpoint is not running")(scope, receive, send)
            return
        if header(scope, b"mcp-protocol-version") in MODERN_PROTOCOL_VERSIONS:
            await jsonrpc_error(400, _NEEDS_SESSION)(scope, receive, send)
            return
        if self.api_key is not None and not key_presented(scope, self.api_key):
            await jsonrpc_error(401, MISSING_KEY)(scope, receive, send)
            return
        key = self.api_key if self.api_key is not None else next(iter(presented_keys(scope)), None)
        scope["user"] = as_user(key)  # the session is bound to this key; the tools forward it
        await self.manager.handle_request(scope, receive, send)
