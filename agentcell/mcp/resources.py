"""The MCP resources: a sandbox's files and its behaviour report, for clients that attach resources to a
conversation instead of calling tools. The same session rule holds: only this session's sandboxes."""

from __future__ import annotations

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError

from agentcell.errors import AgentcellError
from agentcell.mcp.sessions import Sessions
from agentcell.sdk.sandbox_async import AsyncSandbox

FILES = "sandbox://{sandbox_id}/files/{+path}"
REPORT = "sandbox://{sandbox_id}/report"


def register(server: MCPServer, sessions: Sessions) -> None:
    bounds = sessions.bounds

    def sandbox(ctx: Context, sandbox_id: str) -> AsyncSandbox:
        try:
            return sessions.of(ctx).get(sandbox_id)
        except ToolError as e:
            raise ResourceError(str(e)) from None

    @server.resource(FILES, name="sandbox file", description="A file of a sandbox of this session, by its path "
                     "from / (sandbox://ID/files/home/user/data.csv). Text when it is UTF-8, else bytes.")
    async def sandbox_file(sandbox_id: str, path: str, ctx: Context) -> str | bytes:
        sbx = sandbox(ctx, sandbox_id)
        path = "/" + path.lstrip("/")
        try:
            info = await sbx.files.get_info(path)
            if info.size > bounds.max_image_bytes:
                raise ResourceError(f"{path} has {info.size} bytes; resources are capped at {bounds.max_image_bytes}: "
                                    "read it in parts with run_command (head, tail, split)")
            data = bytes(await sbx.files.read(path, format="bytes"))
        except AgentcellError as e:
            raise ResourceError(f"{path}: {e}") from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return data

    @server.resource(REPORT, name="sandbox report", mime_type="text/plain",
                     description="The behaviour report of a sandbox of this session (as get_report's text).")
    async def sandbox_report(sandbox_id: str, ctx: Context) -> str:
        sbx = sandbox(ctx, sandbox_id)
        try:
            report = await sbx.report(format="text")
        except AgentcellError as e:
            raise ResourceError(f"report of {sandbox_id}: {e}") from None
        return str(report)
