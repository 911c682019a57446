"""How the `agentcell` command fails: one line `agentcell: error: ...` on stderr, then a `hint:` line
when there is something to do about it, and an exit code (docs/cli.md). No traceback: `--debug` (or
AGENTCELL_DEBUG=1) lets the original exception through, with its traceback, for a bug report.

Under `--json` an error says the same on stderr, and stdout gets one JSON line too, so a script that
parses stdout always has JSON: {"error": {"message", "hint", "exit_code"}}. A command whose JSON result
already tells the failure (`kill --json` naming the ids it did not find) prints only that result.
Usage errors (exit 2, click's) are text only: they come before the options are read.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

import click

from agentcell.errors import (
    AuthenticationException,
    EmbeddedServerError,
    FileNotFoundException,
    NotFoundException,
    RateLimitException,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    ServerUnreachableException,
    TimeoutException,
)
from agentcell.text_escape import escape

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2  # click's, for a usage error
EXIT_TIMEOUT = 124  # a command or code run killed at its --timeout (as timeout(1))
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)

# set by the group's --debug / AGENTCELL_DEBUG before any subcommand runs
META_DEBUG = "agentcell.debug"
# set by server_options: where the command was sent, and about which sandbox (for the messages)
META_TARGET = "agentcell.target"
META_SANDBOX = "agentcell.sandbox"
# set by output.json_option when --json is given: an error prints its JSON object on stdout too
META_JSON = "agentcell.json"


class CliError(click.ClickException):
    """A failure the user can act on: its message is shown as one line (escaped: it may quote what a
    server or a sandbox sent), its hint says what to do."""

    def __init__(self, message: str, hint: str | None = None, exit_code: int = EXIT_ERROR,
                 json_error: bool = True) -> None:
        super().__init__(message)
        self.hint = hint
        self.exit_code = exit_code
        self.json_error = json_error  # False: the command printed its JSON result, which tells the failure
        self.as_json = False  # set when the command ran with --json

    def show(self, file: IO[Any] | None = None) -> None:
        if self.as_json and self.json_error:
            click.echo(json.dumps({"error": {"message": self.message.strip(), "hint": self.hint,
                                             "exit_code": self.exit_code}}, separators=(",", ":")))
        click.echo(f"agentcell: error: {one_line(self.message)}", err=True)
        if self.hint:
            click.echo(f"hint: {self.hint}", err=True)


def one_line(text: str) -> str:
    """The first line of `text`, escaped: an error may quote what a server or a sandbox sent."""
    first = text.strip().split("\n", 1)[0].strip()
    return escape(first or text.strip())


def debug_enabled() -> bool:
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.find_root().meta.get(META_DEBUG):
        return True
    return os.environ.get("AGENTCELL_DEBUG", "") not in ("", "0", "false", "no")


def _reason(text: str) -> str:
    lowered = text.lower()
    for needle, reason in (("connection refused", "connection refused"), ("no such file", "no such socket"),
                           ("name or service not known", "unknown host"), ("timed out", "timed out"),
                           ("permission denied", "permission denied")):
        if needle in lowered:
            return f" ({reason})"
    return ""


def _where(meta: dict[str, Any]) -> str:
    target = meta.get(META_TARGET)
    url = target.describe() if target is not None else None
    return f" at {url}" if url else ""


def from_exception(e: BaseException, meta: dict[str, Any]) -> CliError:
    """The one-line message and hint for an exception a command let through."""
    sid = meta.get(META_SANDBOX)
    sandbox = f"sandbox {sid}" if sid else "the sandbox"
    text = str(e)
    if isinstance(e, ServerUnreachableException):
        return CliError(f"cannot reach the agentcell server{_where(meta)}{_reason(text)}",
                        "start one with `agentcell serve`, or point AGENTCELL_URL (or --api-url) at a running one")
    if isinstance(e, AuthenticationException):
        return CliError(f"the server refused the API key{_where(meta)}",
                        "pass the server's key with --api-key or AGENTCELL_API_KEY")
    if isinstance(e, FileNotFoundException):
        path, _, why = text.partition(": ")
        why = why.removeprefix(f"{path}: ")  # the SDK's message names the path twice
        return CliError(f"{path}: {why.lower() if why else 'not found'} (in {sandbox})",
                        "check the path (`agentcell exec ID -- ls -la DIR`)")
    if isinstance(e, SandboxNotFoundException) or (isinstance(e, NotFoundException) and sid
                                                   and "sandbox" in text.lower()):
        return CliError(f"{sandbox} not found: it was killed, timed out, or never existed",
                        "`agentcell ls --all` lists the sandboxes there are")
    if isinstance(e, SandboxNotRunningException):
        return CliError(f"{sandbox} is gone: it was killed or its timeout passed",
                        "`agentcell create` starts a new one; --timeout on create keeps one alive longer")
    if isinstance(e, TimeoutException):
        # exec's and run's own --timeout are theirs to say (exit 124); here a request went unanswered
        return CliError(f"the agentcell server{_where(meta)} did not answer in time",
                        "is it overloaded? --request-timeout S waits longer")
    if isinstance(e, RateLimitException):
        return CliError(text, "the server is at its sandbox limit: kill idle ones (`agentcell ls`, `agentcell kill`)")
    if isinstance(e, EmbeddedServerError):
        return CliError(text, "start a server with `agentcell serve` and set AGENTCELL_URL, or run with --debug")
    if isinstance(e, SandboxException):
        return CliError(text)
    if isinstance(e, OSError):
        name = f"{e.filename}: " if e.filename else ""
        return CliError(f"{name}{e.strerror or e}")
    return CliError(f"unexpected {type(e).__name__}: {text}", "run with --debug for the traceback and report it")


class AgentcellGroup(click.Group):
    """The `agentcell` group: whatever a subcommand raises becomes a CliError (unless --debug)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CliError as e:
            e.as_json = bool(ctx.meta.get(META_JSON))
            raise
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        except BrokenPipeError:
            # `agentcell events ID | head`: the reader left; nothing to say
            _silence_stdout()
            raise click.exceptions.Exit(EXIT_ERROR) from None
        except Exception as e:
            if debug_enabled():
                raise
            error = from_exception(e, ctx.meta)
            error.as_json = bool(ctx.meta.get(META_JSON))
            raise error from None


def _silence_stdout() -> None:
    """After a broken pipe, Python's final flush of stdout would fail again and print a warning."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    except OSError:
        pass
