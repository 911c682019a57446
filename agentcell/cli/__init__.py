"""The `agentcell` command. Each group of subcommands has a module of its own: serve.py (the server and the
gateway), client.py (commands that drive a server: demo, ls, kill, report, events).

Text outputs pass every value a tenant or a client chose (ids, templates, metadata, a report's argv
and paths) through text_escape, so none can write to the operator's terminal; JSON outputs are JSON
(their encoder escapes control characters already).
"""

from __future__ import annotations

import click


@click.group()
@click.version_option(package_name="agentcell")
def main() -> None:
    """agentcell: self-hostable E2B-compatible sandboxes for code that AI agents write."""


# the subcommands register themselves on `main` when imported
from agentcell.cli import client, doctor, serve  # noqa: E402,F401
