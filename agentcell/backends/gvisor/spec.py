"""The OCI runtime spec (config.json) of one gVisor sandbox."""

from __future__ import annotations

from typing import Any

from agentcell.backends.base import Limits, VolumeMount
from agentcell.backends.linux import rootfs as linux_rootfs
from agentcell.backends.linux import runtime_store, sandbox_init
from agentcell.backends.linux.cgroups import LOWEST_CPU_SHARES

GUEST_MODULE = "agentcell.backends.gvisor.guest"
_CAP_NAMES = {0: "CHOWN", 1: "DAC_OVERRIDE", 2: "DAC_READ_SEARCH", 3: "FOWNER", 4: "FSETID", 5: "KILL", 6: "SETGID", 7: "SETUID",
              8: "SETPCAP", 10: "NET_BIND_SERVICE", 21: "SYS_ADMIN"}
_CPU_PERIOD_US = 100_000
# A host pids.max counts the sentry's threads and systrap's stub processes (~21 at idle), and a sandbox
# that hits it dies whole (a sentry panic): the guest's RLIMIT_NPROC is the real limit (guest.py), this
# only bounds what one sandbox can take from the host.
_HOST_TASKS_PER_PID = 16
_HOST_TASKS_BASE = 1024


# The sentry holds the guest's page cache of the runtime's files (Python, numpy, pandas ... read through
# the gofer) and its own heap in memory the host charges to the sandbox (~240 MiB with the preloaded
# runtime): the linux backend's sandboxes share those pages with their zygote, uncharged. And a fork in
# the guest copies more on write than Linux does (measured: 60 forked Pythons, ~250 MiB). The host
# limit is the tenant's memory_mb plus this much, so that memory_mb stays about what its code can use.
SENTRY_OVERHEAD_MB = 256


def host_memory_bytes(limits: Limits) -> int:
    return (limits.memory_mb + SENTRY_OVERHEAD_MB) << 20


def host_pids(limits: Limits) -> int:
    return _HOST_TASKS_BASE + _HOST_TASKS_PER_PID * limits.pids


def build(sandbox_id: str, root: str, cgroup: str, limits: Limits, layout: runtime_store.Layout,
          yield_cpu: bool = False) -> dict[str, Any]:
    """`root`: the backend's read-only tree (rootfs.build); `cgroup`: e.g. /agentcell/<instance>/<id>;
    `yield_cpu`: the lowest CPU weight (a standby nobody waits for yet: its claim gives the default back)."""
    caps = [f"CAP_{_CAP_NAMES[c]}" for c in (*sandbox_init.ROOT_CAPS, 8, 21)]  # SETPCAP: to bound the rest
    disk = f"size={limits.disk_limit_mb}m"
    bin_dir = layout.executable.rsplit("/", 1)[0]
    return {
        "ociVersion": "1.0.2",
        "process": {
            # the guest init starts as the guest's root and drops to uid 1000 itself (guest.py)
            "user": {"uid": 0, "gid": 0},
            "args": [layout.executable, "-s", "-P", "-m", GUEST_MODULE],
            "env": [f"PATH={bin_dir}:/usr/local/bin:/usr/bin:/bin", f"PYTHONPATH={layout.pythonpath}",
                    "LANG=C.UTF-8", "OPENBLAS_NUM_THREADS=1", "MPLBACKEND=Agg"],
            "cwd": "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
            "noNewPrivileges": False,
        },
        "root": {"path": root, "readonly": False},  # writable through --overlay2=root:memory
        "hostname": sandbox_id,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "nodev", "mode=1777", disk]},
            # no sysfs (the linux backend has none either): runsc would mount the sentry's at /sys
            {"destination": "/sys", "type": "tmpfs", "source": "tmpfs",
             "options": ["ro", "nosuid", "noexec", "nodev", "size=4k", "mode=0555"]},
            # the disk: one size-limited tmpfs each (the sentry's memory, inside the memory limit)
            {"destination": linux_rootfs.HOME, "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=755", f"uid={linux_rootfs.SANDBOX_UID}", f"gid={linux_rootfs.SANDBOX_UID}", disk]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777", disk]},
        ],
        "linux": {
            "cgroupsPath": cgroup,
            "resources": {
                "memory": {"limit": host_memory_bytes(limits)},
                "cpu": {"quota": max(1000, int(limits.cpu_count * _CPU_PERIOD_US)), "period": _CPU_PERIOD_US,
                        **({"shares": LOWEST_CPU_SHARES} if yield_cpu else {})},
                "pids": {"limit": host_pids(limits)},
            },
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")],
        },
    }


def volume_mounts(volumes: tuple[VolumeMount, ...]) -> list[dict[str, Any]]:
    """Volumes (agentcell/volumes/) as bind mounts of the server's mounts of them: the gofer (host root)
    serves their files, owned by the ids the sandbox uses (0, 1000), as every sandbox sees them."""
    return [{"destination": m.path, "type": "bind", "source": m.source,
             "options": ["rbind", "nosuid", "nodev", "ro" if m.read_only else "rw"]} for m in volumes]
