"""What of /proc a sandbox does not see: kernel and host details no program needs (after runc's
maskedPaths/readonlyPaths and gVisor's minimal /proc).

Each standby mounts its own proc (rootfs.enter) and then, still as host root, ``mask()``: /dev/null
bound over files, an empty read-only tmpfs over directories, /proc/sys bound read-only. Because host
root made these mounts, the kernel locks them when the sandbox later enters its own user namespace:
not even that namespace's root could unmount them to look underneath, and a fresh proc cannot be
mounted while parts of it are covered. Cost: one mount per entry, ~10 us each, in the standby
(before any request).

Left readable, because programs use them: /proc/self and the sandbox's own pids, cpuinfo, meminfo,
stat, loadavg, uptime, version (what uname says anyway), vmstat, filesystems, mounts, net (the
sandbox's own network namespace), sysvipc (its own IPC namespace), pressure, cgroups, and /proc/sys
(read-only: hostname, pid_max, overcommit and friends) but for the host-wide identifiers in it.
Files only host root can read (kmsg, kpage*, slabinfo, vmallocinfo, pagetypeinfo) stay as they are:
a sandbox's uid is never host root.
"""

from __future__ import annotations

import functools
import os

from agentcell.backends.linux import syscalls as sc

# Bound to /dev/null: empty to read.
MASKED_FILES = (
    # the kernel: boot command line (and what it tells about the host), build config, symbols,
    # modules, debug views (runc: kcore, keys, latency_stats, timer_list, timer_stats, sched_debug)
    "cmdline", "config.gz", "kallsyms", "modules", "kcore", "keys", "key-users", "latency_stats",
    "timer_list", "timer_stats", "sched_debug", "schedstat",
    # the host's hardware and what its other tenants do with it: interrupts per CPU, disks and their
    # I/O, swap devices (file paths), memory zones, device drivers, I/O ports, file locks of all
    # processes
    "interrupts", "softirqs", "diskstats", "partitions", "swaps", "buddyinfo", "zoneinfo", "iomem",
    "ioports", "dma", "devices", "misc", "mtrr", "consoles", "locks", "fb", "mdstat", "sysrq-trigger",
    # a host-wide identifier (stable until reboot) and where the host sends its core dumps
    "sys/kernel/random/boot_id", "sys/kernel/core_pattern",
)
# An empty read-only tmpfs on top: ACPI, PCI/USB buses, SCSI, sound, IRQ affinities, per-device
# filesystem statistics, tty and RTC drivers.
MASKED_DIRS = ("acpi", "asound", "bus", "driver", "fs", "irq", "scsi", "tty")
# Readable, never writable (writes need host capabilities anyway; this is the second wall).
READ_ONLY = ("sys",)

_FLAGS = sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC


@functools.cache  # in the zygote, once: every proc instance of this kernel has the same entries
def present() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(files, dirs, read-only) of the lists above that this kernel has."""
    files = tuple(n for n in MASKED_FILES if os.path.isfile(f"/proc/{n}"))
    dirs = tuple(n for n in MASKED_DIRS if os.path.isdir(f"/proc/{n}"))
    ro = tuple(n for n in READ_ONLY if os.path.exists(f"/proc/{n}"))
    return files, dirs, ro


def mask(proc: str, dev_null: str) -> None:
    """Over a freshly mounted proc at `proc` (host root, in the standby): hide and freeze."""
    files, dirs, ro = present()
    for name in ro:  # first, so the masks below land on top of the read-only bind
        sc.mount(f"{proc}/{name}", f"{proc}/{name}", None, sc.MS_BIND)
        sc.mount(None, f"{proc}/{name}", None, sc.MS_REMOUNT | sc.MS_BIND | sc.MS_RDONLY | _FLAGS)
    for name in files:
        sc.mount(dev_null, f"{proc}/{name}", None, sc.MS_BIND)
    for name in dirs:
        sc.mount("tmpfs", f"{proc}/{name}", "tmpfs", sc.MS_RDONLY | _FLAGS, "size=4k,nr_inodes=1,mode=0555")
