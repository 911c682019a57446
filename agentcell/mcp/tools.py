"""The MCP tools: one agentcell SDK call each, on a sandbox of the calling session (sessions.py).

Names and arguments are part of the interface (agentcell/mcp/__init__.py TOOL_NAMES, docs/mcp.md).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ToolAnnotations
from pydantic import Field

from agentcell.errors import CommandExitException
from agentcell.mcp import content as answers
from agentcell.mcp.errors import sdk_errors
from agentcell.mcp.sessions import Sessions
from agentcell.mcp.upload import fetch_into
from agentcell.sdk.sandbox_async import AsyncSandbox

SandboxId = Annotated[str, Field(description="A sandbox this session created (create_sandbox's sandbox_id).")]
Path = Annotated[str, Field(description="A path inside the sandbox, e.g. /home/user/data.csv.")]


def _json(value: Any) -> CallToolResult:
    """A small structured answer, as JSON text and as structured content."""
    return CallToolResult(content=[answers.text(json.dumps(value, indent=1, default=str))], structured_content=value)


def register(server: MCPServer, sessions: Sessions) -> None:
    bounds = sessions.bounds
    tool = server.tool

    @tool(description="Create a sandbox (a Linux machine of its own) and return its sandbox_id. It belongs to this "
                      "MCP session: killed when the session ends unless keep=true (then it lives until its timeout).")
    async def create_sandbox(
        ctx: Context,
        template: Annotated[str, Field(description="Template or snapshot id.")] = "base",
        timeout: Annotated[int, Field(description="Seconds the sandbox lives (the server caps it).", ge=1)] = 300,
        allow_internet_access: Annotated[bool | None, Field(
            description="Whether it may reach the internet at all (default: the server's).")] = None,
        allow_out: Annotated[list[str] | None, Field(
            description="Only these destinations: CIDRs, IPs, domains, *.wildcards.")] = None,
        deny_out: Annotated[list[str] | None, Field(
            description="Never these destinations (same forms as allow_out).")] = None,
        metadata: Annotated[dict[str, str] | None, Field(description="Labels kept with the sandbox.")] = None,
        envs: Annotated[dict[str, str] | None, Field(description="Environment variables of its processes.")] = None,
        keep: Annotated[bool, Field(description="Leave it running when this session ends.")] = False,
    ) -> CallToolResult:
        mine = sessions.of(ctx)
        network = {k: v for k, v in (("allow_out", allow_out), ("deny_out", deny_out)) if v is not None}
        async with mine.creating_one():
            with sdk_errors("create_sandbox"):
                sbx = await AsyncSandbox.create(template, timeout, metadata, envs,
                                                allow_internet_access=allow_internet_access, network=network or None,
                                                **mine.sdk)
            await mine.add(sbx, keep)
        return _json({"sandbox_id": sbx.sandbox_id, "template": template, "timeout": timeout, "keep": keep})

    @tool(description="Run code in a sandbox's stateful interpreter (variables persist between calls). Returns "
                      "stdout, stderr, the last expression's value, errors, and charts as images.")
    async def run_code(
        ctx: Context, sandbox_id: SandboxId,
        code: Annotated[str, Field(description="The code to run.")],
        language: Annotated[str | None, Field(
            description="python (default), javascript, typescript, r, java, bash ... as the template has them.")] = None,
        context: Annotated[str | None, Field(
            description="A context id from create_code_context (instead of language).")] = None,
        timeout: Annotated[float | None, Field(description="Seconds the run may take (default 300).", gt=0)] = None,
    ) -> CallToolResult:
        sbx = sessions.of(ctx).get(sandbox_id)
        with sdk_errors("run_code"):
            ex = await sbx.run_code(code, language=language, context=context, timeout=timeout)
        return answers.execution(ex, bounds)

    @tool(description="Create a separate interpreter state (its own variables, language and working directory) "
                      "for run_code's `context`.")
    async def create_code_context(
        ctx: Context, sandbox_id: SandboxId,
        language: Annotated[str | None, Field(description="Its language (default python).")] = None,
        cwd: Annotated[str | None, Field(description="Its working directory.")] = None,
    ) -> CallToolResult:
        sbx = sessions.of(ctx).get(sandbox_id)
        with sdk_errors("create_code_context"):
            made = await sbx.create_code_context(cwd=cwd, language=language)
        return _json({"context": made.id, "language": made.language, "cwd": made.cwd})

    @tool(description="Run a shell command in a sandbox. Returns exit code, stdout and stderr; background=true "
                      "starts it and returns its pid at once.")
    async def run_command(
        ctx: Context, sandbox_id: SandboxId,
        command: Annotated[str, Field(description="The command line (run by bash -l -c).")],
        timeout: Annotated[float | None, Field(
            description="Seconds it may run, then it is killed (default 60; in the background none; 0: none).",
            ge=0)] = None,
        background: Annotated[bool, Field(description="Start it and return its pid without waiting.")] = False,
        cwd: Annotated[str | None, Field(description="Its working directory.")] = None,
        envs: Annotated[dict[str, str] | None, Field(description="Extra environment variables.")] = None,
    ) -> CallToolResult:
        sbx = sessions.of(ctx).get(sandbox_id)
        if timeout is None:
            timeout = 0 if background else 60  # a server started in the background runs until it is killed
        with sdk_errors("run_command"):
            if background:
                handle = await sbx.commands.run(command, background=True, envs=envs, cwd=cwd, timeout=timeout)
                await handle.disconnect()  # it keeps running; its output is not collected here
                return _json({"pid": handle.pid, "background": True})
            try:
                result = await sbx.commands.run(command, envs=envs, cwd=cwd, timeout=timeout)
            except CommandExitException as e:
                result = e  # a non-zero exit is the command's answer, not the tool's failure
        return answers.command(result, bounds)  # type: ignore[arg-type]

    @tool(description="Read a text file of a sandbox (UTF-8; other bytes are replaced).")
    async def read_file(ctx: Context, sandbox_id: SandboxId, path: Path) -> CallToolResult:
        sbx = sessions.of(ctx).get(sandbox_id)
        with sdk_errors("read_file"):
            data = await sbx.files.read(path)
        return CallToolResult(content=[answers.text(answers.capped(data, bounds, path))])

    @tool(description="Write a file in a sandbox (created or replaced; parent directories are made).")
    async def write_file(
        ctx: Context, sandbox_id: SandboxId, path: Path,
        content: Annotated[str, Field(description="The file's content.")],
        encoding: Annotated[Literal["utf-8", "base64"], Field(
            description="How `content` is given: text, or base64 for binary files.")] = "utf-8",
    ) -> CallToolResult:
        sbx = sessions.of(ctx).get(sandbox_id)
        data: str | bytes = content
        if encoding == "base64":
            import base64
            import binascii

            try:
                data = base64.b64decode(content, validate=True)
            except binascii.Error as e:
                raise ToolError(f"write_file: content is not valid base64: {e}") from None
        with sdk_errors("write_file"):
            info = await sbx.files.write(path, data)
        return _json({"path": info.path, "bytes": len(data.encode() if isinstance(data, str) else data)})

    @tool(description="List a directory of a sandbox: one entry a line (type, size, path).")
    async def list_files(
        ctx: Context, sandbox_id: SandboxId, path: Path,
        depth: Annotated[int, Field(description="How many levels down (1: the directory's own entries).",
                                    ge=1, le=10)] = 1,
    ) -> CallToolResult:
        sbx = sessions.of(ctx).get(sandbox_id)
        with sdk_errors("list_files"):
            entries = await sbx.files.list(path, depth=depth)
        lines = [f"{getattr(e.type, 'value', e.type)}\t{e.size}\t{e.path}" for e in entries]
        return CallToolResult(content=[answers.text(answers.capped("\n".join(lines) or "(empty)", bounds, path))])

    @tool(description="Download a URL into a file of the sandbox, fetched from inside the sandbox: its network "
                      "policy decides what it may reach.")
    async def upload_url(
        ctx: Context, sandbox_id: SandboxId,
        url: Annotated[str, Field(description="An http(s) URL.")], path: Path,
    ) -> CallToolResult:
        sbx = sessions.of(ctx).get(sandbox_id)
        with sdk_errors("upload_url"):
            return _json(await fetch_into(sbx, url, path, bounds.max_upload_bytes))

    @tool(description="The host name (and URL) under which a server listening on `port` inside the sandbox is "
                      "reached through the agentcell server.")
    async def get_host(
        ctx: Context, sandbox_id: SandboxId,
        port: Annotated[int, Field(description="The port inside the sandbox.", ge=1, le=65535)],
    ) -> CallToolResult:
        sbx = sessions.of(ctx).get(sandbox_id)
        host = sbx.get_host(port)
        scheme = "https" if sbx.connection_config.base_url.startswith("https:") else "http"
        answer: dict[str, Any] = {"host": host, "url": f"{scheme}://{host}"}
        if sbx.traffic_access_token:
            answer["header"] = {"e2b-traffic-access-token": sbx.traffic_access_token}
        return _json(answer)

    @tool(description="Pause a sandbox: its memory and files are kept; resume_sandbox continues it.")
    async def pause_sandbox(ctx: Context, sandbox_id: SandboxId) -> CallToolResult:
        sbx = sessions.of(ctx).get(sandbox_id)
        with sdk_errors("pause_sandbox"):
            paused = await sbx.pause()
        return _json({"sandbox_id": sandbox_id, "paused": True, "was_running": paused})

    @tool(description="Resume a paused sandbox.")
    async def resume_sandbox(
        ctx: Context, sandbox_id: SandboxId,
        timeout: Annotated[int | None, Field(description="Seconds it lives from now.", ge=1)] = None,
    ) -> CallToolResult:
        mine = sessions.of(ctx)
        mine.get(sandbox_id)
        with sdk_errors("resume_sandbox"):
            sbx = await AsyncSandbox.connect(sandbox_id, timeout=timeout, **mine.sdk)
        mine.replace(sbx)
        return _json({"sandbox_id": sandbox_id, "running": True})

    @tool(description="Snapshot a sandbox's files (and memory where the backend can): create_sandbox with the "
                      "snapshot_id as template starts copies of it.")
    async def snapshot_sandbox(
        ctx: Context, sandbox_id: SandboxId,
        name: Annotated[str | None, Field(description="A name for the snapshot.")] = None,
    ) -> CallToolResult:
        sbx = sessions.of(ctx).get(sandbox_id)
        with sdk_errors("snapshot_sandbox"):
            snap = await sbx.create_snapshot(name=name)
        return _json({"snapshot_id": snap.snapshot_id, "names": snap.names, "mode": snap.mode})

    @tool(description="Kill a sandbox of this session now.", annotations=ToolAnnotations(destructive_hint=True))
    async def kill_sandbox(ctx: Context, sandbox_id: SandboxId) -> CallToolResult:
        mine = sessions.of(ctx)
        sbx = mine.get(sandbox_id)
        with sdk_errors("kill_sandbox"):
            killed = await sbx.kill()
        mine.forget(sandbox_id)
        return _json({"sandbox_id": sandbox_id, "killed": killed})

    @tool(description="The sandbox's behaviour report: processes, files, network connections and refusals, from "
                      "its record.")
    async def get_report(
        ctx: Context, sandbox_id: SandboxId,
        format: Annotated[Literal["text", "json"], Field(description="text (readable) or json.")] = "text",
    ) -> CallToolResult:
        sbx = sessions.of(ctx).get(sandbox_id)
        with sdk_errors("get_report"):
            report = await sbx.report(format=format)
        body = report if isinstance(report, str) else json.dumps(report, indent=1)
        return CallToolResult(content=[answers.text(answers.capped(body, bounds, "the report"))])

    @tool(description="The sandboxes of this MCP session, with their state.",
          annotations=ToolAnnotations(read_only_hint=True))
    async def list_sandboxes(ctx: Context) -> CallToolResult:
        mine = sessions.of(ctx)
        rows = []
        for sid, sbx in list(mine.sandboxes.items()):
            row: dict[str, Any] = {"sandbox_id": sid, "keep": sid in mine.kept}
            try:
                info = await sbx.get_info()
                row.update(state=info.state, template=info.template_id, end_at=info.end_at.isoformat())
            except Exception as e:  # noqa: BLE001 - a gone sandbox is a row too
                row.update(state="gone", error=str(e))
            rows.append(row)
        return _json({"sandboxes": rows, "max_sandboxes": bounds.max_sandboxes})
