"""`agentcell mcp`: MCP over stdin/stdout, one client, one session: the process. When stdin closes (the
client is done) or SIGTERM/SIGINT come, the session's sandboxes are killed (not the kept ones)."""

from __future__ import annotations

import asyncio
import signal

from agentcell.mcp.bounds import Bounds
from agentcell.mcp.server import build
from agentcell.mcp.sessions import Sessions
from agentcell.mcp.upstream import Upstream


async def serve(upstream: Upstream, bounds: Bounds) -> None:
    sessions = Sessions(upstream, bounds, single=True)
    assert sessions.only is not None
    server = build(sessions)
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, main.cancel)
    try:
        await server.run_stdio_async()
    except asyncio.CancelledError:
        main.uncancel()  # a signal: clean up below, then exit
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await sessions.only.close()


def run(upstream: Upstream, bounds: Bounds) -> None:
    asyncio.run(serve(upstream, bounds))
