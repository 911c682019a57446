"""Commands that drive a server: demo, ls, kill, report, events."""

from __future__ import annotations

import base64
import json
import os
import sys
import time

import click

from agentcell.cli import main
from agentcell.text_escape import escape, escape_text

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _opts(f):  # type: ignore[no-untyped-def]
    f = click.option("--api-url", default=None, help="Server URL (default: AGENTCELL_URL, else an embedded server).")(f)
    return click.option("--api-key", default=None, help="API key (default: AGENTCELL_API_KEY / E2B_API_KEY).")(f)


@main.command()
@_opts
def demo(api_url: str | None, api_key: str | None) -> None:
    """Create a sandbox and run the README quick start in it."""
    from agentcell import Sandbox

    _show_embedded_progress()
    t0 = time.perf_counter()
    with Sandbox.create(api_url=api_url, api_key=api_key) as sbx:
        click.echo(f"sandbox {escape(sbx.sandbox_id)} ready in {(time.perf_counter() - t0) * 1000:.0f} ms")
        sbx.run_code("x = 41")
        t1 = time.perf_counter()
        text = sbx.run_code("x + 1").text
        click.echo(f'run_code("x + 1").text -> {text!r}  ({(time.perf_counter() - t1) * 1000:.1f} ms)')
        r = sbx.run_code("import matplotlib.pyplot as plt; plt.plot([1, 3, 2]); plt.show()")
        png = next((res.png for res in r.results if res.png), None)
        if png:
            data = base64.b64decode(png)
            valid = data[:8] == PNG_MAGIC
            click.echo(f"chart -> PNG, {len(data)} bytes (valid PNG header: {valid})")
        else:
            click.echo(f"chart -> no PNG result ({r})")
        err = sbx.run_code("1/0").error
        click.echo(f'run_code("1/0").error -> {escape(err.name)}: {escape(err.value)}' if err
                   else "run_code('1/0') -> no error?!")
        out = sbx.commands.run("echo hi")
        click.echo(f'commands.run("echo hi") -> stdout={out.stdout!r} exit_code={out.exit_code}')
        sbx.files.write("/home/user/a.csv", "a,b\n1,2\n")
        click.echo(f'files.read("/home/user/a.csv") -> {sbx.files.read("/home/user/a.csv")!r}')
    click.echo("sandbox killed; done")


def _show_embedded_progress() -> None:
    """An embedded server's start (its progress lines, what it changes on the host) on stderr."""
    import logging

    logger = logging.getLogger("agentcell")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("agentcell: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


@main.command(name="ls")
@_opts
def ls_cmd(api_url: str | None, api_key: str | None) -> None:
    """List running sandboxes."""
    from agentcell import Sandbox

    if not (api_url or os.environ.get("AGENTCELL_URL")):
        raise click.UsageError("ls needs a running server: pass --api-url or set AGENTCELL_URL")
    rows = list(Sandbox.list(api_url=api_url, api_key=api_key))
    if not rows:
        click.echo("no sandboxes")
        return
    click.echo(f"{'SANDBOX ID':<22} {'TEMPLATE':<20} {'STARTED':<26} {'ENDS':<26} METADATA")
    for s in rows:
        click.echo(f"{escape(s.sandbox_id):<22} {escape(s.template_id):<20} "
                   f"{s.started_at.isoformat(timespec='seconds'):<26} {s.end_at.isoformat(timespec='seconds'):<26} "
                   f"{escape(s.metadata or '')}")


@main.command()
@click.argument("sandbox_ids", nargs=-1, required=True)
@_opts
def kill(sandbox_ids: tuple[str, ...], api_url: str | None, api_key: str | None) -> None:
    """Kill sandboxes by id."""
    from agentcell import Sandbox

    if not (api_url or os.environ.get("AGENTCELL_URL")):
        raise click.UsageError("kill needs a running server: pass --api-url or set AGENTCELL_URL")
    failed = False
    for sid in sandbox_ids:
        if Sandbox.kill(sid, api_key=api_key, api_url=api_url):
            click.echo(f"killed {escape(sid)}")
        else:
            click.echo(f"{escape(sid)}: not found", err=True)
            failed = True
    sys.exit(1 if failed else 0)


@main.command()
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON instead of text.")
@_opts
def report(sandbox_id: str, as_json: bool, api_url: str | None, api_key: str | None) -> None:
    """A sandbox's behaviour report: processes, files, hosts, denials, limits and flags (also after it is gone)."""
    from agentcell import Sandbox

    if not (api_url or os.environ.get("AGENTCELL_URL")):
        raise click.UsageError("report needs a running server: pass --api-url or set AGENTCELL_URL")
    got = Sandbox.report(sandbox_id, format="json" if as_json else "text", api_key=api_key, api_url=api_url)
    # the server's text escapes every value already; escape_text leaves that as it is and covers a
    # server that does not (an older one)
    click.echo(json.dumps(got, indent=2) if as_json else escape_text(str(got).rstrip("\n")))


@main.command()
@click.argument("sandbox_id")
@click.option("--kind", "kinds", multiple=True, help="Only these kinds (repeatable; 'file.' for a prefix).")
@click.option("--follow", is_flag=True, help="Then stream new events until the sandbox is gone.")
@_opts
def events(sandbox_id: str, kinds: tuple[str, ...], follow: bool, api_url: str | None, api_key: str | None) -> None:
    """A sandbox's behaviour record as JSON lines, oldest first."""
    from agentcell import Sandbox

    if not (api_url or os.environ.get("AGENTCELL_URL")):
        raise click.UsageError("events needs a running server: pass --api-url or set AGENTCELL_URL")
    for e in Sandbox.events(sandbox_id, kinds=list(kinds) or None, follow=follow, api_key=api_key, api_url=api_url):
        click.echo(json.dumps(e, separators=(",", ":")))
