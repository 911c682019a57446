"""`agentcell mcp`: agentcell's sandboxes as MCP tools, over stdio and streamable HTTP (docs/mcp.md).

Built on the official `mcp` SDK (its MCPServer). The parts: bounds.py (what one session and one server
may take), upstream.py (which agentcell server the tools call, with whose key), sessions.py (the
sandboxes of one MCP session, killed when it ends), content.py (results as MCP content, capped),
tools.py and resources.py (what a client sees), server.py (the MCPServer with them), http.py (the
streamable HTTP endpoint: `agentcell mcp --http` and `/mcp` of `agentcell serve`), mounted.py (that
endpoint inside the server), stdio.py (`agentcell mcp`).
"""

from __future__ import annotations

# The tool names scripts and docs rely on (issue 29): changing one breaks its users.
TOOL_NAMES = (
    "create_sandbox", "run_code", "create_code_context", "run_command", "read_file", "write_file", "list_files",
    "upload_url", "get_host", "pause_sandbox", "resume_sandbox", "snapshot_sandbox", "kill_sandbox", "get_report",
    "list_sandboxes",
)

__all__ = ["TOOL_NAMES"]
