"""The linux backend's behaviour record (issue 10): what each host-side collector watches, and the
protocol they share. The collectors observe a sandbox from outside it (kernel interfaces read by the
server's record process as host root), so code in the sandbox can neither forge nor suppress their events.

A collector is started once per server, told of each sandbox as it is prepared (`watch`: a standby
is watched before any tenant claims it, which keeps the watch off the create's path), when a tenant
claims it (`claimed`) and when it is killed (`unwatch`), and calls its `EventSink`
(agentcell/record/events.py) on its event loop for each event. The server runs them in a process of
their own (record/linux/process.py), which forwards these calls and sends the events back. Events of a sandbox before
its claim are not kept: its record begins at the claim (record/store.py `begin`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from agentcell.backends.linux import cgroups


@dataclass(frozen=True)
class WatchTarget:
    """What a collector may know of one sandbox."""

    sandbox_id: str
    host_pid: int  # the sandbox's pid 1 (its agent's init), in the host's numbers
    host_uids: tuple[int, ...]  # the host ids its processes run as: its user's, its root's
    cgroup: cgroups.Cgroups  # its cgroups (memory, pids, cpu, freezer)
    disk_fd: int  # O_PATH fd of the root of its disk tmpfs (home, tmp, shm, overlay uppers); dup to keep


class Collector(Protocol):
    async def start(self) -> None: ...

    def watch(self, target: WatchTarget) -> None: ...

    def claimed(self, sandbox_id: str) -> None:
        """A sandbox it watches since its preparation was claimed: what the claim changed (its
        limits) is read again."""
        ...

    def unwatch(self, sandbox_id: str) -> None: ...

    async def close(self) -> None: ...


def nspid(host_pid: int) -> list[int] | None:
    """A process's pid at each pid-namespace level, the host's first (/proc/<pid>/status NSpid);
    None once it is gone."""
    try:
        with open(f"/proc/{host_pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except OSError:
        return None
    return None
