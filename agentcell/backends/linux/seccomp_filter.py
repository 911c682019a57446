"""The seccomp filter loaded last in the sandbox's pid 1: default allow, EPERM for syscalls that reach
kernel attack surface a sandboxed program never needs. Built once in the zygote, loaded per sandbox."""

from __future__ import annotations

import errno

import pyseccomp as seccomp

from agentcell.backends.linux import syscalls as sc

DENIED = (
    "mount", "umount2", "pivot_root", "chroot", "ptrace", "process_vm_readv", "process_vm_writev", "bpf",
    "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "perf_event_open", "setns", "unshare", "userfaultfd", "open_by_handle_at",
    "name_to_handle_at", "swapon", "swapoff", "reboot", "syslog", "acct", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "iopl", "ioperm", "quotactl", "quotactl_fd", "fsopen", "fsconfig", "fsmount",
    "fspick", "move_mount", "open_tree", "mount_setattr", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "pidfd_getfd", "lookup_dcookie", "uselib", "vhangup", "nfsservctl",
)
_NEW_NS_FLAGS = (
    sc.CLONE_NEWNS, sc.CLONE_NEWCGROUP, sc.CLONE_NEWUTS, sc.CLONE_NEWIPC, sc.CLONE_NEWUSER, sc.CLONE_NEWPID,
    sc.CLONE_NEWNET,
)
TIOCSTI = 0x5412
TIOCLINUX = 0x541C


def build() -> seccomp.SyscallFilter:
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    eperm = seccomp.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            f.add_rule(eperm, name)
        except (OSError, RuntimeError, ValueError):
            pass  # not a syscall on this architecture / libseccomp version
    for flag in _NEW_NS_FLAGS:
        f.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory a filter cannot inspect: ENOSYS makes glibc fall back to clone
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for cmd in (TIOCSTI, TIOCLINUX):  # the ioctl number is an int: compare the low 32 bits only
        f.add_rule(eperm, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, cmd))
    return f
