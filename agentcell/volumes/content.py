"""File operations inside one volume, for the content API (api.py), as host root but never outside it.

A path is normalised lexically (`..` cannot climb above the volume's `/`), then walked one component at
a time from the volume's root with O_NOFOLLOW: a symlink a sandbox left in the volume is never followed
(an operation on one acts on the link itself, or is refused), so nothing outside the volume is reached.
The volume is its own filesystem: a hard link cannot point out of it either.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import secrets
import shutil
import stat
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agentcell.volumes.store import VolumeError

DEFAULT_IDS = (1000, 1000)  # files the API makes belong to the sandbox's user unless uid/gid say otherwise
MAX_DEPTH = 16
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def normalise(path: str | None) -> str:
    """The volume path `path` names: absolute, without `.`, `..` or repeated slashes."""
    if path is None:
        raise VolumeError(400, "the 'path' query parameter is required")
    if "\0" in path:
        raise VolumeError(400, "a path cannot contain NUL")
    return posixpath.normpath("/" + path.strip().lstrip("/")) if path.strip() not in ("", "/") else "/"


def _not_found(path: str) -> VolumeError:
    return VolumeError(404, f"path '{path}' not found in the volume")


class VolumeFiles:
    """The files of the volume whose filesystem is mounted at `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    # --- walking ----------------------------------------------------------------------------------

    def _parent(self, path: str) -> tuple[int, str]:
        """An O_PATH fd of `path`'s parent directory (the caller closes it) and the last component
        ("" for the root). 404 if a component is missing, 409 if one is not a directory (or a symlink)."""
        fd = os.open(self.root, _DIR)
        parts = [p for p in path.split("/") if p]
        try:
            for part in parts[:-1]:
                nxt = self._step(fd, part, path)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1] if parts else ""

    @staticmethod
    def _step(fd: int, part: str, path: str) -> int:
        try:
            return os.open(part, _DIR, dir_fd=fd)
        except FileNotFoundError:
            raise _not_found(path) from None
        except (NotADirectoryError, OSError) as e:
            if isinstance(e, NotADirectoryError) or e.errno == errno.ELOOP:
                raise VolumeError(409, f"'{path}': a component is not a directory (symlinks are not followed)") from None
            raise

    def _dir(self, path: str) -> int:
        """An O_PATH fd of the directory `path` (404 if missing, 409 if not a directory)."""
        parent, name = self._parent(path)
        if not name:
            return parent
        try:
            return self._step(parent, name, path)
        finally:
            os.close(parent)

    # --- stat ---------------------------------------------------------------------------------------

    @staticmethod
    def entry(path: str, st: os.stat_result, target: str | None = None) -> dict[str, Any]:
        kind = ("directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                else "symlink" if stat.S_ISLNK(st.st_mode) else "unknown")
        out: dict[str, Any] = {
            "name": posixpath.basename(path) or "/", "type": kind, "path": path, "size": st.st_size,
            "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
            "atime": _iso(st.st_atime), "mtime": _iso(st.st_mtime), "ctime": _iso(st.st_ctime),
        }
        if target is not None:
            out["target"] = target
        return out

    def _entry_at(self, fd: int, name: str, path: str) -> dict[str, Any]:
        try:
            st = os.stat(name or ".", dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise _not_found(path) from None
        target = os.readlink(name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else None
        return self.entry(path, st, target)

    def stat(self, path: str) -> dict[str, Any]:
        fd, name = self._parent(path)
        try:
            return self._entry_at(fd, name, path)
        finally:
            os.close(fd)

    def list(self, path: str, depth: int = 1) -> list[dict[str, Any]]:
        if not 1 <= depth <= MAX_DEPTH:
            raise VolumeError(400, f"'depth' is 1 to {MAX_DEPTH}")
        fd = self._dir(path)
        try:
            out: list[dict[str, Any]] = []
            self._list_into(fd, path, depth, out)
            return out
        finally:
            os.close(fd)

    def _list_into(self, fd: int, path: str, depth: int, out: list[dict[str, Any]]) -> None:
        listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        try:
            names = sorted(os.listdir(listing))
        finally:
            os.close(listing)
        for name in names:
            child = posixpath.join(path, name)
            with contextlib.suppress(VolumeError):  # gone since the listing
                e = self._entry_at(fd, name, child)
                out.append(e)
                if depth > 1 and e["type"] == "directory":
                    sub = os.open(name, _DIR, dir_fd=fd)
                    try:
                        self._list_into(sub, child, depth - 1, out)
                    finally:
                        os.close(sub)

    # --- changes --------------------------------------------------------------------------------------

    def make_dir(self, path: str, uid: int | None, gid: int | None, mode: int | None, force: bool) -> dict[str, Any]:
        if path == "/":
            if force:
                return self.stat("/")
            raise VolumeError(409, "'/' already exists")
        parts = [p for p in path.split("/") if p]
        fd = os.open(self.root, _DIR)
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                sofar = "/" + "/".join(parts[: i + 1])
                if last or force:  # without force, every parent must exist already
                    try:
                        os.mkdir(part, 0o700, dir_fd=fd)  # mode and owner are set below, never through a umask
                        made = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                        try:
                            _own(made, uid, gid, 0o755 if mode is None else mode)
                        finally:
                            os.close(made)
                    except FileExistsError:
                        if last and not force:
                            raise VolumeError(409, f"'{path}' already exists") from None
                nxt = self._step(fd, part, sofar)
                os.close(fd)
                fd = nxt
            return self.entry(path, os.stat(".", dir_fd=fd))
        finally:
            os.close(fd)

    def write(self, path: str, chunks: Iterator[bytes], uid: int | None, gid: int | None, mode: int | None,
              force: bool) -> dict[str, Any]:
        """Write a file from `chunks` (a temporary file renamed over the path: a failed or refused write
        leaves the old file as it was). 409 if it exists and not `force`; 507 when the volume is full."""
        if path == "/":
            raise VolumeError(409, "'/' is a directory")
        fd, name = self._parent(path)
        try:
            try:
                old = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                old = None
            if old is not None and stat.S_ISDIR(old.st_mode):
                raise VolumeError(409, f"'{path}' is a directory")
            if old is not None and not force:
                raise VolumeError(409, f"'{path}' already exists: write with force=True to replace it")
            tmp = f".{name[:200]}.agentcell-{secrets.token_hex(6)}"
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=fd)
            try:
                with os.fdopen(out, "wb", closefd=True) as f:
                    for chunk in chunks:
                        f.write(chunk)
                    f.flush()
                    _own(f.fileno(), uid, gid, 0o644 if mode is None else mode)
                os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException as e:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise VolumeError(507, "the volume is full (its size is its quota): remove files, "
                                           "or make a bigger volume") from None
                raise
            return self._entry_at(fd, name, path)
        finally:
            os.close(fd)

    def open_file(self, path: str) -> int:
        """A readable fd of the regular file `path` (404 if missing or not a regular file)."""
        fd, name = self._parent(path)
        try:
            try:
                f = os.open(name or ".", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                raise _not_found(path) from None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise VolumeError(404, f"'{path}' is a symlink, not a file (links are not followed)") from None
                raise
            if not stat.S_ISREG(os.fstat(f).st_mode):  # a FIFO or device left by a sandbox: never read
                os.close(f)
                raise VolumeError(404, f"'{path}' is not a regular file")
            os.set_blocking(f, True)
            return f
        finally:
            os.close(fd)

    def update(self, path: str, uid: int | None, gid: int | None, mode: int | None) -> dict[str, Any]:
        fd, name = self._parent(path)
        try:
            try:
                st = os.stat(name or ".", dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                raise _not_found(path) from None
            if stat.S_ISLNK(st.st_mode):
                if mode is not None:
                    raise VolumeError(400, f"'{path}' is a symlink: a link has no mode of its own")
                os.chown(name, -1 if uid is None else uid, -1 if gid is None else gid, dir_fd=fd,
                         follow_symlinks=False)  # lchown: the link itself
            else:
                # by an fd opened without following links: a link swapped in since the stat is refused (ELOOP)
                try:
                    f = os.open(name or ".", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
                except OSError as e:
                    raise VolumeError(409, f"'{path}' changed or cannot be opened: {e.strerror}") from None
                try:
                    if uid is not None or gid is not None:
                        os.fchown(f, -1 if uid is None else uid, -1 if gid is None else gid)
                    if mode is not None:
                        os.fchmod(f, mode & 0o7777)
                finally:
                    os.close(f)
            return self._entry_at(fd, name, path)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        if path == "/":
            raise VolumeError(400, "the volume's root cannot be removed (destroy the volume instead)")
        fd, name = self._parent(path)
        try:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                raise _not_found(path) from None
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)  # symlink-safe: walks by fds, never follows a link
            else:
                os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)


def _own(fd: int, uid: int | None, gid: int | None, mode: int) -> None:
    """Owner and mode of what `fd` opened (never by name: a name could be swapped for a symlink)."""
    os.fchown(fd, DEFAULT_IDS[0] if uid is None else uid, DEFAULT_IDS[1] if gid is None else gid)
    os.fchmod(fd, mode & 0o7777)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")
