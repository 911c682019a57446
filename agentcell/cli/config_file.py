"""`--config FILE` (or AGENTCELL_CONFIG): a TOML file equal to a command's flags.

Its keys are the command's long flag names without the leading dashes, as written on the command line
(`max-sandboxes = 10`, `allowed-host = ["a.example", "b.example"]`, `record = false` for --no-record,
`insecure-no-auth = true`); the same name with `_` for `-` is accepted too. A repeatable flag takes a
list (or one value). Values are checked as the flag's are. An unknown key is an error naming it.

Precedence, highest first: the command line, the flag's environment variable, the file, the default.
Relative paths are read as on the command line (from the working directory).

Built from the click command's own parameters (a `default_map`), so every flag, present or future,
can be set in the file.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Callable
from typing import Any, TypeVar

import click

ENV = "AGENTCELL_CONFIG"
WARNINGS = "agentcell.config_warnings"  # ctx.meta: what to log once the log is configured
F = TypeVar("F", bound=Callable[..., Any])


def _keys(command: click.Command) -> dict[str, click.Parameter]:
    """Each settable parameter by its long flag name (`max-sandboxes`)."""
    out: dict[str, click.Parameter] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name in (None, "config") or param.is_eager:
            continue
        longs = [o for o in param.opts if o.startswith("--")]
        if longs:
            out[longs[0][2:]] = param
    return out


def load(path: str, command: click.Command) -> dict[str, Any]:
    """The file as a click default_map (parameter name -> value); ClickException on any error."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise click.ClickException(f"config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise click.ClickException(f"config file {path}: not TOML: {e}") from None
    keys = _keys(command)
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("_", "-")
        param = keys.get(name)
        if param is None:
            near = difflib.get_close_matches(name, list(keys), n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else f" (the keys are {command.name}'s flags)"
            raise click.ClickException(f"config file {path}: unknown key '{key}'{hint}")
        if isinstance(value, dict):
            raise click.ClickException(f"config file {path}: '{key}' is a table; give a value")
        if param.multiple and not isinstance(value, list):
            value = [value]
        elif not param.multiple and isinstance(value, list):
            raise click.ClickException(f"config file {path}: '{key}' takes one value, not a list")
        if param.name in out:
            raise click.ClickException(f"config file {path}: '{key}' is given twice")
        out[param.name] = value  # type: ignore[index]
    return out


def _apply(ctx: click.Context, _param: click.Parameter, path: str | None) -> str | None:
    if path:
        loaded = load(path, ctx.command)
        ctx.default_map = {**(ctx.default_map or {}), **loaded}
        if any("key" in name and not name.endswith("_file") for name in loaded) and world_readable(path):
            ctx.meta.setdefault(WARNINGS, []).append(
                f"config file {path} holds a key and is readable by every user of this host: chmod 600 it")
    return path


def config_option(command: F) -> F:
    """Add `--config FILE` to a command (eager: the file is read before the other flags)."""
    return click.option(
        "--config", "config", default=None, envvar=ENV, is_eager=True, expose_value=False, callback=_apply,
        type=click.Path(dir_okay=False), metavar="FILE",
        help=f"A TOML file of flags (keys: the long flag names, e.g. max-sandboxes = 10); the command line "
             f"overrides it. Also ${ENV}.")(command)


def given_on_command_line(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


def world_readable(path: str) -> bool:
    try:
        return bool(os.stat(path).st_mode & 0o004)
    except OSError:
        return False
