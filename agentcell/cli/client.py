"""`agentcell demo`: the README's quick start, in a sandbox of its own (an embedded server when none is
configured: the sandbox ends with the command)."""

from __future__ import annotations

import base64
import sys
import time

import click

from agentcell.cli import main
from agentcell.cli.target import Target, server_options
from agentcell.text_escape import escape

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@main.command()
@server_options
def demo(target: Target) -> None:
    """Create a sandbox and run the README quick start in it (without a server configured, in an
    embedded one)."""
    from agentcell import Sandbox

    _show_embedded_progress()
    t0 = time.perf_counter()
    with Sandbox.create(**target.sdk) as sbx:
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
