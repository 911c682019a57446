"""Rootless mode without cgroups: a sandbox's `Cgroups` that holds no directory and limits nothing.

An ordinary user cannot create cgroups on a cgroup v1 host, nor on a v2 host without a delegated
subtree. Then every per-sandbox cgroup operation is a no-op, the limits fall back to rlimits
(ns_limits.rlimits: RLIMIT_DATA for memory, RLIMIT_NPROC for processes; no CPU quota), statistics
are zero, and pause/resume, which need the freezer, are refused with the reason. docs/rootless.md
lists what that costs.
"""

from __future__ import annotations

import errno

from agentcell.backends.base import Limits, SandboxStats
from agentcell.backends.linux.cgroups import CgroupError, Cgroups

NO_FREEZER = ("rootless mode has no cgroups here: pausing a sandbox needs the freezer (run the server as root, or "
              "rootless in a delegated cgroup v2 directory: docs/rootless.md)")


# RLIMIT_NPROC cannot stand in at run time: it is each process's own (a running process keeps its value,
# and may raise its soft limit back to the hard one), and a hard limit once lowered cannot be raised
# again without CAP_SYS_RESOURCE on the host
NO_PIDS_MAX = ("rootless mode has no cgroups here: a sandbox's process limit is the RLIMIT_NPROC it started with "
               "and cannot change at run time (run the server as root, or rootless in a delegated cgroup v2 "
               "directory with the pids controller: docs/rootless.md)")


class NoCgroups(Cgroups):
    """Looks like a sandbox's Cgroups; every write is skipped, every read is empty."""

    @classmethod
    def named(cls, rel: str) -> NoCgroups:
        return cls(rel, False, {})

    def create_and_join(self, pid: int) -> None:
        pass

    def controllers(self) -> frozenset[str]:
        return frozenset()  # every limit is an rlimit

    def opened(self, min_fd: int = 3) -> tuple[Cgroups, list[int]]:
        return self, []

    def set_limits(self, limits: Limits) -> None:
        pass  # the rlimits do it (ns_limits.rlimits with rootless on)

    def set_pids_max(self, n: int) -> None:
        raise CgroupError(errno.EOPNOTSUPP, NO_PIDS_MAX)

    def pids_max(self) -> int | None:
        return None

    def set_cpu_weight(self, standby: bool) -> None:
        pass

    def retune(self, old: Limits, new: Limits) -> None:
        pass

    def remove(self) -> bool:
        return True

    def freeze(self) -> None:
        raise CgroupError(errno.EOPNOTSUPP, NO_FREEZER)

    def thaw(self) -> None:
        raise CgroupError(errno.EOPNOTSUPP, NO_FREEZER)

    def frozen(self) -> bool:
        return False

    def exists(self) -> bool:
        return False

    def kill_all(self) -> None:
        pass  # pid 1's death takes its pid namespace along

    def thaw_quietly(self) -> None:
        pass

    def stats(self) -> SandboxStats:
        return SandboxStats(memory_bytes=0, memory_limit_bytes=0, cpu_seconds=0.0, pids=0)
