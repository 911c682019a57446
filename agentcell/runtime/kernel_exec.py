"""What the code contexts of every language share: how a kernel is started and spoken to.

A kernel is one process per context. It reads requests on fd 3 (a socketpair with the agent) and
answers there in the agent framing (``{"line": true}`` frames carrying one E2B line, then
``{"done": true}``; ``{"warm": true}`` once, when it is ready); its fds 1 and 2 are pipes the agent
reads as the run's stdout and stderr (kernel.py). Python contexts are forks of the agent (kernel.py);
the other languages' kernels are programs of the host's /usr, started here with ``posix_spawn`` as
the sandbox user, inside the sandbox's namespaces, cgroups, seccomp filter and Landlock domain like
any command (kernel_node.py, kernel_bash.py).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

from agentcell.runtime.processes import spawn
from agentcell.runtime.protocol import encode_frame

CTRL_FD = 3
# (ctrl fd, stdout pipe, stderr pipe, cwd, env, oom_score_adj) -> pid of the kernel, a session leader
Launcher = Callable[[int, int, int, str, dict[str, str], int], int]


def framed_run(code: str, env_vars: dict[str, str]) -> bytes:
    return encode_frame({"env_vars": env_vars}, code.encode("utf-8", "surrogatepass"))


def framed_env(envs: dict[str, str]) -> bytes:
    return encode_frame({"set_env": envs})


@dataclass(frozen=True)
class KernelSpec:
    """One language's kernel: how to start it, how to ask it to run code, what it needs."""

    language: str
    launch: Launcher
    missing: Callable[[], str | None] = lambda: None  # what the host lacks for it (a 400's message), or None
    encode_run: Callable[[str, dict[str, str]], bytes] = framed_run
    encode_env: Callable[[dict[str, str]], bytes] = framed_env
    interrupt_group: bool = False  # SIGINT to the kernel's whole process group (its commands too)
    # the agent joins the pieces of a line (held up to kernel.PARTIAL_LINE_S) into one stdout/stderr
    # message: for a kernel whose program writes a line in pieces, each flushed (R's console)
    whole_lines: bool = False


def find_program(names: tuple[str, ...], env: dict[str, str] | None = None) -> str | None:
    """The first of `names` on the sandbox's PATH (the host's /usr, read-only)."""
    path = (env or {}).get("PATH") or os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin"
    for name in names:
        found = shutil.which(name, path=path)
        if found:
            return found
    return None


def exec_kernel(argv: list[str], ctrl_fd: int, out_w: int, err_w: int, cwd: str, env: dict[str, str],
                oom_score_adj: int, stdin_is_ctrl: bool = False) -> int:  # fmt: skip
    """Start `argv` as a kernel: fd 3 the control socket, 1 and 2 the output pipes, 0 /dev/null (or
    the control socket, for a kernel that reads its requests as text on stdin)."""
    devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        actions = [
            (os.POSIX_SPAWN_DUP2, ctrl_fd if stdin_is_ctrl else devnull, 0),
            (os.POSIX_SPAWN_DUP2, out_w, 1),
            (os.POSIX_SPAWN_DUP2, err_w, 2),
            (os.POSIX_SPAWN_DUP2, ctrl_fd, CTRL_FD),
        ]
        # the OOM killer takes a context before the agent
        pid = spawn(argv[0], argv, env, cwd, actions, oom_score_adj)
    finally:
        os.close(devnull)
    return pid
