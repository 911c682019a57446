"""`agentcell doctor`: what this host offers agentcell, each check one line with its fix.

The checks only look (files, sysctls, a socket connect, a few harmless syscalls); nothing is changed.
`diagnose()` picks the mode a server started here would run in (root; the system service's socket;
rootless for an ordinary user) and says whether that mode can run: the `required` checks of the mode
must pass. For rootless mode it also lists the guarantees that hold and those that do not
(rootless.guarantees, docs/rootless.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import grp
import os
import pwd
import shutil
import socket
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from agentcell import rootless

if TYPE_CHECKING:
    from agentcell.backends.linux.cgroup_delegation import Delegation

Status = Literal["ok", "warn", "missing"]
Mode = Literal["root", "system", "rootless"]
SYSTEM_SOCKET = "/run/agentcell/agentcell.sock"  # the system service's (agentcell system install)
SYSTEM_GROUP = "agentcell"
ROOT_STATE_DIR = "/var/lib/agentcell"
STORE_FREE_BYTES = 2 << 30  # the runtime store: ~0.2 GB linked, up to ~2 GB where it must copy


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""  # one line, for a status other than ok
    needed_for: str = ""  # what stops working without it


@dataclass(slots=True)
class Report:
    mode: Mode
    can_run: bool
    checks: list[Check] = field(default_factory=list)
    guarantees: list[dict[str, Any]] = field(default_factory=list)  # rootless mode only

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "can_run": self.can_run, "checks": [asdict(c) for c in self.checks],
                "guarantees": self.guarantees}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def system_socket() -> str:
    return os.environ.get("AGENTCELL_SYSTEM_SOCKET", SYSTEM_SOCKET)


def _socket_answers(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(path)
        return True
    except OSError:
        return False


# -- the checks -------------------------------------------------------------------------------------


def check_privilege() -> Check:
    if os.geteuid() == 0:
        return Check("privilege", "ok", "running as root: the full server (cgroups, egress router, record)")
    sock = system_socket()
    in_group = False
    try:
        gid = grp.getgrnam(SYSTEM_GROUP).gr_gid
        in_group = gid in os.getgroups() or gid == os.getgid()
    except KeyError:
        pass
    if os.path.exists(sock) and _socket_answers(sock):
        return Check("privilege", "ok", f"not root; the system service answers at {sock}: no server to start")
    if os.path.exists(sock):
        fix = (f"ask an administrator to add you to the {SYSTEM_GROUP} group (usermod -aG {SYSTEM_GROUP} {_user()}), "
               "then log in again" if not in_group else "the service's socket does not answer: systemctl start agentcell")
        return Check("privilege", "warn", f"not root; {sock} exists but does not accept you", fix,
                     "the system service (full guarantees for non-root users)")
    return Check("privilege", "warn", "not root and no system service: a server you start runs rootless",
                 "for full guarantees an administrator runs `agentcell system install` once", "full guarantees")


def check_userns() -> Check:
    limit = _read("/proc/sys/user/max_user_namespaces")
    if limit is None:
        return Check("user namespaces", "missing", "this kernel has no user namespaces (CONFIG_USER_NS)",
                     "use a kernel built with CONFIG_USER_NS=y", "every sandbox")
    if int(limit) < 10:
        return Check("user namespaces", "missing", f"user.max_user_namespaces={limit}",
                     "sysctl -w user.max_user_namespaces=65536 (as root)", "every sandbox")
    if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        return Check("user namespaces", "missing", "kernel.unprivileged_userns_clone=0: only root may create them",
                     "sysctl -w kernel.unprivileged_userns_clone=1 (as root)", "every sandbox")
    if _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        return Check("user namespaces", "warn", "AppArmor restricts unprivileged user namespaces",
                     "an AppArmor profile with `userns,` for this Python, or sysctl -w "
                     "kernel.apparmor_restrict_unprivileged_userns=0 (as root)", "rootless mode")
    return Check("user namespaces", "ok", f"available to every user (user.max_user_namespaces={limit})")


def check_subids() -> Check:
    from agentcell.backends.linux import userns

    if os.geteuid() == 0:
        return Check("newuidmap + subordinate ids", "ok", "not needed as root")
    helpers = [t for t in ("newuidmap", "newgidmap") if shutil.which(t) is None]
    if helpers:
        return Check("newuidmap + subordinate ids", "missing", f"{' and '.join(helpers)} not found",
                     "apt-get install uidmap (dnf install shadow-utils), as root", "rootless mode")
    not_setuid = [t for t in ("newuidmap", "newgidmap")
                  if not (st := os.stat(shutil.which(t) or t)).st_mode & stat.S_ISUID or st.st_uid != 0]
    if not_setuid:
        return Check("newuidmap + subordinate ids", "missing", f"{', '.join(not_setuid)} is not setuid root",
                     "chmod u+s $(which newuidmap newgidmap), as root (or setcap cap_setuid,cap_setgid+ep)",
                     "rootless mode")
    user, uid = _user(), os.getuid()
    sub_uid, sub_gid = userns.subids(userns.SUBUID, user, uid), userns.subids(userns.SUBGID, user, uid)
    if sub_uid is None or sub_gid is None:
        return Check("newuidmap + subordinate ids", "missing", f"{user} has no range in /etc/subuid or /etc/subgid",
                     f"usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {user} (as root)",
                     "rootless mode")
    n = min(sub_uid.count, sub_gid.count)
    if n < 20_000:
        return Check("newuidmap + subordinate ids", "missing", f"{user}'s subordinate ranges hold only {n} ids",
                     f"give {user} 65536 ids in /etc/subuid and /etc/subgid (as root)", "rootless mode")
    return Check("newuidmap + subordinate ids", "ok",
                 f"newuidmap/newgidmap setuid; {user}: uids {sub_uid.start}+{sub_uid.count}, gids {sub_gid.start}+"
                 f"{sub_gid.count}")


def _delegation() -> tuple[Delegation | None, str]:
    """(the delegation, or None and why not): the cgroup v2 directory a rootless server started here
    would put its sandboxes' cgroups in."""
    from agentcell.backends.linux import cgroup_delegation

    return cgroup_delegation.probe()


def check_cgroups() -> Check:
    v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    if v2:
        controllers = set((_read("/sys/fs/cgroup/cgroup.controllers") or "").split())
        layout = f"cgroup v2 (controllers: {' '.join(sorted(controllers)) or 'none'})"
    else:
        present = [c for c in ("memory", "pids", "cpu", "freezer") if os.path.isdir(f"/sys/fs/cgroup/{c}")]
        layout = f"cgroup v1 ({', '.join(present) or 'no controllers'})"
        if {"memory", "pids", "cpu"} - set(present):
            return Check("cgroups", "missing", layout, "mount the memory, pids and cpu controllers, or boot with "
                         "cgroup v2 (systemd.unified_cgroup_hierarchy=1)", "memory, pids and CPU limits")
    if os.geteuid() == 0:
        return Check("cgroups", "ok", layout)
    delegation, why = _delegation()
    if delegation is None:
        return Check("cgroups", "warn", f"{layout}; no cgroup v2 directory delegated to you ({why})",
                     "start the server in a delegated systemd user scope (systemd-run --user --scope -p Delegate=yes "
                     "agentcell serve, on a host with cgroup v2 and user@.service); without: rlimits, no pause",
                     "cgroup limits and pause rootless")
    if delegation.missing:
        return Check("cgroups", "warn", f"{layout}; {delegation.describe()}",
                     f"an administrator delegates {' '.join(delegation.missing)} to users (a drop-in for "
                     f"user@.service with Delegate=cpu cpuset io memory pids)", f"{', '.join(delegation.missing)} limits by cgroup")
    return Check("cgroups", "ok", f"{layout}; {delegation.describe()}")


def check_seccomp() -> Check:
    lib = ctypes.util.find_library("seccomp")
    try:
        import pyseccomp  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means the same: no filter can be built
        return Check("seccomp", "missing", f"pyseccomp cannot load libseccomp ({e})",
                     "apt-get install libseccomp2 (as root)", "every sandbox (its syscall filter)")
    mode = (_read("/proc/self/status") or "").partition("Seccomp:")[2].split("\n")[0].strip()
    return Check("seccomp", "ok", f"libseccomp: {lib or 'found'}; this process's seccomp mode {mode or '?'}")


def check_landlock() -> Check:
    from agentcell.backends.linux import landlock

    abi = landlock.abi_version()
    if abi <= 0:
        return Check("Landlock", "missing", "the kernel has no Landlock (or it is off)",
                     "boot a kernel >= 5.13 with lsm=...,landlock", "the sandboxes' file access rules")
    return Check("Landlock", "ok", f"ABI {abi}")


def check_nftables() -> Check:
    if shutil.which("nft") is None:
        return Check("nftables", "missing", "nft not found", "apt-get install nftables (as root)",
                     "internet for sandboxes (the egress router); --egress-uplink none works without")
    return Check("nftables", "ok", f"{shutil.which('nft')}")


def check_usermode_net() -> Check:
    from agentcell.network import usermode

    if os.geteuid() == 0:
        return Check("user-mode networking", "ok", "not needed: root's egress router has a host uplink")
    found = usermode.missing()
    if found is not None:
        return Check("user-mode networking", "warn", found[0], found[1], "internet for rootless sandboxes")
    return Check("user-mode networking", "ok", f"{shutil.which(usermode.TOOL)}, {usermode.TUN} usable: "
                 "rootless sandboxes get internet through the egress router")


def check_bpf() -> Check:
    from agentcell.record.linux import bpf_build, kernel_trace

    missing = []
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        missing.append("kernel BTF (/sys/kernel/btf/vmlinux)")
    if ctypes.util.find_library("bpf") is None:
        missing.append("libbpf (apt-get install libbpf1)")
    # the object shipped for this source and machine (a wheel's), else clang to compile one
    prebuilt = (kernel_trace.SOURCE.parent / bpf_build.object_name(kernel_trace.SOURCE.read_bytes())).exists()
    clang = bpf_build.find_clang()
    if not prebuilt and clang is None:
        missing.append("a prebuilt tracer object or clang (apt-get install clang libbpf-dev)")
    if missing:
        return Check("libbpf + BTF", "missing", "missing: " + "; ".join(missing), "install what is listed (as root)",
                     "processes in the behaviour record")
    detail = f"BTF, libbpf, {'prebuilt object' if prebuilt else clang}"
    if os.geteuid() != 0:
        return Check("libbpf + BTF", "warn", detail + "; loading the tracer needs root",
                     "rootless: the record has no processes", "processes in the behaviour record")
    return Check("libbpf + BTF", "ok", detail)


def check_exec_rules() -> Check:
    """What a sandbox policy's exec rules need (docs/policy.md): fanotify permission events, and the exec
    guard's BPF program (loaded here to be sure: ~ms)."""
    from agentcell.policy.linux import exec_guard, exec_hold

    needed = "a sandbox policy's exec rules (otherwise refused with the reason)"
    why = exec_hold.available() or exec_guard.available()
    if why is not None:
        return Check("exec rules", "warn", why, "run the server as root on a kernel with fanotify and BPF", needed)
    return Check("exec rules", "ok", "fanotify permission events and the exec guard load here")


def check_audit() -> Check:
    if os.geteuid() != 0:
        return Check("kernel audit", "warn", "needs root", "rootless: no Landlock/seccomp denials in the record",
                     "denials in the behaviour record")
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 9)  # NETLINK_AUDIT
        s.close()
    except OSError as e:
        return Check("kernel audit", "missing", f"no audit netlink socket ({e.strerror})",
                     "boot a kernel with CONFIG_AUDIT (audit=1)", "denials in the behaviour record")
    enabled = _read("/proc/self/loginuid") is not None
    return Check("kernel audit", "ok", "audit netlink available" + ("" if enabled else " (no loginuid)"))


def check_node() -> Check:
    node = shutil.which("node")
    if node is None:
        return Check("node", "missing", "node not found", "apt-get install nodejs (as root)",
                     "JavaScript/TypeScript contexts")
    return Check("node", "ok", node)


def check_r() -> Check:
    rscript = shutil.which("Rscript")
    if rscript is None:
        return Check("R", "missing", "Rscript not found", "apt-get install r-base-core (as root)", "R contexts (optional)")
    return Check("R", "ok", rscript)


def check_runsc() -> Check:
    runsc = shutil.which("runsc")
    if runsc is None:
        return Check("runsc (gvisor)", "missing", "runsc not found", "install gVisor's runsc (gvisor.dev)",
                     "the gvisor backend (optional)")
    if os.geteuid() != 0:
        return Check("runsc (gvisor)", "warn", f"{runsc}; the gvisor backend needs root", "run the server as root",
                     "the gvisor backend (optional)")
    return Check("runsc (gvisor)", "ok", runsc)


def check_microvm() -> Check:
    """What `serve --backend microvm` needs: QEMU 10 (bookworm-backports), bubblewrap, squashfs-tools, a
    static busybox and the unpacked guest kernel. Whether KVM works is known only by booting: the server's
    --accel auto probe does that."""
    from agentcell.backends.microvm import initramfs, kernel

    what = "the microvm backend (optional)"
    missing = [tool for tool in ("qemu-system-x86_64", "bwrap", "setpriv", "mksquashfs") if shutil.which(tool) is None]
    if not os.path.exists(initramfs.BUSYBOX):
        missing.append("busybox-static")
    if missing:
        return Check("microvm", "missing", f"not found: {', '.join(missing)}",
                     "bash scripts/setup (qemu-system-x86 from bookworm-backports, bubblewrap, squashfs-tools, "
                     "busybox-static)", what)
    try:
        guest = kernel.find()
    except kernel.KernelMissingError as e:
        return Check("microvm", "missing", str(e), "python -m agentcell.backends.microvm.kernel install", what)
    return Check("microvm", "ok", f"QEMU, guest kernel {guest.version}; --accel auto boots a probe VM to decide "
                                  "on KVM (else --accel tcg: emulated)")


def check_kvm() -> Check:
    if not os.path.exists("/dev/kvm"):
        return Check("/dev/kvm", "warn", "absent: gvisor uses its systrap/ptrace platform",
                     "a host with virtualisation (or nested) exposes /dev/kvm", "gvisor's KVM platform (optional)")
    ok = os.access("/dev/kvm", os.R_OK | os.W_OK)
    return Check("/dev/kvm", "ok" if ok else "warn", "present" + ("" if ok else ", not accessible to you"),
                 "" if ok else "add yourself to the kvm group", "gvisor's KVM platform (optional)")


def _state_dir(mode: Mode) -> str:
    return ROOT_STATE_DIR if mode == "root" else rootless.default_state_dir()


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_state_dir(mode: Mode) -> Check:
    if mode == "system":
        return Check("state dir", "ok", "the system service keeps its own")
    path = _state_dir(mode)
    existing = _nearest_existing(path)
    if os.access(existing, os.W_OK | os.X_OK):
        return Check("state dir", "ok", f"{path} writable" + ("" if existing == path else " (will be created)"))
    return Check("state dir", "missing", f"{path}: {existing} is not writable by you",
                 "pass --state-dir DIR (a directory you can write)", "the server")


def check_disk(mode: Mode) -> Check:
    if mode == "system":
        return Check("disk for the runtime store", "ok", "the system service keeps its own")
    from agentcell.backends.linux import runtime_store

    path = runtime_store.STORE_DIR if mode == "root" else rootless.runtime_store_dir()
    free = shutil.disk_usage(_nearest_existing(path)).free
    status: Status = "ok" if free >= STORE_FREE_BYTES else "warn"
    return Check("disk for the runtime store", status, f"{free / (1 << 30):.1f} GiB free at {path}",
                 "" if status == "ok" else f"free {STORE_FREE_BYTES >> 30} GiB there", "the first server start")


# -- the verdict ------------------------------------------------------------------------------------


def chosen_mode() -> Mode:
    if os.geteuid() == 0:
        return "root"
    sock = system_socket()
    return "system" if os.path.exists(sock) and _socket_answers(sock) else "rootless"


# what must hold for each mode to run at all
REQUIRED: dict[Mode, tuple[str, ...]] = {
    "root": ("user namespaces", "cgroups", "seccomp", "Landlock", "state dir"),
    "system": ("privilege",),
    "rootless": ("user namespaces", "newuidmap + subordinate ids", "seccomp", "Landlock", "state dir"),
}


def diagnose() -> Report:
    mode = chosen_mode()
    probes: list[Callable[[], Check]] = [
        check_privilege, check_userns, check_subids, check_cgroups, check_seccomp, check_landlock, check_nftables,
        check_usermode_net,
        check_bpf, check_exec_rules, check_audit, check_node, check_r, check_runsc, check_microvm, check_kvm, lambda: check_state_dir(mode),
        lambda: check_disk(mode)]
    checks = []
    for probe in probes:
        try:
            checks.append(probe())
        except Exception as e:  # noqa: BLE001 - a check that breaks is a finding, not a crash
            checks.append(Check(getattr(probe, "__name__", "check"), "warn", f"could not check: {e!r}"))
    failing = {c.name for c in checks if c.status == "missing"}
    can_run = not failing & set(REQUIRED[mode])
    report = Report(mode, can_run, checks)
    if mode == "rootless":
        subids_ok = next(c for c in checks if c.name == "newuidmap + subordinate ids").status == "ok"
        usermode_ok = next(c for c in checks if c.name == "user-mode networking").status == "ok"
        delegation, _ = _delegation()
        report.guarantees = [asdict(g) for g in rootless.guarantees(
            subids=subids_ok, delegated=delegation.controllers if delegation is not None else None,
            user_net=usermode_ok)]
    return report
