"""The sandbox's root, as the agent reaches it (see docs/security.md "Root inside a sandbox").

The agent runs as the sandbox's user (uid 1000) with the root capability set (sandbox_init.ROOT_CAPS,
in the sandbox's user namespace only) in its *permitted* set and nothing effective, under
no_new_privs and seccomp like everything in the sandbox. It raises a capability for one step only:
CAP_SETUID/SETGID in a forked child that becomes uid 0 and execs a command as root (which then holds
ROOT_CAPS: exec under no_new_privs never gives more than the agent had), and CAP_KILL to signal such
a command. Its other children drop the permitted set right after the fork (`drop_in_child`), so
user code (contexts, commands) never has it; a command run as the user execs with nothing.
Without the set (a sandbox started by an older server, or tests outside a sandbox) root is refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

from agentcell.errors import PermissionDeniedError

CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER = 0, 1, 3
CAP_KILL, CAP_SETGID, CAP_SETUID = 5, 6, 7
_FILE_CAPS = (1 << CAP_CHOWN | 1 << CAP_DAC_OVERRIDE | 1 << CAP_FOWNER | 1 << CAP_SETUID | 1 << CAP_SETGID)
ROOT_HOME = "/root"
_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_CAPGET, _CAPSET = {"x86_64": (125, 126), "aarch64": (90, 91)}.get(os.uname().machine, (-1, -1))
_V3 = 0x20080522


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _get() -> tuple[int, int]:
    """(permitted, effective) of the calling thread."""
    h, d = _Header(_V3, 0), (_Data * 2)()
    if _libc.syscall(ctypes.c_long(_CAPGET), ctypes.byref(h), ctypes.byref(d)) < 0:
        return 0, 0
    return d[0].permitted | d[1].permitted << 32, d[0].effective | d[1].effective << 32


def _set(permitted: int, effective: int) -> None:
    h, d = _Header(_V3, 0), (_Data * 2)()
    for i in range(2):
        d[i].permitted, d[i].effective = (permitted >> 32 * i) & 0xFFFFFFFF, (effective >> 32 * i) & 0xFFFFFFFF
    if _libc.syscall(ctypes.c_long(_CAPSET), ctypes.byref(h), ctypes.byref(d)) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")


def root_path(path: str) -> str:
    """The user's PATH (the sandbox's Python first) with the sbin directories root also searches."""
    dirs = [d for d in path.split(":") if d]
    return ":".join([*dirs[:1], *(d for d in _SBIN if d not in dirs), *dirs[1:]])


def _root_is_host_root() -> bool:
    """True unless our user namespace maps uid 0 to a host id other than 0 (an agent run outside a
    sandbox, in tests, must never start anything as host root)."""
    try:
        with open("/proc/self/uid_map") as f:
            rows = [line.split() for line in f]
    except OSError:
        return True
    return not any(r[0] == "0" and r[1] != "0" for r in rows)


# Set by the gvisor backend's guest init (backends/gvisor/guest.py): there uid 0 is the guest kernel's
# root, which /proc/self/uid_map shows as "0 0 ..." though it is never the host's.
GUEST_KERNEL = False


def available() -> bool:
    permitted, _ = _get()
    return (bool(permitted & (1 << CAP_SETUID)) and bool(permitted & (1 << CAP_SETGID))
            and (GUEST_KERNEL or not _root_is_host_root()))


def drop_in_child() -> None:
    """In a freshly forked child that runs user code as the user: no capability at all, ever."""
    if _get()[0]:
        _set(0, 0)


def become_root() -> None:
    """In a freshly forked child of the agent, before exec: uid/gid 0 of the sandbox's namespace, with
    the permitted set effective (the kernel does that on the change to uid 0)."""
    permitted, _ = _get()
    _set(permitted, permitted & (1 << CAP_SETUID | 1 << CAP_SETGID))
    os.setresgid(0, 0, 0)  # setgroups is denied in the namespace: no supplementary groups at all
    os.setresuid(0, 0, 0)


@contextlib.contextmanager
def _effective(mask: int) -> Iterator[None]:
    """The permitted capabilities of `mask` effective for the block, in this thread."""
    permitted, effective = _get()
    raised = permitted & mask & ~effective
    if raised:
        _set(permitted, effective | raised)
    try:
        yield
    finally:
        if raised:
            _set(permitted, effective)


def kill_capability() -> contextlib.AbstractContextManager[None]:
    """CAP_KILL effective for the block (the agent signals commands it ran as root), in this thread."""
    return _effective(1 << CAP_KILL)


@contextlib.contextmanager
def files_as(user: str | None) -> Iterator[None]:
    """File operations of the block as `user`: for root, this thread's fsuid/fsgid 0 (what is made is
    root's) with root's file capabilities effective, as a command run as root would have them. Only
    around synchronous calls: an await inside would let another request's operation run as root."""
    if not check(user):
        yield
        return
    with _effective(_FILE_CAPS):
        _libc.setfsgid(0)
        _libc.setfsuid(0)
        try:
            yield
        finally:  # back before the capabilities go (always allowed: they are the agent's own ids)
            _libc.setfsuid(os.getuid())
            _libc.setfsgid(os.getgid())


def check(user: str | None) -> bool:
    """True when `user` asks for root; raises when root is asked for and cannot be had."""
    if user != "root":
        return False
    if not available():
        raise PermissionDeniedError("this sandbox has no root user (its agent holds no root capabilities)")
    return True
