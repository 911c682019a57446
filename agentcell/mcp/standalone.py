"""`agentcell mcp --http`: the MCP endpoint on a port of its own, in front of an agentcell server.

It holds no key of its own: each client's key (X-API-KEY or Bearer) goes to the agentcell server with its
calls. It listens on loopback unless told otherwise, and checks Host and Origin as the SDK's DNS-rebinding
protection does for loopback servers (a web page must not drive it).
"""

from __future__ import annotations

from typing import Any

from mcp.server.transport_security import TransportSecuritySettings

from agentcell.mcp.bounds import Bounds
from agentcell.mcp.http import PATH, McpHttp, jsonrpc_error
from agentcell.mcp.upstream import Upstream
from agentcell.server.hosts import is_loopback


class StandaloneApp:
    def __init__(self, upstream: Upstream, bounds: Bounds, host: str) -> None:
        security = None
        if is_loopback(host):
            security = TransportSecuritySettings(
                enable_dns_rebinding_protection=True,
                allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
                allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"])
        self.endpoint = McpHttp(upstream, bounds, security=security)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http" and scope["path"] == PATH:
            await self.endpoint(scope, receive, send)
        elif scope["type"] == "http":
            await jsonrpc_error(404, f"the MCP endpoint is {PATH}")(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.endpoint.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.endpoint.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


def serve(upstream: Upstream, bounds: Bounds, host: str, port: int, log_level: str = "warning") -> None:
    import uvicorn

    uvicorn.run(StandaloneApp(upstream, bounds, host), host=host, port=port, log_level=log_level, lifespan="on",
                ws="none")
