"""Per-sandbox cgroups: memory, pids and CPU limits, on cgroup v1 or v2 (detected at runtime).

Every backend instance owns one directory, agentcell/<instance>, where <instance> is
"<server pid>-<its start time in clock ticks>-<n>": a later server can tell whether the owner is
gone (pid dead or reused) and then kill and remove what it left (`remove_stale_instances`).
Sandboxes live in agentcell/<instance>/<name>, named by the zygote that forked them.

v1 (hybrid hosts): one directory per controller, /sys/fs/cgroup/<controller>/agentcell/....
v2 (unified): one directory tree, /sys/fs/cgroup/agentcell/..., with the controllers enabled in the
parents' cgroup.subtree_control.

Container mode (a privileged pod, e.g. the Kubernetes DaemonSet): /sys/fs/cgroup is the root of the
container's private cgroup namespace, not the host's root cgroup. On v2 that root holds the
container's processes, and the "no internal processes" rule forbids enabling controllers for its
children while it does: `enter_container_leaf` first moves every process there into a leaf,
/sys/fs/cgroup/agentcell-server, as moby's dind entrypoint does. v1 has no such rule: the
container's hierarchies (mounted at its own cgroup by the runtime) work as a host's do.

Socket buffers: v2 charges them to memory.current, inside memory.max. v1 charges them only once
`memory.kmem.tcp.limit_in_bytes` has been written for the cgroup (then to a separate counter, for
TCP, UDP and every protocol with memory accounting): without it a 64 MiB sandbox queued gigabytes in
loopback sockets. So on v1 every sandbox gets a socket limit of its own (`socket_limit_bytes`), and
the instance directory one for all of them (`set_parent_limits`). TCP can still go past the limit by
its forced minimum per socket (one skb each way), which the kernel never refuses.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import re
import signal
import sys
import time
from dataclasses import dataclass

from agentcell import rootless
from agentcell.backends.base import Limits, SandboxStats
from agentcell.backends.linux import syscalls as sc

ROOT = "/sys/fs/cgroup"
GROUP = "agentcell"
# rootless mode: the cgroup v2 directory delegated to the user, set by the launcher that moved the
# server into it (cgroup_delegation.py); agentcell/ is made there instead of under ROOT
DELEGATED_ENV = "AGENTCELL_CGROUP_DELEGATED"
_CPU_PERIOD_US = 100_000
# a standby's preparation yields to everything else: v1's lowest cpu.shares (v2: cpu.weight 1, which
# OCI runtimes also make of these shares)
LOWEST_CPU_SHARES = 2
_MIN_SOCKET_BYTES = 4 << 20
# freezer: pause/resume (Cgroups.freeze); a host without it cannot pause sandboxes
_V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")
LIMIT_CONTROLLERS = frozenset({"memory", "pids", "cpu"})
_FREEZE_TIMEOUT_S = 5.0
# container mode, v2: where the container's own processes go so that its root can delegate controllers
SERVER_LEAF = "agentcell-server"
_LEAF_MOVE_ROUNDS = 50  # processes forked while we move the others are moved on the next round
_INSTANCE_RE = re.compile(r"^(\d+)-(\d+)-(\d+)$")
_instance_seq = itertools.count()


class CgroupError(OSError):
    pass


def delegated_root() -> str | None:
    """Rootless mode with a delegated cgroup v2 directory: that directory (else None)."""
    return (os.environ.get(DELEGATED_ENV) or None) if rootless.active() else None


def root_dir() -> str:
    """The directory agentcell/ lives in: ROOT, or a rootless server's delegated cgroup v2 directory."""
    return delegated_root() or ROOT


def is_v2() -> bool:
    return os.path.exists(os.path.join(root_dir(), "cgroup.controllers"))


def _root_is_v2() -> bool:
    return os.path.exists(os.path.join(ROOT, "cgroup.controllers"))


def in_container_root() -> bool:
    """v2 and ROOT is some cgroup below the host's root: a container's private cgroup namespace (the
    host's root cgroup has no cgroup.type; every other one has)."""
    return delegated_root() is None and _root_is_v2() and os.path.exists(os.path.join(ROOT, "cgroup.type"))


def _limit_or_none(path: str) -> int | None:
    """A limit file's value; None if absent, "max", or v1's page-rounded LONG_MAX (no limit)."""
    try:
        text = _read(path).strip()
    except FileNotFoundError:
        return None
    if text == "max" or int(text) >= 1 << 62:
        return None
    return int(text)


def root_limits() -> tuple[int | None, int | None]:
    """(memory bytes, pids) limits of the cgroup at ROOT itself: in container mode the container's (a
    pod's resources.limits), which bound the server and all its sandboxes together; (None, None) on a
    host, whose root cgroup has no limits."""
    if _root_is_v2():
        return _limit_or_none(os.path.join(ROOT, "memory.max")), _limit_or_none(os.path.join(ROOT, "pids.max"))
    bases = _v1_bases()
    memory = _limit_or_none(os.path.join(bases["memory"], "memory.limit_in_bytes")) if "memory" in bases else None
    pids = _limit_or_none(os.path.join(bases["pids"], "pids.max")) if "pids" in bases else None
    return memory, pids


def _procs(d: str) -> list[int]:
    return [int(p) for p in _read(f"{d}/cgroup.procs").split()]


def enter_container_leaf() -> list[int]:
    """Container mode (v2): move every process of ROOT itself (this server, its threads with it, and
    whatever else the container runs there, e.g. an init) into ROOT/SERVER_LEAF, so that ROOT may
    enable controllers for agentcell/. Returns the pids moved; [] on a host or when already done."""
    if not in_container_root():
        return []
    return enter_leaf(ROOT, "container mode", "the container's root cgroup",
                      "mount /sys/fs/cgroup read-write in the container (privileged, or a writable cgroup mount)")


def enter_leaf(parent: str, mode: str, what: str, fix: str) -> list[int]:
    """v2's "no internal processes" rule: a cgroup that enables controllers for its children holds no
    process itself. Move every process of `parent` (`what`, for messages) into parent/SERVER_LEAF.
    Returns the pids moved; [] when there were none. Raises CgroupError (with `fix`)."""
    leaf = os.path.join(parent, SERVER_LEAF)
    try:
        os.makedirs(leaf, exist_ok=True)
    except OSError as e:
        raise CgroupError(e.errno, f"cannot create {leaf} ({e}); {fix}") from e
    moved: list[int] = []
    for _ in range(_LEAF_MOVE_ROUNDS):
        try:
            pids = _procs(parent)
        except OSError as e:
            raise CgroupError(e.errno, f"cannot read {parent}/cgroup.procs ({e})") from e
        if not pids:
            if moved:
                print(f"agentcell: {mode}: moved {len(moved)} process(es) of {what} into {leaf}",
                      file=sys.stderr, flush=True)
            return moved
        if 0 in pids:  # "0" would move the writer itself, over and over
            raise CgroupError(errno.EPERM, f"{what} holds processes outside this pid namespace: cannot move them "
                                           f"into {leaf}")
        for pid in pids:
            try:
                sc.write_file(f"{leaf}/cgroup.procs", str(pid))  # the whole thread group moves
                moved.append(pid)
            except ProcessLookupError:
                pass  # exited meanwhile
            except OSError as e:
                raise CgroupError(e.errno, f"cannot move process {pid} from {what} into {leaf} ({e})") from e
    raise CgroupError(errno.EBUSY, f"processes keep appearing in {parent}/cgroup.procs: cannot empty {what} to "
                                   "enable its controllers")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _quota_us(cpu_count: float) -> int:
    """The CFS quota per _CPU_PERIOD_US for `cpu_count` cores (the kernel's minimum is 1 ms)."""
    return max(1000, int(cpu_count * _CPU_PERIOD_US))


def socket_limit_bytes(memory_mb: int) -> int:
    """v1: the socket buffers one sandbox may hold, beside its memory limit (an eighth of it)."""
    return max(_MIN_SOCKET_BYTES, (memory_mb << 20) // 8)


def _v1_hierarchies() -> dict[str, str]:
    """Every cgroup hierarchy mounted under ROOT (v1 hybrid hosts): name -> its mount. More than
    `_v1_bases`: runsc makes a sandbox's cgroup in each one (cpuset, devices, blkio, name=systemd, ...),
    and whatever removes a sandbox or a dead server's tree must look in all of them."""
    found = {}
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            mount = left.split()[4]
            kind = right.split(" ", 1)[0]
            if kind in ("cgroup", "cgroup2") and os.path.dirname(mount) == ROOT:
                # a hybrid host's v2 mount is not the "unified" of a v2 host (which Cgroups.dirs means by it)
                name = os.path.basename(mount)
                found[name if kind == "cgroup" else f"v2:{name}"] = os.path.realpath(mount)
    found.update(_v1_bases())
    return found


def _v1_bases() -> dict[str, str]:
    """controller -> its hierarchy's mount (cpu and cpuacct may share one, e.g. 'cpu,cpuacct')."""
    bases = {}
    for name in _V1_CONTROLLERS:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            bases[name] = os.path.realpath(path)
    return bases


@dataclass(frozen=True, slots=True)
class Cgroups:
    """The cgroup directories of one sandbox."""

    sandbox_id: str  # the relative path under ROOT/<controller>, e.g. agentcell/<instance>/<name>
    v2: bool
    dirs: dict[str, str]  # controller (or "unified") -> directory

    @classmethod
    def at(cls, rel: str, every_hierarchy: bool = False) -> Cgroups:
        """The cgroups at `rel` (a path below each hierarchy's root, e.g. "agentcell/<inst>/<name>").
        `every_hierarchy`: on v1 also the hierarchies agentcell does not limit with, where a runtime
        that makes its own cgroups (runsc) puts them too, so that `remove()` takes those away."""
        if rootless.active():  # an ordinary user's server: a delegated v2 subtree, else no cgroups
            delegated = delegated_root()
            if delegated is not None:
                from agentcell.backends.linux.cgroup_delegation import DelegatedCgroups

                return DelegatedCgroups(rel, True, {"unified": os.path.join(delegated, rel)})
            from agentcell.backends.linux.no_cgroups import NoCgroups

            return NoCgroups.named(rel)
        if is_v2():
            return cls(rel, True, {"unified": os.path.join(ROOT, rel)})
        bases = _v1_hierarchies() if every_hierarchy else _v1_bases()
        return cls(rel, False, {name: os.path.join(base, rel) for name, base in bases.items()})

    def _unique_dirs(self) -> list[str]:
        return list(dict.fromkeys(self.dirs.values()))

    def create_and_join(self, pid: int) -> None:
        """Create the directories and move `pid` in (host root). The first move of a process costs a
        whole RCU grace period on v1 (~10 ms), which is why standby children do it before a request."""
        for d in self._unique_dirs():
            os.makedirs(d, exist_ok=True)
        for d in self._unique_dirs():
            sc.write_file(f"{d}/cgroup.procs", str(pid))

    def opened(self, min_fd: int = 3) -> tuple[Cgroups, list[int]]:
        """The same cgroups reached through open directory fds (numbered >= min_fd, via
        /proc/self/fd), for a process that pivots away from /sys; close the fds once done."""
        fds: dict[str, int] = {}
        for d in self._unique_dirs():
            fd = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            if fd < min_fd:
                fd, old = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, min_fd), fd
                os.close(old)
            fds[d] = fd
        dirs = {k: f"/proc/self/fd/{fds[d]}" for k, d in self.dirs.items()}
        return type(self)(self.sandbox_id, self.v2, dirs), list(fds.values())

    def controllers(self) -> frozenset[str]:
        """Which of memory, pids, cpu limit this sandbox (set_limits): all of them as root."""
        return LIMIT_CONTROLLERS

    def set_limits(self, limits: Limits) -> None:
        mem = limits.memory_mb << 20
        quota = _quota_us(limits.cpu_count)
        if self.v2:
            d = self.dirs["unified"]
            sc.write_file(f"{d}/memory.max", str(mem))
            if os.path.exists(f"{d}/memory.swap.max"):
                sc.write_file(f"{d}/memory.swap.max", "0")
            sc.write_file(f"{d}/pids.max", str(limits.pids))
            sc.write_file(f"{d}/cpu.max", f"{quota} {_CPU_PERIOD_US}")
        else:
            m = self.dirs.get("memory")
            p = self.dirs.get("pids")
            c = self.dirs.get("cpu")
            if not (m and p and c):
                raise CgroupError(errno.ENOENT, "cgroup v1 needs the memory, pids and cpu controllers mounted")
            sc.write_file(f"{m}/memory.limit_in_bytes", str(mem))
            if os.path.exists(f"{m}/memory.memsw.limit_in_bytes"):  # no swap either
                sc.write_file(f"{m}/memory.memsw.limit_in_bytes", str(mem))
            # turns on socket accounting for this cgroup (see the module's docstring)
            sc.write_file(f"{m}/memory.kmem.tcp.limit_in_bytes", str(socket_limit_bytes(limits.memory_mb)))
            sc.write_file(f"{p}/pids.max", str(limits.pids))
            sc.write_file(f"{c}/cpu.cfs_period_us", str(_CPU_PERIOD_US))
            sc.write_file(f"{c}/cpu.cfs_quota_us", str(quota))

    def set_pids_max(self, n: int) -> None:
        """A running sandbox's pids.max (processes + threads) from now on (a policy's processes.max): a
        process count already above it stays, new forks fail with EAGAIN until it is below."""
        d = self.dirs.get("unified" if self.v2 else "pids")
        if d is None:
            raise CgroupError(errno.EOPNOTSUPP, "cgroup v1's pids controller is not mounted")
        sc.write_file(f"{d}/pids.max", str(n))

    def pids_max(self) -> int | None:
        """Its pids.max now (None: "max")."""
        d = self.dirs.get("unified" if self.v2 else "pids")
        return None if d is None else _limit_or_none(f"{d}/pids.max")

    def set_cpu_weight(self, standby: bool) -> None:
        """A standby's preparation runs at the lowest CPU weight, so that it yields to sandboxes that
        serve someone (and to the server); its claim gives it the default weight back."""
        if self.v2:
            sc.write_file(f"{self.dirs['unified']}/cpu.weight", "1" if standby else "100")
        else:
            sc.write_file(f"{self.dirs['cpu']}/cpu.shares", str(LOWEST_CPU_SHARES) if standby else "1024")

    def retune(self, old: Limits, new: Limits) -> None:
        """Change a live sandbox's memory and CPU limits from `old` to `new` (a standby's claim)."""
        if new.cpu_count != old.cpu_count:
            quota = _quota_us(new.cpu_count)
            if self.v2:
                sc.write_file(f"{self.dirs['unified']}/cpu.max", f"{quota} {_CPU_PERIOD_US}")
            else:
                sc.write_file(f"{self.dirs['cpu']}/cpu.cfs_quota_us", str(quota))
        if new.memory_mb == old.memory_mb:
            return
        mem = str(new.memory_mb << 20)
        if self.v2:
            sc.write_file(f"{self.dirs['unified']}/memory.max", mem)
            return
        m = self.dirs["memory"]
        # memory + swap may never be below memory: raise it first, lower it last
        order = ["memory.memsw.limit_in_bytes", "memory.limit_in_bytes"]
        if new.memory_mb < old.memory_mb:
            order.reverse()
        for name in order:
            if name == "memory.limit_in_bytes" or os.path.exists(f"{m}/{name}"):
                sc.write_file(f"{m}/{name}", mem)
        sc.write_file(f"{m}/memory.kmem.tcp.limit_in_bytes", str(socket_limit_bytes(new.memory_mb)))

    def remove(self) -> bool:
        """rmdir every directory; False while some are still busy (tasks not reaped yet)."""
        busy = False
        for d in self._unique_dirs():
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                busy = True
        return not busy

    def freeze(self) -> None:
        """Stop every task of the cgroup where it is (no CPU; memory stays resident) and wait until
        all are stopped: a task in an uninterruptible sleep stops only when it leaves it."""
        self._set_frozen(True)

    def thaw(self) -> None:
        self._set_frozen(False)

    def frozen(self) -> bool:
        if self.v2:
            return "frozen 1" in _read(f"{self.dirs['unified']}/cgroup.events")
        return _read(f"{self._freezer()}/freezer.state").strip() == "FROZEN"

    def _freezer(self) -> str:
        d = self.dirs.get("freezer")
        if d is None:
            raise CgroupError(errno.ENOENT, "cgroup v1's freezer controller is not mounted: sandboxes cannot pause")
        return d

    def _set_frozen(self, frozen: bool) -> None:
        if self.v2:
            path, value = f"{self.dirs['unified']}/cgroup.freeze", "1" if frozen else "0"
        else:
            path, value = f"{self._freezer()}/freezer.state", "FROZEN" if frozen else "THAWED"
        sc.write_file(path, value)
        deadline = time.monotonic() + _FREEZE_TIMEOUT_S
        delay = 0.0002
        while self.frozen() != frozen:  # v1 reads FREEZING until the last task stopped
            if time.monotonic() > deadline:
                if frozen:  # never leave a half-frozen sandbox behind
                    self._set_frozen(False)
                raise CgroupError(errno.EBUSY, f"the sandbox did not {'stop' if frozen else 'start'} within "
                                               f"{_FREEZE_TIMEOUT_S:g} s")
            if not self.v2 and frozen:
                sc.write_file(path, value)  # v1: a write retries the tasks that were busy
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def exists(self) -> bool:
        return any(os.path.isdir(d) for d in self._unique_dirs())

    def kill_all(self) -> None:
        """SIGKILL every task still in the cgroup (a safety net; pid 1's death normally does it)."""
        self.thaw_quietly()
        if self.v2 and os.path.exists(f"{self.dirs['unified']}/cgroup.kill"):
            try:
                sc.write_file(f"{self.dirs['unified']}/cgroup.kill", "1")
            except OSError:
                pass
            return
        for d in self._unique_dirs():
            try:
                pids = _read(f"{d}/cgroup.procs").split()
            except OSError:
                continue
            for pid in pids:
                if int(pid) <= 0:
                    continue  # outside our pid namespace (see kill_tree)
                try:
                    os.kill(int(pid), 9)
                except OSError:
                    pass

    def thaw_quietly(self) -> None:
        """Thaw a cgroup about to be killed: on v1 a frozen task does not die until thawed."""
        try:
            path = f"{self.dirs['unified']}/cgroup.freeze" if self.v2 else f"{self._freezer()}/freezer.state"
            sc.write_file(path, "0" if self.v2 else "THAWED")
        except OSError:
            pass

    def stats(self) -> SandboxStats:
        if self.v2:
            d = self.dirs["unified"]
            limit = _read(f"{d}/memory.max").strip()
            usage_usec = 0
            for line in _read(f"{d}/cpu.stat").splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    usage_usec = int(value)
            mem = _memory_stat(f"{d}/memory.stat")
            return SandboxStats(
                memory_bytes=int(_read(f"{d}/memory.current")),
                memory_limit_bytes=int(limit) if limit != "max" else 0,
                cpu_seconds=usage_usec / 1e6,
                pids=int(_read(f"{d}/pids.current")),
                cache_bytes=mem.get("file", 0),
                disk_bytes=mem.get("shmem", 0),
            )
        m, p = self.dirs["memory"], self.dirs["pids"]
        acct = self.dirs.get("cpuacct")
        cpu_ns = int(_read(f"{acct}/cpuacct.usage")) if acct else 0
        mem = _memory_stat(f"{m}/memory.stat")
        return SandboxStats(
            memory_bytes=int(_read(f"{m}/memory.usage_in_bytes")),
            memory_limit_bytes=int(_read(f"{m}/memory.limit_in_bytes")),
            cpu_seconds=cpu_ns / 1e9,
            pids=int(_read(f"{p}/pids.current")),
            cache_bytes=mem.get("cache", 0),
            disk_bytes=mem.get("shmem", 0),
        )


def _memory_stat(path: str) -> dict[str, int]:
    """memory.stat's counters. The disk is a tmpfs, so what it holds is the cgroup's `shmem` (with
    the sandbox's /dev/shm and SysV segments: the same tmpfs or the same pages)."""
    out: dict[str, int] = {}
    for line in _read(path).splitlines():
        key, _, value = line.partition(" ")
        if key in ("cache", "file", "shmem"):
            out[key] = int(value)
    return out


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time
    except (OSError, IndexError, ValueError):
        return None


def new_instance_id() -> str:
    """A name for this backend instance's cgroup directory, unique on this host and checkable."""
    pid = os.getpid()
    return f"{pid}-{_start_ticks(pid)}-{next(_instance_seq)}"


def instance_alive(instance: str) -> bool:
    m = _INSTANCE_RE.match(instance)
    if m is None:
        return True  # not ours to judge
    return _start_ticks(int(m.group(1))) == int(m.group(2))


def _subdirs(path: str) -> list[str]:
    try:
        return [e.path for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def kill_tree(rel: str) -> int:
    """SIGKILL every task in the cgroups at `rel` and below, on every hierarchy. Returns how many."""
    n = 0
    for base in _bases():
        for dirpath, _dirs, _files in os.walk(os.path.join(base, rel)):
            try:
                pids = _read(f"{dirpath}/cgroup.procs").split()
            except OSError:
                continue
            for pid in pids:
                if int(pid) <= 0:
                    continue  # a task outside our pid namespace reads as 0: kill(0) would hit our own group
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    n += 1
                except OSError:
                    pass
            for name, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):  # frozen tasks die thawed
                if pids and os.path.exists(f"{dirpath}/{name}"):
                    with contextlib.suppress(OSError):
                        sc.write_file(f"{dirpath}/{name}", value)
    return n


def remove_tree(rel: str, timeout: float = 3.0) -> bool:
    """rmdir the cgroups at `rel` and below (children first), retrying while dying tasks go away."""
    deadline = time.monotonic() + timeout
    while True:
        busy = False
        for base in _bases():
            top = os.path.join(base, rel)
            for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -len(w[0])):
                try:
                    os.rmdir(dirpath)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                        raise
                    busy = True
        if not busy:
            return True
        if time.monotonic() > deadline:
            return False
        kill_tree(rel)
        time.sleep(0.02)


def _bases() -> list[str]:
    if is_v2():
        return [root_dir()]
    return list(dict.fromkeys(_v1_hierarchies().values()))


def remove_stale_instances() -> list[str]:
    """Kill and remove what servers that are gone left under agentcell/. Returns the instances."""
    stale = set()
    for base in _bases():
        for d in _subdirs(os.path.join(base, GROUP)):
            name = os.path.basename(d)
            if _INSTANCE_RE.match(name) and not instance_alive(name):
                stale.add(name)
    for name in sorted(stale):
        kill_tree(f"{GROUP}/{name}")
        remove_tree(f"{GROUP}/{name}")
    return sorted(stale)


def prepare_instance(instance: str) -> None:
    """Create agentcell/<instance> (and enable v2 controllers). Raises CgroupError with a fix."""
    if is_v2():
        parent = os.path.join(ROOT, GROUP)
        enter_container_leaf()
        try:
            os.makedirs(os.path.join(parent, instance), exist_ok=True)
            for d in (ROOT, parent, os.path.join(parent, instance)):
                sc.write_file(f"{d}/cgroup.subtree_control", "+memory +pids +cpu")
        except OSError as e:
            raise CgroupError(
                e.errno, f"cannot set up cgroup v2 at {parent} ({e}); mount cgroup2 read-write and run as root"
            ) from e
        return
    bases = _v1_bases()
    missing = {"memory", "pids", "cpu"} - bases.keys()
    if missing:
        raise CgroupError(
            errno.ENOENT, f"cgroup v1 controllers {sorted(missing)} are not mounted under {ROOT}; mount them or use cgroup v2"
        )
    for base in set(bases.values()):
        try:
            os.makedirs(os.path.join(base, GROUP, instance), exist_ok=True)
        except OSError as e:
            raise CgroupError(e.errno, f"cannot create {base}/{GROUP} ({e}); is {base} mounted read-write?") from e


def _limit_value(path: str) -> int:
    """A cgroup limit file's value; "max" (v2, pids) is unlimited."""
    text = _read(path).strip()
    return (1 << 63) - 1 if text == "max" else int(text)


def set_parent_limits(rel: str, memory_bytes: int, pids: int, socket_bytes: int, only_lower: bool = False) -> None:
    """Limits on a directory above the sandboxes (agentcell/<instance>, agentcell): what all of them
    together may use. v1 counts socket buffers apart from memory (`socket_bytes`); v2 within it.
    only_lower: keep a value that is already at or below ours (a directory other servers share)."""
    if is_v2():
        d = os.path.join(ROOT, rel)
        writes = [(f"{d}/memory.max", memory_bytes), (f"{d}/pids.max", pids)]
    else:
        bases = _v1_bases()
        m, p = os.path.join(bases["memory"], rel), os.path.join(bases["pids"], rel)
        writes = [(f"{m}/memory.limit_in_bytes", memory_bytes)]
        if os.path.exists(f"{m}/memory.memsw.limit_in_bytes"):  # memsw >= memory: written after it
            writes.append((f"{m}/memory.memsw.limit_in_bytes", memory_bytes))
        writes += [(f"{m}/memory.kmem.tcp.limit_in_bytes", socket_bytes), (f"{p}/pids.max", pids)]
    for path, value in writes:
        if only_lower and _limit_value(path) <= value:
            continue
        sc.write_file(path, str(value))


def parent_limits(rel: str) -> dict[str, int]:
    """The limits set_parent_limits wrote (for logs and tests): memory, sockets (v1), pids."""
    if is_v2():
        d = os.path.join(ROOT, rel)
        return {"memory": _limit_value(f"{d}/memory.max"), "pids": _limit_value(f"{d}/pids.max")}
    bases = _v1_bases()
    m, p = os.path.join(bases["memory"], rel), os.path.join(bases["pids"], rel)
    return {"memory": _limit_value(f"{m}/memory.limit_in_bytes"),
            "sockets": _limit_value(f"{m}/memory.kmem.tcp.limit_in_bytes"),
            "pids": _limit_value(f"{p}/pids.max")}
