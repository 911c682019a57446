"""Per-sandbox caps on kernel pools, set by the sandbox's pid 1 on its own namespaces during setup.

Two steps, both in `sandbox_init._run_sandbox` after the unshare and before the capabilities go:

* `confine_namespaces()`: the sandbox's new user namespace has its own limits in /proc/sys/user (a
  ucount limit, checked at every level up to the host's per-uid one), which its creator may lower
  while it still holds CAP_SYS_RESOURCE there: no nested namespaces of any kind (defense in depth
  behind seccomp's unshare/clone/setns rules and the dropped capabilities), no fanotify, a per-sandbox
  number of inotify instances and watches. The new network namespace has its own TCP buffer sizes:
  smaller ones bound what one socket can queue before the memory cgroup's socket limit does.
  These are 14 writes to /proc/sys (through rootfs.PROC_SYS_FD: /proc/sys itself may be mounted
  read-only by then), ~0.15 ms in a fresh namespace.
* `set_rlimits(limits)`: every rlimit set explicitly, so that nothing of the server's leaks in.
  RLIMIT_NPROC, _SIGPENDING, _MSGQUEUE and _MEMLOCK are counted per (user namespace, uid) and up the
  chain, so they bound the sandbox's host uid as well.

SysV IPC and POSIX mqueue sysctls of the sandbox's IPC namespace are not writable this way (the
kernel wants the namespace's root uid, which is not mapped): their objects are charged to the memory
cgroup, and mqueue bytes to RLIMIT_MSGQUEUE.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Collection

from agentcell import rootless
from agentcell.backends.base import Limits
from agentcell.backends.linux import rootfs

INOTIFY_INSTANCES = 64  # per sandbox (the host's fs.inotify.max_user_instances is 128 per uid)
INOTIFY_WATCHES = 65536  # per sandbox; each is ~1 KiB of kernel memory, and pins an inode
# The sandbox's user namespace and everything it owns. 0 namespaces: creating one fails with ENOSPC.
USERNS_LIMITS = {
    "max_user_namespaces": 0, "max_pid_namespaces": 0, "max_net_namespaces": 0, "max_mnt_namespaces": 0,
    "max_ipc_namespaces": 0, "max_uts_namespaces": 0, "max_cgroup_namespaces": 0, "max_time_namespaces": 0,
    "max_fanotify_groups": 0, "max_fanotify_marks": 0,
    "max_inotify_instances": INOTIFY_INSTANCES, "max_inotify_watches": INOTIFY_WATCHES,
}
# (min, default, max) bytes of one TCP socket's receive and send buffers in the sandbox's netns (the
# host's: 4096 131072 33554432 / 4096 16384 4194304). The default sets a new connection's first window,
# and with it the size of the segment TCP queues past the memory cgroup's socket limit (its forced
# minimum): 16 KiB instead of 64-128 KiB cut that from ~39 KiB to ~16 KiB per socket. Autotuning still
# grows a busy socket to the max: loopback throughput stays ~4.5 GB/s (measured, both settings).
TCP_RMEM = (4096, 16384, 1 << 20)
TCP_WMEM = (4096, 16384, 1 << 20)
NETNS_SYSCTLS = {
    "net/ipv4/tcp_rmem": " ".join(map(str, TCP_RMEM)),
    "net/ipv4/tcp_wmem": " ".join(map(str, TCP_WMEM)),
}

_INF = resource.RLIM_INFINITY
MEMLOCK_BYTES = 8 << 20  # the kernel's default since 5.16; locked pages are memory-cgroup pages anyway
SIGPENDING = 4096  # queued signals and POSIX timers (each holds a preallocated sigqueue)
MSGQUEUE_BYTES = 819200  # POSIX message queue bytes: the kernel's default


def _write(sys_fd: int, path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC, dir_fd=sys_fd)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def confine_namespaces() -> None:
    """In the new user+net namespaces, before the capabilities are dropped. Raises OSError: a sandbox
    without these caps must not start.

    Which namespace a /proc/sys file belongs to is decided when it is opened, by the opener's
    namespaces; the directory is the standby's own proc, opened before anything covered it
    (rootfs.PROC_SYS_FD: /proc/sys is mounted read-only for the sandbox), and closed here."""
    sys_fd, rootfs.PROC_SYS_FD = rootfs.PROC_SYS_FD, -1
    if sys_fd < 0:
        sys_fd = os.open("/proc/sys", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name, value in USERNS_LIMITS.items():
            _write(sys_fd, f"user/{name}", str(value))
        for name, text in NETNS_SYSCTLS.items():
            _write(sys_fd, name, text)
    finally:
        os.close(sys_fd)


def rlimits(limits: Limits, by_cgroup: Collection[str] = ()) -> dict[int, tuple[int, int]]:
    """(soft, hard) of every rlimit a sandbox gets. `by_cgroup`: the controllers limiting it (rootless
    mode: those of a delegated cgroup, cgroup_delegation.py; a root server's cgroups have them all)."""
    data = limits.memory_mb << 20 if rootless.active() and "memory" not in by_cgroup else _INF
    return {
        resource.RLIMIT_NOFILE: (limits.open_files, limits.open_files),
        resource.RLIMIT_FSIZE: (limits.file_size_mb << 20, limits.file_size_mb << 20),
        resource.RLIMIT_CORE: (0, 0),
        # the pids cgroup is the real bound; this one also holds if the cgroup were misconfigured
        resource.RLIMIT_NPROC: (limits.pids, limits.pids),
        resource.RLIMIT_MEMLOCK: (MEMLOCK_BYTES, MEMLOCK_BYTES),
        resource.RLIMIT_SIGPENDING: (SIGPENDING, SIGPENDING),
        resource.RLIMIT_MSGQUEUE: (MSGQUEUE_BYTES, MSGQUEUE_BYTES),
        resource.RLIMIT_RTPRIO: (0, 0),  # no SCHED_FIFO/RR: a real-time loop ignores the CPU quota
        resource.RLIMIT_RTTIME: (0, 0),
        resource.RLIMIT_NICE: (0, 0),  # no raising one's priority above the default
        resource.RLIMIT_STACK: (8 << 20, _INF),
        resource.RLIMIT_AS: (_INF, _INF),  # memory is the cgroup's business
        # ... except rootless without cgroups: each process's heap and private mappings (not the address
        # space: V8 and Python reserve far more than they use)
        resource.RLIMIT_DATA: (data, data),
        resource.RLIMIT_RSS: (_INF, _INF),
        resource.RLIMIT_CPU: (_INF, _INF),
    }


def set_rlimits(limits: Limits, by_cgroup: Collection[str] = ()) -> None:
    """Set them all; a value above the server's own hard limit is lowered to it (raising a hard limit
    needs CAP_SYS_RESOURCE in the host's namespace, which the sandbox never has)."""
    for which, (soft, hard) in rlimits(limits, by_cgroup).items():
        _, cur_hard = resource.getrlimit(which)
        if cur_hard != _INF:
            hard = cur_hard if hard == _INF else min(hard, cur_hard)
            soft = hard if soft == _INF else min(soft, hard)
        resource.setrlimit(which, (soft, hard))
