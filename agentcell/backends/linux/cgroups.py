"""Per-sandbox cgroups: memory, pids and CPU limits, on cgroup v1 or v2 (detected at runtime).

v1 (hybrid hosts): one directory per controller, /sys/fs/cgroup/<controller>/agentcell/<id>.
v2 (unified): one directory, /sys/fs/cgroup/agentcell/<id>, with the controllers enabled in the
parents' cgroup.subtree_control.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from agentcell.backends.base import Limits, SandboxStats

ROOT = "/sys/fs/cgroup"
GROUP = "agentcell"
_CPU_PERIOD_US = 100_000
_V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")


class CgroupError(OSError):
    pass


def is_v2() -> bool:
    return os.path.exists(os.path.join(ROOT, "cgroup.controllers"))


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


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

    sandbox_id: str
    v2: bool
    dirs: dict[str, str]  # controller (or "unified") -> directory

    @classmethod
    def for_sandbox(cls, sandbox_id: str) -> Cgroups:
        if is_v2():
            return cls(sandbox_id, True, {"unified": os.path.join(ROOT, GROUP, sandbox_id)})
        dirs: dict[str, str] = {}
        for name, base in _v1_bases().items():
            dirs[name] = os.path.join(base, GROUP, sandbox_id)
        return cls(sandbox_id, False, dirs)

    def _unique_dirs(self) -> list[str]:
        return list(dict.fromkeys(self.dirs.values()))

    def create_and_join(self, limits: Limits, pid: int) -> None:
        """Create the directories, set the limits and move `pid` in (runs as host root)."""
        for d in self._unique_dirs():
            os.makedirs(d, exist_ok=True)
        mem = limits.memory_mb << 20
        quota = max(1000, int(limits.cpu_count * _CPU_PERIOD_US))
        if self.v2:
            d = self.dirs["unified"]
            _write(f"{d}/memory.max", str(mem))
            if os.path.exists(f"{d}/memory.swap.max"):
                _write(f"{d}/memory.swap.max", "0")
            _write(f"{d}/pids.max", str(limits.pids))
            _write(f"{d}/cpu.max", f"{quota} {_CPU_PERIOD_US}")
        else:
            m = self.dirs.get("memory")
            p = self.dirs.get("pids")
            c = self.dirs.get("cpu")
            if not (m and p and c):
                raise CgroupError(errno.ENOENT, "cgroup v1 needs the memory, pids and cpu controllers mounted")
            _write(f"{m}/memory.limit_in_bytes", str(mem))
            if os.path.exists(f"{m}/memory.memsw.limit_in_bytes"):  # no swap either
                _write(f"{m}/memory.memsw.limit_in_bytes", str(mem))
            _write(f"{p}/pids.max", str(limits.pids))
            _write(f"{c}/cpu.cfs_period_us", str(_CPU_PERIOD_US))
            _write(f"{c}/cpu.cfs_quota_us", str(quota))
        for d in self._unique_dirs():
            _write(f"{d}/cgroup.procs", str(pid))

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

    def exists(self) -> bool:
        return any(os.path.isdir(d) for d in self._unique_dirs())

    def kill_all(self) -> None:
        """SIGKILL every task still in the cgroup (a safety net; pid 1's death normally does it)."""
        if self.v2 and os.path.exists(f"{self.dirs['unified']}/cgroup.kill"):
            try:
                _write(f"{self.dirs['unified']}/cgroup.kill", "1")
            except OSError:
                pass
            return
        for d in self._unique_dirs():
            try:
                pids = _read(f"{d}/cgroup.procs").split()
            except OSError:
                continue
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
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
            return SandboxStats(
                memory_bytes=int(_read(f"{d}/memory.current")),
                memory_limit_bytes=int(limit) if limit != "max" else 0,
                cpu_seconds=usage_usec / 1e6,
                pids=int(_read(f"{d}/pids.current")),
            )
        m, p = self.dirs["memory"], self.dirs["pids"]
        acct = self.dirs.get("cpuacct")
        cpu_ns = int(_read(f"{acct}/cpuacct.usage")) if acct else 0
        return SandboxStats(
            memory_bytes=int(_read(f"{m}/memory.usage_in_bytes")),
            memory_limit_bytes=int(_read(f"{m}/memory.limit_in_bytes")),
            cpu_seconds=cpu_ns / 1e9,
            pids=int(_read(f"{p}/pids.current")),
        )


def prepare_parents() -> None:
    """Create the agentcell parent groups (and enable v2 controllers). Raises CgroupError with a fix."""
    if is_v2():
        parent = os.path.join(ROOT, GROUP)
        try:
            os.makedirs(parent, exist_ok=True)
            for d in (ROOT, parent):
                _write(f"{d}/cgroup.subtree_control", "+memory +pids +cpu")
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
            os.makedirs(os.path.join(base, GROUP), exist_ok=True)
        except OSError as e:
            raise CgroupError(e.errno, f"cannot create {base}/{GROUP} ({e}); is {base} mounted read-write?") from e
