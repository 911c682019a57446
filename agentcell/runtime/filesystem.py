"""File operations of the agent (the ``fs.*`` ops) and the EntryInfo they return.

The agent runs inside the sandbox's own root, so plain syscalls on the resolved path are confined by the
kernel: there is no host path here to escape to. Errors become typed SandboxErrors with Connect codes.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import shutil
import stat
import tempfile
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
from agentcell.runtime import rootcaps

CHUNK = 1 << 20
MAX_READ = 2 << 30  # the largest file files.read returns (the disk of a sandbox is far smaller)
MAX_LIST_ENTRIES = 100_000  # a listing stops here: list a smaller directory or a lower depth
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
    errno.ENXIO: InvalidArgumentError,  # e.g. /dev/tty with no terminal, a FIFO with no reader
    errno.ENODEV: InvalidArgumentError,
    errno.EINVAL: InvalidArgumentError,
    errno.EBUSY: InvalidArgumentError,
    errno.ETXTBSY: InvalidArgumentError,
    errno.EMFILE: ResourceExhaustedError,
    errno.ENFILE: ResourceExhaustedError,
    errno.ENOMEM: ResourceExhaustedError,
}
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def os_error(e: OSError, path: str | None = None) -> SandboxError:
    """The typed error for an OSError, with the path and the reason in the message."""
    cls = _ERRNO_ERRORS.get(e.errno or 0, SandboxError)
    where = path or e.filename
    reason = e.strerror or str(e)
    if e.errno in _DISK_FULL:
        reason += " (the sandbox's disk or file size limit was reached)"
    return cls(f"{where}: {reason}" if where else reason)


_UPLOADS_REMEMBERED = 1024  # recent uploads' temp files, for watchers (watcher.py) to name them right


class FileSystem:
    def __init__(self, home: str) -> None:
        self.home = home
        # temp file -> destination of the uploads of late: a watcher that reads their events after the
        # upload ended still reports them as writes of the destination
        self._uploads: collections.OrderedDict[str, str] = collections.OrderedDict()

    @contextlib.contextmanager
    def acting_as(self, user: str | None) -> Iterator[None]:
        """The block's operations as `user` (the files API's `user`): root's make root's files, may
        go where the sandbox's root may, and resolve relative paths against /root. Synchronous
        calls only (rootcaps.files_as)."""
        if not rootcaps.check(user):
            yield
            return
        home, self.home = self.home, rootcaps.ROOT_HOME
        try:
            with rootcaps.files_as(user):
                yield
        finally:
            self.home = home

    def upload_target(self, path: str) -> str | None:
        return self._uploads.get(path)

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
            entries = []
            for entry in self._walk(p, depth):
                entries.append(entry)
                if len(entries) > MAX_LIST_ENTRIES:
                    raise ResourceExhaustedError(
                        f"{p} holds more than {MAX_LIST_ENTRIES} entries at depth {depth}; "
                        "list a smaller directory or a lower depth")
            return entries
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
        """Remove a file or a directory tree; a path that is not there is already removed (as envd)."""
        p = self.resolve(path)
        try:
            if stat.S_ISDIR(os.lstat(p).st_mode):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        except FileNotFoundError:
            return
        except OSError as e:
            raise os_error(e) from None

    def open_for_read(self, path: str) -> tuple[str, int]:
        """(resolved path, fd) of a regular file to stream; typed errors for the rest.

        O_NONBLOCK: opening a FIFO must not wait for a writer (it would hang the agent), and only
        regular files are read at all: a device such as /dev/zero would stream forever.
        """
        p = self.resolve(path)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.EIO:  # a device that cannot even be opened (gVisor's /dev/tty): say what it is
                with contextlib.suppress(OSError):
                    _check_regular(p, os.stat(p).st_mode, None, "read")
            raise os_error(e, p) from None
        try:
            st = os.fstat(fd)
            _check_regular(p, st.st_mode, fd, "read")
            if st.st_size > MAX_READ:
                raise ResourceExhaustedError(
                    f"{p} is {st.st_size} bytes; files.read returns at most {MAX_READ >> 20} MiB: "
                    "read it in pieces with a command (e.g. split, head -c)")
        except BaseException:
            os.close(fd)
            raise
        return p, fd

    def open_upload(self, path: str) -> Upload:
        """A new file for content that arrives in pieces. It is written beside its destination and
        renamed over it only once complete: a failed upload (a full disk, a client gone) leaves the
        old file as it was and no partial one behind."""
        p = self.resolve(path)
        target = os.path.realpath(p)  # writes go through a symlink, as they always did
        try:
            try:
                mode = os.stat(target).st_mode
            except FileNotFoundError:
                pass
            else:
                _check_regular(p, mode, None, "write")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.",
                                       suffix=".upload")
            os.fchmod(fd, 0o644)
            self._uploads[tmp] = target
            if len(self._uploads) > _UPLOADS_REMEMBERED:
                self._uploads.popitem(last=False)
        except OSError as e:
            raise os_error(e, p) from None
        return Upload(self, p, target, tmp, fd)

    def write(self, path: str, data: bytes, metadata: dict[str, str] | None = None) -> dict[str, Any]:
        upload = self.open_upload(path)
        try:
            upload.write(data)
            return upload.finish(metadata)
        finally:
            upload.close()


class Upload:
    """A file being written by the files API; every error is a typed SandboxError."""

    def __init__(self, fs: FileSystem, path: str, target: str, tmp: str, fd: int) -> None:
        self._fs = fs
        self.path = path
        self._target = target
        self._tmp = tmp
        self._fd = fd

    def write(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view[:CHUNK]) :]
        except OSError as e:
            raise os_error(e, self.path) from None

    def finish(self, metadata: dict[str, str] | None) -> dict[str, Any]:
        try:
            os.close(self._fd)
            self._fd = -1
            if metadata is not None:
                set_metadata(self._tmp, metadata)
            os.replace(self._tmp, self._target)
        except OSError as e:
            raise os_error(e, self.path) from None
        self._tmp = ""
        return self._fs.stat(self.path)

    def close(self) -> None:
        """Done with it: a file that was not finished is removed."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._tmp:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            self._tmp = ""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _check_regular(path: str, mode: int, fd: int | None, what: str) -> None:
    """Only regular files, and none of the agent's own /proc files (the agent would be a confused
    deputy: its /proc entries are closed to the sandbox's code, which runs as the same user)."""
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        hint = "; list it instead" if stat.S_ISDIR(mode) else ""
        raise InvalidArgumentError(f"{path} is {kind}: the files API can only {what} regular files{hint}")
    if fd is None:
        return
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return
    if real.startswith(f"/proc/{os.getpid()}/"):
        raise PermissionDeniedError(f"{path}: the sandbox agent's own /proc files are not readable")


def _name(ident: int) -> str:
    return _NAMES.get(ident, str(ident))


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    return "dir" if stat.S_ISDIR(mode) else "file"


def entry_info(path: str) -> dict[str, Any]:
    st = os.lstat(path)
    mode = st.st_mode
    target = None
    kind = _kind(mode)
    if stat.S_ISLNK(mode):
        # As envd: the link's own name, path, size and mode, the type of what it points to, and the
        # absolute path it resolves to (symlink_target); a dangling link stays "symlink".
        target = os.path.realpath(path)
        with contextlib.suppress(OSError):
            kind = _kind(os.stat(path).st_mode)
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
        "is_symlink": target is not None,
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
