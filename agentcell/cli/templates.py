"""`agentcell template import|ls|rm|gc`: templates from OCI images, in this host's template store.

These commands work on the store directly (as root, on the server's host), like an operator's tool:
`import` takes every transport (a registry, an OCI layout directory, a `docker save` tarball); a
client elsewhere imports from registries through the server's API (POST /templates/imports). The
registry policy and ceilings are given as `serve` takes them. A password is read from stdin
(--password-stdin), never from the command line, where `ps` would show it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click

from agentcell.cli import main
from agentcell.cli.errors import CliError
from agentcell.cli.output import json_option, print_json, table
from agentcell.cli.target import NO_SERVER_HINT, Target, server_options
from agentcell.errors import AgentcellError
from agentcell.text_escape import escape

DEFAULT_STORE = "/var/lib/agentcell/templates"

_store_option = click.option("--store", "store_dir", default=DEFAULT_STORE, show_default=True,
                             envvar="AGENTCELL_TEMPLATE_STORE", type=click.Path(file_okay=False),
                             help="The template store (a server's is <its --state-dir>/templates).")
_budget_option = click.option("--store-max-gb", default=50.0, show_default=True, type=click.FloatRange(min=0),
                              help="Disk the store's layers may take (serve --template-store-max-gb).")


def _store(store_dir: str, max_gb: float = 50.0) -> Any:
    from agentcell.templates.store import TemplateStore

    if os.geteuid() != 0:
        raise CliError("the template store is root's (its layers keep the images' owners and set-id bits)",
                       hint="run this command as root")
    return TemplateStore(store_dir, int(max_gb * (1 << 30)))


def _run(action: Callable[[], Any]) -> Any:
    try:
        return action()
    except AgentcellError as e:
        raise CliError(str(e)) from None


@main.group()
def template() -> None:
    """Templates: import, ls, rm, gc (OCI images, this host's template store); build (a Dockerfile, on a
    server)."""


@template.command(name="import")
@click.argument("ref", metavar="REF")
@click.option("--name", required=True, help="The template's name (a-z0-9._-); an existing one is replaced.")
@click.option("--username", default=None, help="The registry's user name (with --password-stdin).")
@click.option("--password-stdin", is_flag=True, help="Read the registry password (or token) from stdin.")
@click.option("--allowed-registry", "allowed", multiple=True, metavar="HOST[:PORT]",
              help="Only these registries (repeatable). Default: any at a public address.")
@click.option("--insecure-registry", "insecure", multiple=True, metavar="HOST:PORT",
              help="Allow this registry over plain HTTP or unverified TLS (repeatable).")
@click.option("--max-image-mb", default=4096, show_default=True, type=click.IntRange(1),
              help="Refuse images bigger than this (compressed and unpacked).")
@_store_option
@_budget_option
@json_option
def template_import(ref: str, name: str, username: str | None, password_stdin: bool, allowed: tuple[str, ...],
                    insecure: tuple[str, ...], max_image_mb: int, store_dir: str, store_max_gb: float,
                    as_json: bool) -> None:
    """Import the image REF as template NAME. REF in skopeo's syntax: docker://HOST/REPO:TAG (a bare
    NAME:TAG is Docker Hub's), oci:DIR[:TAG], docker-archive:FILE."""
    from agentcell.templates.fetch import Credentials
    from agentcell.templates.importer import Importer, ImportLimits
    from agentcell.templates.refs import RegistryPolicy

    if (username is None) != (not password_stdin):
        raise CliError("--username and --password-stdin go together")
    creds = Credentials(username, sys.stdin.readline().rstrip("\r\n")) if username is not None else None
    store = _store(store_dir, store_max_gb)
    importer = Importer(store, RegistryPolicy.of(allowed, insecure), ImportLimits(max_image_bytes=max_image_mb << 20))
    record = _run(lambda: importer.import_image(ref, name, creds))
    if as_json:
        print_json(record)
    else:
        click.echo(f"{escape(record['name'])}: {len(record['layers'])} layers, {record['size_bytes']} bytes "
                   f"({escape(record['manifest_digest'])})")


@template.command(name="ls")
@_store_option
@json_option
def template_ls(store_dir: str, as_json: bool) -> None:
    """The templates of the store."""
    records = _store(store_dir).templates()
    if as_json:
        print_json(records)
        return
    table(["NAME", "LAYERS", "BYTES", "IMPORTED", "SOURCE"],
          [[r["name"], str(len(r["layers"])), str(r["size_bytes"]),
            datetime.fromtimestamp(r["imported_at"], UTC).isoformat(timespec="seconds"), r["source"]]
           for r in records])


@template.command(name="rm")
@click.argument("name")
@_store_option
def template_rm(name: str, store_dir: str) -> None:
    """Delete a template (its layers go at the next gc, unless another template has them)."""
    _run(lambda: _store(store_dir).delete_template(name))


@template.command(name="gc")
@_store_option
@json_option
def template_gc(store_dir: str, as_json: bool) -> None:
    """Remove the layers no template names (waits for imports in progress)."""
    done = _run(lambda: _store(store_dir).collect())
    if as_json:
        print_json(done)
    else:
        click.echo(f"removed {len(done.removed_layers)} layers ({done.freed_bytes} bytes); "
                   f"the store holds {done.size_bytes} bytes")


@template.command(name="build")
@click.argument("context", default=".", type=click.Path(exists=True, file_okay=False))
@click.option("-f", "--file", "dockerfile", default=None, type=click.Path(dir_okay=False, allow_dash=True),
              help="The Dockerfile (default: CONTEXT/Dockerfile; - reads it from stdin).")
@click.option("--name", required=True, help="The template's name (NAME or NAME:TAG).")
@click.option("--build-arg", "build_args", multiple=True, metavar="NAME[=VALUE]",
              help="A build argument (repeatable); NAME alone takes its value from this environment.")
@click.option("--tag", "tags", multiple=True, metavar="TAG", help="Also tag the build TAG (repeatable).")
@click.option("--no-cache", is_flag=True, help="Rebuild every step (no cached layer).")
@click.option("--ready-cmd", default=None, metavar="CMD",
              help="The start command's ready check, run until it exits 0 (default: the HEALTHCHECK's "
                   "command, else none: ready once started).")
@server_options
@json_option
def template_build(context: str, dockerfile: str | None, name: str, build_args: tuple[str, ...],
                   tags: tuple[str, ...], no_cache: bool, ready_cmd: str | None, target: Target,
                   as_json: bool) -> None:
    """Build template NAME from a Dockerfile and its build CONTEXT (default: .), on the server,
    through E2B's template-build API. Build logs go to stderr."""
    from agentcell.sdk.config import resolve_api_key
    from agentcell.templates.dockerfile import convert_dockerfile, load_dockerfile
    from agentcell.templates.remote_build import build_on_server

    api_url = target.api_url or os.environ.get("AGENTCELL_URL")
    if not api_url:
        raise CliError("`agentcell template build` needs a running agentcell server's URL", NO_SERVER_HINT)
    args = _build_args(build_args)
    if dockerfile == "-":
        converted = _run(lambda: convert_dockerfile(sys.stdin.read(), context, args, label="Dockerfile",
                                                    ready_cmd=ready_cmd))
    else:
        converted = _run(lambda: load_dockerfile(dockerfile or os.path.join(context, "Dockerfile"), context, args,
                                                 ready_cmd=ready_cmd))
    for warning in converted.warnings:
        click.echo(f"warning: {escape(warning)}", err=True)

    def show(entry: Any) -> None:
        click.echo(escape(str(entry)), err=True)

    result = _run(lambda: build_on_server(converted, name, api_url=api_url, api_key=resolve_api_key(target.api_key),
                                          tags=list(tags), skip_cache=no_cache, on_log=show,
                                          request_timeout=target.request_timeout))
    if as_json:
        print_json({"templateID": result.template_id, "buildID": result.build_id, "name": result.name,
                    "tags": result.tags, "warnings": converted.warnings})
    else:
        click.echo(f"{escape(result.name)}: template {escape(result.template_id)}, build {escape(result.build_id)}")


def _build_args(pairs: tuple[str, ...]) -> dict[str, str]:
    """Docker's --build-arg: NAME=VALUE, or NAME for this environment's value (skipped when unset)."""
    args = {}
    for pair in pairs:
        name, has_value, value = pair.partition("=")
        if not name:
            raise CliError(f"--build-arg {pair!r}: the name is empty", "use --build-arg NAME=VALUE")
        if has_value:
            args[name] = value
        elif name in os.environ:
            args[name] = os.environ[name]
    return args
