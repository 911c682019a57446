"""`agentcell shell ID`: an interactive login shell in a sandbox, on a real PTY (the SDK's pty API).

This terminal goes to raw mode, so every key (Ctrl-C, Ctrl-D, arrows) reaches the sandbox's shell;
its window size follows this one's (SIGWINCH); the command ends, with the shell's exit code, when the
shell exits. Two threads: the main one forwards stdin and resizes, another writes the shell's output.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import threading
from typing import Any

import click

from agentcell.cli import main
from agentcell.cli.errors import EXIT_ERROR
from agentcell.cli.params import key_values
from agentcell.cli.target import Target, complete_sandbox_ids, connect_running, server_options

_DONE = b"\0"  # what the output thread writes to the wakeup pipe when the shell has ended
_EOT = b"\x04"  # Ctrl-D: a piped (not a terminal) stdin's end ends the shell as a typed Ctrl-D would


def _size() -> Any:
    from agentcell.sdk.models import PtySize

    cols, rows = shutil.get_terminal_size((80, 24))
    return PtySize(rows=rows, cols=cols)


class _RawTerminal:
    """Raw mode on a terminal stdin for the block, restored however the block ends."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.saved: list[Any] | None = None

    def __enter__(self) -> _RawTerminal:
        if os.isatty(self.fd):
            import termios
            import tty

            self.saved = termios.tcgetattr(self.fd)
            tty.setraw(self.fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)


@main.command()
@click.argument("sandbox_id", metavar="ID", shell_complete=complete_sandbox_ids)
@click.option("--user", "-u", default=None, help="Log in as this user (user, root; default: user).")
@click.option("--cwd", "-w", default=None, help="Start in this directory (default: the user's home).")
@click.option("--env", "-e", "envs", multiple=True, metavar="KEY=VALUE", help="An environment variable (repeatable).")
@server_options
def shell(sandbox_id: str, user: str | None, cwd: str | None, envs: tuple[str, ...], target: Target) -> None:
    """An interactive shell in a sandbox (bash on a PTY); exits with the shell's exit code."""
    env_map = key_values(envs, "--env")
    sbx = connect_running(target, sandbox_id, "shell")
    if "TERM" in os.environ:
        env_map.setdefault("TERM", os.environ["TERM"])
    handle = sbx.pty.create(_size(), user=user, cwd=cwd, envs=env_map or None, timeout=0)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    outcome: dict[str, Any] = {}

    def copy_output() -> None:
        try:
            for _, _, data in handle:
                if data:
                    os.write(sys.stdout.fileno(), data)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, raised there
            outcome["error"] = e
        outcome["exit_code"] = handle.exit_code
        os.write(wake_w, _DONE)

    stdin = sys.stdin.fileno()
    old_winch = signal.signal(signal.SIGWINCH, lambda *_: None)
    old_wakeup = signal.set_wakeup_fd(wake_w)  # a SIGWINCH wakes the select below, as a byte on the pipe
    try:
        with _RawTerminal(stdin):
            threading.Thread(target=copy_output, name="agentcell-pty-output", daemon=True).start()
            _forward(sbx, handle.pid, stdin, wake_r)
    finally:
        signal.set_wakeup_fd(old_wakeup)
        signal.signal(signal.SIGWINCH, old_winch)
    if "error" in outcome:
        raise outcome["error"]
    code = outcome.get("exit_code")
    sys.exit(EXIT_ERROR if code is None else code if code >= 0 else 128 + signal.SIGHUP)


def _forward(sbx: Any, pid: int, stdin: int, wake: int) -> None:
    """Stdin to the PTY and window sizes to its size, until the output thread says the shell ended."""
    watched = [stdin, wake]
    while True:
        ready, _, _ = select.select(watched, [], [])
        if wake in ready:
            woke = os.read(wake, 512)
            if _DONE in woke:
                return
            if bytes([signal.SIGWINCH]) in woke:
                sbx.pty.resize(pid, _size())
        if stdin in ready:
            data = os.read(stdin, 64 << 10)
            if not data:  # a piped stdin ended: end the shell as Ctrl-D would, then only wait for it
                data, watched = _EOT, [wake]
            try:
                sbx.pty.send_stdin(pid, data)
            except Exception:
                if _ended_meanwhile(wake):  # typed after `exit`: the shell's end says the rest
                    return
                raise


def _ended_meanwhile(wake: int, within: float = 2.0) -> bool:
    ready, _, _ = select.select([wake], [], [], within)
    return bool(ready) and _DONE in os.read(wake, 512)
