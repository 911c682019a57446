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
import pwd
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from agentcell.backends.linux import syscalls as sc
from agentcell.errors import BackendUnavailableError

SUBUID, SUBGID = "/etc/subuid", "/etc/subgid"
MIN_SUBIDS = 65536 - 1  # ids 1..65535 inside: the sandboxes' range starts at 10,000 (rootless.FIRST_SANDBOX_ID)


class RootlessUnavailableError(BackendUnavailableError):
    """Rootless mode cannot start on this host; the message says what to change."""


@dataclass(frozen=True, slots=True)
class SubIds:
    start: int
    count: int


def subids(path: str, user: str, uid: int) -> SubIds | None:
    """The user's first range in /etc/subuid or /etc/subgid (by name or by numeric id)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.strip().split(":")
        if len(fields) != 3 or fields[0] not in (user, str(uid)):
            continue
        try:
            return SubIds(int(fields[1]), int(fields[2]))
        except ValueError:
            continue
    return None


@dataclass(frozen=True, slots=True)
class IdMaps:
    uid: int
    gid: int
    sub_uid: SubIds
    sub_gid: SubIds

    @property
    def size(self) -> int:
        """Ids mapped inside: 0 and 1..size-1."""
        return 1 + min(self.sub_uid.count, self.sub_gid.count, MIN_SUBIDS)

    def helper_args(self) -> tuple[list[str], list[str]]:
        """newuidmap's and newgidmap's triples (inside, outside, count) after the pid."""
        n = self.size - 1
        return ([str(x) for x in (0, self.uid, 1, 1, self.sub_uid.start, n)],
                [str(x) for x in (0, self.gid, 1, 1, self.sub_gid.start, n)])


def plan() -> IdMaps:
    """The maps for the calling user, or RootlessUnavailableError saying what is missing."""
    uid, gid = os.getuid(), os.getgid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    sub_uid, sub_gid = subids(SUBUID, user, uid), subids(SUBGID, user, uid)
    if sub_uid is None or sub_gid is None:
        raise RootlessUnavailableError(
            f"rootless mode needs subordinate ids for {user}: ask an administrator to run "
            f"`usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {user}` (without them every "
            "sandbox would run as you, able to read your files and each other's)")
    maps = IdMaps(uid, gid, sub_uid, sub_gid)
    if maps.size < 20_000:
        raise RootlessUnavailableError(
            f"{user}'s subordinate id ranges are too small ({maps.size - 1} ids; rootless mode wants 65536): "
            f"ask an administrator to give {user} a range of 65536 in {SUBUID} and {SUBGID}")
    for tool in ("newuidmap", "newgidmap"):
        if shutil.which(tool) is None:
            raise RootlessUnavailableError(f"rootless mode needs {tool}: install the `uidmap` package "
                                           "(apt-get install uidmap, dnf install shadow-utils)")
    return maps


def check_kernel() -> None:
    """RootlessUnavailableError if this kernel refuses unprivileged user namespaces."""
    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    if read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        raise RootlessUnavailableError("unprivileged user namespaces are off: an administrator must run "
                                       "`sysctl -w kernel.unprivileged_userns_clone=1`")
    limit = read("/proc/sys/user/max_user_namespaces")
    if limit is not None and int(limit) < 10:
        raise RootlessUnavailableError("user namespaces are disabled: an administrator must run "
                                       "`sysctl -w user.max_user_namespaces=65536`")
    if read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        raise RootlessUnavailableError(
            "AppArmor restricts unprivileged user namespaces (Ubuntu 24.04+): an administrator must allow them "
            "for this Python with an AppArmor profile granting `userns,`, or run "
            "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`")


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
