"""Enter a user namespace an ordinary user owns, as its root, with the user's subordinate ids mapped.

The map (the user's own id and /etc/subuid's range, written by the setuid helpers newuidmap and
newgidmap of the `uidmap` package, the only part of this that is privileged):

    inside 0           -> the user (the server runs as it: its files are the user's)
    inside 1 .. N      -> the user's subordinate ids (sandboxes get ids of their own from these)

Every other host id, root included, is unmapped: inside it shows as the overflow id (65534) and
no capability there reaches it. The process then takes a private mount namespace (the server's
mounts never show on the host) and execs its command with rootless.ENV set. The network namespace
stays the host's, so the user reaches the server on loopback or its unix socket; each sandbox has
its own, owned by the namespace.

How: the process forks a helper before it unshares; the helper, still outside, runs newuidmap and
newgidmap on the process's pid (a process cannot map ids it does not own into its own namespace).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from agentcell.backends.linux import syscalls as sc

# the host's prerequisites live with the mode (agentcell/rootless.py), light enough for the SDK to check
from agentcell.rootless import (  # noqa: E402,F401
    MIN_SUBIDS,
    SUBGID,
    SUBUID,
    IdMaps,
    RootlessUnavailableError,
    SubIds,
    check_kernel,
    plan,
    subids,
)


def exec_inside(argv: Sequence[str], env: Mapping[str, str]) -> NoReturn:
    """Become root of a new user namespace (ids mapped as `plan()` says) with a private mount
    namespace, and exec `argv` there with `env`. Raises RootlessUnavailableError before anything
    changed if the host does not allow it."""
    check_kernel()
    maps = plan()
    uid_args, gid_args = maps.helper_args()
    me = os.getpid()
    go_r, go_w = os.pipe()
    helper = os.fork()
    if helper == 0:  # outside: map the parent's namespace once it exists
        try:
            os.close(go_w)
            if os.read(go_r, 1) != b"1":
                os._exit(2)  # the parent could not unshare: nothing to map
            for tool, args in (("newuidmap", uid_args), ("newgidmap", gid_args)):
                done = subprocess.run([tool, str(me), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"agentcell: {tool} {me} {' '.join(args)} failed: {done.stderr.strip()}", file=sys.stderr)
                    os._exit(1)
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    os.close(go_r)
    try:
        sc.unshare(sc.CLONE_NEWUSER)
    except OSError as e:
        os.write(go_w, b"0")
        os.waitpid(helper, 0)
        raise RootlessUnavailableError(f"cannot create a user namespace ({e.strerror}): see `agentcell doctor`") from None
    os.write(go_w, b"1")
    os.close(go_w)
    _, status = os.waitpid(helper, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RootlessUnavailableError(
            "newuidmap/newgidmap could not map your subordinate ids (see the line above); check /etc/subuid, "
            "/etc/subgid and that newuidmap is setuid root (ls -l $(which newuidmap))")
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    os.setgroups([])
    # A pid namespace of its own too: the zygote returns to its pid namespace after each fork (setns),
    # which needs the namespace to be owned by ours.
    sc.unshare(sc.CLONE_NEWNS | sc.CLONE_NEWPID)
    sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)  # nothing mounted here reaches the host's view
    server = os.fork()
    if server == 0:  # pid 1 of the new pid namespace: its own /proc, then the server
        try:
            sc.prctl(sc.PR_SET_PDEATHSIG, signal.SIGKILL)
            sc.mount("proc", "/proc", "proc", sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC)
            os.execve(argv[0], list(argv), dict(env))
        except BaseException as e:  # noqa: BLE001
            print(f"agentcell: cannot start the rootless server: {e}", file=sys.stderr)
            os._exit(127)
    _relay(server)


def _relay(child: int) -> NoReturn:
    """Stay outside as the server's parent (the SDK or the shell holds our pid): pass on the signals
    that stop it, and exit with its status."""
    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, forward)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)
