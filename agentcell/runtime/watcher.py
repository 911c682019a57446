"""Directory watchers of the agent (the ``fs.watch`` / ``fs.watcher_*`` ops), on inotify.

envd watches with fsnotify; this mirrors what it reports. One inotify instance per watcher (the
sandbox's user namespace allows 64 instances and 65536 watches: `backends/linux/ns_limits.py`), at
most MAX_WATCHERS of them per sandbox, so the sandbox's own code keeps most instances. Event types
and numbers are envd's `filesystem.EventType`; a name is the path relative to the watched directory
("sub/file.txt" in a recursive watch). A recursive watcher adds a watch for every directory that
appears later, and reports what a new directory already holds as CREATE (it may be filled before
its watch exists).

Memory is bounded: a streaming watcher reads the inotify queue only while the server takes its
frames, so a client that stops reading leaves the events in the kernel's queue (fs.inotify
.max_queued_events, 16384); a polling watcher keeps at most MAX_PENDING events between two polls.
Past either bound the watcher ends with envd's overflow error, as fsnotify's does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import errno
import os
import secrets
import stat
import struct
from typing import Any

from agentcell.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError, SandboxError
from agentcell.runtime.filesystem import FileSystem, entry_info, os_error

MAX_WATCHERS = 32  # per sandbox (polling and streaming together); the user namespace allows 64 instances
MAX_PENDING = 16384  # events a polling watcher keeps between two polls (the kernel queue's default size)
_READ_SIZE = 64 << 10  # inotify bytes read at once

# envd's filesystem.EventType
CREATE, WRITE, REMOVE, RENAME, CHMOD = 1, 2, 3, 4, 5

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
# fsnotify's mask: everything it maps to Create/Write/Remove/Rename/Chmod
_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len

OVERFLOW = "watcher error: fsnotify: queue or buffer overflow"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _types(mask: int) -> list[int]:
    """envd's event types for one inotify event, in envd's order (fsnotify's mapping)."""
    out = []
    if mask & (IN_CREATE | IN_MOVED_TO):
        out.append(CREATE)
    if mask & (IN_MOVE_SELF | IN_MOVED_FROM):
        out.append(RENAME)
    if mask & IN_ATTRIB:
        out.append(CHMOD)
    if mask & IN_MODIFY:
        out.append(WRITE)
    if mask & (IN_DELETE_SELF | IN_DELETE):
        out.append(REMOVE)
    return out


class WatcherError(SandboxError):
    """The watcher ended (its queue overflowed, or the kernel refused a watch)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "internal")


class Watcher:
    """One watched directory (and, if recursive, every directory below it) on its own inotify fd."""

    def __init__(self, fs: FileSystem, path: str, recursive: bool, include_entry: bool) -> None:
        self.fs = fs
        root = fs.resolve(path)
        try:
            st = os.stat(root)
        except FileNotFoundError:
            raise NotFoundError(f"path {root} not found") from None
        except OSError as e:
            raise os_error(e, root) from None
        if not stat.S_ISDIR(st.st_mode):
            raise InvalidArgumentError(f"path {root} not a directory")
        self.root = root
        self._real_root = os.path.realpath(root)  # uploads name their temp files by real path
        self.recursive = recursive
        self.include_entry = include_entry
        self.error: WatcherError | None = None
        self._dirs: dict[int, str] = {}  # wd -> directory relative to root ("" for root)
        self._moves: dict[int, str] = {}  # cookie -> relative path a directory moved away from
        self._upload_moves: set[int] = set()  # cookies of the agent's own upload renames
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            if err in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                raise ResourceExhaustedError(
                    "no inotify instance left in this sandbox (its processes hold them all); close some "
                    "watchers or processes that watch files") from None
            raise os_error(OSError(err, os.strerror(err)), root) from None
        self.fd = fd
        try:
            self._add(root, "", initial=True)
            if recursive:
                self._add_tree(root, "", report=None)
        except BaseException:
            self.close()
            raise

    # -- watches ------------------------------------------------------------------------------
    def _add(self, full: str, rel: str, initial: bool = False) -> bool:
        wd = _libc.inotify_add_watch(self.fd, os.fsencode(full), _MASK | IN_ONLYDIR)
        if wd < 0:
            err = ctypes.get_errno()
            if err == errno.ENOSPC:
                raise ResourceExhaustedError(
                    f"cannot watch {full}: the sandbox's inotify watch limit (65536) is reached; watch a "
                    "smaller tree or stop other watchers")
            if not initial and err in (errno.ENOENT, errno.ENOTDIR, errno.EACCES):
                return False  # gone or closed again before we got to it
            raise os_error(OSError(err, os.strerror(err)), full)
        self._dirs[wd] = rel
        return True

    def _add_tree(self, full: str, rel: str, report: list[dict[str, Any]] | None) -> None:
        """Watch every directory below `full`; with `report`, add a CREATE for each entry found."""
        try:
            with os.scandir(full) as it:
                children = sorted(it, key=lambda d: d.name)
        except OSError:
            return
        for child in children:
            child_rel = f"{rel}/{child.name}" if rel else child.name
            if report is not None:
                report.append(self._event(child_rel, CREATE))
            try:
                is_dir = child.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir and self._add(child.path, child_rel):
                self._add_tree(child.path, child_rel, report)

    def _forget_below(self, rel: str) -> None:
        for wd, d in list(self._dirs.items()):
            if d == rel or d.startswith(rel + "/"):
                with contextlib.suppress(OSError):
                    _libc.inotify_rm_watch(self.fd, wd)
                del self._dirs[wd]

    def _rename_below(self, old: str, new: str) -> None:
        for wd, d in self._dirs.items():
            if d == old or d.startswith(old + "/"):
                self._dirs[wd] = new + d[len(old):]

    # -- events -------------------------------------------------------------------------------
    def _event(self, rel: str, kind: int, upload_tmp: str | None = None) -> dict[str, Any]:
        event: dict[str, Any] = {"name": rel or ".", "type": kind}
        if self.include_entry:
            full = os.path.join(self.root, rel) if rel else self.root
            with contextlib.suppress(OSError):
                try:
                    event["entry"] = entry_info(full)
                except FileNotFoundError:
                    if upload_tmp is None:
                        raise
                    # an upload not yet renamed into place: its temp file, under the destination's name
                    event["entry"] = {**entry_info(upload_tmp), "name": os.path.basename(full), "path": full}
        return event

    def read(self) -> list[dict[str, Any]]:
        """The events queued now (never blocks); raises WatcherError once the watcher ended."""
        if self.error is not None:
            raise self.error
        out: list[dict[str, Any]] = []
        while True:
            try:
                data = os.read(self.fd, _READ_SIZE)
            except BlockingIOError:
                return out
            except OSError as e:
                self.fail(f"watcher error: {e.strerror or e}")
                raise self.error from None  # type: ignore[misc]
            if not data:
                return out
            self._parse(data, out)
            if len(data) < _READ_SIZE // 2:
                return out

    def _parse(self, data: bytes, out: list[dict[str, Any]]) -> None:
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, cookie, length = _HEADER.unpack_from(data, offset)
            offset += _HEADER.size
            name = data[offset:offset + length].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            offset += length
            if mask & IN_Q_OVERFLOW:
                self.fail(OVERFLOW)
                raise self.error  # type: ignore[misc]
            self._one(wd, mask, cookie, name, out)

    def _one(self, wd: int, mask: int, cookie: int, name: str, out: list[dict[str, Any]]) -> None:
        if mask & IN_IGNORED:
            self._dirs.pop(wd, None)
            return
        directory = self._dirs.get(wd)
        if directory is None:
            return
        if not name and directory:
            # An event of a subdirectory itself: its parent's watch reported it already.
            if mask & IN_MOVE_SELF and directory in self._moves.values():
                self._forget_below(directory)  # moved out of the tree: no longer ours
            return
        rel = f"{directory}/{name}" if directory and name else (name or directory)
        full = os.path.join(self.root, rel) if rel else self.root
        real = os.path.join(self._real_root, rel) if rel else self._real_root
        target = self.fs.upload_target(real)
        upload_tmp = None
        if target is not None:
            # The agent's own upload: a temp file beside the destination, renamed over it. Report it
            # as envd reports its in-place write (CREATE/CHMOD/WRITE of the destination), not the
            # temp file's life.
            if mask & IN_MOVED_FROM:
                self._upload_moves.add(cookie)
                return
            if mask & IN_DELETE:
                return
            rel = os.path.relpath(target, self._real_root)
            upload_tmp = real
        elif mask & IN_MOVED_TO and cookie in self._upload_moves:
            self._upload_moves.discard(cookie)
            return
        for kind in _types(mask):
            out.append(self._event(rel, kind, upload_tmp))
        if self.recursive and mask & IN_ISDIR:
            if mask & IN_MOVED_FROM:
                self._moves[cookie] = rel
                if len(self._moves) > 256:
                    self._moves.pop(next(iter(self._moves)))
            elif mask & IN_MOVED_TO and cookie in self._moves:
                self._rename_below(self._moves.pop(cookie), rel)
            elif mask & (IN_CREATE | IN_MOVED_TO) and self._add(full, rel):
                self._add_tree(full, rel, out)

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = WatcherError(message)
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1

    async def readable(self) -> None:
        """Until the inotify fd has events."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        loop.add_reader(self.fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            if self.fd >= 0:
                loop.remove_reader(self.fd)


class PollingWatcher:
    """A watcher of envd's CreateWatcher: reads its events as they come and keeps them for the next
    GetWatcherEvents, at most MAX_PENDING (then it ends with envd's overflow error)."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher
        self.pending: collections.deque[dict[str, Any]] = collections.deque()
        asyncio.get_running_loop().add_reader(watcher.fd, self.pump)

    def pump(self) -> None:
        w = self.watcher
        if w.error is not None:
            return
        try:
            self.pending.extend(w.read())
        except WatcherError:
            self.pending.clear()
            return
        if len(self.pending) > MAX_PENDING:
            self.pending.clear()
            w.fail(OVERFLOW)

    def take(self) -> list[dict[str, Any]]:
        self.pump()
        if self.watcher.error is not None:
            raise self.watcher.error
        events = list(self.pending)
        self.pending.clear()
        return events


class Watchers:
    """The sandbox's watchers: polling ones by id, streaming ones counted, MAX_WATCHERS together."""

    def __init__(self, fs: FileSystem) -> None:
        self.fs = fs
        self.polling: dict[str, PollingWatcher] = {}
        self.streaming = 0

    def _check_room(self) -> None:
        if len(self.polling) + self.streaming >= MAX_WATCHERS:
            raise ResourceExhaustedError(
                f"this sandbox already has {MAX_WATCHERS} directory watchers, the most it may have; stop one "
                "(WatchHandle.stop()) before watching another directory")

    def open_stream(self, path: str, recursive: bool, include_entry: bool) -> Watcher:
        self._check_room()
        watcher = Watcher(self.fs, path, recursive, include_entry)
        self.streaming += 1
        return watcher

    def close_stream(self, watcher: Watcher) -> None:
        watcher.close()
        self.streaming -= 1

    def create(self, path: str, recursive: bool, include_entry: bool) -> str:
        self._check_room()
        watcher_id = "w" + secrets.token_hex(8)
        self.polling[watcher_id] = PollingWatcher(Watcher(self.fs, path, recursive, include_entry))
        return watcher_id

    def _get(self, watcher_id: Any) -> PollingWatcher:
        found = self.polling.get(watcher_id) if isinstance(watcher_id, str) else None
        if found is None:
            raise NotFoundError(f"watcher with id {watcher_id} not found")
        return found

    def events(self, watcher_id: Any) -> list[dict[str, Any]]:
        return self._get(watcher_id).take()

    def remove(self, watcher_id: Any) -> None:
        self._get(watcher_id).watcher.close()
        del self.polling[watcher_id]

    def pump(self) -> None:
        """Read what the polling watchers have queued now: after a file op, so that a recursive
        watcher watches a directory the op created before the op's answer goes out."""
        for polling in self.polling.values():
            polling.pump()

    def close(self) -> None:
        for polling in self.polling.values():
            polling.watcher.close()
        self.polling.clear()
