"""ctypes wrappers for the new mount API (open_tree, move_mount, mount_setattr, fsopen/fsconfig/fsmount)
and openat2, as used by file_rules.py. Every call works on file descriptors, so a path is resolved once,
under our rules (openat2 RESOLVE_NO_SYMLINKS), never again by the kernel on a later call.

The numbers are the same on x86_64 and aarch64 (the unified table, 424 and up). Errors are OSError
with errno and the call, like agentcell/backends/linux/syscalls.py.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

_OPEN_TREE, _MOVE_MOUNT, _FSOPEN, _FSCONFIG, _FSMOUNT, _OPENAT2, _MOUNT_SETATTR = 428, 429, 430, 431, 432, 437, 442

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
MOVE_MOUNT_F_EMPTY_PATH = 0x04
MOVE_MOUNT_T_EMPTY_PATH = 0x40
MOVE_MOUNT_BENEATH = 0x200
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 0x1, 0x2, 0x4, 0x8
FSCONFIG_SET_STRING, FSCONFIG_CMD_CREATE = 1, 6
RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_IN_ROOT = 0x02, 0x04, 0x10
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _check(res: int, what: str) -> int:
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return res


def _sys(nr: int, *args: object) -> int:
    return int(_libc.syscall(ctypes.c_long(nr), *args))


def open_exact(dir_fd: int, rel: str, flags: int = os.O_PATH) -> int:
    """openat2(dir_fd, rel) following no symlink at all (ELOOP if a component is one): the object
    at exactly that path, whatever a sandbox made of its directories."""
    how = _OpenHow(flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    return _check(_sys(_OPENAT2, ctypes.c_int(dir_fd), (rel or ".").encode(), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how))), f"openat2({rel!r})")


def open_in_root(root_fd: int, path: str, flags: int = os.O_PATH) -> int:
    """openat2(root_fd, path, RESOLVE_IN_ROOT): `path` resolved with root_fd as "/" (absolute symlinks
    and ".." stay inside: a sandbox's symlink never leads to a host file), no magic links
    (/proc/self/fd/N)."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    return _check(_sys(_OPENAT2, ctypes.c_int(root_fd), path.lstrip("/").encode(errors="surrogateescape") or b".",
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how))), f"openat2({path!r}, RESOLVE_IN_ROOT)")


def clone_tree(fd: int, rel: str = "", recursive: bool = True) -> int:
    """A detached copy of the mount tree at (fd, rel): an fd that attach() places somewhere."""
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | AT_SYMLINK_NOFOLLOW | (AT_RECURSIVE if recursive else 0)
    if not rel:
        flags |= AT_EMPTY_PATH
    return _check(_sys(_OPEN_TREE, ctypes.c_int(fd), rel.encode(), ctypes.c_uint(flags)),
                  f"open_tree({rel or fd!r})")


def set_attrs(fd: int, attr_set: int, attr_clr: int = 0, recursive: bool = True) -> None:
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    flags = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    _check(_sys(_MOUNT_SETATTR, ctypes.c_int(fd), b"", ctypes.c_uint(flags), ctypes.byref(attr),
                ctypes.c_size_t(ctypes.sizeof(attr))), f"mount_setattr({fd}, set={attr_set:#x})")


def attach(tree_fd: int, target_fd: int, beneath: bool = False) -> None:
    """move_mount the detached tree `tree_fd` onto the object `target_fd` refers to (on top of what is
    mounted there; with `beneath`, under the mount whose root `target_fd` is)."""
    flags = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH | (MOVE_MOUNT_BENEATH if beneath else 0)
    _check(_sys(_MOVE_MOUNT, ctypes.c_int(tree_fd), b"", ctypes.c_int(target_fd), b"", ctypes.c_uint(flags)),
           f"move_mount({tree_fd} -> {target_fd}{', beneath' if beneath else ''})")


def new_tmpfs(options: dict[str, str], attrs: int) -> int:
    """A fresh tmpfs as a detached mount (fsopen, fsconfig, fsmount): its fd."""
    fs = _check(_sys(_FSOPEN, b"tmpfs", ctypes.c_uint(1)), "fsopen(tmpfs)")  # FSOPEN_CLOEXEC
    try:
        for key, value in options.items():
            _check(_sys(_FSCONFIG, ctypes.c_int(fs), ctypes.c_uint(FSCONFIG_SET_STRING), key.encode(),
                        value.encode(), ctypes.c_int(0)), f"fsconfig(tmpfs, {key}={value})")
        _check(_sys(_FSCONFIG, ctypes.c_int(fs), ctypes.c_uint(FSCONFIG_CMD_CREATE), None, None, ctypes.c_int(0)),
               "fsconfig(tmpfs, create)")
        return _check(_sys(_FSMOUNT, ctypes.c_int(fs), ctypes.c_uint(1), ctypes.c_uint(attrs)), "fsmount(tmpfs)")
    finally:
        os.close(fs)


def umount_fd(proc_fd: int, fd: int) -> None:
    """Lazily detach the mount whose root `fd` is, through the host's /proc (`proc_fd`, opened before a
    setns): no path inside the sandbox is looked up."""
    os.fchdir(proc_fd)
    _check(_libc.umount2(f"thread-self/fd/{fd}".encode(), ctypes.c_int(MNT_DETACH)), f"umount2(fd {fd})")
