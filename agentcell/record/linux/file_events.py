"""The file collector of the behaviour record (issue 10): what a sandbox creates, writes, deletes,
renames and chmods on its disk, seen by fanotify from the host.

Every place a sandbox can write (/home/user, /tmp, /dev/shm and the upper layers of its copy-on-write
overlays over /usr, /etc, /var ...) is a directory of ONE tmpfs, its disk (rootfs.finish). So one
filesystem mark (FAN_MARK_FILESYSTEM) on that tmpfs sees every change the sandbox makes, whatever mount,
bind or overlay it went through, and nothing else: another sandbox's disk is another superblock, and
the host's files are never on it. The group reports file handles (FAN_REPORT_DFID_NAME + TARGET_FID),
which the collector turns back into paths with open_by_handle_at on the disk's root, then into the
paths the sandbox sees (home -> /home/user, .root/<n>/up -> rootfs.OVERLAYS[n] ...).

One fanotify group per sandbox: its queue is its own (a flood overflows only the flooder's queue, and
the overflow is reported to it as record.dropped), at 2 fds per sandbox (the group and the disk's root).
A write is seen when the file opened for writing is closed (FAN_CLOSE_WRITE; `count`: how many such
closes), not at each write(2): a FAN_MODIFY per write cost the writing process ~1.2 µs in the kernel
(+12 % on a shell loop of 2,000 `echo > file`), a close costs ~1.6 µs once per open. So a file a
process keeps open is recorded when it closes it, exits or is killed with its sandbox, and a path
truncate(2) alone is not seen. Writes are coalesced per file (one file.write {size, count} once the
file is quiet), and each sandbox has bounded state (pending writes, path cache) and a rate limit;
what is cut is counted (record.dropped).

Overlay internals are translated: a copy-up (the lower file linked into the upper layer, the
`trusted.overlay.origin` xattr on it) is no create; a whiteout renamed into the upper layer is a delete;
what happens in an overlay's work directory is not the sandbox's doing and is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import stat
import struct
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from agentcell.backends.linux import host_settings, rootfs
from agentcell.record.events import EventSink, event
from agentcell.record.linux.target import WatchTarget, nspid

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
MAX_GROUPS = "fs.fanotify.max_user_groups"  # fanotify groups per user (the host's root: all servers')
_META = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
# an info record's header, fsid and file handle's header: info_type, pad, len, fsid (2 x int),
# handle_bytes, handle_type; then f_handle, then (for a DFID_NAME) the name and its NUL
_INFO_FID = struct.Struct("=BBHiiIi")

INIT_FLAGS = (FAN_CLOEXEC | FAN_NONBLOCK | FAN_REPORT_FID | FAN_REPORT_DIR_FID | FAN_REPORT_NAME
              | FAN_REPORT_TARGET_FID)
MASK = FAN_CREATE | FAN_DELETE | FAN_RENAME | FAN_CLOSE_WRITE | FAN_ATTRIB | FAN_ONDIR


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
    """Decode what one read() of a FID-reporting group returned (hot: a few µs an event)."""
    out: list[Raw] = []
    meta, info = _META.unpack_from, _INFO_FID.unpack_from
    pos, end = 0, len(buf)
    while pos + 24 <= end:
        length, vers, _, meta_len, mask, fd, pid = meta(buf, pos)
        if vers != METADATA_VERSION or length < meta_len or pos + length > end:
            break
        if fd >= 0:  # never asked for (FID mode reports no fds), closed all the same
            os.close(fd)
        raw = Raw(mask, pid)
        at, stop = pos + meta_len, pos + length
        while at + 16 <= stop:
            kind, _, ilen, f0, f1, hbytes, _ = info(buf, at)
            if ilen < 16:
                break
            h1 = at + 20 + hbytes
            handle = buf[at + 12:h1]
            raw.fsid = (f0, f1)
            if kind == INFO_FID:
                raw.fid = handle
            elif kind == INFO_NEW_DFID_NAME:
                raw.new_dir = handle
                raw.new_name = buf[h1:buf.index(0, h1, at + ilen)].decode(errors="surrogateescape")
            else:  # DFID_NAME, DFID, OLD_DFID_NAME
                raw.dir = handle
                if kind != INFO_DFID:
                    raw.name = buf[h1:buf.index(0, h1, at + ilen)].decode(errors="surrogateescape")
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


# -- the collector ---------------------------------------------------------------------------------
QUIET_S = 0.2  # a file nobody closed after writing for this long: its coalesced file.write goes out
MAX_AGE_S = 5.0  # a file written and closed without pause: a file.write every so often all the same
TICK_S = 0.2  # how often pending writes are looked at (only while some are pending)
MAX_PENDING = 512  # coalesced writes kept per sandbox; beyond, the oldest goes out at once
PATH_CACHE = 4096  # directory handle -> path entries kept per sandbox ...
PATH_CACHE_BYTES = 256 << 10  # ... and their characters at most (a path may be 4 KiB long)
RATE = 1000.0  # events/s a sandbox may put in its record, sustained ...
BURST = 10_000.0  # ... and at once; beyond, they are counted and reported as record.dropped
BATCH_S = 0.05  # a woken reader waits this long first: events pile up (and the kernel merges them) so
# that a busy sandbox costs 20 wake-ups a second, not one per event (its queue holds 16,384)
FLOOD_PAUSE_S = 0.5  # ... and a sandbox over its rate waits this long
READ_SIZE = 4 << 10  # per read(): ~60 events, ~0.6 ms to handle ...
READS_PER_SLICE = 1  # ... then the loop serves others before reading on
SLICE_S = 0.001  # pending writes are sent this long at a time
HOLD_MAX = 8192  # events kept for the next turn while their directory's delete is not read yet
UNWATCH_READS = 1024  # what unwatch reads of a queue the sandbox filled before it ended
WHITEOUT = "whiteout"
_UNKNOWN = "path unknown (its directory was gone before the collector looked)"
_ORIGIN = "trusted.overlay.origin"  # on a file or directory an overlay copied up from its lower layer
_OPAQUE = "trusted.overlay.opaque"  # on a directory made where a lower one was deleted

# disk directory -> the sandbox's path (rootfs._WRITABLE), and .root/<n>/up -> rootfs.OVERLAYS[n]
_PLACES = {name: target for target, name, _ in rootfs._WRITABLE}
_OVERLAY_PATHS = tuple(path for path, _ in rootfs.OVERLAYS)


def sandbox_path(disk_path: str) -> str | None:
    """The path a sandbox sees for `disk_path` (relative to its disk's root, as readlink shows it);
    None for the disk's own internals (overlay work directories, .boot_id ...)."""
    parts = disk_path.split("/", 4)  # "", first, second, third, rest
    first = parts[1] if len(parts) > 1 else ""
    if first in _PLACES:
        rest = disk_path[len(first) + 1:]
        return _PLACES[first] + rest
    if first == ".root" and len(parts) > 3 and parts[3] == "up" and parts[2].isdigit():
        n = int(parts[2])
        if n < len(_OVERLAY_PATHS):
            return _OVERLAY_PATHS[n] + ("/" + parts[4] if len(parts) > 4 else "")
    return None


def _in_work(disk_path: str) -> bool:
    parts = disk_path.split("/", 4)
    return len(parts) > 3 and parts[1] == ".root" and parts[3] == "work"


def _in_upper(disk_path: str) -> bool:
    parts = disk_path.split("/", 4)
    return len(parts) > 3 and parts[1] == ".root" and parts[3] == "up"


@dataclass(slots=True)
class _Write:
    path: str
    first: float
    last: float
    host_pid: int
    pid: int | None
    count: int = 0


@dataclass(slots=True)
class _Watched:
    target: WatchTarget
    group: int
    root: int  # the disk's root, opened for open_by_handle_at (an O_PATH fd is not enough there)
    pid_depth: int  # the sandbox's pid namespace: its level in a process's NSpid
    pidns: int  # ... and its inode
    paths: OrderedDict[bytes, str] = field(default_factory=OrderedDict)  # dir handle -> disk path
    path_chars: int = 0  # the cached paths' length, summed
    writes: OrderedDict[bytes, _Write] = field(default_factory=OrderedDict)  # file handle -> pending
    internal: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # overlays' work files
    modes: OrderedDict[bytes, tuple[int, int, int]] = field(default_factory=OrderedDict)  # dir -> mode, owner
    tokens: float = BURST
    refilled: float = field(default_factory=time.monotonic)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> events not recorded
    pids: dict[int, int | None] = field(default_factory=dict)  # host pid -> sandbox pid, per batch
    gone: dict[bytes, tuple[bytes, str]] = field(default_factory=dict)  # dirs the batch removes
    held: list[Raw] = field(default_factory=list)  # events waiting for the next turn
    events: int = 0  # fanotify events read (for the benchmark)
    reading: bool = False  # the loop watches its group's fd
    later: asyncio.Handle | None = None  # ... or a read is scheduled


class FileCollector:
    """The file collector (record.Collector): one fanotify group per watched sandbox."""

    def __init__(self, sink: EventSink, *, rate: float = RATE, burst: float = BURST,
                 max_pending: int = MAX_PENDING, tune_sysctl: bool = True) -> None:
        self.sink = sink
        self.rate = rate
        self.burst = burst
        self.max_pending = max_pending
        self.tune_sysctl = tune_sysctl  # raise fs.fanotify.max_user_groups when groups run out
        self._groups_holder: host_settings.Holder | None = None  # our hold on that raise
        self._watched: dict[str, _Watched] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.Handle | None = None  # the next _tick (later, or soon to go on)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def close(self) -> None:
        for sandbox_id in list(self._watched):
            self.unwatch(sandbox_id)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._groups_holder is not None:  # its groups are closed: the raised limit can go back
            self._groups_holder.close()
            self._groups_holder = None

    # -- watch / unwatch ---------------------------------------------------------------------------
    def watch(self, target: WatchTarget) -> None:
        if target.sandbox_id in self._watched:
            return
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        try:
            group, root = self._mark(target)
        except OSError as e:  # the sandbox runs all the same; its record says what it lacks
            print(f"agentcell: no file events for sandbox {target.sandbox_id}: {e}", file=sys.stderr, flush=True)
            self.sink(target.sandbox_id, event("record.dropped", count=1, collector="file",
                                               reason=f"no file events for this sandbox: {e.strerror or e}"))
            return
        depth, pidns = _pidns(target.host_pid)
        w = _Watched(target, group, root, depth, pidns, tokens=self.burst)
        self._watched[target.sandbox_id] = w
        loop.add_reader(group, self._readable, w)
        w.reading = True

    def claimed(self, sandbox_id: str) -> None:
        """Nothing a claim changes matters here (record.Collector)."""

    def unwatch(self, sandbox_id: str) -> None:
        """Read what is still queued, send every pending write, forget the sandbox. Call it once the
        sandbox's processes are dead (or its last events may come after)."""
        w = self._watched.pop(sandbox_id, None)
        if w is None:
            return
        assert self._loop is not None
        if w.reading:
            self._loop.remove_reader(w.group)
        if w.later is not None:
            w.later.cancel()
        try:
            for _ in range(UNWATCH_READS // READS_PER_SLICE):
                if not self._read(w, READS_PER_SLICE):
                    break
            self._flush(w, None)
        except Exception as e:  # called from a kill: never fails it
            print(f"agentcell: file events of {sandbox_id}: {e!r}", file=sys.stderr, flush=True)
        finally:
            # Closing a fanotify group waits for the kernel's SRCU grace period (~10 ms): off the loop.
            # The disk's root goes with it, after: the tmpfs (and its memory) is freed once both are closed.
            self._loop.run_in_executor(None, _close_all, w.group, w.root)

    def _mark(self, target: WatchTarget) -> tuple[int, int]:
        """A group marking the sandbox's disk, and the disk's root opened for open_by_handle_at."""
        root = os.open(f"/proc/self/fd/{target.disk_fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            group = self._new_group()
            try:
                mark_filesystem(group, root)
            except BaseException:
                os.close(group)
                raise
        except BaseException:
            os.close(root)
            raise
        return group, root

    def _new_group(self) -> int:
        try:
            return fanotify_init()
        except OSError as e:
            if e.errno != errno.EMFILE or not self.tune_sysctl:
                raise
        # 128 by default: far below 1,000 sandboxes. A shared host setting (host_settings.py): the last
        # server to let go of it puts the original back (docs/host-changes.md)
        if self._groups_holder is None:
            self._groups_holder = host_settings.Holder("file-events")

        def raise_it(_original: Any, _holders: host_settings.Holders) -> None:
            current = int(host_settings.sysctl(MAX_GROUPS).read())
            host_settings.write_sysctl(MAX_GROUPS, str(current + 1024))
            print(f"agentcell: raised {MAX_GROUPS} to {current + 1024} (one group per sandbox; put back at stop)",
                  file=sys.stderr, flush=True)

        self._groups_holder.hold(host_settings.sysctl(MAX_GROUPS), raise_it)
        return fanotify_init()

    def stats(self, sandbox_id: str) -> dict[str, Any]:
        """What the collector holds for a sandbox (tests and benchmarks)."""
        w = self._watched[sandbox_id]
        return {"pending": len(w.writes), "paths": len(w.paths), "path_chars": w.path_chars, "events": w.events,
                "dropped": dict(w.dropped)}

    # -- reading -------------------------------------------------------------------------------------
    def _readable(self, w: _Watched) -> None:
        assert self._loop is not None
        self._loop.remove_reader(w.group)
        w.reading = False
        w.later = self._loop.call_later(BATCH_S, self._drain, w)

    def _drain(self, w: _Watched) -> None:
        assert self._loop is not None
        w.later = None
        try:
            if self._read(w, READS_PER_SLICE):  # more queued: after the others had their turn
                w.later = self._loop.call_soon(self._drain, w)
        except Exception as e:  # a collector bug must not take the server's loop down
            print(f"agentcell: file events of {w.target.sandbox_id}: {e!r}", file=sys.stderr, flush=True)
        if w.later is None and w.tokens < 1:
            # over its rate: its queue is read less often, the kernel merges (and at worst drops and
            # counts) its events, so that a flooding sandbox costs the server little
            w.later = self._loop.call_later(FLOOD_PAUSE_S, self._drain, w)
        if w.later is None:
            self._loop.add_reader(w.group, self._readable, w)
            w.reading = True
        self._arm()

    def _read(self, w: _Watched, reads: int) -> bool:
        """Up to `reads` reads of the queue, then their events in order; True if more may be queued."""
        raws, w.held = w.held, []
        held = len(raws)
        more = True
        for _ in range(reads):
            got = read_events(w.group, READ_SIZE)
            if not got:
                more = False
                break
            raws += got
        if not raws:
            return False
        now = time.time()
        w.pids.clear()
        w.events += len(raws) - held
        # the directories these events remove, by handle: the events of their files, which come first,
        # are named through them (`rm -rf` of a tree the collector never saw made: gone when it looks)
        w.gone = {r.fid: (r.dir, r.name) for r in raws
                  if r.mask & FAN_DELETE and r.mask & FAN_ONDIR and r.fid and r.dir}
        for i, raw in enumerate(raws):
            if not self._handle(w, raw, now, final=not more or len(raws) - i > HOLD_MAX):
                # its directory is gone and its delete not read yet: this and what follows wait for
                # the next turn (in order), which reads on
                w.held = raws[i:]
                return True
        return more

    def _handle(self, w: _Watched, raw: Raw, now: float, final: bool = True) -> bool:
        """One event into the record; False (and nothing done) if its directory is unknown yet and
        not `final`."""
        mask = raw.mask
        if mask & FAN_Q_OVERFLOW:
            _count(w, "kernel queue overflow (each loses an unknown number of events)")
            return True
        is_dir = bool(mask & FAN_ONDIR)
        if mask & FAN_RENAME:
            if not self._rename(w, raw, now, is_dir, final):
                return False
            mask &= ~FAN_RENAME
            if not mask & ~FAN_ONDIR:
                return True
            final = True
        if not raw.dir:
            return True  # e.g. the link count of a file already unlinked: its delete said it all
        if not mask & FAN_CLOSE_WRITE and not self._has_token(w):
            _count(w, self._over_rate)  # spare the lookups: it would not be recorded anyway
            return True
        parent = self._dir_path(w, raw.dir)
        if parent is None:
            if not final:
                return False
            _count(w, _UNKNOWN)
            return True
        if _in_work(parent):
            if mask & FAN_CREATE and raw.fid:
                _remember(w.internal, raw.fid, 256)  # a copy-up's or a whiteout's first steps
            return True
        disk_path = parent if raw.name in ("", ".") else f"{parent}/{raw.name}"
        path = sandbox_path(disk_path)
        if path is None:
            return True
        create = bool(mask & FAN_CREATE)
        if create and raw.name not in ("", "."):
            if is_dir and raw.fid:
                _cache_path(w, raw.fid, disk_path)
            if _in_upper(parent) and raw.fid and self._copied_up(w, raw.fid):
                create = False  # the overlay brought a lower file up: no create of the sandbox's
            if create:
                # the kernel merged a create and a delete of this name: in which order, the entry says
                if mask & FAN_DELETE and self._exists(w, raw.dir, raw.name):
                    self._delete(w, raw, now, path, is_dir)
                    mask &= ~FAN_DELETE
                self._emit(w, "file.create", raw.pid, now, path=path, **_dir(is_dir))
        if mask & FAN_CLOSE_WRITE and raw.fid and not is_dir:
            self._wrote(w, raw, now, path)
        if mask & FAN_ATTRIB and not (mask & FAN_CREATE and create):
            self._attrib(w, raw, now, path, parent)
        if mask & FAN_DELETE:
            self._delete(w, raw, now, path, is_dir)
        return True

    def _rename(self, w: _Watched, raw: Raw, now: float, is_dir: bool, final: bool) -> bool:
        old_parent = self._dir_path(w, raw.dir) if raw.dir else None
        new_parent = self._dir_path(w, raw.new_dir) if raw.new_dir else None
        if old_parent is None or new_parent is None:
            if not final:
                return False
            _count(w, _UNKNOWN)
            return True
        old_disk, new_disk = f"{old_parent}/{raw.name}", f"{new_parent}/{raw.new_name}"
        if is_dir:  # the cached paths below it are stale now: forgotten (all of them, cheaper, in a flood)
            if len(w.paths) > 512 or not self._has_token(w):
                w.paths.clear()
                w.path_chars = 0
            for key in [k for k, p in w.paths.items() if p == old_disk or p.startswith(old_disk + "/")]:
                w.path_chars -= len(w.paths.pop(key))
            if raw.fid:
                _cache_path(w, raw.fid, new_disk)
        to = sandbox_path(new_disk)
        if _in_work(old_parent):
            # the last step of an overlay's work: a whiteout (a delete), a file made where a lower one
            # was deleted, a directory made so (opaque) or copied up (neither: nothing of the sandbox's)
            if to is None or not raw.fid:
                return True
            kind = self._upper_kind(w, raw.fid, is_dir)
            if kind == WHITEOUT:
                self._emit(w, "file.delete", raw.pid, now, path=to)
            elif kind == "new":
                self._emit(w, "file.create", raw.pid, now, path=to, **_dir(is_dir))
            return True
        path = sandbox_path(old_disk)
        if path is None or to is None:
            return True  # into the work directory: the other half of an overlay's exchange
        if raw.fid and not is_dir:
            self._flush_one(w, raw.fid)
        self._emit(w, "file.rename", raw.pid, now, path=path, to=to, **_dir(is_dir))
        return True

    def _delete(self, w: _Watched, raw: Raw, now: float, path: str, is_dir: bool) -> None:
        if raw.fid:
            if is_dir and raw.fid in w.paths:
                w.path_chars -= len(w.paths.pop(raw.fid))
            else:
                self._flush_one(w, raw.fid)
        self._emit(w, "file.delete", raw.pid, now, path=path, **_dir(is_dir))

    def _wrote(self, w: _Watched, raw: Raw, now: float, path: str) -> None:
        """A file opened for writing was closed: one more write to its coalesced file.write."""
        pending = w.writes.get(raw.fid)
        if pending is None:
            if len(w.writes) >= self.max_pending:
                self._flush_one(w, next(iter(w.writes)))
            pending = _Write(path, now, now, raw.pid, self._pid(w, raw.pid))
            w.writes[raw.fid] = pending
        pending.path = path
        pending.count += 1
        pending.last = now

    def _attrib(self, w: _Watched, raw: Raw, now: float, path: str, parent: str) -> None:
        """A mode, owner or time change: recorded as file.chmod when it was not only the times (a write
        or `touch` leaves ctime == mtime; chmod and chown move ctime alone). A directory's: when its
        mode or owner is not what the collector saw before (an overlay sets the times of the upper
        directories it copies into); a directory in an overlay it never saw before is not reported."""
        own = raw.name in ("", ".")
        key = raw.dir if own else raw.fid
        if not key or key in w.internal:
            return
        st = self._stat(w, key)
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode):
            seen = w.modes.get(key)
            now_mode = (st.st_mode, st.st_uid, st.st_gid)
            _remember(w.modes, key, PATH_CACHE, now_mode)
            if seen == now_mode or (seen is None and (_in_upper(parent) or st.st_ctime_ns == st.st_mtime_ns)):
                return
        elif st.st_ctime_ns == st.st_mtime_ns:
            return
        self._emit(w, "file.chmod", raw.pid, now, path=path, mode=f"{stat.S_IMODE(st.st_mode):04o}",
                   **_dir(stat.S_ISDIR(st.st_mode)))

    # -- pending writes ------------------------------------------------------------------------------
    def _flush_one(self, w: _Watched, fid: bytes) -> None:
        pending = w.writes.pop(fid, None)
        if pending is not None:
            self._emit_write(w, fid, pending)

    def _emit_write(self, w: _Watched, fid: bytes, p: _Write) -> None:
        st = self._stat(w, fid)
        self._emit(w, "file.write", p.host_pid, p.last, p.pid, path=p.path,
                   size=st.st_size if st is not None else None, count=p.count, first=p.first)

    def _flush(self, w: _Watched, now: float | None, until: float | None = None) -> bool:
        """Send the pending writes that are due (all when `now` is None), and what was dropped; with
        `until` (monotonic), stop then: True if it stopped with some due ones left."""
        for n, (fid, p) in enumerate(list(w.writes.items())):
            if until is not None and n % 16 == 15 and time.monotonic() > until:
                return True
            if now is None or now - p.last >= QUIET_S or now - p.first >= MAX_AGE_S:
                del w.writes[fid]
                self._emit_write(w, fid, p)
        for reason, count in w.dropped.items():
            self.sink(w.target.sandbox_id, event("record.dropped", count=count, reason=reason, collector="file"))
        w.dropped.clear()
        return False

    def _arm(self) -> None:
        if self._timer is None and self._loop is not None and any(
                w.writes or w.dropped for w in self._watched.values()):
            self._timer = self._loop.call_later(TICK_S, self._tick)

    def _tick(self) -> None:
        """The due writes go out, SLICE_S of them at a time (a build's hundreds of files come due
        together): what is left goes on after whatever else the loop has ready."""
        assert self._loop is not None
        self._timer = None
        now, until = time.time(), time.monotonic() + SLICE_S
        for w in [w for w in self._watched.values() if w.writes or w.dropped]:
            try:
                if self._flush(w, now, until):
                    self._timer = self._loop.call_soon(self._tick)
                    return
            except Exception as e:
                print(f"agentcell: file events of {w.target.sandbox_id}: {e!r}", file=sys.stderr, flush=True)
        self._arm()

    # -- output --------------------------------------------------------------------------------------
    @property
    def _over_rate(self) -> str:
        return f"over the file events rate ({self.rate:g}/s, bursts of {self.burst:g})"

    def _has_token(self, w: _Watched) -> bool:
        mono = time.monotonic()
        w.tokens = min(self.burst, w.tokens + (mono - w.refilled) * self.rate)
        w.refilled = mono
        return w.tokens >= 1

    def _emit(self, w: _Watched, kind: str, host_pid: int, at: float, pid: int | None = -1,
              **fields: Any) -> None:
        """Into the sink, within the sandbox's rate (a token bucket); what is over it is counted."""
        if not self._has_token(w):
            _count(w, self._over_rate)
            return
        w.tokens -= 1
        if pid == -1:
            pid = self._pid(w, host_pid)
        for key in ("path", "to"):  # names are bytes: valid text for JSON and SQLite, whatever they hold
            value = fields.get(key)
            if value is not None and not value.isascii():
                fields[key] = value.encode(errors="surrogateescape").decode(errors="backslashreplace")
        self.sink(w.target.sandbox_id, event(kind, pid=pid, at=at, host_pid=host_pid, **fields))

    # -- the kernel's answers --------------------------------------------------------------------------
    def _dir_path(self, w: _Watched, handle: bytes, depth: int = 0) -> str | None:
        """A directory handle's path on the disk ("/home/x"), from the cache, the kernel, or (removed
        already) the batch's own delete of it."""
        path = w.paths.get(handle)
        if path is not None:
            w.paths.move_to_end(handle)
            return path
        try:
            fd = open_handle(w.root, handle)
        except OSError:  # gone already (ESTALE)
            return self._removed_dir_path(w, handle, depth)
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
            st = os.fstat(fd)
        finally:
            os.close(fd)
        _remember(w.modes, handle, PATH_CACHE, (st.st_mode, st.st_uid, st.st_gid))
        if st.st_nlink == 0:  # removed meanwhile: readlink says "... (deleted)"
            return self._removed_dir_path(w, handle, depth)
        _cache_path(w, handle, path)
        return path

    def _removed_dir_path(self, w: _Watched, handle: bytes, depth: int) -> str | None:
        where = w.gone.get(handle)
        if where is None or depth > 64:
            return None
        parent = self._dir_path(w, where[0], depth + 1)
        if parent is None:
            return None
        path = f"{parent}/{where[1]}"
        _cache_path(w, handle, path)
        return path

    def _stat(self, w: _Watched, handle: bytes) -> os.stat_result | None:
        try:
            fd = open_handle(w.root, handle)
        except OSError:
            return None
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def _exists(self, w: _Watched, dir_handle: bytes, name: str) -> bool:
        try:
            fd = open_handle(w.root, dir_handle)
        except OSError:
            return False
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def _xattrs(self, w: _Watched, handle: bytes) -> tuple[os.stat_result, set[str]] | None:
        try:
            fd = open_handle(w.root, handle)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            try:  # through the magic link: an O_PATH fd has no f*xattr
                names = set(os.listxattr(f"/proc/self/fd/{fd}"))
            except OSError:
                names = set()
            return st, names
        finally:
            os.close(fd)

    def _copied_up(self, w: _Watched, fid: bytes) -> bool:
        found = self._xattrs(w, fid)
        return found is not None and _ORIGIN in found[1]

    def _upper_kind(self, w: _Watched, fid: bytes, is_dir: bool) -> str:
        """What an overlay renamed from its work directory into an upper one: "whiteout", "new" (made
        by the sandbox) or "copy" (a copy-up)."""
        found = self._xattrs(w, fid)
        if found is None:
            return "copy"
        st, names = found
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            return WHITEOUT
        if is_dir:
            return "new" if _OPAQUE in names else "copy"
        return "copy" if _ORIGIN in names else "new"

    def _pid(self, w: _Watched, host_pid: int) -> int | None:
        """The sandbox's number for a host pid, while the process lives (NSpid); None for a process
        outside the sandbox's pid namespace (host root's own writes) or gone."""
        if host_pid <= 0:
            return None
        if host_pid in w.pids:
            return w.pids[host_pid]
        ns = nspid(host_pid)
        pid = ns[w.pid_depth] if ns is not None and len(ns) > w.pid_depth and w.pid_depth > 0 else None
        if pid is not None and _pidns(host_pid)[1] != w.pidns:
            pid = None  # a sibling namespace at the same level (or the pid was reused meanwhile)
        w.pids[host_pid] = pid
        return pid


def _dir(is_dir: bool) -> dict[str, Any]:
    return {"dir": True} if is_dir else {}


def _cache_path(w: _Watched, handle: bytes, path: str) -> None:
    old = w.paths.pop(handle, None)
    if old is not None:
        w.path_chars -= len(old)
    w.paths[handle] = path
    w.path_chars += len(path)
    while len(w.paths) > PATH_CACHE or w.path_chars > PATH_CACHE_BYTES:
        w.path_chars -= len(w.paths.popitem(last=False)[1])


def _count(w: _Watched, reason: str) -> None:
    w.dropped[reason] = w.dropped.get(reason, 0) + 1


def _remember(cache: OrderedDict[bytes, Any], key: bytes, limit: int, value: Any = None) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


def _pidns(pid: int) -> tuple[int, int]:
    """(the level of `pid`'s pid namespace, where its numbers stand in NSpid; the namespace's inode)."""
    ns = nspid(pid)
    try:
        ino = os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        ino = -1
    return (len(ns) - 1 if ns else 0), ino


def _close_all(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
