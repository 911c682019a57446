"""Bash contexts: one interactive ``bash`` per context (the host's), its state kept between runs.

The agent writes each run to the shell's stdin as three lines (kernel_bash.sh defines the functions):
``__agentcell_start``, then ``NAME=$'value' ... eval -- $'<code>' </dev/null 3>&-`` (the code and the
run's env vars ANSI-C quoted, so no byte of them is shell syntax; the run's own stdin is /dev/null, so
it cannot read the next lines), then ``__agentcell_done``, which reports the exit status. An interrupt
goes to the shell's process group: the running command dies, the interactive shell abandons the rest
of that line and goes on with ``__agentcell_done``.
"""

from __future__ import annotations

import os
import re

from agentcell.runtime.kernel_exec import KernelSpec, exec_kernel, find_program

RC_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_bash.sh")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 ,._+-/:=@%^")


def quote(text: str) -> str:
    """`text` as a bash ANSI-C quoted word ($'...'): every other byte as \\xHH, NULs dropped."""
    out = ["$'"]
    for b in text.encode("utf-8", "surrogatepass"):
        if b in _PLAIN:
            out.append(chr(b))
        elif b:
            out.append(f"\\x{b:02x}")
    out.append("'")
    return "".join(out)


def _assignments(env: dict[str, str]) -> str:
    # names bash cannot hold are left out (they could not be variables of the shell anyway)
    return "".join(f"{k}={quote(v)} " for k, v in env.items() if _NAME.match(k))


def encode_run(code: str, env_vars: dict[str, str]) -> bytes:
    return (f"__agentcell_start\n{_assignments(env_vars)}eval -- {quote(code)} </dev/null 3>&-\n"
            "__agentcell_done\n").encode()


def encode_env(envs: dict[str, str]) -> bytes:
    return "".join(f"export {k}={quote(v)}\n" for k, v in envs.items() if _NAME.match(k)).encode()


def _missing() -> str | None:
    if find_program(("bash",)) is None:
        return "bash contexts need bash, which this host does not have: apt-get install bash"
    return None


def _launch(ctrl_fd: int, out_w: int, err_w: int, cwd: str, env: dict[str, str], oom: int) -> int:
    bash = find_program(("bash",), env) or "/bin/bash"
    return exec_kernel([bash, "--noprofile", "--rcfile", RC_FILE, "--noediting", "-i"],
                       ctrl_fd, out_w, err_w, cwd, env, oom, stdin_is_ctrl=True)  # fmt: skip


BASH = KernelSpec("bash", _launch, _missing, encode_run, encode_env, interrupt_group=True)
