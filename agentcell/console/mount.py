"""The console as `agentcell serve` and `agentcell gateway` mount it at /ui."""

from __future__ import annotations

from typing import Any

from agentcell.console.app import ConsoleApp, GatewayView, ServerView, mounted
from agentcell.console.upstream import Upstream

__all__ = ["for_gateway", "for_server", "mounted"]


def for_server(app: Any) -> ConsoleApp:
    """`app`: the AgentcellApp; the console calls its router (`_route`) with its API key."""
    return ConsoleApp(Upstream(app._route, app.config.api_key, "server"), ServerView(app),
                      app.config.console_viewer_key)


def for_gateway(gateway: Any, viewer_key: str | None) -> ConsoleApp:
    """`gateway`: the GatewayApp; the console calls its router (`route`) with the clients' key."""
    return ConsoleApp(Upstream(gateway.route, gateway.api_key, "gateway"), GatewayView(gateway), viewer_key)
