"""The guest's seccomp filter: the linux backend's, plus rules that keep signals off the agent and
device nodes out of the guest.

Linux lets nothing in a pid namespace kill its init with a signal init has no handler for (SIGKILL
above all), and the linux backend's agent is that init. The sentry delivers such signals, so the
agent (pid 1 of the guest, the sandbox's user like the code it runs) would die of `kill -9 1`: here
signals whose target is pid 1 are refused instead (kill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo,
pidfd_open of pid 1), and tkill and pidfd_send_signal, which could name one of its threads or a pidfd
of it otherwise, are refused outright (glibc and Go use tgkill; tkill is obsolete).
kill(-1, ...) never reaches init, in gVisor as in Linux.

And device nodes: Linux wants CAP_MKNOD (which the sandbox's root lacks) for a character or block
special file, the sentry (this runsc) makes one for anyone: mknod and mknodat of those two types are
refused here (fifos and sockets stay).
"""

from __future__ import annotations

import errno
import stat

import pyseccomp as seccomp

from agentcell.backends.linux import seccomp_filter

_TO_PID_1 = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open")
_NEVER = ("tkill", "pidfd_send_signal")
# (syscall, index of its mode argument): a device node's file type
_MKNOD = (("mknod", 1), ("mknodat", 2))
_DEVICE_TYPES = (stat.S_IFCHR, stat.S_IFBLK)
_S_IFMT = 0o170000  # the file type bits of a mode


def build() -> bytes:
    f = seccomp_filter.rules()
    eperm = seccomp.ERRNO(errno.EPERM)
    for name in _TO_PID_1:  # the pid is an int: its low 32 bits
        f.add_rule(eperm, name, seccomp.Arg(0, seccomp.MASKED_EQ, 0xFFFFFFFF, 1))
    for name in _NEVER:
        f.add_rule(eperm, name)
    for name, arg in _MKNOD:
        for kind in _DEVICE_TYPES:
            f.add_rule(eperm, name, seccomp.Arg(arg, seccomp.MASKED_EQ, _S_IFMT, kind))
    return seccomp_filter.Filter(f).bpf


def build_strict() -> bytes:
    """The strict filter (seccomp_filter.build_strict), built here on the host like the default one;
    the guest's agent loads it into itself when a policy asks (runtime/policy.py)."""
    return seccomp_filter.build_strict().bpf
