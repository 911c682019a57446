"""fanotify, through ctypes: the kernel half of the file collector."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_init.argtypes = (ctypes.c_uint, ctypes.c_uint)
_libc.fanotify_init.restype = ctypes.c_int
_libc.fanotify_mark.argtypes = (ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p)
_libc.fanotify_mark.restype = ctypes.c_int
_libc.open_by_handle_at.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
_libc.open_by_handle_at.restype = ctypes.c_int

# <linux/fanotify.h>
FAN_CLOEXEC, FAN_NONBLOCK = 0x1, 0x2
FAN_REPORT_FID, FAN_REPORT_DIR_FID, FAN_REPORT_NAME, FAN_REPORT_TARGET_FID = 0x200, 0x400, 0x800, 0x1000
FAN_MARK_ADD, FAN_MARK_REMOVE, FAN_MARK_FILESYSTEM = 0x1, 0x2, 0x100
FAN_MODIFY, FAN_ATTRIB, FAN_CLOSE_WRITE = 0x2, 0x4, 0x8
FAN_MOVED_FROM, FAN_MOVED_TO, FAN_CREATE, FAN_DELETE = 0x40, 0x80, 0x100, 0x200
FAN_Q_OVERFLOW, FAN_RENAME, FAN_ONDIR = 0x4000, 0x10000000, 0x40000000
INFO_FID, INFO_DFID_NAME, INFO_DFID, INFO_OLD_DFID_NAME, INFO_NEW_DFID_NAME = 1, 2, 3, 10, 12
METADATA_VERSION = 3
_META = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
_INFO = struct.Struct("=BBH")  # info_type, pad, len
_FSID_HANDLE = struct.Struct("=iiIi")  # fsid (2 x int), handle_bytes, handle_type

INIT_FLAGS = (FAN_CLOEXEC | FAN_NONBLOCK | FAN_REPORT_FID | FAN_REPORT_DIR_FID | FAN_REPORT_NAME
              | FAN_REPORT_TARGET_FID)
MASK = FAN_CREATE | FAN_DELETE | FAN_RENAME | FAN_MODIFY | FAN_CLOSE_WRITE | FAN_ATTRIB | FAN_ONDIR


def _check(res: int, what: str) -> int:
    if res < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return res


def fanotify_init(flags: int = INIT_FLAGS) -> int:
    return _check(_libc.fanotify_init(flags, os.O_RDONLY | os.O_CLOEXEC), "fanotify_init")


def mark_filesystem(group: int, fd: int, mask: int = MASK, remove: bool = False) -> None:
    """Mark (or unmark) the whole filesystem `fd` lies on; "." resolves an O_PATH directory fd."""
    flags = (FAN_MARK_REMOVE if remove else FAN_MARK_ADD) | FAN_MARK_FILESYSTEM
    _check(_libc.fanotify_mark(group, flags, mask, fd, b"."), "fanotify_mark")


def open_handle(mount_fd: int, handle: bytes, flags: int = os.O_PATH | os.O_CLOEXEC) -> int:
    """open_by_handle_at: `handle` is a struct file_handle (handle_bytes, handle_type, f_handle)."""
    return _check(_libc.open_by_handle_at(mount_fd, handle, flags), "open_by_handle_at")


@dataclass(slots=True)
class Raw:
    """One fanotify event, decoded: which object (fid), where (dir handle + name), who (host pid)."""

    mask: int
    pid: int
    fsid: tuple[int, int] = (0, 0)
    fid: bytes = b""  # the object's own handle (FAN_REPORT_FID / TARGET_FID)
    dir: bytes = b""  # the directory's handle and the entry's name (DFID_NAME; OLD for a rename)
    name: str = ""
    new_dir: bytes = b""  # a rename's destination
    new_name: str = ""


def parse(buf: bytes) -> list[Raw]:
    """Decode what one read() of a FID-reporting group returned."""
    out: list[Raw] = []
    view = memoryview(buf)
    pos, end = 0, len(buf)
    while pos + _META.size <= end:
        length, vers, _, meta_len, mask, fd, pid = _META.unpack_from(buf, pos)
        if vers != METADATA_VERSION or length < meta_len or pos + length > end:
            break
        if fd >= 0:  # never asked for (FID mode reports no fds), closed all the same
            os.close(fd)
        raw = Raw(mask, pid)
        at, stop = pos + meta_len, pos + length
        while at + _INFO.size <= stop:
            kind, _, ilen = _INFO.unpack_from(buf, at)
            if ilen < _INFO.size + _FSID_HANDLE.size:
                break
            f0, f1, hbytes, _ = _FSID_HANDLE.unpack_from(buf, at + _INFO.size)
            h0 = at + _INFO.size + 8
            h1 = h0 + 8 + hbytes
            handle = bytes(view[h0:h1])
            name = ""
            if kind in (INFO_DFID_NAME, INFO_OLD_DFID_NAME, INFO_NEW_DFID_NAME):
                nul = buf.index(b"\0", h1, at + ilen)
                name = buf[h1:nul].decode(errors="surrogateescape")
            raw.fsid = (f0, f1)
            if kind == INFO_FID:
                raw.fid = handle
            elif kind in (INFO_DFID_NAME, INFO_DFID, INFO_OLD_DFID_NAME):
                raw.dir, raw.name = handle, name
            elif kind == INFO_NEW_DFID_NAME:
                raw.new_dir, raw.new_name = handle, name
            at += ilen
        out.append(raw)
        pos += length
    return out


def read_events(group: int, size: int = 1 << 16) -> list[Raw] | None:
    """One non-blocking read: None when nothing is queued."""
    try:
        return parse(os.read(group, size))
    except BlockingIOError:
        return None
    except OSError as e:
        if e.errno == errno.EAGAIN:
            return None
        raise
