"""`agentcell system install|uninstall`: the administrator's one root step for the system service
(docs/system-service.md). Every change is said before it is made; --dry-run says them and makes none."""

from __future__ import annotations

import os
from pathlib import Path

import click

from agentcell.cli import main


@main.group()
def system() -> None:
    """Install agentcell as this machine's service for its non-root users (needs root)."""


def _need_root(root: Path | None, dry_run: bool) -> None:
    if root is None and not dry_run and os.geteuid() != 0:
        raise click.ClickException("this changes the host (packages, a group, systemd units): run it as root "
                                   "(sudo agentcell system ...), or see the plan with --dry-run")


@system.command()
@click.option("--dry-run", is_flag=True, help="Print every change it would make; make none.")
@click.option("--root", "root", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="Write the unit files under this directory only (for packaging): no packages, group or systemctl.")
@click.option("--packages/--no-packages", default=True, show_default=True,
              help="Install the Debian packages pip cannot bring (libseccomp2, nftables, libbpf1, nodejs, ...).")
@click.option("--gvisor", is_flag=True, help="Also install runsc (the gvisor backend) from bookworm-backports.")
@click.option("--group", default="agentcell", show_default=True, help="The group whose members may use the service.")
@click.option("--user", "users", multiple=True, metavar="USER", help="Add this user to the group (repeatable).")
@click.option("--serve-arg", "serve_args", multiple=True, metavar="ARG",
              help="One more argument for the service's `agentcell serve --system` (repeatable), "
                   "e.g. --serve-arg=--max-sandboxes-per-user=5.")
@click.option("--no-start", is_flag=True, help="Write and reload the units, but do not enable or start them.")
def install(dry_run: bool, root: Path | None, packages: bool, gvisor: bool, group: str, users: tuple[str, ...],
            serve_args: tuple[str, ...], no_start: bool) -> None:
    """Install the system service: Debian packages, the group, agentcell.socket + agentcell.service."""
    from agentcell.system import host, plan

    _need_root(root, dry_run)
    opts = plan.InstallOptions(root=root, packages=packages, gvisor=gvisor, group=group, users=users,
                               serve_args=serve_args, start=not no_start)
    steps, notes = plan.install_steps(opts)
    if not steps:
        click.echo("agentcell system install: nothing to change (everything is in place)")
    try:
        plan.carry_out(steps, dry_run, click.echo)
    except host.HostError as e:
        raise click.ClickException(str(e)) from None
    for note in notes:
        click.echo(f"note: {note}")
    if not dry_run and steps:
        click.echo(f"done: users of group '{group}' now get Sandbox.create() with no server to start and no URL "
                   "(docs/system-service.md)")


@system.command()
@click.option("--dry-run", is_flag=True, help="Print every change it would make; make none.")
@click.option("--root", "root", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="Remove the unit files under this directory only.")
@click.option("--group", default="agentcell", show_default=True)
@click.option("--remove-group", is_flag=True, help="Also delete the group (its members lose it).")
def uninstall(dry_run: bool, root: Path | None, group: str, remove_group: bool) -> None:
    """Stop and remove the system service. Packages, the state in /var/lib/agentcell and (unless
    --remove-group) the group are left."""
    from agentcell.system import host, plan

    _need_root(root, dry_run)
    steps = plan.uninstall_steps(root, group, remove_group)
    if not steps:
        click.echo("agentcell system uninstall: nothing to remove")
    try:
        plan.carry_out(steps, dry_run, click.echo)
    except host.HostError as e:
        raise click.ClickException(str(e)) from None
    click.echo("note: left in place: the Debian packages, /var/lib/agentcell (the server's state)"
               + ("" if remove_group else f", the group '{group}'"))
