"""File operations of the agent (the ``fs.*`` ops) and the EntryInfo they return.

The agent runs inside the sandbox's own root, so plain syscalls on the resolved path are confined by the
kernel: there is no host path here to escape to. Errors become typed SandboxErrors with Connect codes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from typing import Any

from agentcell.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxError,
)

CHUNK = 1 << 20
XATTR_PREFIX = "user.e2b."
_NAMES = {0: "root", 1000: "user"}

_ERRNO_ERRORS: dict[int, type[SandboxError]] = {
    errno.ENOENT: NotFoundError,
    errno.ENOTDIR: NotFoundError,
    errno.EACCES: PermissionDeniedError,
    errno.EPERM: PermissionDeniedError,
    errno.EROFS: PermissionDeniedError,
    errno.ENOSPC: ResourceExhaustedError,
    errno.EDQUOT: ResourceExhaustedError,
    errno.EFBIG: ResourceExhaustedError,
    errno.EEXIST: AlreadyExistsError,
    errno.EISDIR: InvalidArgumentError,
    errno.ENAMETOOLONG: InvalidArgumentError,
    errno.ELOOP: InvalidArgumentError,
    errno.ENOTEMPTY: InvalidArgumentError,
    errno.EXDEV: InvalidArgumentError,
}


def os_error(e: OSError, path: str | None = None) -> SandboxError:
    """The typed error for an OSError, with the path and the reason in the message."""
    cls = _ERRNO_ERRORS.get(e.errno or 0, SandboxError)
    where = path or e.filename
    reason = e.strerror or str(e)
    if cls is ResourceExhaustedError:
        reason += " (the sandbox's disk or file size limit was reached)"
    return cls(f"{where}: {reason}" if where else reason)


class FileSystem:
    def __init__(self, home: str) -> None:
        self.home = home

    def resolve(self, path: Any) -> str:
        if not isinstance(path, str) or not path:
            raise InvalidArgumentError("path must be a non-empty string")
        if "\0" in path:
            raise InvalidArgumentError("path must not contain NUL bytes")
        return os.path.normpath(os.path.join(self.home, path))

    # -- ops ------------------------------------------------------------------------------------
    def stat(self, path: str) -> dict[str, Any]:
        p = self.resolve(path)
        try:
            return entry_info(p)
        except OSError as e:
            raise os_error(e, p) from None

    def list(self, path: str, depth: int = 1) -> list[dict[str, Any]]:
        p = self.resolve(path)
        depth = int(depth or 1)
        if depth < 1:
            raise InvalidArgumentError(f"depth must be at least 1, got {depth}")
        try:
            if not stat.S_ISDIR(os.stat(p).st_mode):
                raise InvalidArgumentError(f"{p} is not a directory")
            return list(self._walk(p, depth))
        except OSError as e:
            raise os_error(e, p) from None

    def _walk(self, directory: str, depth: int) -> Iterator[dict[str, Any]]:
        with os.scandir(directory) as it:
            children = sorted(it, key=lambda d: d.name)
        for child in children:
            try:
                yield entry_info(child.path)
            except FileNotFoundError:  # removed while we looked
                continue
            if depth > 1 and child.is_dir(follow_symlinks=False):
                with contextlib.suppress(PermissionError):
                    yield from self._walk(child.path, depth - 1)

    def mkdir(self, path: str) -> dict[str, Any]:
        p = self.resolve(path)
        try:
            os.makedirs(p)
        except FileExistsError:
            if os.path.isdir(p):
                raise AlreadyExistsError(f"directory {p} already exists") from None
            raise InvalidArgumentError(f"{p} exists and is not a directory") from None
        except OSError as e:
            raise os_error(e, p) from None
        return self.stat(p)

    def move(self, source: str, destination: str) -> dict[str, Any]:
        src, dst = self.resolve(source), self.resolve(destination)
        try:
            os.lstat(src)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.rename(src, dst)
        except OSError as e:
            raise os_error(e) from None
        return self.stat(dst)

    def remove(self, path: str) -> None:
        p = self.resolve(path)
        try:
            if stat.S_ISDIR(os.lstat(p).st_mode):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        except OSError as e:
            raise os_error(e) from None

    def open_for_read(self, path: str) -> tuple[str, int]:
        """(resolved path, fd) of a regular file to stream; typed errors for the rest."""
        p = self.resolve(path)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise os_error(e, p) from None
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            raise InvalidArgumentError(f"{p} is a directory; list it instead of reading it")
        return p, fd

    def write(self, path: str, data: bytes, metadata: dict[str, str] | None = None) -> dict[str, Any]:
        p = self.resolve(path)
        try:
            if os.path.isdir(p):
                raise InvalidArgumentError(f"{p} is a directory; cannot write a file over it")
            os.makedirs(os.path.dirname(p), exist_ok=True)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view[:CHUNK]) :]
            finally:
                os.close(fd)
            if metadata is not None:
                set_metadata(p, metadata)
        except OSError as e:
            raise os_error(e, p) from None
        return self.stat(p)


def _name(ident: int) -> str:
    return _NAMES.get(ident, str(ident))


def entry_info(path: str) -> dict[str, Any]:
    st = os.lstat(path)
    mode = st.st_mode
    target = None
    if stat.S_ISLNK(mode):
        kind = "symlink"
        target = os.path.realpath(path)
    elif stat.S_ISDIR(mode):
        kind = "dir"
    else:
        kind = "file"
    return {
        "name": os.path.basename(path) or path,
        "type": kind,
        "path": path,
        "size": st.st_size,
        "mode": stat.S_IMODE(mode),
        "permissions": stat.filemode(mode),
        "owner": _name(st.st_uid),
        "group": _name(st.st_gid),
        "modified_time": st.st_mtime,
        "symlink_target": target,
        "metadata": {} if target is not None else get_metadata(path),
    }


def get_metadata(path: str) -> dict[str, str]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:  # no xattr support here: no metadata
        return {}
    out = {}
    for name in names:
        if name.startswith(XATTR_PREFIX):
            with contextlib.suppress(OSError):
                out[name[len(XATTR_PREFIX) :]] = os.getxattr(path, name, follow_symlinks=False).decode(
                    "utf-8", "replace"
                )
    return out


def set_metadata(path: str, metadata: dict[str, str]) -> None:
    """Replace the file's user.e2b.* xattrs; silently skipped where xattrs are unsupported."""
    try:
        for name in os.listxattr(path):
            if name.startswith(XATTR_PREFIX):
                os.removexattr(path, name)
        for key, value in metadata.items():
            os.setxattr(path, XATTR_PREFIX + str(key), str(value).encode())
    except OSError as e:
        if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            raise
