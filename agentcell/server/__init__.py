"""agentcell's server: E2B's control plane and sandbox data plane on one port."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentcell.server.config import ServerConfig

if TYPE_CHECKING:
    from agentcell.server.app import AgentcellApp


def create_app(config: ServerConfig, backend: Any = None) -> AgentcellApp:
    from agentcell.server.app import create_app as _create_app

    return _create_app(config, backend)


def serve(config: ServerConfig) -> None:
    from agentcell.server.app import serve as _serve

    _serve(config)


__all__ = ["ServerConfig", "create_app", "serve"]
