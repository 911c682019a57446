"""`agentcell doctor`: check this host for agentcell (agentcell/doctor.py) and print each finding with
its fix; exit 0 if the mode a server would run in here can run, 1 if not."""

from __future__ import annotations

import json

import click

from agentcell.cli import main

_MARK = {"ok": "ok  ", "warn": "warn", "missing": "MISS"}
_HOLDS = {True: "holds", False: "does not hold", None: "weaker"}
_MODE = {"root": "root (full guarantees)", "system": "the system service (full guarantees)",
         "rootless": "rootless (reduced guarantees, listed below)"}


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json: bool) -> None:
    """Check this host: what works, what is missing and how to fix it. Exit code 1 if a server cannot run."""
    from agentcell.doctor import diagnose

    report = diagnose()
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        click.echo(f"mode: {_MODE[report.mode]}")
        for c in report.checks:
            line = f"[{_MARK[c.status]}] {c.name}: {c.detail}"
            if c.status != "ok" and c.fix:
                line += f" -> fix: {c.fix}"
            click.echo(line)
        if report.guarantees:
            click.echo("rootless mode's guarantees (docs/rootless.md):")
            for g in report.guarantees:
                click.echo(f"  [{_HOLDS[g['holds']]}] {g['area']}: {g['text']}")
        click.echo("verdict: " + (f"a server can run here ({report.mode})" if report.can_run
                                  else f"a server cannot run here ({report.mode}): fix the MISS lines above"))
    raise SystemExit(0 if report.can_run else 1)
