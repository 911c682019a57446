"""Host-wide kernel pools: what a server sets up once, at start, so that its sandboxes together can
neither drain a pool the whole host shares nor take the host's memory or task slots.

Per-sandbox caps live where each sandbox is made (cgroups.set_limits, ns_limits, rootfs, the seccomp
filter); this module does the host's side, from `LinuxBackend.start()`:

* sysctls whose host-wide default is far below what the sandboxes' own limits already bound, so a
  few sandboxes could exhaust them for everyone (raised, never lowered; each change is logged):
  - fs.file-max -> LONG_MAX, as systemd does: every struct file is charged to its memory cgroup, so
    memory is the real bound (a 256 MiB sandbox opened 887,860 files, a third of the default pool).
  - kernel.pid_max -> 4194304 (systemd's value on 64-bit): 32768 is less than 200 sandboxes' pids.
  - kernel.pty.max -> pty.reserve + the sum over every server on the host of max_sandboxes x
    ptys_per_sandbox: every sandbox's devpts instance has `max=ptys_per_sandbox`, and all of them, of
    every server, share pty.max - pty.reserve.
  Each is a shared host setting (host_settings.py): every server holds the ones it relies on, the first
  saves the original values, the last to stop puts them back (`release`).
  An operator can opt out (`tune_sysctls=False`, `agentcell serve --no-host-sysctls`); then what is
  left unprotected is logged and listed in `HostBudget.unprotected`.
* limits on the cgroup above all of this server's sandboxes (agentcell/<instance>), and the same on
  agentcell/ shared by every server on the host (only ever lowered there): memory = MemTotal minus a
  reserve for the host (max(1 GiB, 10%)), and pids = min(pid_max, threads-max) minus a reserve
  (max(1024, 10%)). In a container (a pod) the container's own cgroup limits, when lower, take the
  place of MemTotal and of the host's task count (`cgroups.root_limits`): they bound the server and
  its sandboxes together. On cgroup v1 an eighth of that memory goes to socket buffers, which v1 counts
  apart (see cgroups.py). The result is `LinuxBackend.host_budget`, for admission control.

AIO contexts (fs.aio-max-nr) need no sysctl: the seccomp filter answers io_setup with ENOSYS.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass

from agentcell.backends.base import Limits
from agentcell.backends.linux import cgroups, host_settings, rootfs
from agentcell.backends.linux import syscalls as sc

LONG_MAX = (1 << 63) - 1
PID_MAX = 4_194_304  # PID_MAX_LIMIT on 64-bit; systemd sets it at boot
PTY_MAX_LIMIT = 1 << 20  # the kernel refuses a larger kernel.pty.max
PTYS_PER_SANDBOX = rootfs.PTYS_PER_SANDBOX  # 64
_GiB = 1 << 30
_holders: dict[str, host_settings.Holder] = {}  # a server's (its instance's) hold on the sysctls it raised


@dataclass(frozen=True, slots=True)
class HostTuning:
    """The operator's choices about the host's kernel (`agentcell serve` options)."""

    tune_sysctls: bool = True  # raise fs.file-max, kernel.pid_max, kernel.pty.max when too low
    ptys_per_sandbox: int = PTYS_PER_SANDBOX  # each sandbox's devpts `max=`
    memory_reserve_bytes: int | None = None  # memory no sandbox may take; None: max(1 GiB, 10%)


@dataclass(frozen=True, slots=True)
class HostBudget:
    """What all of one server's sandboxes together may use: the limits of agentcell/<instance>."""

    memory_bytes: int  # memory.limit_in_bytes (v1) / memory.max (v2) of the parent cgroup
    socket_bytes: int  # v1: memory.kmem.tcp.limit_in_bytes of the parent (socket buffers, apart); v2: 0
    pids: int  # pids.max of the parent cgroup
    ptys_per_sandbox: int
    max_open_files: int  # the server's own hard RLIMIT_NOFILE: a sandbox cannot get more
    unprotected: tuple[str, ...] = ()  # host-wide pools left as they were, and why


def _log(msg: str) -> None:
    print(f"agentcell: {msg}", file=sys.stderr, flush=True)


def _sysctl_path(name: str) -> str:
    return "/proc/sys/" + name.replace(".", "/")


def read_sysctl(name: str) -> int:
    with open(_sysctl_path(name)) as f:
        return int(f.read().split()[0])


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def _raise_sysctls(max_sandboxes: int, tuning: HostTuning, holder: host_settings.Holder | None = None) -> list[str]:
    """Raise the host-wide pools that are too small (holding each for this server: `holder`; without
    one, or with tune_sysctls off, nothing changes); returns what stays unprotected."""
    reserve = read_sysctl("kernel.pty.reserve")
    ptys = max_sandboxes * tuning.ptys_per_sandbox

    def pty_target(holders: host_settings.Holders) -> int:  # every server's sandboxes share the pool
        return min(reserve + sum(int(h.get("ptys", 0)) for h in holders.values()), PTY_MAX_LIMIT)

    wanted: list[tuple[str, Callable[[host_settings.Holders], int], str]] = [
        ("fs.file-max", lambda _: LONG_MAX,
         "sandboxes together can fill the host's file table (their memory allows more files), and then "
         "unprivileged host processes get ENFILE"),
        ("kernel.pid_max", lambda _: PID_MAX, "sandboxes together can use up the host's process ids"),
        ("kernel.pty.max", pty_target,
         f"{max_sandboxes} sandboxes x {tuning.ptys_per_sandbox} PTYs do not fit: sandboxes can run out of PTYs "
         "(the host keeps kernel.pty.reserve)"),
    ]
    unprotected = []
    if reserve + ptys > PTY_MAX_LIMIT:
        unprotected.append(f"kernel.pty.max: {wanted[2][2]} even at the kernel's maximum {PTY_MAX_LIMIT}")
    for name, target_of, risk in wanted:
        if holder is None or not tuning.tune_sysctls:  # --no-host-sysctls: said, not changed
            current, target = read_sysctl(name), target_of({"": {"ptys": ptys}})
            if current < target:
                unprotected.append(f"{name}={current} (wants {target}): {risk}")
            continue

        def raise_to(original: str, holders: host_settings.Holders, name: str = name,
                     target_of: Callable[[host_settings.Holders], int] = target_of) -> None:
            current, target = read_sysctl(name), target_of(holders)
            if current < target:
                sc.write_file(_sysctl_path(name), str(target))
                _log(f"raised {name} from {current} to {target}")

        try:  # held even when high enough already: another server's raise must not be undone under us
            holder.hold(host_settings.sysctl(name), raise_to, ptys=ptys if name == "kernel.pty.max" else 0)
        except (OSError, host_settings.HostSettingsError) as e:
            current = read_sysctl(name)
            unprotected.append(f"{name}={current} (could not raise it: {getattr(e, 'strerror', None) or e}): {risk}")
    for item in unprotected:
        _log(f"NOT PROTECTED: {item}")
    return unprotected


def max_open_files() -> int:
    """The most RLIMIT_NOFILE a sandbox can get: the server's own hard limit (raising past it needs
    CAP_SYS_RESOURCE). The operator's maximum (--max-open-files) is the server's to check."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return read_sysctl("fs.nr_open") if hard == resource.RLIM_INFINITY else hard


def budget_for(tuning: HostTuning) -> tuple[int, int, int]:
    """(memory, socket, pids) of the parent cgroup, from this host's size."""
    container_memory, container_pids = cgroups.root_limits()
    total = min(mem_total(), container_memory or LONG_MAX)
    reserve = tuning.memory_reserve_bytes
    if reserve is None:
        reserve = max(_GiB, total // 10)
    page = os.sysconf("SC_PAGE_SIZE")  # the kernel keeps limits in pages
    memory = max(total - reserve, 256 << 20) // page * page
    sockets = 0 if cgroups.is_v2() else memory // 8 // page * page  # v1: socket buffers are counted apart
    tasks = min(read_sysctl("kernel.pid_max"), read_sysctl("kernel.threads-max"), container_pids or LONG_MAX)
    pids = tasks - min(max(1024, tasks // 10), tasks // 2)  # a small pod's pids limit keeps half for sandboxes
    return memory - sockets, sockets, pids


def _host_bound() -> tuple[int, int, int]:
    memory, sockets, pids = budget_for(HostTuning())
    return memory, pids, sockets


def prepare(instance_rel: str, max_sandboxes: int, tuning: HostTuning) -> HostBudget:
    """At server start (root): host sysctls, then the parent cgroups' limits. `instance_rel` is
    agentcell/<instance>, already created (cgroups.prepare_instance)."""
    holder = None
    if tuning.tune_sysctls:
        holder = _holders[instance_rel] = _holders.get(instance_rel) or host_settings.Holder(instance_rel)
    unprotected = _raise_sysctls(max_sandboxes, tuning, holder)
    memory, sockets, pids = budget_for(tuning)
    cgroups.set_parent_limits(instance_rel, memory, pids, sockets)
    try:  # the host's bound on what every server's sandboxes together hold: the default reserve, so
        # one server's own smaller budget (--memory-reserve-mb) never lowers it for the others
        cgroups.set_parent_limits(cgroups.GROUP, *_host_bound(), only_lower=True)
    except OSError as e:
        _log(f"could not limit {cgroups.GROUP}/ (shared by every server on this host): {e}")
    budget = HostBudget(memory, sockets, pids, tuning.ptys_per_sandbox, max_open_files(), tuple(unprotected))
    _log(f"all sandboxes of this server together: memory {memory / _GiB:.1f} GiB"
         + (f" + socket buffers {sockets / _GiB:.1f} GiB" if sockets else "")
         + f", {pids} tasks; each sandbox: {tuning.ptys_per_sandbox} PTYs, at most {budget.max_open_files} open files")
    return budget


def release(instance_rel: str) -> None:
    """At server stop: this server no longer relies on the sysctls it raised; the last server to stop
    puts their original values back."""
    holder = _holders.pop(instance_rel, None)
    if holder is not None:
        holder.close()


def check_limits(limits: Limits, budget: HostBudget | None) -> None:
    """Raise ValueError for limits this host cannot give one sandbox (per request: cheap)."""
    if budget is None:
        return
    if limits.open_files > budget.max_open_files:
        raise ValueError(f"open_files must be at most {budget.max_open_files} on this host, got {limits.open_files}")
    if limits.memory_mb << 20 > budget.memory_bytes:
        raise ValueError(f"memory_mb must be at most {budget.memory_bytes >> 20} on this host, got {limits.memory_mb}")
    if limits.pids > budget.pids:
        raise ValueError(f"pids must be at most {budget.pids} on this host, got {limits.pids}")


def prepare_rootless(tuning: HostTuning, controllers: frozenset[str] | None = None) -> HostBudget:
    """At a rootless server's start (rootless.py): nothing on the host can change, so the budget
    is what this host's size allows, enforced only by admission control (and by the instance's cgroup
    where a delegated one has the controller: `controllers`, None without cgroups), and every host-wide
    pool is listed as unprotected."""
    memory, sockets, pids = budget_for(tuning)
    memory += sockets  # no v1 socket counter to keep apart
    fallback = {"memory": "memory is bounded per process (RLIMIT_DATA)",
                "pids": "processes per sandbox (RLIMIT_NPROC)", "cpu": "CPU not at all"}
    missing = [c for c in ("memory", "pids", "cpu") if c not in (controllers or ())]
    unprotected = ["rootless mode: host sysctls (fs.file-max, kernel.pid_max, kernel.pty.max) are left as they are"]
    if missing:
        what = "no cgroups" if controllers is None else f"no {', '.join(missing)} controller in the delegated cgroup"
        unprotected.append(f"rootless mode: {what}; " + ", ".join(fallback[c] for c in missing))
    for item in unprotected:
        _log(f"NOT PROTECTED: {item}")
    return HostBudget(memory, 0, pids, tuning.ptys_per_sandbox, max_open_files(), tuple(unprotected))
