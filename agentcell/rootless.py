"""Rootless mode: the same server, run by an ordinary user inside a user namespace that user owns.

Where no one has root (a shared machine, a CI runner without sudo) `agentcell serve` re-executes
itself inside a new user namespace (backends/linux/userns.py) in which the user is root and the
user's subordinate ids (/etc/subuid, /etc/subgid) are ids 1..N: each sandbox still runs as ids of
its own, none of them the user's. This module says whether that mode is on (in the server and its
zygotes: AGENTCELL_ROOTLESS, set by the launcher), where such a server keeps what a root server
keeps under /var/lib and /run (the user's own directories), and which guarantees hold
(docs/rootless.md; `agentcell doctor` prints the same list).

The SDK asks `embedded_serve_args()` which flags its embedded server needs: a user who is not root
gets a rootless server.
"""

from __future__ import annotations

import os
import pwd
import shutil
from collections.abc import Collection
from dataclasses import dataclass

from agentcell.errors import BackendUnavailableError

ENV = "AGENTCELL_ROOTLESS"  # "1" in a server (and its zygotes) running inside its rootless namespace
# the pid, outside, of the process that started a rootless server and stays its parent (userns._relay):
# inside, the server is pid 1 of a pid namespace of its own, a pid that means nothing to the user
OUTSIDE_PID_ENV = "AGENTCELL_ROOTLESS_PID"
# Ids inside the namespace that sandboxes use: above the ids a distribution hands to users and below
# 65534 (the overflow id: what the namespace shows for every unmapped host id).
FIRST_SANDBOX_ID = 10_000


def active() -> bool:
    """This process runs inside a rootless server's user namespace."""
    return os.environ.get(ENV) == "1"


def outside_pid() -> int | None:
    """Inside a rootless server: the pid the user sees for it (its launcher, which signals reach it
    through); None if the launcher did not say."""
    value = os.environ.get(OUTSIDE_PID_ENV, "")
    return int(value) if value.isdigit() else None


def wanted() -> bool:
    """A server started by this process should run rootless: it is not root."""
    return os.geteuid() != 0


def embedded_serve_args() -> list[str]:
    """Extra `agentcell serve` flags for the SDK's embedded server (none for root)."""
    return ["--rootless"] if wanted() else []


def _home() -> str:
    # HOME, not the password database: inside the namespace the user is uid 0 (root's home there)
    return os.environ.get("HOME") or os.path.expanduser("~")


def state_home() -> str:
    return os.environ.get("XDG_STATE_HOME") or os.path.join(_home(), ".local", "state")


def cache_home() -> str:
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(_home(), ".cache")


def default_state_dir() -> str:
    """A rootless server's --state-dir when none is given."""
    return os.path.join(state_home(), "agentcell")


def runtime_store_dir() -> str:
    """The runtime store (backends/linux/runtime_store.py) of this user's rootless servers."""
    return os.path.join(cache_home(), "agentcell", "runtime")


def uid_lock_dir() -> str:
    """Where this user's rootless servers reserve their sandbox id ranges (backends/linux/uids.py):
    shared by all of them, so two servers of one user never hand out the same ids."""
    return os.path.join(cache_home(), "agentcell", "uids")


def staging_dir() -> str:
    """The template root's mount point: under the state home, as /run/agentcell is root's."""
    return os.path.join(cache_home(), "agentcell", "root")


def netns_dir() -> str:
    """Where a rootless server bind-mounts its egress router's network namespace (network/usermode.py):
    the mount is in the server's own mount namespace; the empty file is all the host sees."""
    return os.path.join(cache_home(), "agentcell", "netns")


@dataclass(frozen=True, slots=True)
class Guarantee:
    """One line of the table in docs/rootless.md: what holds in rootless mode, next to a root server."""

    area: str
    holds: bool | None  # True: as with root; False: does not hold; None: holds, weaker
    text: str


def guarantees(subids: bool = True, delegated: Collection[str] | None = None, user_net: bool = True) -> list[Guarantee]:
    """What rootless mode promises on this host (`subids`: the user has /etc/subuid and /etc/subgid
    ranges; `delegated`: the server would run in a cgroup v2 directory delegated to the user, with
    these of memory, pids, cpu (backends/linux/cgroup_delegation.py), None: no such directory;
    `user_net`: user-mode networking can run, network/usermode.py)."""
    cg = set(delegated or ())
    rows = [
        Guarantee("sandboxes from each other", True if subids else False,
                  "own user, pid, mount, net, ipc, uts namespaces and own ids (subordinate ids), Landlock, seccomp"
                  if subids else "needs /etc/subuid and /etc/subgid ranges: rootless mode refuses to start without"),
        Guarantee("sandboxes from the user's files", True if subids else False,
                  "sandbox ids are subordinate ids, not the user's; the user's home is not in the sandbox's root"),
        Guarantee("sandboxes from the host", None,
                  "the kernel is shared as with root; the server itself has no host privilege (a compromise of it "
                  "is a compromise of the user's account, not of root)"),
        Guarantee("writable /usr, /etc, /opt (apt/pip as the sandbox's root)", False,
                  "idmapped mounts of host filesystems need host root: those are read-only (no sudo either; "
                  "commands as user root still run); the home directory (python -m venv there), /tmp and "
                  "/dev/shm stay writable"),
    ]
    rows += [
        Guarantee("memory limit", True, "memory.max of the sandbox's cgroup (below the delegated directory), as "
                  "with root") if "memory" in cg else
        Guarantee("memory limit", None,
                  "RLIMIT_DATA per process (memory_mb), and the disk tmpfs's size: a sandbox with several "
                  "processes can use memory_mb in each; nothing bounds the page cache or kernel memory"),
        Guarantee("process limit (fork bomb)", True, "pids.max of the sandbox's cgroup, as with root")
        if "pids" in cg else
        Guarantee("process limit (fork bomb)", None,
                  "RLIMIT_NPROC per sandbox id (pids): it counts the processes and threads of one id, and each "
                  "sandbox has ids of its own, two of them (its user, its root): at most 2 x pids tasks"),
        Guarantee("CPU limit", True, "cpu.max (CFS quota) of the sandbox's cgroup, as with root") if "cpu" in cg else
        Guarantee("CPU limit", False, "no CPU quota without cgroups: sandboxes run at nice 10 and their lifetime "
                  "(timeout) is the only bound"),
        Guarantee("network", None, (
            "the same egress router as root's (policy, resolver, proxy, never-list, events), its uplink user-mode "
            "networking (slirp4netns: the traffic leaves as the user's own sockets, at user-space speed); the "
            "router's connection-tracking and nftables are those of a namespace the user owns")
            if user_net else (
            "no user-mode networking here (slirp4netns and a usable /dev/net/tun): sandboxes have loopback only "
            "(each its own network namespace); a create asking for the internet gets a sandbox without it")),
        Guarantee("behaviour record", None, "API calls and lifecycle are recorded; the host-side collectors "
                  "(processes via audit/BPF, files via fanotify, limits) need root and are off"),
        Guarantee("pause, resume, snapshots", True, "the sandbox's cgroup is frozen (cgroup.freeze, a core cgroup "
                  "v2 file: no controller needed)") if delegated is not None else
        Guarantee("pause, resume, snapshots", False, "need the freezer cgroup: not available rootless (without a "
                  "delegated cgroup v2 directory)"),
        Guarantee("host sysctls (file-max, pid_max, pty.max)", False,
                  "left as they are: an ordinary user cannot raise them"),
    ]
    return rows


# --- what the host must offer (the SDK checks it before starting a rootless embedded server) ---

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
