"""`/mcp` of `agentcell serve`: the MCP endpoint inside the server, under its API key.

The tools call the server back through the SDK, over its own TCP listener, with the caller's key: the
same checks, quotas and records as any client's calls. A server that has no plain-TCP listener to call
back (only a unix socket, or TLS, whose certificate the loopback client would not verify) answers /mcp
with 501 and says what to do instead; so does a --system server to a request that came over its unix
socket (there the caller's uid is its identity, which a call back over TCP could not carry).

Nothing of the mcp SDK is imported until the first /mcp request (it costs ~0.5 s of start-up, and the
embedded server starts once per SDK process): then a task of its own imports it and runs the endpoint's
session manager, until the server stops.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import TYPE_CHECKING, Any

from agentcell.server.auth import key_presented
from agentcell.server.config import ServerConfig
from agentcell.server.errors import json_error

if TYPE_CHECKING:
    from agentcell.mcp.http import McpHttp

log = logging.getLogger("agentcell.mcp")

PATH = "/mcp"
_INSTEAD = "run `agentcell mcp --http` (or `agentcell mcp` over stdio) next to the server instead"
_STOP_TIMEOUT_S = 10.0


def loopback_url(config: ServerConfig) -> str | None:
    """The URL the server reaches itself at, None when it cannot (see the module's docstring)."""
    if config.tls_cert is not None:
        return None
    if config.uds is not None and not (config.system and config.system_tcp):
        return None
    host = config.host
    if host in ("", "0.0.0.0", "*"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://{f'[{host}]' if ':' in host else host}:{config.port}"


class MountedMcp:
    def __init__(self, config: ServerConfig, is_peer: Any) -> None:
        """`is_peer(scope)`: whether a request came over a --system server's unix socket."""
        self.config = config
        self.url = loopback_url(config)
        self.is_peer = is_peer
        self._ready: asyncio.Future[McpHttp] | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def refusal(self, scope: dict[str, Any]) -> str | None:
        if self.url is None:
            listener = "TLS" if self.config.tls_cert is not None else "only a unix socket"
            return f"/mcp is served by a server with a plain-TCP listener; this one has {listener}: {_INSTEAD}"
        if self.is_peer(scope):
            return f"/mcp over the unix socket is not served: {_INSTEAD}, or use the TCP listener with the API key"
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (refusal := self.refusal(scope)) is not None:
            await json_error(501, refusal)(scope, receive, send)
            return
        if self.config.api_key is not None and not key_presented(scope, self.config.api_key):
            await json_error(401, "Invalid or missing API key: send it as X-API-KEY or "
                                  "'Authorization: Bearer KEY'")(scope, receive, send)
            return
        try:
            endpoint = await self._endpoint()
        except Exception as e:  # noqa: BLE001 - the endpoint could not start: say why, keep serving the rest
            await json_error(503, f"the MCP endpoint could not start: {e}")(scope, receive, send)
            return
        await endpoint(scope, receive, send)

    async def _endpoint(self) -> McpHttp:
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._own(self._ready), name="agentcell-mcp")
        return await asyncio.shield(self._ready)

    async def _own(self, ready: asyncio.Future[McpHttp]) -> None:
        """The endpoint's life, in one task (the SDK's session manager keeps its task group here)."""
        try:
            await asyncio.to_thread(importlib.import_module, "agentcell.mcp.http")
            from agentcell.mcp.bounds import Bounds
            from agentcell.mcp.http import McpHttp
            from agentcell.mcp.upstream import Upstream

            endpoint = McpHttp(Upstream(self.url), Bounds())  # the key is checked above, and by the calls
            async with endpoint.running():
                ready.set_result(endpoint)
                await self._stop.wait()
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else RuntimeError("stopped"))
            if isinstance(e, Exception):
                log.exception("the MCP endpoint failed")
                return
            raise

    async def stop(self) -> None:
        """At server shutdown: end the sessions (their sandboxes are killed with the server's anyway)."""
        if self._task is None:
            return
        ready = self._ready
        if ready is not None and ready.done() and not ready.cancelled() and ready.exception() is None:
            ready.result().sessions.release_all()  # the server's own shutdown ends their sandboxes
        self._stop.set()
        try:
            await asyncio.wait_for(self._task, _STOP_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError):
            log.warning("the MCP endpoint did not stop within %.0f s", _STOP_TIMEOUT_S)
