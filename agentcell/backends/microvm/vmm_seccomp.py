"""The VMM's seccomp allow-list (like Firecracker's): the syscalls QEMU makes in this configuration, and
every other one kills the whole VMM.

Where it applies. bubblewrap loads it (`--seccomp FD`, a compiled BPF program on an inherited fd) just
before it execs the command, and into its own pid 1 of the VMM's pid namespace, which only waits for
the command. So three programs run under it: bwrap's pid 1 (wait4, exit_group), setpriv (it drops the
uid, groups and capabilities: setresuid, setresgid, setgroups, capset, prctl, then execve) and QEMU.
setpriv's calls stay allowed for QEMU, which does not need them: it has no capability left to use
them with (setpriv emptied every set and the bounding set), and QEMU's own -sandbox filter (vmm.py),
stacked on this one before it reads a byte from a guest, refuses privilege changes, execve and fork.
The alternative, a loader between setpriv and QEMU, would add an exec (a Python one costs ~30 ms per
VMM) to close a window in which no guest runs yet.

How the list was found: QEMU under `strace -f` in its jail (bwrap's pid 1, setpriv and QEMU from
setpriv's exec on: startup, QMP, a TCG boot) and outside it under KVM (vCPUs in KVM_RUN), unioned; then
VMMs under this filter itself (a kill names its syscall in the kernel's audit record, type=1326)
through the VMM side of every path: RAM in a shared file migrated to an fd (a template), a clone of
it restored with -incoming defer + migrate-incoming from an fd, stop/cont, a full migration to an fd
and its restore into anonymous RAM, ringbuf-read, quit (tests/test_vmm_seccomp.py). That found msync
and fadvise64, which no trace of a boot shows. Then a whole life under it, killed by nothing: a
template booted and saved, a standby restored from it, a create, code and commands run, 200 MiB
touched and freed (the balloon's free page reports), pause/resume, the files API out (export), a
checkpoint with the VM running on and its restore, a cold boot. Then a margin for paths that did not come up (abort,
errors written before an exit, signal waits, the I/O thread pool's growth, the balloon's discards).

Arguments checked where it costs nothing and breaks nothing:
  * clone: threads only (CLONE_THREAD set), and no CLONE_NEW* flag. QEMU never forks here (spawn=deny);
    clone3 (flags in memory, which a filter cannot read) gets ENOSYS: glibc then uses clone.
  * socket: AF_UNIX only (all 64 bits): the VMM has no network device; glibc's NSS probes a unix socket.
  * prctl: the options seen (setpriv's capability drops, QEMU's thread names, timer slack, MCE policy)
    and their reads.
  * ioctl: not checked. Under KVM it carries the whole VM API (~40 KVM_* commands, on fds QEMU makes),
    under TCG a few TCGETS on stdio; a list of commands would break on every QEMU or kernel update for
    little: the jail has no tty (--new-session, stdin /dev/null) and no device but null, zero, random,
    urandom and kvm.
Refused with ENOSYS rather than killed, as fallbacks their callers handle: io_uring_setup (QEMU 10
watches its fds with io_uring when it can; io_uring's operations are performed by the kernel out of
seccomp's sight, so it would carry any syscall past this filter: QEMU falls back to ppoll), clone3.
The i386 and x32 entry points kill (another architecture to the filter).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

import pyseccomp as seccomp

from agentcell.backends.linux import syscalls as sc

# seen in the traces and runs (module doc), by who needs them, with siblings on the same code paths
# that did not come up: readv/pwritev next to writev/pread64, epoll next to ppoll (QEMU's fd monitor
# without io_uring switches to epoll past a number of fds), pipe2/dup/timerfd of its event loop
SEEN = (
    # memory: the guest's RAM, TCG's code buffer (PROT_EXEC), the balloon's discards (madvise)
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "get_mempolicy", "set_mempolicy", "memfd_create",
    # files: the kernel, initrd, image and RAM by /dev/fd, the migration fds; the VM's disk (thread pool)
    "openat", "close", "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "lseek",
    "newfstatat", "fstat", "statfs", "fstatfs", "access", "readlink", "fcntl", "getdents64", "fchdir", "ioctl",
    "fallocate", "ftruncate", "fdatasync", "fsync",
    # a restore into file-backed RAM writes it back when the load ends (qemu_ram_block_writeback): this
    # one killed the first clones restored under the filter
    "msync",
    # and its block layer drops the image's page cache when an incoming migration hands it the VM
    # (posix_fadvise DONTNEED at cont): that one killed the next
    "fadvise64",
    # the main loop and its threads
    "ppoll", "poll", "futex", "eventfd2", "signalfd4", "pipe2", "dup", "dup3", "epoll_create1", "epoll_ctl",
    "epoll_wait", "epoll_pwait", "timerfd_create", "timerfd_settime",
    "clock_gettime", "clock_nanosleep", "nanosleep", "clock_getres", "gettimeofday",
    "getpid", "gettid", "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "uname", "sysinfo",
    "sched_getaffinity", "sched_yield", "getrandom", "prlimit64",
    "rseq", "set_robust_list", "set_tid_address", "arch_prctl",
    # QMP and the virtio-serial ports: unix sockets passed in, fds received over QMP (recvmsg)
    "recvmsg", "sendmsg", "recvfrom", "sendto", "getsockopt", "setsockopt", "getsockname", "getpeername",
    "shutdown", "connect",
    # signals: vCPU kicks (tgkill), SIGBUS on RAM, QEMU's termination signals
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigtimedwait", "rt_sigpending", "sigaltstack",
    "tgkill", "restart_syscall",
    "exit", "exit_group",
    # QEMU's -sandbox loads its own filter on top of this one (it can only add refusals)
    "seccomp",
    # bwrap's pid 1 and setpriv (module doc)
    "wait4", "execve", "setresuid", "setresgid", "setgroups", "capget", "capset",
)
# not seen, allowed for paths that did not come up: abort() (the signal it sends itself), a signal
# wait, QEMU's RCU (membarrier, where its build uses it), glibc's stat and sched_getcpu fallbacks,
# realpath() of a relative path (getcwd: the tests' probe, python, needs it at startup too)
MARGIN = ("tkill", "kill", "rt_sigsuspend", "membarrier", "statx", "getcpu", "getcwd")
SOCKET_FAMILIES = (1,)  # AF_UNIX
# prctl options: setpriv's (KEEPCAPS, CAPBSET_READ/DROP, CAP_AMBIENT, NO_NEW_PRIVS, SECUREBITS),
# QEMU's (SET_NAME/GET_NAME for its threads, MCE_KILL, TIMERSLACK), reads of them
PRCTL_OPTIONS = (
    1, 2,  # PR_SET_PDEATHSIG, PR_GET_PDEATHSIG (bwrap's --die-with-parent)
    8, 7,  # PR_SET_KEEPCAPS, PR_GET_KEEPCAPS
    15, 16,  # PR_SET_NAME, PR_GET_NAME
    23, 24,  # PR_CAPBSET_READ, PR_CAPBSET_DROP
    27, 28,  # PR_GET_SECUREBITS, PR_SET_SECUREBITS
    29, 30,  # PR_SET_TIMERSLACK, PR_GET_TIMERSLACK
    33, 34,  # PR_MCE_KILL, PR_MCE_KILL_GET
    38, 39,  # PR_SET_NO_NEW_PRIVS, PR_GET_NO_NEW_PRIVS
    47,  # PR_CAP_AMBIENT
)
# ENOSYS: refused, and the caller falls back (module doc)
NOT_IMPLEMENTED = ("clone3", "io_uring_setup")
CLONE_THREAD = 0x00010000


def allowed() -> tuple[str, ...]:
    """Every syscall allowed without an argument check, sorted."""
    return tuple(sorted(set(SEEN) | set(MARGIN)))


def _known(name: str) -> bool:
    try:
        return seccomp.resolve_syscall(seccomp.system_arch(), name) >= 0
    except (OSError, RuntimeError, ValueError):
        return False


def rules() -> seccomp.SyscallFilter:
    """The allow-list in libseccomp's terms (`rules().export_pfc(sys.stdout)` shows it)."""
    f = seccomp.SyscallFilter(seccomp.KILL_PROCESS)
    f.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    try:
        f.set_attr(seccomp.Attr.CTL_OPTIMIZE, 2)  # a binary search on the syscall number (libseccomp >= 2.5)
    except (OSError, RuntimeError, ValueError):
        pass
    for name in allowed():
        if _known(name):
            f.add_rule(seccomp.ALLOW, name)
    for name in NOT_IMPLEMENTED:
        if _known(name):
            f.add_rule(seccomp.ERRNO(errno.ENOSYS), name)
    # a thread, in no new namespace (clone's flags are an unsigned long; the kernel reads 32 bits of it)
    f.add_rule(seccomp.ALLOW, "clone",
               seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD | sc.CLONE_NEW_ALL, CLONE_THREAD))
    _allow_if(f, "socket", 0, SOCKET_FAMILIES)
    _allow_if(f, "prctl", 0, PRCTL_OPTIONS)
    return f


def _allow_if(f: seccomp.SyscallFilter, name: str, arg: int, values: Sequence[int]) -> None:
    """`name` allowed when argument `arg` is exactly (64 bits) one of `values`; else the default: kill."""
    for value in values:
        f.add_rule(seccomp.ALLOW, name, seccomp.Arg(arg, seccomp.EQ, value))


def build() -> bytes:
    """The filter as a BPF program (struct sock_filter[]), what bwrap's --seccomp reads."""
    fd = os.memfd_create("vmm-seccomp", os.MFD_CLOEXEC)
    with os.fdopen(fd, "w+b") as f:
        rules().export_bpf(f)
        f.seek(0)
        return f.read()


def instructions(bpf: bytes) -> int:
    return len(bpf) // 8


def program_fd(bpf: bytes) -> int:
    """A pipe's read end holding `bpf` for one bwrap (which reads it to EOF): the caller passes it
    (pass_fds) and closes it after the spawn. A program is a few KiB, under a pipe's 64 KiB buffer."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        view = memoryview(bpf)
        while view:
            view = view[os.write(w, view):]
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r
