"""`agentcell mcp`: agentcell's MCP server (agentcell/mcp/, docs/mcp.md), over stdio for one client, or
over streamable HTTP (--http) for many. It talks to an agentcell server as the other commands do
(--api-url / --api-key, else AGENTCELL_URL / AGENTCELL_API_KEY; with neither, the SDK's own resolution:
the machine's system service, else an embedded server private to this process, gone with it).
"""

from __future__ import annotations

import click

from agentcell.cli import main
from agentcell.cli.target import Target, server_options


@main.command("mcp")
@click.option("--http", "use_http", is_flag=True,
              help="Serve MCP over streamable HTTP at http://HOST:PORT/mcp instead of stdio. Each client's key "
                   "(X-API-KEY or Authorization: Bearer) is passed on to the agentcell server.")
@click.option("--host", default="127.0.0.1", show_default=True, help="With --http: the address to listen on.")
@click.option("--port", default=49990, show_default=True, type=click.IntRange(1, 65535),
              help="With --http: the port.")
@click.option("--max-sandboxes", default=10, show_default=True, type=click.IntRange(1),
              help="Sandboxes one MCP session may hold at once.")
@click.option("--max-sessions", default=100, show_default=True, type=click.IntRange(1),
              help="With --http: concurrent sessions (more are answered 503).")
@click.option("--session-idle-timeout", default=1800.0, show_default=True, type=click.FloatRange(min=1),
              help="With --http: seconds a session may go without a request; then it ends and its sandboxes "
                   "are killed (not the kept ones).")
@click.option("--max-output", default=100_000, show_default=True, type=click.IntRange(1000),
              help="Characters of one output (stdout, stderr, a file) in a tool's answer; the rest is cut, and "
                   "the answer says so.")
@server_options
def mcp(use_http: bool, host: str, port: int, max_sandboxes: int, max_sessions: int, session_idle_timeout: float,
        max_output: int, target: Target) -> None:
    """Run agentcell's MCP server: sandboxes as tools for AI agents (Claude, Cursor, the OpenAI Agents SDK...).

    Over stdio (the default), the client starts this command and the process is one session: its sandboxes
    are killed when the client closes it, except those created with keep=true. docs/mcp.md has the configs.
    """
    from agentcell.mcp.bounds import Bounds
    from agentcell.mcp.upstream import Upstream

    bounds = Bounds(max_sandboxes=max_sandboxes, max_sessions=max_sessions,
                    session_idle_timeout=session_idle_timeout, max_text=max_output)
    if use_http:
        import os

        from agentcell.cli.errors import CliError
        from agentcell.mcp import standalone

        if target.api_key:
            raise CliError("--api-key is for stdio: over --http each client sends its own key",
                           "give the MCP clients the agentcell server's key (X-API-KEY or Authorization: Bearer)")
        # no key of its own: a client that sends none must not get this environment's (the SDK would use it)
        for name in ("AGENTCELL_API_KEY", "E2B_API_KEY"):
            os.environ.pop(name, None)
        from agentcell.server.hosts import is_loopback

        if not is_loopback(host):
            click.echo(f"agentcell mcp: listening on {host}: any client that reaches it can use it with a key of "
                       "the agentcell server (it holds none of its own)", err=True)
        standalone.serve(Upstream(target.api_url, None, target.request_timeout), bounds, host, port)
        return
    from agentcell.mcp import stdio

    stdio.run(Upstream(target.api_url, target.api_key, target.request_timeout), bounds)
