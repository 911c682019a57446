"""The sandboxes of one MCP session: created through it, seen only by it, killed when it ends.

A session is the MCP connection: over stdio the process (one client), over streamable HTTP one
`Mcp-Session-Id` (it ends when the client deletes it, when it has been idle too long, or when the
endpoint stops). A sandbox id from anywhere else is "not found in this session", whatever the server
knows of it. When the session ends its sandboxes are killed, except those created with keep=true: they
live on until their own timeout, as any sandbox does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError

from agentcell.mcp.bounds import Bounds
from agentcell.mcp.upstream import Upstream, key_of
from agentcell.sdk.sandbox_async import AsyncSandbox

log = logging.getLogger("agentcell.mcp")

_STATE_KEY = "agentcell.sandboxes"


class NotInSession(ToolError):
    """A sandbox id this session did not create (or has killed)."""

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id!r} not found in this session: an MCP session sees only the sandboxes "
                         "it created (list_sandboxes names them); create one with create_sandbox")


@dataclass
class SessionSandboxes:
    """One session's sandboxes and the key they are reached with."""

    upstream: Upstream
    api_key: str | None
    bounds: Bounds
    sandboxes: dict[str, AsyncSandbox] = field(default_factory=dict)
    kept: set[str] = field(default_factory=set)  # created with keep=true: not killed at the end
    creating: int = 0  # creates in flight: they count against the bound already
    closed: bool = False

    @property
    def sdk(self) -> dict[str, Any]:
        return self.upstream.sdk(self.api_key)

    def get(self, sandbox_id: str) -> AsyncSandbox:
        sbx = self.sandboxes.get(sandbox_id)
        if sbx is None:
            raise NotInSession(sandbox_id)
        return sbx

    @asynccontextmanager
    async def creating_one(self) -> AsyncIterator[None]:
        """A slot for one create, within the bound (concurrent creates cannot pass it together)."""
        if self.closed:
            raise ToolError("this MCP session has ended")
        held = len(self.sandboxes) + self.creating
        if held >= self.bounds.max_sandboxes:
            raise ToolError(f"this MCP session holds {held} sandboxes, the most it may "
                            f"(--max-sandboxes {self.bounds.max_sandboxes}); kill_sandbox one it no longer needs")
        self.creating += 1
        try:
            yield
        finally:
            self.creating -= 1

    async def add(self, sbx: AsyncSandbox, keep: bool) -> None:
        if self.closed:  # the session ended while the sandbox was being created: nobody would own it
            await sbx.kill(request_timeout=self.bounds.cleanup_timeout)
            raise ToolError("this MCP session has ended")
        self.sandboxes[sbx.sandbox_id] = sbx
        if keep:
            self.kept.add(sbx.sandbox_id)

    def replace(self, sbx: AsyncSandbox) -> None:
        """A new handle for a sandbox of this session (resume gives one)."""
        self.sandboxes[sbx.sandbox_id] = sbx

    def forget(self, sandbox_id: str) -> None:
        self.sandboxes.pop(sandbox_id, None)
        self.kept.discard(sandbox_id)

    async def close(self) -> None:
        """The session ended: kill its sandboxes (not the kept ones), within the cleanup bound."""
        if self.closed:
            return
        self.closed = True
        doomed = [sbx for sid, sbx in self.sandboxes.items() if sid not in self.kept]
        self.sandboxes.clear()
        if not doomed:
            return

        async def kill(sbx: AsyncSandbox) -> None:
            try:
                await sbx.kill(request_timeout=self.bounds.cleanup_timeout)
            except Exception as e:  # noqa: BLE001 - one failure must not keep the others alive
                log.warning("mcp: could not kill sandbox %s at the end of its session: %s", sbx.sandbox_id, e)

        try:
            await asyncio.wait_for(asyncio.gather(*(kill(s) for s in doomed)), self.bounds.cleanup_timeout)
        except TimeoutError:
            log.warning("mcp: killing %d sandboxes of an ended session took over %.0f s; their timeouts will end "
                        "them", len(doomed), self.bounds.cleanup_timeout)


class Sessions:
    """Finds the SessionSandboxes of the session a request belongs to.

    `single`: stdio, where the process is the one session (closed by stdio.py when stdin ends). Otherwise
    each MCP connection (a streamable-HTTP session) gets its own, closed with the connection."""

    def __init__(self, upstream: Upstream, bounds: Bounds, single: bool) -> None:
        self.upstream = upstream
        self.bounds = bounds
        self.only = SessionSandboxes(upstream, upstream.api_key, bounds) if single else None
        self.open: dict[int, SessionSandboxes] = {}  # HTTP sessions that own sandboxes, by id()

    def release_all(self) -> None:
        """The server these sessions call is stopping and ends every sandbox itself: their ends need not
        (and could not: it no longer answers) kill them."""
        for mine in self.open.values():
            mine.closed = True
        self.open.clear()

    def of(self, ctx: Context) -> SessionSandboxes:
        if self.only is not None:
            return self.only
        request = ctx.request_context.request
        key = key_of(request.scope.get("user")) if request is not None else None
        # The SDK's Context has no public handle on the connection yet (its ServerRunner builds a
        # ServerSession per request from it); the connection's `state` and `exit_stack` are the SDK's
        # documented place for per-connection state and cleanup. mcp is pinned, and tests/test_mcp.py
        # proves a session's end kills its sandboxes.
        connection = ctx.request_context.session._connection  # noqa: SLF001
        mine = connection.state.get(_STATE_KEY)
        if mine is None:
            if connection.session_id is None:  # a stateless, per-request connection: nothing could own a sandbox
                raise ToolError("this MCP endpoint needs a session (the initialize handshake) to own sandboxes")
            mine = connection.state[_STATE_KEY] = SessionSandboxes(self.upstream, key, self.bounds)
            self.open[id(mine)] = mine
            connection.exit_stack.callback(self.open.pop, id(mine), None)
            connection.exit_stack.push_async_callback(mine.close)
        return mine
