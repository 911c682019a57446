"""The seccomp filter loaded last in the sandbox's pid 1: default allow, errors for syscalls that reach
kernel attack surface or host-wide kernel pools a sandboxed program never needs. Built once in the
zygote, loaded per sandbox.

Structure. Most syscalls are allowed without looking at their arguments, and the kernel caches that
verdict per syscall number (SECCOMP_FILTER cache, 5.11+), so only the denied ones and the few with
argument checks below (socket, socketpair, personality, ioctl, clone) run the filter at all.

Argument checks are allow-lists: libseccomp compares whole 64-bit registers while the kernel
truncates an `int` argument to 32 bits, so "deny family == AF_VSOCK" would let 0x1_00000028 through.
Here a value is denied unless it is exactly (all 64 bits) one of the allowed ones: the complement of
the allowed set is covered by one `> max` rule (every value with high bits lands there) and aligned
power-of-two blocks compared with a full 64-bit mask. An allowed value with garbage in the high bits
is refused too, which is stricter than the kernel, never looser. libseccomp allows one comparison per
argument per rule, which is why ranges become blocks rather than `lo <= x <= hi`.

The i386 and x32 entry points (int 0x80 `socketcall` would otherwise bypass every socket rule) are
another architecture to the filter: that kills the process.

libseccomp generates the BPF program anew on every load (~1.3 ms for this filter); `build()` does it
once and each sandbox loads the same bytes with one prctl (~0.25 ms).

Two programs: the filter proper, loaded with SECCOMP_FILTER_FLAG_LOG (the kernel's audit writes a
record of each refusal: the behaviour record's deny.syscall), and a small one without that flag for the
NOT_IMPLEMENTED calls, which are fallbacks rather than refusals (glibc tries clone3 at every fork): a
record each would cost every fork ~µs of the kernel's audit formatting and the server a parse. Of two
filters' verdicts the stricter wins, and for an equal one the later-loaded filter's: so those calls get
the second filter's ENOSYS and no record.

The strict filter (`build_strict()`, a sandbox policy's `syscalls: "strict"`) is a third one, stacked on
these two by the agent into itself when a policy asks for it (runtime/policy.py), with
SECCOMP_FILTER_FLAG_TSYNC: every thread of the agent carries it, and every process it starts from then
on (commands, code contexts, sudo). Processes started before keep the filters they had: a filter is
attached to a task and inherited at fork, never added to another running process. It can only be
added: no filter is ever removed, so a sandbox goes from default to strict, never back
(runtime/policy.syscalls_change_allowed). Built once in the zygote with the default pair.

Strict refuses (EPERM, logged like the default's refusals) what code that needs no special powers
never uses, where the kernel's attack surface or a way around the network's rules lies:
  * raw, packet and ICMP ("ping") sockets: an inet socket is SOCK_STREAM or SOCK_DGRAM (with
    SOCK_NONBLOCK / SOCK_CLOEXEC) of protocol 0, TCP or UDP; a unix one SOCK_STREAM, SOCK_DGRAM or
    SOCK_SEQPACKET (socket and socketpair). The default filter already keeps out every other family.
  * SysV IPC (shm*, sem*, msg*): POSIX shared memory (/dev/shm) and semaphores (futexes) are what
    Python, Node and most programs use. PostgreSQL needs SysV shared memory: run it under "default".
  * character and block device nodes (mknod, mknodat): never made without CAP_MKNOD, except overlayfs
    "whiteouts" (0:0), which anyone may make; FIFOs and sockets stay (mkfifo).
  * personality(2) other than PER_LINUX and the query (no PER_LINUX32, UNAME26: `linux32`, `setarch`).
  * vmsplice: pages of a process mapped into a pipe, the path of several kernel bugs; programs use
    write/splice instead.
Already refused by the default filter: ptrace, process_vm_readv/writev, io_uring, bpf, perf_event_open,
userfaultfd, namespaces (unshare, setns, clone's CLONE_NEW*), keyrings, the mount API, kcmp, pidfd_getfd.
Not refused, on purpose:
  * setuid/setgid-family and capset: the agent itself (which carries the filter) uses them to start
    commands as the sandbox's root (sudo, user="root": rootcaps.become_root) and for the files API as
    root (setfsuid, capset); refusing them would break sudo. The kernel bounds them already: two ids
    are mapped, and the bounding set is the root capability set.
  * memfd_create (MFD_EXEC or not) and execveat(AT_EMPTY_PATH): a memfd made without flags is
    executable too, so a flag filter proves nothing; what may run is the exec policy's business (BPF
    LSM on every exec, whatever its path). wasmtime, .NET and Chromium use memfds.
  * pidfd_open, pidfd_send_signal: the race-free way to wait for and signal a process (Go >= 1.23,
    Python's asyncio, systemd); the checks are kill()'s.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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
    # what Docker's default profile also refuses without a capability: another process's kernel
    # objects (kcmp, process_madvise), NUMA policy and page migration, obsolete or never-implemented
    # calls (sysfs, _sysctl, ustat, vm86, the module and STREAMS stubs ...)
    "kcmp", "process_madvise", "mbind", "set_mempolicy", "set_mempolicy_home_node", "get_mempolicy",
    "migrate_pages", "move_pages", "sysfs", "_sysctl", "ustat", "vm86", "vm86old", "create_module",
    "get_kernel_syms", "query_module", "afs_syscall", "tuxcall", "security", "getpmsg", "putpmsg", "vserver",
    # fanotify: a per-user pool of groups and marks and a large interface; nothing here needs it
    "fanotify_init", "fanotify_mark",
    # secret memory is unmapped from the kernel's direct map (splits its huge pages host-wide); LDT
    # segments are for 16-bit code and Wine
    "memfd_secret", "modify_ldt",
)
# ENOSYS, so callers fall back to what they do on kernels without them: clone3 passes its flags in
# memory a filter cannot inspect (glibc then uses clone); Linux AIO contexts come from a host-wide
# pool (fs.aio-max-nr) one sandbox could drain (glibc's POSIX AIO uses threads, not these).
NOT_IMPLEMENTED = (
    "clone3", "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
)
_NEW_NS_FLAGS = (
    sc.CLONE_NEWNS, sc.CLONE_NEWCGROUP, sc.CLONE_NEWUTS, sc.CLONE_NEWIPC, sc.CLONE_NEWUSER, sc.CLONE_NEWPID,
    sc.CLONE_NEWNET,
)
TIOCSTI = 0x5412
TIOCLINUX = 0x541C

AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP, IPPROTO_ICMPV6 = 1, 6, 17, 58
# Everything else (AF_VSOCK reaches the VM host whatever the network namespace; AF_NETLINK buffers
# escape the memory cgroup on v1; AF_PACKET, AF_ALG, AF_BLUETOOTH, AF_XDP, AF_TIPC ...) gets
# EAFNOSUPPORT, as on a kernel built without them. glibc copes without netlink (getaddrinfo assumes
# both address families, getifaddrs fails).
SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6)
SOCKETPAIR_FAMILIES = (AF_UNIX,)
# The protocol an inet socket may name: 0 (the type's default: TCP or UDP), TCP, UDP, and ICMP for ping
# sockets. SCTP, DCCP, UDP-Lite, MPTCP, L2TP ... get EPROTONOSUPPORT: no module autoload, no reach.
INET_PROTOCOLS = {
    AF_INET: (0, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP),
    AF_INET6: (0, IPPROTO_TCP, IPPROTO_UDP, IPPROTO_ICMPV6),
}
# personality(2): what Docker allows, PER_LINUX and PER_LINUX32 with or without UNAME26, and the query
# 0xffffffff; not ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, MMAP_PAGE_ZERO and the other flags.
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
_U64 = (1 << 64) - 1


def outside_blocks(allowed: Iterable[int]) -> list[tuple[int, int]]:
    """(mask, value) pairs whose `x & mask == value` (64-bit) match exactly the values in
    [0, max(allowed)] that are not allowed: aligned power-of-two blocks, a few per gap."""
    blocks = []
    lo = 0
    for a in sorted(set(allowed)):
        while lo < a:  # cover [lo, a - 1] with the largest aligned block that fits
            size = lo & -lo if lo else 1 << 63
            while lo + size > a:
                size >>= 1
            blocks.append((_U64 & ~(size - 1), lo))
            lo += size
        lo = a + 1
    return blocks


def _deny_unless(f: seccomp.SyscallFilter, action: int, syscall: str, arg: int, allowed: Sequence[int],
                 *also: seccomp.Arg) -> None:
    """`action` for `syscall` unless argument `arg` (all 64 bits) is one of `allowed` (and `also` holds)."""
    f.add_rule(action, syscall, seccomp.Arg(arg, seccomp.GT, max(allowed)), *also)
    for mask, value in outside_blocks(allowed):
        f.add_rule(action, syscall, seccomp.Arg(arg, seccomp.MASKED_EQ, mask, value), *also)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
# seccomp(2) (x86_64 317, arm64 277): SECCOMP_FILTER_FLAG_LOG makes the kernel write an audit record for
# each refused syscall (the behaviour record's deny.syscall, record/linux/audit_events.py). It costs nothing while
# audit is off: the kernel's audit_seccomp returns at once.
_SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, SECCOMP_FILTER_FLAG_LOG = 1, 1, 2


class Filter:
    """The filter as a BPF program, generated once; loaded with the audit flag if `log`, then `then`."""

    def __init__(self, rules: seccomp.SyscallFilter | None, log: bool = True, then: Filter | None = None,
                 bpf: bytes = b"") -> None:
        self.log, self.then = log, then
        if rules is not None:
            fd = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)
            with os.fdopen(fd, "w+b") as f:
                rules.export_bpf(f)
                f.seek(0)
                bpf = f.read()
        self.bpf = bpf
        self._buf = ctypes.create_string_buffer(self.bpf, len(self.bpf))
        self._prog = _SockFprog(len(self.bpf) // 8, ctypes.addressof(self._buf))

    @classmethod
    def of_program(cls, bpf: bytes, log: bool = True) -> Filter:
        """A program built elsewhere (gvisor: on the host, whose libseccomp probes the real kernel)."""
        return cls(None, log=log, bpf=bpf)

    def load(self) -> None:
        """Confine the calling thread (and everything it forks) for good."""
        sc.prctl(sc.PR_SET_NO_NEW_PRIVS, 1)  # the kernel's condition for an unprivileged filter
        nr = _SYS_SECCOMP.get(os.uname().machine)
        res = -1
        if nr is not None:
            res = _libc.syscall(ctypes.c_long(nr), ctypes.c_uint(SECCOMP_SET_MODE_FILTER),
                                ctypes.c_uint(SECCOMP_FILTER_FLAG_LOG if self.log else 0),
                                ctypes.c_void_p(ctypes.addressof(self._prog)))
        if res != 0:
            sc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(self._prog))  # no logging flag here
        if self.then is not None:
            self.then.load()

    def load_all_threads(self) -> None:
        """Confine every thread of the calling process (SECCOMP_FILTER_FLAG_TSYNC), and all they fork, for
        good. Raises OSError if the kernel refuses (a thread it could not synchronise: its tid)."""
        nr = _SYS_SECCOMP.get(os.uname().machine)
        if nr is None:
            raise OSError(errno.ENOSYS, f"seccomp(2) with TSYNC: unknown syscall number on {os.uname().machine}")
        sc.prctl(sc.PR_SET_NO_NEW_PRIVS, 1)
        flags = SECCOMP_FILTER_FLAG_TSYNC | (SECCOMP_FILTER_FLAG_LOG if self.log else 0)
        res = _libc.syscall(ctypes.c_long(nr), ctypes.c_uint(SECCOMP_SET_MODE_FILTER), ctypes.c_uint(flags),
                            ctypes.c_void_p(ctypes.addressof(self._prog)))
        if res < 0 and self.log and ctypes.get_errno() == errno.EINVAL:  # a kernel (or sentry) without LOG
            flags = SECCOMP_FILTER_FLAG_TSYNC
            res = _libc.syscall(ctypes.c_long(nr), ctypes.c_uint(SECCOMP_SET_MODE_FILTER), ctypes.c_uint(flags),
                                ctypes.c_void_p(ctypes.addressof(self._prog)))
        if res < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"seccomp(SECCOMP_SET_MODE_FILTER, TSYNC): {os.strerror(err)}")
        if res > 0:
            raise OSError(errno.EBUSY, f"seccomp TSYNC: thread {res} could not take the filter")
        if self.then is not None:
            self.then.load_all_threads()


@dataclass(frozen=True)
class SandboxFilters:
    """What the zygote builds once for all its sandboxes: the default pair, loaded by each sandbox's pid 1
    during setup (`load`), and the strict filter its agent loads into itself when a policy asks."""

    default: Filter
    strict: Filter

    def load(self) -> None:
        self.default.load()


def build_sandbox_filters() -> SandboxFilters:
    return SandboxFilters(build(), build_strict())


def build() -> Filter:
    """The sandbox's filters: the refusals (logged), then the unlogged NOT_IMPLEMENTED (module doc)."""
    return Filter(rules(not_implemented=False), then=Filter(_refusing(NOT_IMPLEMENTED, errno.ENOSYS), log=False))


def _refusing(names: Sequence[str], err: int, f: seccomp.SyscallFilter | None = None) -> seccomp.SyscallFilter:
    """`f` (a new default-allow filter if None) with `err` for each of `names` this architecture has."""
    if f is None:
        f = _default_allow()
    arch = seccomp.system_arch()
    for name in names:
        try:
            if seccomp.resolve_syscall(arch, name) >= 0:  # < 0: not a syscall on this architecture
                f.add_rule(seccomp.ERRNO(err), name)
        except (OSError, RuntimeError, ValueError):
            pass  # unknown to this libseccomp version
    return f


def _default_allow() -> seccomp.SyscallFilter:
    """A default-allow filter: an i386/x32 syscall (a foreign architecture) kills the whole process, and
    the syscall number is found by binary search rather than a chain of compares (libseccomp >= 2.5)."""
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    f.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    try:
        f.set_attr(seccomp.Attr.CTL_OPTIMIZE, 2)
    except (OSError, RuntimeError, ValueError):
        pass
    return f


def rules(not_implemented: bool = True) -> seccomp.SyscallFilter:
    """The filter in libseccomp's terms (`rules().export_pfc(sys.stdout)` shows it); without the
    NOT_IMPLEMENTED calls if not `not_implemented` (build() gives them a filter of their own)."""
    f = _default_allow()
    _refusing(DENIED, errno.EPERM, f)
    if not_implemented:
        _refusing(NOT_IMPLEMENTED, errno.ENOSYS, f)
    eperm = seccomp.ERRNO(errno.EPERM)
    for flag in _NEW_NS_FLAGS:
        f.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    for cmd in (TIOCSTI, TIOCLINUX):  # the ioctl number is an int: compare the low 32 bits only
        f.add_rule(eperm, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, cmd))
    no_family = seccomp.ERRNO(errno.EAFNOSUPPORT)
    _deny_unless(f, no_family, "socket", 0, SOCKET_FAMILIES)
    _deny_unless(f, no_family, "socketpair", 0, SOCKETPAIR_FAMILIES)
    for family, protocols in INET_PROTOCOLS.items():
        _deny_unless(f, seccomp.ERRNO(errno.EPROTONOSUPPORT), "socket", 2, protocols,
                     seccomp.Arg(0, seccomp.EQ, family))
    _deny_unless(f, eperm, "personality", 0, PERSONALITIES)
    return f


# -- strict (module doc) ------------------------------------------------------------------------------
SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_SEQPACKET = 1, 2, 3, 5
SOCK_NONBLOCK, SOCK_CLOEXEC = 0o4000, 0o2000000


def with_type_flags(types: Iterable[int]) -> tuple[int, ...]:
    """Each socket type as socket(2) may name it: alone, with SOCK_NONBLOCK, SOCK_CLOEXEC or both."""
    return tuple(sorted({t | nb | ce for t in types for nb in (0, SOCK_NONBLOCK) for ce in (0, SOCK_CLOEXEC)}))


STRICT_SOCKET_TYPES = {
    AF_UNIX: with_type_flags((SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET)),
    AF_INET: with_type_flags((SOCK_STREAM, SOCK_DGRAM)),
    AF_INET6: with_type_flags((SOCK_STREAM, SOCK_DGRAM)),
}
STRICT_INET_PROTOCOLS = (0, IPPROTO_TCP, IPPROTO_UDP)  # no ICMP / ICMPv6: no ping sockets
STRICT_DENIED = (
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl",
    "vmsplice",
)
STRICT_PERSONALITIES = (0x0, 0xFFFFFFFF)  # PER_LINUX, and the query
# (syscall, index of its mode argument); the file types refused there
_MKNOD_MODE_ARG = (("mknod", 1), ("mknodat", 2))
_DEVICE_TYPES = (stat.S_IFCHR, stat.S_IFBLK)
_S_IFMT = 0o170000  # the file type bits of a mode


def strict_rules() -> seccomp.SyscallFilter:
    """The strict filter in libseccomp's terms: a default-allow filter loaded on top of the default pair
    (whose refusals still hold: a family the default refuses never gets here allowed)."""
    f = _default_allow()
    eperm = seccomp.ERRNO(errno.EPERM)
    _refusing(STRICT_DENIED, errno.EPERM, f)
    for family, types in STRICT_SOCKET_TYPES.items():
        _deny_unless(f, eperm, "socket", 1, types, seccomp.Arg(0, seccomp.EQ, family))
        if family == AF_UNIX:
            _deny_unless(f, eperm, "socketpair", 1, types, seccomp.Arg(0, seccomp.EQ, family))
        else:
            _deny_unless(f, eperm, "socket", 2, STRICT_INET_PROTOCOLS, seccomp.Arg(0, seccomp.EQ, family))
    _deny_unless(f, eperm, "personality", 0, STRICT_PERSONALITIES)
    for name, arg in _MKNOD_MODE_ARG:  # mode_t: the mask's high bits are 0, so garbage there cannot hide
        try:
            if seccomp.resolve_syscall(seccomp.system_arch(), name) < 0:
                continue
        except (OSError, RuntimeError, ValueError):
            continue
        for kind in _DEVICE_TYPES:
            f.add_rule(eperm, name, seccomp.Arg(arg, seccomp.MASKED_EQ, _S_IFMT, kind))
    return f


def build_strict() -> Filter:
    """The strict filter as a program (module doc), loaded with the audit flag like the default's."""
    return Filter(strict_rules())
