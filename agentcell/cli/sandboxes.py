"""A sandbox's life from the command line: create, ls, info, pause, resume, kill."""

from __future__ import annotations

import json

import click

from agentcell.cli import main
from agentcell.cli.errors import CliError
from agentcell.cli.output import fields, json_option, metadata_text, print_json, table, when
from agentcell.cli.params import key_values, limits
from agentcell.cli.target import Target, about, complete_sandbox_ids, server_options
from agentcell.text_escape import escape


def json_arg(text: str | None, option: str) -> dict | None:  # type: ignore[type-arg]
    """An option's JSON object, given inline or as @FILE."""
    if text is None:
        return None
    if text.startswith("@"):
        try:
            with open(text[1:]) as f:
                text = f.read()
        except OSError as e:
            raise CliError(f"{option}: cannot read {text[1:]}: {e.strerror}") from None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise CliError(f"{option}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise CliError(f"{option}: must be a JSON object")
    return value


sandbox_id_arg = click.argument("sandbox_id", metavar="ID", shell_complete=complete_sandbox_ids)


@main.command()
@click.option("--template", "-t", default="base", show_default=True,
              help="Template, or a snapshot id (`agentcell snapshot ls`) to start from.")
@click.option("--timeout", type=click.IntRange(1), default=300, show_default=True,
              help="Seconds the sandbox lives (then it is killed; extend it with `agentcell resume`).")
@click.option("--env", "-e", "envs", multiple=True, metavar="KEY=VALUE", help="An environment variable (repeatable).")
@click.option("--metadata", "-m", "metadata", multiple=True, metavar="KEY=VALUE",
              help="A metadata entry, shown by ls and matched by `ls --metadata` (repeatable).")
@click.option("--limit", "-l", "limit_pairs", multiple=True, metavar="NAME=VALUE",
              help="A resource limit: memory=1G, disk=2G, cpus=0.5, pids=256, open-files=1024 (repeatable).")
@click.option("--internet/--no-internet", default=None,
              help="Whether the sandbox may reach the internet (default: the server's --internet-default).")
@click.option("--policy", "policy_text", metavar="JSON|@FILE", default=None,
              help='What its code may run, touch and reach (docs/policy.md), as JSON or @a file of it: '
                   '\'{"exec": {"default": "deny", "allow": ["python3", "git"]}}\'.')
@json_option
@server_options
def create(template: str, timeout: int, envs: tuple[str, ...], metadata: tuple[str, ...],
           limit_pairs: tuple[str, ...], internet: bool | None, policy_text: str | None, as_json: bool,
           target: Target) -> None:
    """Create a sandbox on the server and print its id. It lives --timeout seconds, this command's
    exit does not end it: `agentcell kill ID` does."""
    from agentcell import Sandbox

    body_limits = limits(limit_pairs)
    env_map, meta_map = key_values(envs, "--env"), key_values(metadata, "--metadata")
    target.require_server("create")
    sbx = Sandbox.create(template, timeout=timeout, metadata=meta_map, envs=env_map, limits=body_limits or None,
                         allow_internet_access=internet, policy=json_arg(policy_text, "--policy"), **target.sdk)
    if as_json:
        print_json(Sandbox.get_info(sbx.sandbox_id, **target.sdk))
    else:
        click.echo(escape(sbx.sandbox_id))


@main.command(name="ls")
@click.option("--all", "-a", "show_all", is_flag=True, help="Paused sandboxes too (default: running ones).")
@click.option("--state", "states", multiple=True, type=click.Choice(["running", "paused"]),
              help="Only sandboxes in this state (repeatable).")
@click.option("--metadata", "-m", "metadata", multiple=True, metavar="KEY=VALUE",
              help="Only sandboxes with this metadata entry (repeatable: all must match).")
@click.option("--quiet", "-q", is_flag=True, help="Only the ids, one a line.")
@json_option
@server_options
def ls_cmd(show_all: bool, states: tuple[str, ...], metadata: tuple[str, ...], quiet: bool, as_json: bool,
           target: Target) -> None:
    """List sandboxes, newest first."""
    from agentcell import Sandbox
    from agentcell.sdk.models import SandboxQuery

    query = SandboxQuery(metadata=key_values(metadata, "--metadata") or None,
                         state=list(states) or (["running", "paused"] if show_all else ["running"]))
    target.require_server("ls")
    rows = list(Sandbox.list(query, **target.sdk))
    if as_json:
        print_json(rows)
    elif quiet:
        for s in rows:
            click.echo(escape(s.sandbox_id))
    elif not rows:
        click.echo("no sandboxes", err=True)
    else:
        table(["SANDBOX ID", "TEMPLATE", "STATE", "STARTED", "ENDS", "METADATA"],
              [[s.sandbox_id, s.template_id, s.state, when(s.started_at), when(s.end_at), metadata_text(s.metadata)]
               for s in rows])


@main.command()
@sandbox_id_arg
@json_option
@server_options
def info(sandbox_id: str, as_json: bool, target: Target) -> None:
    """A sandbox's details: template, state, times, limits, network, metadata."""
    from agentcell import Sandbox

    target.require_server("info")
    s = Sandbox.get_info(about(sandbox_id), **target.sdk)
    if as_json:
        print_json(s)
        return
    fields([("id", s.sandbox_id), ("template", s.template_id), ("state", s.state),
            ("pause mode", s.pause_mode), ("started", when(s.started_at)), ("ends", when(s.end_at)),
            ("cpus", s.cpu_count), ("memory MB", s.memory_mb), ("disk MB", s.disk_size_mb),
            ("limits", metadata_text({k: str(v) for k, v in (s.limits or {}).items()})),
            ("internet", s.allow_internet_access), ("metadata", metadata_text(s.metadata))])


@main.command()
@click.argument("sandbox_ids", metavar="ID...", nargs=-1, shell_complete=complete_sandbox_ids)
@click.option("--all", "kill_all", is_flag=True, help="Every sandbox of the server (running and paused).")
@json_option
@server_options
def kill(sandbox_ids: tuple[str, ...], kill_all: bool, as_json: bool, target: Target) -> None:
    """Kill sandboxes. Exits 1 if any was not found. --json: {killed: [ID...], not_found: [ID...]}."""
    from agentcell import Sandbox
    from agentcell.sdk.models import SandboxQuery

    if kill_all == bool(sandbox_ids):
        raise click.UsageError("name the sandboxes to kill, or pass --all (not both)")
    target.require_server("kill")
    if kill_all:
        sandbox_ids = tuple(s.sandbox_id for s in Sandbox.list(SandboxQuery(state=["running", "paused"]),
                                                               **target.sdk))
    killed, missing = [], []
    for sid in sandbox_ids:
        about(sid)
        if Sandbox.kill(sid, **target.sdk):
            killed.append(sid)
            if not as_json:
                click.echo(f"killed {escape(sid)}")
        else:
            missing.append(sid)
    if as_json:
        print_json({"killed": killed, "not_found": missing})
    if missing:
        raise CliError(f"not found: {' '.join(missing)}", "`agentcell ls --all` lists the sandboxes there are",
                       json_error=False)


@main.command()
@click.argument("sandbox_ids", metavar="ID...", nargs=-1, required=True, shell_complete=complete_sandbox_ids)
@click.option("--mode", type=click.Choice(["full", "filesystem"]), default=None,
              help="full: memory kept, resumed where it was; filesystem: files only, a resume cold-starts it "
                   "(default: full).")
@json_option
@server_options
def pause(sandbox_ids: tuple[str, ...], mode: str | None, as_json: bool, target: Target) -> None:
    """Pause sandboxes (`agentcell resume` continues them). A paused sandbox does not time out; the
    server keeps it --paused-ttl seconds. --json: {paused: [ID...], already_paused: [ID...]}."""
    from agentcell import Sandbox

    target.require_server("pause")
    paused, already = [], []
    for sid in sandbox_ids:
        if Sandbox.pause(about(sid), mode=mode, **target.sdk):
            paused.append(sid)
            if not as_json:
                click.echo(f"paused {escape(sid)}")
        else:
            already.append(sid)
            if not as_json:
                click.echo(f"{escape(sid)} was paused already", err=True)
    if as_json:
        print_json({"paused": paused, "already_paused": already})


@main.command()
@sandbox_id_arg
@click.option("--timeout", type=click.IntRange(1), default=None,
              help="Seconds it lives from now (default: the server's default timeout, 300 s unless set).")
@json_option
@server_options
def resume(sandbox_id: str, timeout: int | None, as_json: bool, target: Target) -> None:
    """Resume a paused sandbox; with --timeout, also give a running one longer. --json: its details
    afterwards (as `info --json`)."""
    from agentcell import Sandbox

    target.require_server("resume")
    info = Sandbox.get_info(about(sandbox_id), **target.sdk)
    if info.state != "paused" and timeout is None:
        raise CliError(f"sandbox {sandbox_id} is not paused", "`--timeout S` extends a running sandbox's life")
    Sandbox.connect(sandbox_id, timeout=timeout, **target.sdk)
    if as_json:
        print_json(Sandbox.get_info(sandbox_id, **target.sdk))
    else:
        click.echo(f"{'resumed' if info.state == 'paused' else 'extended'} {escape(sandbox_id)}")
