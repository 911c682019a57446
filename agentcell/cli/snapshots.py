"""`agentcell snapshot create|ls|rm`: a sandbox's files (and, on backends that keep it, its memory) kept
on the server; `agentcell create --template SNAPSHOT_ID` starts a sandbox from one."""

from __future__ import annotations

import click

from agentcell.cli import main
from agentcell.cli.errors import CliError
from agentcell.cli.output import json_option, print_json, table
from agentcell.cli.target import Target, about, complete_sandbox_ids, server_options
from agentcell.text_escape import escape


@main.group()
def snapshot() -> None:
    """Snapshots of sandboxes: create, ls, rm."""


@snapshot.command(name="create")
@click.argument("sandbox_id", metavar="ID", shell_complete=complete_sandbox_ids)
@click.option("--name", default=None, help="A name to create sandboxes from (a-z0-9._-, then NAME:default).")
@click.option("--mode", type=click.Choice(["full", "filesystem"]), default=None,
              help="filesystem: its files; full: memory too (backends that keep it: gvisor). "
                   "Default: the most the server's backend keeps.")
@json_option
@server_options
def snapshot_create(sandbox_id: str, name: str | None, mode: str | None, as_json: bool, target: Target) -> None:
    """Snapshot a sandbox (paused for the moment it takes) and print the snapshot's id."""
    from agentcell import Sandbox

    target.require_server("snapshot create")
    snap = Sandbox.create_snapshot(about(sandbox_id), name=name, mode=mode, **target.sdk)
    if as_json:
        print_json(snap)
    else:
        click.echo(escape(snap.snapshot_id))


@snapshot.command(name="ls")
@click.option("--sandbox", "sandbox_id", default=None, metavar="ID", help="Only this sandbox's snapshots.")
@json_option
@server_options
def snapshot_ls(sandbox_id: str | None, as_json: bool, target: Target) -> None:
    """List snapshots, newest first."""
    from agentcell import Sandbox

    target.require_server("snapshot ls")
    rows = list(Sandbox.list_snapshots(sandbox_id, **target.sdk))
    if as_json:
        print_json(rows)
    elif not rows:
        click.echo("no snapshots", err=True)
    else:
        table(["SNAPSHOT ID", "MODE", "SIZE", "OF SANDBOX"],
              [[s.snapshot_id, s.mode or "-", _size(s.size_bytes), s.sandbox_id or "-"] for s in rows])


@snapshot.command(name="rm")
@click.argument("snapshot_ids", metavar="SNAPSHOT_ID...", nargs=-1, required=True)
@json_option
@server_options
def snapshot_rm(snapshot_ids: tuple[str, ...], as_json: bool, target: Target) -> None:
    """Delete snapshots. Exits 1 if any was not found. --json: {deleted: [ID...], not_found: [ID...]}."""
    from agentcell import Sandbox

    target.require_server("snapshot rm")
    deleted, missing = [], []
    for snapshot_id in snapshot_ids:
        if Sandbox.delete_snapshot(snapshot_id, **target.sdk):
            deleted.append(snapshot_id)
            if not as_json:
                click.echo(f"deleted {escape(snapshot_id)}")
        else:
            missing.append(snapshot_id)
    if as_json:
        print_json({"deleted": deleted, "not_found": missing})
    if missing:
        raise CliError(f"no snapshot {' '.join(missing)}", "`agentcell snapshot ls` lists them", json_error=False)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)
