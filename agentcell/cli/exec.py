"""`agentcell exec` (a command in a sandbox) and `agentcell run` (code in one of its code contexts).

Both stream: what the sandbox writes is on this terminal as it is written, stdout to stdout and
stderr to stderr. A command's output is passed through byte for byte, as the command wrote it (as
`docker exec` and ssh do: exec_output.py); `exec --json` collects it into one object instead. The
results and errors `run` formats itself are escaped (`run`'s output is the code interpreter's text).
"""

from __future__ import annotations

import shlex
import sys
import threading
from typing import Any

import click

from agentcell.cli import main
from agentcell.cli.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_TIMEOUT, CliError
from agentcell.cli.exec_output import relay
from agentcell.cli.output import json_option, print_json
from agentcell.cli.params import key_values
from agentcell.cli.target import Target, about, complete_sandbox_ids, connect_running, server_options
from agentcell.errors import CommandExitException, SandboxNotRunningException, TimeoutException
from agentcell.text_escape import escape_text

LANGUAGES = ["python", "javascript", "typescript", "bash", "java", "r"]
# a command a signal ended exits 128 + the signal's number, as in a shell
_SIGNALS = {"hangup": 1, "interrupt": 2, "quit": 3, "aborted": 6, "killed": 9, "segmentation fault": 11,
            "broken pipe": 13, "terminated": 15}


def _write(stream: Any, text: str) -> None:
    stream.buffer.write(text.encode("utf-8", "surrogateescape"))
    stream.buffer.flush()


def _write_bytes(stream: Any, data: bytes) -> None:
    stream.buffer.write(data)
    stream.buffer.flush()


def _signal_exit(error: str | None) -> int:
    name = (error or "").removeprefix("signal: ").split(" (")[0]
    return 128 + _SIGNALS[name] if name in _SIGNALS else EXIT_ERROR


def _forward_stdin(sbx: Any, pid: int) -> None:
    """Copy this process's stdin to the command's, then close it (EOF), in a daemon thread."""
    import os

    def pump() -> None:
        try:
            while chunk := os.read(sys.stdin.fileno(), 64 << 10):
                sbx.commands.send_stdin(pid, chunk)
            sbx.commands.close_stdin(pid)
        except Exception:  # noqa: BLE001 - the command ended first: its exit code says the rest
            pass

    threading.Thread(target=pump, name="agentcell-stdin", daemon=True).start()


@main.command(name="exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id", metavar="ID", shell_complete=complete_sandbox_ids)
@click.argument("command", metavar="-- CMD [ARG...]", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--user", "-u", default=None, help="Run as this user (user, root; default: user).")
@click.option("--cwd", "-w", default=None, help="Working directory (default: the user's home).")
@click.option("--env", "-e", "envs", multiple=True, metavar="KEY=VALUE", help="An environment variable (repeatable).")
@click.option("--timeout", type=click.FloatRange(0), default=0, show_default=True,
              help="Seconds before the command is killed (exit code 124); 0: never.")
@click.option("--interactive", "-i", is_flag=True, help="Pass this stdin to the command (EOF closes its stdin).")
@json_option
@server_options
def exec_cmd(sandbox_id: str, command: tuple[str, ...], user: str | None, cwd: str | None, envs: tuple[str, ...],
             timeout: float, interactive: bool, as_json: bool, target: Target) -> None:
    """Run a command in a sandbox, streaming its output; exit with its exit code.

    The words after `--` are the command and its arguments (quoted for bash: `-- sh -c 'echo $HOME'`
    runs a shell line). --json: no streaming; at the end one object, {exit_code, stdout, stderr}."""
    env_map = key_values(envs, "--env")
    sbx = connect_running(target, sandbox_id, "exec")
    handle = sbx.commands.run(shlex.join(command), background=True, envs=env_map or None, user=user, cwd=cwd,
                              stdin=interactive, timeout=timeout, retain_output=False)
    if interactive:
        _forward_stdin(sbx, handle.pid)
    out, err = bytearray(), bytearray()
    on_out, on_err = (out.extend, err.extend) if as_json else (lambda b: _write_bytes(sys.stdout, b),
                                                               lambda b: _write_bytes(sys.stderr, b))
    try:
        relay(handle, on_out, on_err)
        code = 0
    except CommandExitException as e:
        code = e.exit_code if e.exit_code >= 0 else _signal_exit(handle._output.status)
    except SandboxNotRunningException:
        raise  # the sandbox went (a TimeoutException too, as in e2b): errors.py says so
    except TimeoutException:
        if not timeout:
            raise
        raise CliError(f"the command ran past --timeout {timeout:g} s and was killed", None, EXIT_TIMEOUT) from None
    except KeyboardInterrupt:
        handle.kill()  # as ssh: the command goes with the terminal that ran it
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        handle.kill()  # `agentcell exec ... | head`: the reader left, so does the command
        raise
    if as_json:
        print_json({"exit_code": code, "stdout": out.decode("utf-8", "replace"),
                    "stderr": err.decode("utf-8", "replace")})
    if code:
        sys.exit(code)


@main.command(name="run")
@click.argument("args", metavar="ID CODE|-", nargs=-1, required=True)
@click.option("--language", "-L", type=click.Choice(LANGUAGES), default=None,
              help="The code's language (default: python). Each language has one context per sandbox that "
                   "keeps its state between runs.")
@click.option("--context", "context_id", default=None, metavar="CONTEXT_ID", help="Run in this code context.")
@click.option("--env", "-e", "envs", multiple=True, metavar="KEY=VALUE", help="An environment variable (repeatable).")
@click.option("--timeout", type=click.FloatRange(0), default=300, show_default=True,
              help="Seconds before the run is interrupted (exit code 124); 0: never.")
@click.option("--rm", "one_shot", is_flag=True,
              help="No ID: run in a new sandbox, killed afterwards (without a server configured, in an "
                   "embedded one).")
@click.option("--template", "-t", default="base", show_default=True, help="With --rm: the new sandbox's template.")
@json_option
@server_options
def run_cmd(args: tuple[str, ...], language: str | None, context_id: str | None, envs: tuple[str, ...],
            timeout: float, one_shot: bool, template: str, as_json: bool, target: Target) -> None:
    """Run code in a sandbox's code context: stdout and stderr stream, then the results' text. An
    error in the code prints its traceback and exits 1. CODE `-` reads the code from stdin.

    `agentcell run --rm CODE` runs in a fresh sandbox instead of ID."""
    from agentcell import Sandbox

    if len(args) != (1 if one_shot else 2):
        raise click.UsageError("usage: agentcell run ID CODE|-, or agentcell run --rm CODE|-")
    code = sys.stdin.read() if args[-1] == "-" else args[-1]
    env_map = key_values(envs, "--env")
    run = {"language": language, "context": context_id, "envs": env_map or None, "timeout": timeout}
    if one_shot:
        with Sandbox.create(template, timeout=int(timeout) + 60 if timeout else 3600, **target.sdk) as sbx:
            _run(sbx, code, run, as_json)
    else:
        _run(connect_running(target, args[0], "run"), code, run, as_json)


def _run(sbx: Any, code: str, run: dict[str, Any], as_json: bool) -> None:
    about(sbx.sandbox_id)
    streaming: dict[str, Any] = {} if as_json else {
        "on_stdout": lambda m: _write(sys.stdout, m.line),
        "on_stderr": lambda m: _write(sys.stderr, m.line),
        "on_result": _show_result,
    }
    try:
        execution = sbx.run_code(code, **run, **streaming)
    except SandboxNotRunningException:
        raise
    except TimeoutException as e:
        raise CliError(f"the code ran past --timeout {run['timeout']:g} s and was interrupted", None,
                       EXIT_TIMEOUT) from e
    if as_json:
        print_json({
            "results": [{"is_main_result": r.is_main_result, **{f: r[f] for f in r.formats() if hasattr(r, f)}}
                        for r in execution.results],
            "stdout": execution.logs.stdout, "stderr": execution.logs.stderr,
            "error": None if execution.error is None else {"name": execution.error.name, "value": execution.error.value,
                                                           "traceback": execution.error.traceback},
            "execution_count": execution.execution_count,
        })
    elif execution.error is not None:
        err = execution.error
        click.echo(escape_text(err.traceback.rstrip("\n") or f"{err.name}: {err.value}"), err=True)
    if execution.error is not None:
        sys.exit(EXIT_ERROR)


def _show_result(result: Any) -> None:
    if result.text is not None:
        click.echo(escape_text(result.text))
    else:
        click.echo(f"[a result in {', '.join(result.formats()) or 'no format'}: see --json]", err=True)
