"""Rootless mode with a delegated cgroup v2 directory: real cgroups for an ordinary user's sandboxes.

systemd gives each user a cgroup v2 subtree of their own (user@UID.service, `Delegate=yes`): the user
owns the directory, its cgroup.procs and cgroup.subtree_control, and may create cgroups below it. When
a rootless server starts inside such a directory (its own cgroup, /proc/self/cgroup's "0::" line,
below the cgroup2 mount from /proc/self/mountinfo), its sandboxes get cgroups below it, as a root
server's do below /sys/fs/cgroup:

    <delegated>/agentcell-server         the server, the launcher and whatever else was there (a leaf)
    <delegated>/agentcell/<instance>     one per server (flock'ed by it while it lives)
    <delegated>/agentcell/<instance>/s…  one per sandbox

1. The launcher (cli/rootless_serve.py), still outside the user namespace where it sees the host's
   pids, checks the directory (`find`) and moves every process in it into the leaf (`enter`): v2's
   "no internal processes" rule lets a cgroup enable controllers for its children only while it holds
   no process itself. Inside, the server's pid namespace shows every outside process as pid 0: the
   move can only be made from outside. The directory reaches the server as cgroups.DELEGATED_ENV.
2. The server (`prepare_instance`) enables whichever of memory, pids, cpu the directory offers
   (its cgroup.controllers: what the host's systemd delegates) down to its instance directory.
3. Each sandbox (`DelegatedCgroups`) gets memory.max, pids.max, cpu.max for the controllers present;
   the rlimits stay for the missing ones (ns_limits.rlimits). Freezing (cgroup.freeze), cgroup.kill
   and cpu.stat are core v2 files, in every cgroup whatever the controllers: pause and resume work.

Stale instances: a rootless server is pid 1 of its own pid namespace, so the pid in an instance's name
says nothing to another server. Each server holds an flock on its instance directory instead; a
directory nobody holds belongs to a server that is gone (its sandboxes died with its pid namespace;
cgroup.kill takes whatever is left) and is removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import time
from dataclasses import dataclass

from agentcell.backends.base import Limits, SandboxStats
from agentcell.backends.linux import cgroups
from agentcell.backends.linux import syscalls as sc

WANTED = ("memory", "pids", "cpu")
_LIMIT_FILE = {"memory": "memory.max", "pids": "pids.max", "cpu": "cpu.max"}  # present iff the controller is
_LOCK_TRIES = 50
_locks: dict[str, int] = {}  # instance -> the fd of its directory, flock'ed while this server lives


NO_PIDS_CONTROLLER = ("rootless mode: the delegated cgroup has no pids controller, so a sandbox's process limit is "
                      "the RLIMIT_NPROC it started with and cannot change at run time (delegate pids: docs/rootless.md)")


class NotDelegatedError(Exception):
    """This process's cgroup is not a cgroup v2 directory the user may manage; the message says why."""


@dataclass(frozen=True, slots=True)
class Delegation:
    directory: str  # the delegated cgroup (the server runs in directory/agentcell-server)
    controllers: frozenset[str]  # which of WANTED it offers
    freezer: bool  # cgroup.freeze (kernel >= 5.2): pause and resume

    @property
    def missing(self) -> list[str]:
        return [c for c in WANTED if c not in self.controllers]

    def describe(self) -> str:
        """One line for the server's log and `agentcell doctor`."""
        have = ",".join(c for c in WANTED if c in self.controllers) or "none"
        text = f"cgroup v2 delegated at {self.directory}: controllers {have}"
        if self.missing:
            text += f" (missing {','.join(self.missing)} -> rlimits)"
        return text + f", freezer {'yes' if self.freezer else 'no'}"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def unified_mount(mountinfo: str | None = None) -> tuple[str, str] | None:
    """(mount point, root inside the hierarchy) of the cgroup2 mount: /sys/fs/cgroup on a v2 host,
    /sys/fs/cgroup/unified on a hybrid one."""
    text = _read("/proc/self/mountinfo") if mountinfo is None else mountinfo
    for line in (text or "").splitlines():
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if rest.split()[:1] == ["cgroup2"] and len(parts) >= 5:
            return parts[4], parts[3]
    return None


def own_cgroup() -> str | None:
    """This process's cgroup v2 path ("0::" line of /proc/self/cgroup)."""
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def offered(directory: str) -> frozenset[str]:
    return frozenset(set((_read(f"{directory}/cgroup.controllers") or "").split()) & set(WANTED))


def find() -> Delegation:
    """The delegated directory this process runs in (or, once `enter`ed, the leaf's parent). Raises
    NotDelegatedError with the reason."""
    mount = unified_mount()
    own = own_cgroup()
    if mount is None:
        raise NotDelegatedError("no cgroup2 hierarchy is mounted")
    if own is None:
        raise NotDelegatedError("this process has no cgroup v2 path (/proc/self/cgroup)")
    point, root = mount
    if own == "/" or not (own + "/").startswith(root.rstrip("/") + "/"):
        raise NotDelegatedError(f"this process is in the root cgroup of {point}")
    directory = os.path.normpath(os.path.join(point, os.path.relpath(own, root)))
    if os.path.basename(directory) == cgroups.SERVER_LEAF:  # a server started from an entered directory
        directory = os.path.dirname(directory)
    if directory == point:
        raise NotDelegatedError(f"this process is in the root cgroup of {point}")
    not_yours = [p for p in (directory, f"{directory}/cgroup.procs", f"{directory}/cgroup.subtree_control")
                 if not os.access(p, os.W_OK)]
    if not_yours:
        raise NotDelegatedError(f"your cgroup {directory} is not delegated to you ({', '.join(not_yours)} not "
                                "writable): start the server in a systemd user scope, e.g. `systemd-run --user "
                                "--scope -p Delegate=yes agentcell serve`")
    return Delegation(directory, offered(directory), os.path.exists(f"{directory}/cgroup.freeze"))


def probe() -> tuple[Delegation | None, str]:
    """find(), or (None, why not)."""
    try:
        return find(), ""
    except NotDelegatedError as e:
        return None, str(e)


def enter(delegation: Delegation) -> list[int]:
    """Outside the user namespace (the launcher): every process of the delegated directory moves into
    its leaf, so that it may enable controllers for agentcell/. Raises cgroups.CgroupError."""
    return cgroups.enter_leaf(delegation.directory, "rootless mode", f"your cgroup {delegation.directory}",
                              "check that the directory is delegated to you")


def launch_env() -> dict[str, str]:
    """The launcher's part: {DELEGATED_ENV: directory} once entered; {} (no cgroups) where not delegated
    or the move failed (said on stderr)."""
    delegation, _ = probe()
    if delegation is None:
        return {}
    try:
        enter(delegation)
    except cgroups.CgroupError as e:
        print(f"agentcell: rootless mode: cannot use the delegated cgroup {delegation.directory}: {e.strerror or e}",
              flush=True, file=sys.stderr)
        return {}
    return {cgroups.DELEGATED_ENV: delegation.directory}


# -- the server's part (inside its user namespace) --------------------------------------------------


def _instance_dir(instance: str) -> str:
    root = cgroups.delegated_root()
    assert root is not None, "rootless mode with a delegated cgroup only"
    return os.path.join(root, cgroups.GROUP, instance)


def _try_lock(path: str) -> int | None:
    """An fd of directory `path` holding its flock, or None if another server holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def prepare_instance(instance: str) -> Delegation:
    """Create agentcell/<instance> below the delegated directory, hold it, and enable the controllers
    it offers down to it. Returns what holds (the controllers that could be enabled). Raises
    cgroups.CgroupError."""
    root = cgroups.delegated_root()
    assert root is not None, "rootless mode with a delegated cgroup only"
    parent, inst = os.path.join(root, cgroups.GROUP), _instance_dir(instance)
    try:
        # Another server's stale-instance sweep may hold the new directory for a moment (it then finds
        # it empty and removes it): lock, then check that the directory locked is still the one there.
        for _ in range(_LOCK_TRIES):
            os.makedirs(inst, exist_ok=True)
            fd = _try_lock(inst)
            if fd is not None and os.path.samestat(os.fstat(fd), os.stat(inst)):
                _locks[instance] = fd
                break
            if fd is not None:
                os.close(fd)
            time.sleep(0.02)
        else:
            raise cgroups.CgroupError(errno.EBUSY, f"{inst} is held by another server")
    except FileNotFoundError as e:
        raise cgroups.CgroupError(e.errno, f"cannot create {inst} ({e})") from e
    except PermissionError as e:
        raise cgroups.CgroupError(e.errno, f"cannot create {inst} ({e}): is {root} delegated to you?") from e
    enabled = set()
    for controller in (c for c in WANTED if c in offered(root)):
        try:
            for d in (root, parent, inst):
                sc.write_file(f"{d}/cgroup.subtree_control", f"+{controller}")
            enabled.add(controller)
        except OSError:
            pass  # e.g. EBUSY: a process in the directory itself; the rlimit stays the bound
    return Delegation(root, frozenset(enabled), os.path.exists(f"{inst}/cgroup.freeze"))


def set_instance_limits(instance: str, memory_bytes: int, pids: int) -> None:
    """What all of this server's sandboxes together may use, where the controller is there."""
    inst = _instance_dir(instance)
    for name, value in (("memory.max", memory_bytes), ("pids.max", pids)):
        if os.path.exists(f"{inst}/{name}"):
            sc.write_file(f"{inst}/{name}", str(value))


def release(instance: str) -> None:
    """The server stops: let go of its instance directory (removed before, by cgroups.remove_tree)."""
    fd = _locks.pop(instance, None)
    if fd is not None:
        os.close(fd)


def remove_stale_instances() -> list[str]:
    """Kill and remove the instance directories no live server holds (their servers are gone)."""
    root = cgroups.delegated_root()
    if root is None:
        return []
    stale = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(os.path.join(root, cgroups.GROUP)):
            if not entry.is_dir(follow_symlinks=False) or entry.name in _locks:
                continue
            try:
                fd = _try_lock(entry.path)
            except OSError:
                continue
            if fd is None:
                continue  # a live server's
            try:
                with contextlib.suppress(OSError):
                    sc.write_file(f"{entry.path}/cgroup.kill", "1")  # the whole subtree, whatever pid namespace
                if cgroups.remove_tree(f"{cgroups.GROUP}/{entry.name}"):
                    stale.append(entry.name)
            finally:
                os.close(fd)
    return sorted(stale)


class DelegatedCgroups(cgroups.Cgroups):
    """A sandbox's cgroup below the delegated directory: v2, with whichever controllers it got."""

    def controllers(self) -> frozenset[str]:
        d = self.dirs["unified"]
        return frozenset(c for c in WANTED if os.path.exists(f"{d}/{_LIMIT_FILE[c]}"))

    def _has(self, name: str) -> bool:
        return os.path.exists(f"{self.dirs['unified']}/{name}")

    def set_limits(self, limits: Limits) -> None:
        d, have = self.dirs["unified"], self.controllers()
        if "memory" in have:
            sc.write_file(f"{d}/memory.max", str(limits.memory_mb << 20))
            if self._has("memory.swap.max"):
                sc.write_file(f"{d}/memory.swap.max", "0")
        if "pids" in have:
            sc.write_file(f"{d}/pids.max", str(limits.pids))
        if "cpu" in have:
            sc.write_file(f"{d}/cpu.max", f"{cgroups._quota_us(limits.cpu_count)} {cgroups._CPU_PERIOD_US}")

    def set_pids_max(self, n: int) -> None:
        if "pids" not in self.controllers():
            raise cgroups.CgroupError(errno.EOPNOTSUPP, NO_PIDS_CONTROLLER)
        super().set_pids_max(n)

    def set_cpu_weight(self, standby: bool) -> None:
        if self._has("cpu.weight"):
            super().set_cpu_weight(standby)

    def retune(self, old: Limits, new: Limits) -> None:
        d, have = self.dirs["unified"], self.controllers()
        if new.cpu_count != old.cpu_count and "cpu" in have:
            sc.write_file(f"{d}/cpu.max", f"{cgroups._quota_us(new.cpu_count)} {cgroups._CPU_PERIOD_US}")
        if new.memory_mb != old.memory_mb and "memory" in have:
            sc.write_file(f"{d}/memory.max", str(new.memory_mb << 20))

    def stats(self) -> SandboxStats:
        """What the controllers present measure; zero for the others (cpu.stat is a core file)."""
        d = self.dirs["unified"]

        def number(name: str) -> int:
            text = _read(f"{d}/{name}")
            return int(text) if text is not None and text.strip().isdigit() else 0

        usage_usec = 0
        cpu_stat = _read(f"{d}/cpu.stat")
        if cpu_stat is None:
            raise FileNotFoundError(errno.ENOENT, f"{d}/cpu.stat")  # the cgroup is gone
        for line in cpu_stat.splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                usage_usec = int(value)
        mem = cgroups._memory_stat(f"{d}/memory.stat") if self._has("memory.stat") else {}
        return SandboxStats(memory_bytes=number("memory.current"), memory_limit_bytes=number("memory.max"),
                            cpu_seconds=usage_usec / 1e6, pids=number("pids.current"),
                            cache_bytes=mem.get("file", 0), disk_bytes=mem.get("shmem", 0))
