"""Keys given without putting them in argv (where `ps` shows them to every user of the host): each key
flag `--X` has `--X-file PATH` (the key is the file's content, surrounding whitespace stripped; e.g.
systemd's LoadCredential= gives `$CREDENTIALS_DIRECTORY/NAME`) and an environment variable. A key
given as a flag on the command line still works, with a warning in the log.
"""

from __future__ import annotations

import logging

import click

from agentcell.cli.config_file import WARNINGS, given_on_command_line, world_readable

log = logging.getLogger("agentcell.server")


def read_key_file(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise click.ClickException(f"--{flag}-file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not key:
        raise click.ClickException(f"--{flag}-file {path}: the file is empty")
    if "\n" in key:
        raise click.ClickException(f"--{flag}-file {path}: the key is one line; the file has several")
    return key


def resolve_key(ctx: click.Context, opts: dict[str, object], name: str) -> str | None:
    """opts[name] from itself or opts[name + '_file'] (popped); refuses both at once or an empty key."""
    flag = name.replace("_", "-")
    key, path = opts.get(name), opts.pop(f"{name}_file", None)
    if key is not None and path is not None:
        raise click.ClickException(f"--{flag} and --{flag}-file both given: pass one")
    if path is not None:
        key = read_key_file(str(path), flag)
    if key == "":
        raise click.BadParameter("is empty; pass a real key or leave the option out", param_hint=f"--{flag}")
    opts[name] = key
    return key  # type: ignore[return-value]


def warn_exposed_keys(ctx: click.Context, names: tuple[str, ...]) -> None:
    """Log a warning for each key given as a command-line flag (to call once the log is configured)."""
    for name in names:
        flag = name.replace("_", "-")
        if given_on_command_line(ctx, name) and ctx.params.get(name) is not None:
            log.warning("--%s was given on the command line: every user of this host can read it (ps, "
                        "/proc/PID/cmdline); use --%s-file or the environment variable instead", flag, flag)
        path = ctx.params.get(f"{name}_file")
        if isinstance(path, str) and world_readable(path):
            log.warning("--%s-file %s is readable by every user of this host: chmod 600 it", flag, path)
    for warning in ctx.meta.get(WARNINGS, ()):
        log.warning("%s", warning)


def key_file_option(name: str, envvar: str, what: str):  # type: ignore[no-untyped-def]
    flag = name.replace("_", "-")
    return click.option(f"--{flag}-file", f"{name}_file", default=None, envvar=envvar, metavar="PATH",
                        type=click.Path(dir_okay=False),
                        help=f"Read {what} from this file (not visible in `ps`, unlike --{flag}).")
