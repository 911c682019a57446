"""The MCPServer: agentcell's tools and resources, over whichever transport runs it."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer

from agentcell.mcp import resources, tools
from agentcell.mcp.sessions import Sessions

INSTRUCTIONS = (
    "agentcell sandboxes: isolated Linux machines for running code. create_sandbox first (it returns a "
    "sandbox_id), then run_code / run_command / files on it; kill_sandbox when done. The sandboxes belong to this "
    "session and end with it unless created with keep=true. Answers are capped in size and say where they were cut."
)


def build(sessions: Sessions) -> MCPServer:
    from agentcell.server.banner import version

    server: MCPServer = MCPServer("agentcell", instructions=INSTRUCTIONS, version=version(), log_level="WARNING")
    tools.register(server, sessions)
    resources.register(server, sessions)
    return server
