"""A sandbox's behaviour record (docs/record.md) from the command line: `events` (JSON lines, for
scripts), `logs` (one escaped line per event, for people) and `report` (the summary). All three work
after the sandbox is gone, for as long as the server keeps its record."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import click

from agentcell.cli import main
from agentcell.cli.output import json_option, print_json, print_json_line
from agentcell.cli.target import Target, about, complete_sandbox_ids, server_options
from agentcell.text_escape import escape, escape_text

# what every event has; logs shows the rest as key=value
_COMMON = ("time", "kind", "source", "sandbox_id", "seq")

sandbox_id_arg = click.argument("sandbox_id", metavar="ID", shell_complete=complete_sandbox_ids)
kind_option = click.option("--kind", "kinds", multiple=True, metavar="KIND",
                           help="Only these kinds (repeatable; 'file.' for a prefix).")
follow_option = click.option("--follow", "-f", is_flag=True, help="Then each new event, until the sandbox is gone.")


def _events(sandbox_id: str, kinds: tuple[str, ...], follow: bool, target: Target) -> Any:
    from agentcell import Sandbox

    target.require_server("events")
    return Sandbox.events(about(sandbox_id), kinds=list(kinds) or None, follow=follow, **target.sdk)


@main.command()
@sandbox_id_arg
@kind_option
@follow_option
@server_options
def events(sandbox_id: str, kinds: tuple[str, ...], follow: bool, target: Target) -> None:
    """A sandbox's behaviour record as JSON lines, oldest first."""
    for e in _events(sandbox_id, kinds, follow, target):
        print_json_line(e)


@main.command()
@sandbox_id_arg
@kind_option
@follow_option
@server_options
def logs(sandbox_id: str, kinds: tuple[str, ...], follow: bool, target: Target) -> None:
    """A sandbox's behaviour record as text, one line an event: time, kind, source, then its fields."""
    for e in _events(sandbox_id, kinds, follow, target):
        click.echo(log_line(e))


def log_line(e: dict[str, Any]) -> str:
    t = e.get("time")
    stamp = datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z" \
        if isinstance(t, int | float) else "-"
    rest = " ".join(f"{escape(k)}={_value(v)}" for k, v in e.items() if k not in _COMMON and v is not None)
    return f"{stamp}  {escape(e.get('kind', '?')):<16} {escape(e.get('source', '?')):<4}  {rest}".rstrip()


def _value(v: Any) -> str:
    return escape(v if isinstance(v, str) else json.dumps(v, separators=(",", ":")))


@main.command()
@sandbox_id_arg
@json_option
@click.option("--html", "as_html", is_flag=True, help="One self-contained HTML page (to stdout, or to -o FILE).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the report to FILE instead of printing it.")
@server_options
def report(sandbox_id: str, as_json: bool, as_html: bool, output: str | None, target: Target) -> None:
    """A sandbox's behaviour report: processes, files, hosts, denials, limits and signatures."""
    from agentcell import Sandbox

    if as_json and as_html:
        raise click.UsageError("--json and --html: choose one")
    target.require_server("report")
    fmt = "html" if as_html else "json" if as_json else "text"
    got = Sandbox.report(about(sandbox_id), format=fmt, **target.sdk)
    if output is not None or as_html:
        data = json.dumps(got, indent=2) + "\n" if as_json else str(got)
        if output is None:  # (a server's HTML has no control character; escape_text keeps it so on a terminal)
            click.echo(escape_text(data), nl=False)
        else:
            with open(output, "w", encoding="utf-8", errors="backslashreplace") as f:
                f.write(data)
            click.echo(f"wrote {escape(output)}", err=True)
    elif as_json:
        print_json(got)
    else:
        # the server's text escapes every value already; escape_text leaves that as it is and covers a
        # server that does not (an older one)
        click.echo(escape_text(str(got).rstrip("\n")))
