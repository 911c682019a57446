"""The `agentcell` command (docs/cli.md). Each group of subcommands has a module of its own: serve.py
(the server and the gateway), sandboxes.py (create, ls, info, pause, resume, kill), exec.py (exec,
run), shell.py, files.py (cp), snapshots.py, record.py (events, logs, report), mcp.py (the MCP
server), completion.py, and client.py (demo). target.py says which server a command talks to,
errors.py how a command fails (one line and a hint, no traceback), output.py how it prints (text or
--json).

Text outputs pass every value a tenant or a client chose (ids, templates, metadata, a report's argv
and paths) through text_escape, so none can write to the operator's terminal; JSON outputs are JSON
(their encoder escapes control characters already).
"""

from __future__ import annotations

import click

from agentcell.cli.errors import META_DEBUG, AgentcellGroup


@click.group(cls=AgentcellGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="agentcell")
@click.option("--debug", is_flag=True, envvar="AGENTCELL_DEBUG",
              help="On an error, the traceback instead of one line (also AGENTCELL_DEBUG=1).")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """agentcell: self-hostable E2B-compatible sandboxes for code that AI agents write."""
    ctx.meta[META_DEBUG] = debug


# the subcommands register themselves on `main` when imported
from agentcell.cli import (  # noqa: E402,F401
    client,
    completion,
    doctor,
    exec,
    files,
    mcp,
    record,
    sandboxes,
    serve,
    shell,
    snapshots,
    system,
    templates,
    vault,
)
