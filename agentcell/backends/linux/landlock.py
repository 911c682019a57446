"""Landlock: the sandbox may read and execute everywhere in its root but write only to its scratch
places. A second wall behind the read-only mounts (ctypes, syscalls 444/445/446)."""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2  # ABI 6
# ABI 7 (6.15+) writes an audit record for each denial (the behaviour record's deny.write,
# record/linux/audit_events.py), by default only until the confined process execs: the sandbox's commands are
# exec'd programs, so ask for their denials too. Nothing is written while audit is off.
RESTRICT_SELF_LOG_NEW_EXEC_ON = 1 << 1

_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV

WRITABLE_DIRS = ("/home/user", "/tmp", "/dev/shm")
# The copy-on-write overlays of the root (rootfs.OVERLAYS): writable as far as the files' modes allow
# (the sandbox's root, mostly), never a device node (they are nodev; this is the second wall).
OVERLAY_DIRS = ("/usr", "/etc", "/var", "/opt", "/opt/agentcell/venv", "/root", "/srv", "/mnt")
WRITABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/tty")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def abi_version() -> int:
    """0 when the kernel has no Landlock (or it is disabled at boot)."""
    res = _libc.syscall(ctypes.c_long(_SYS_CREATE), None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(int(res), 0)


def _all_fs(abi: int) -> int:
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


def _check(res: int, what: str) -> int:
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock {what}: {os.strerror(err)}")
    return int(res)


def _add(ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if not os.path.isdir(path):
            access &= _FILE_RIGHTS
        attr = _PathBeneath(access, fd)
        _check(_libc.syscall(ctypes.c_long(_SYS_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                             ctypes.byref(attr), ctypes.c_uint32(0)), f"add_rule({path})")
    finally:
        os.close(fd)


def _writable_root() -> bool:
    return os.statvfs("/").f_flag & os.ST_RDONLY == 0


def restrict(abi: int | None = None) -> int:
    """Confine the calling process (and its future children). Needs no_new_privs. Returns the ABI used."""
    abi = abi_version() if abi is None else abi
    if abi < 1:
        return 0
    handled = _all_fs(abi)
    attr = _RulesetAttr(handled, 0, 0)
    size = 8
    if abi >= 4:
        size = 16  # network rules: not handled (the sandbox has its own empty network namespace)
    if abi >= 6:
        attr.scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
        size = 24
    ruleset = _check(_libc.syscall(ctypes.c_long(_SYS_CREATE), ctypes.byref(attr), ctypes.c_size_t(size),
                                   ctypes.c_uint32(0)), "create_ruleset")
    try:
        read = (EXECUTE | READ_FILE | READ_DIR | IOCTL_DEV) & handled
        # an image template's root is one writable overlay (image_root.py): all of it as far as the
        # files' modes allow (the default template's root is read-only: only its overlays below)
        _add(ruleset, "/", handled & ~(MAKE_CHAR | MAKE_BLOCK) if _writable_root() else read)
        for d in WRITABLE_DIRS:
            _add(ruleset, d, handled)
        for d in OVERLAY_DIRS:
            if os.path.ismount(d) and os.statvfs(d).f_flag & os.ST_RDONLY == 0:  # overlays only
                _add(ruleset, d, handled & ~(MAKE_CHAR | MAKE_BLOCK))
        for dev in WRITABLE_DEVICES:
            _add(ruleset, dev, (READ_FILE | WRITE_FILE | TRUNCATE | IOCTL_DEV) & handled)
        _add(ruleset, "/dev/pts", (READ_FILE | WRITE_FILE | READ_DIR | TRUNCATE | IOCTL_DEV) & handled)
        # /proc/self/oom_score_adj and friends; the kernel's own permission checks still apply
        _add(ruleset, "/proc", (READ_FILE | WRITE_FILE | READ_DIR | TRUNCATE) & handled)
        flags = RESTRICT_SELF_LOG_NEW_EXEC_ON if abi >= 7 else 0
        _check(_libc.syscall(ctypes.c_long(_SYS_RESTRICT), ctypes.c_int(ruleset), ctypes.c_uint32(flags)), "restrict_self")
    finally:
        os.close(ruleset)
    return abi
