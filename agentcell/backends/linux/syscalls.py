"""Thin ctypes wrappers for the Linux syscalls Python 3.11 does not expose (x86_64 / aarch64 numbers).

Every wrapper raises OSError with errno and the call's arguments, so a failure during sandbox setup
says exactly which step broke.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEW_ALL = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
)

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_KEEPCAPS = 8
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

_MACHINE = platform.machine()
_NR = {
    "x86_64": {"pivot_root": 155, "capset": 126, "ptrace": 101},
    "aarch64": {"pivot_root": 41, "capset": 91, "ptrace": 117},
}.get(_MACHINE, {})


def _check(res: int, what: str) -> int:
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return res


def _syscall_nr(name: str) -> int:
    try:
        return _NR[name]
    except KeyError:
        raise OSError(errno.ENOSYS, f"{name}: unsupported architecture {_MACHINE}") from None


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), f"unshare({flags:#x})")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), f"setns({fd}, {nstype:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    res = _libc.mount(
        source.encode() if source is not None else None,
        target.encode(),
        fstype.encode() if fstype is not None else None,
        ctypes.c_ulong(flags),
        data.encode() if data is not None else None,
    )
    _check(res, f"mount({source!r}, {target!r}, {fstype!r}, {flags:#x}, {data!r})")


def umount2(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount2({target!r})")


def pivot_root(new_root: str, put_old: str) -> None:
    res = _libc.syscall(ctypes.c_long(_syscall_nr("pivot_root")), new_root.encode(), put_old.encode())
    _check(res, f"pivot_root({new_root!r}, {put_old!r})")


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, ctypes.c_size_t(len(raw))), f"sethostname({name!r})")


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    res = _libc.prctl(
        ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), ctypes.c_ulong(arg4), ctypes.c_ulong(arg5)
    )
    return _check(res, f"prctl({option}, {arg2})")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def capset_zero() -> None:
    """Clear the effective, permitted and inheritable capability sets of the calling thread."""
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    res = _libc.syscall(ctypes.c_long(_syscall_nr("capset")), ctypes.byref(header), ctypes.byref(data))
    _check(res, "capset(0)")


def ptrace_traceme() -> int:
    """Only used by tests to check that ptrace is denied; returns the raw result."""
    return int(_libc.syscall(ctypes.c_long(_syscall_nr("ptrace")), 0, 0, 0, 0))


def write_file(path: str, text: str) -> None:
    """One write(2) to an existing kernel interface file (cgroup knobs, /proc/self/uid_map ...).

    Such files take a value in a single write, so no buffering layer may split it.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# -- idmapped mounts and user namespaces made by a privileged parent (rootfs.finish) ------------------

_NR.update({"x86_64": {"open_tree": 428, "move_mount": 429, "mount_setattr": 442, "pause": 34},
            "aarch64": {"open_tree": 428, "move_mount": 429, "mount_setattr": 442}}.get(_MACHINE, {}))
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
MOVE_MOUNT_F_EMPTY_PATH = 4
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 0x1, 0x2, 0x4, 0x8
MOUNT_ATTR_IDMAP = 0x00100000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def idmapped_clone(path: str, userns_fd: int, attrs: int) -> int:
    """A detached copy of the mount at `path` (that one mount, not its submounts) whose file owners are
    read through `userns_fd`'s id maps (host root's files show as the uid host 0 maps to there), with
    `attrs` (MOUNT_ATTR_*) set. Returns the tree's fd; attach it with move_mount_fd."""
    fd = open_tree_one(path)
    try:
        set_idmap(fd, userns_fd, attrs, path)
    except OSError:
        os.close(fd)
        raise
    return fd


def open_tree_one(path: str) -> int:
    """A detached copy of the mount or directory at `path` alone (no submounts): an fd, which another
    process may receive, idmap (set_idmap) and attach (move_mount_fd) in its own mount namespace."""
    return int(_check(_libc.syscall(ctypes.c_long(_syscall_nr("open_tree")), ctypes.c_int(AT_FDCWD), path.encode(),
                                    ctypes.c_uint(OPEN_TREE_CLONE | os.O_CLOEXEC)), f"open_tree({path!r})"))


def set_idmap(fd: int, userns_fd: int, attrs: int, what: str = "") -> None:
    """Owners of the detached tree `fd` read through `userns_fd`'s id maps, and `attrs` set."""
    attr = _MountAttr(attrs | MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
    _check(_libc.syscall(ctypes.c_long(_syscall_nr("mount_setattr")), ctypes.c_int(fd), b"",
                         ctypes.c_uint(AT_EMPTY_PATH), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
           f"mount_setattr({what or fd!r}, idmap)")


def open_tree_clone(path: str) -> int:
    """A detached recursive copy of the mount tree at `path` (an fd; attach it with move_mount_fd)."""
    return int(_check(_libc.syscall(ctypes.c_long(_syscall_nr("open_tree")), ctypes.c_int(AT_FDCWD), path.encode(),
                                    ctypes.c_uint(OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC)),
                      f"open_tree({path!r}, recursive)"))


def move_mount_fd(fd: int, target: str) -> None:
    _check(_libc.syscall(ctypes.c_long(_syscall_nr("move_mount")), ctypes.c_int(fd), b"", ctypes.c_int(AT_FDCWD),
                         target.encode(), ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)), f"move_mount({target!r})")


_CLONE_VM = 0x100
_SIGKILL = 9
_clone_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


def new_userns(uid_map: str, gid_map: str) -> int:
    """An fd of a fresh user namespace with these id maps (written by us, host root, so they may have
    several lines, which a process cannot write for itself), setgroups denied.

    A throwaway task creates it: clone(CLONE_NEWUSER | CLONE_VM) sharing our memory (no page tables
    copied, unlike fork: ~0.1 ms) that only waits in pause(2) (a bare syscall: no libc state touched
    on the shared memory); we write its maps, keep its namespace and kill it."""
    stack = ctypes.create_string_buffer(64 * 1024)
    top = (ctypes.addressof(stack) + len(stack) - 64) & ~0xF
    pause_nr = _NR.get("pause")
    fn = ctypes.cast(_libc.syscall if pause_nr else _libc.pause, _clone_fn)
    pid = _check(_libc.clone(fn, ctypes.c_void_p(top), ctypes.c_int(CLONE_NEWUSER | _CLONE_VM | 17),  # 17: SIGCHLD
                             ctypes.c_void_p(pause_nr or 0)), "clone(CLONE_NEWUSER)")
    try:
        write_file(f"/proc/{pid}/setgroups", "deny")
        write_file(f"/proc/{pid}/uid_map", uid_map)
        write_file(f"/proc/{pid}/gid_map", gid_map)
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.kill(pid, _SIGKILL)
        os.waitpid(pid, 0)
        del stack


def capset(permitted: int, effective: int, inheritable: int = 0) -> None:
    """Set the calling thread's capability sets (bit masks of CAP_* numbers)."""
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for i in range(2):
        data[i].permitted = (permitted >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = (effective >> (32 * i)) & 0xFFFFFFFF
        data[i].inheritable = (inheritable >> (32 * i)) & 0xFFFFFFFF
    res = _libc.syscall(ctypes.c_long(_syscall_nr("capset")), ctypes.byref(header), ctypes.byref(data))
    _check(res, f"capset({permitted:#x}, {effective:#x})")
