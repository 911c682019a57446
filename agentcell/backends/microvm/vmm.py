"""One jailed QEMU: the command line of a sandbox's VM, and the jail it runs in (like Firecracker's jailer).

The jail (bubblewrap, as the host's root, no user namespace):
  * new mount, pid, ipc, uts, net and cgroup namespaces: the VMM sees only /usr read-only, an empty
    /dev (null, zero, random, urandom; /dev/kvm with --accel kvm), its own /proc and a small /tmp. No
    host file of the sandbox's is a path in there: the kernel, initramfs, root image and template RAM
    come as inherited file descriptors opened read-only by the server (/dev/fd/N), migration streams
    as fds over QMP. Its network namespace is empty: the guest's NIC is a TAP device's fd, the device
    itself in the egress router's namespace (the sandbox's link, where its policy is enforced);
  * then setpriv: its own host uid and gid (one per sandbox, from the server's reserved range), no
    supplementary groups, every capability dropped from all sets and the bounding set, no_new_privs;
  * a seccomp allow-list (vmm_seccomp.py, loaded by bubblewrap before it execs setpriv): any other
    syscall kills the VMM; and on top of it QEMU's own filter (-sandbox: no obsolete calls, no
    privilege changes, no spawning, no resource-limit changes);
  * the host cgroup the server puts it in before it starts (memory, CPU, pids of the whole VMM: guest
    RAM and QEMU's own).
A VMM escape lands in that: an unprivileged uid of its own, with nothing of the host's to write.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

QEMU = "qemu-system-x86_64"
# under TCG the translation cache defaults to 1 GiB per VMM: bounded here (MiB), at some speed
TCG_CACHE_MB = 64
# what QEMU takes besides the guest's RAM (TCG's cache, its own heap, device buffers), counted in the
# VMM's host memory limit (measured: ~40-90 MiB RSS beyond the guest's pages under TCG)
VMM_OVERHEAD_MB = 160
# the NIC's address at boot; a networked guest takes one of its link's at its identity (guest.py)
GUEST_MAC = "02:ac:00:00:00:02"
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"


@dataclass
class Machine:
    """What one VM is: identical for a template and every clone restored from it (a migration checks
    that its devices and RAM match)."""

    memory_mb: int
    vcpus: int
    accel: str  # "kvm" or "tcg"
    cmdline: str
    machine: str = "microvm"  # or "q35" where microvm is unusable
    # fds the VMM inherits, by what they are (see jail_argv)
    fds: dict[str, int] = field(default_factory=dict)


def qemu_path() -> str | None:
    return shutil.which(QEMU)


def qemu_argv(m: Machine, ram: str, ram_shared: bool, incoming: bool) -> list[str]:
    """QEMU's arguments. `ram`: "anon" (fresh memory) or the /dev/fd path of a RAM file mapped shared
    (a template being booted: the file is its memory) or private (a clone: copy-on-write)."""
    fd = m.fds
    accel = "kvm" if m.accel == "kvm" else f"tcg,tb-size={TCG_CACHE_MB}"
    cpu = "host,-arch-capabilities" if m.accel == "kvm" else "max"
    if ram == "anon":
        backend = f"memory-backend-ram,id=ram,size={m.memory_mb}M"
    else:
        # a clone opens the template's file read-only and maps it private: writable RAM, never the file
        mode = "share=on" if ram_shared else "share=off,readonly=on,rom=off"
        backend = f"memory-backend-file,id=ram,size={m.memory_mb}M,mem-path={ram},{mode},prealloc=off"
    machine = m.machine + ",memory-backend=ram"
    argv = [
        QEMU, "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-sandbox", SECCOMP,
        "-M", machine, "-accel", accel, "-cpu", cpu, "-smp", str(m.vcpus), "-m", f"{m.memory_mb}M",
        "-object", backend,
        "-kernel", f"/dev/fd/{fd['kernel']}", "-initrd", f"/dev/fd/{fd['initrd']}", "-append", m.cmdline,
        "-drive", f"id=root,file=/dev/fd/{fd['image']},format=raw,if=none,readonly=on",
        "-chardev", f"socket,id=qmp,fd={fd['qmp']}", "-mon", "chardev=qmp,mode=control",
        "-chardev", f"socket,id=agent,fd={fd['agent']}", "-chardev", f"socket,id=control,fd={fd['control']}",
        "-chardev", _console_chardev(),
    ]
    # every VM has its NIC (a template's clones must have its devices); its backend is the sandbox's
    # TAP on the egress router when it has one (network/router.py: connect_tap), else none (frames
    # dropped). No vnet header either way (the TAP is opened without IFF_VNET_HDR): a clone's features
    # must be its template's
    nic = f"mac={GUEST_MAC}"
    if "tap" in fd:
        argv += ["-netdev", f"tap,id=net0,fd={fd['tap']}"]
        nic += ",netdev=net0"
    bus = "device" if m.machine == "microvm" else "pci"
    argv += ["-device", f"virtio-net-{bus},{nic}"]
    if m.machine == "microvm":
        argv += ["-device", "virtio-blk-device,drive=root", "-device", "virtio-serial-device,max_ports=4",
                 "-device", "virtio-rng-device", "-device", "virtio-balloon-device,free-page-reporting=on",
                 "-serial", "chardev:console"]
    else:
        argv += ["-device", "virtio-blk-pci,drive=root", "-device", "virtio-serial-pci,max_ports=4",
                 "-device", "virtio-rng-pci", "-device", "virtio-balloon-pci,free-page-reporting=on",
                 "-serial", "chardev:console"]
    argv += ["-device", "virtserialport,chardev=agent,name=agentcell",
             "-device", "virtserialport,chardev=control,name=control"]
    if incoming:
        argv += ["-incoming", "defer"]
    return argv


def jail_argv(qemu: list[str], uid: int, accel: str, seccomp_fd: int = -1, kvm: str | None = None) -> list[str]:
    """`qemu` run inside the jail (bubblewrap, then setpriv to `uid`); under the seccomp program that
    bwrap reads from the inherited `seccomp_fd` (vmm_seccomp.program_fd), if one is given. `kvm`: the
    VMM's own device node for /dev/kvm (backend._kvm_node), bound there with --accel kvm."""
    binary = qemu_path() or f"/usr/bin/{QEMU}"
    argv = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--hostname", "vmm",
            "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib64", "sbin"):
        target = os.path.join("/", name)
        if os.path.islink(target):
            argv += ["--symlink", os.readlink(target), target]
        elif os.path.isdir(target):
            argv += ["--ro-bind", target, target]
    argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--chdir", "/tmp"]
    if accel == "kvm":
        argv += ["--dev-bind", kvm or "/dev/kvm", "/dev/kvm"]
    if seccomp_fd >= 0:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += ["--", "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
             "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
             binary, *qemu[1:]]
    return argv


def _console_chardev() -> str:
    """The guest's serial console: a ring buffer inside the VMM (bounded; the server reads its end when a
    boot fails), or with AGENTCELL_MICROVM_CONSOLE=log the VMM's output, whose last 16 KiB the server
    keeps and quotes in errors: what a guest that dies at once said (an operator's debugging switch)."""
    if os.environ.get("AGENTCELL_MICROVM_CONSOLE") == "log":
        return "stdio,id=console,signal=off"
    return "ringbuf,id=console,size=65536"
