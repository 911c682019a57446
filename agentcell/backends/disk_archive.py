"""Disk archives: a sandbox's writable files as one pax tar (E2B's filesystem snapshots).

A sandbox's disk is one tmpfs (backends/linux/rootfs.py) holding `home` (/home/user), `tmp` (/tmp),
`shm` (/dev/shm: memory, never archived) and `.root/<n>/up`, the upper layer of the copy-on-write
overlay over the n-th of the backend's overlay paths (/usr, /etc, /var ...). The archive names them

    home/...                  /home/user
    tmp/...                   /tmp
    root/<overlay path>/...   what the sandbox changed under that path, e.g. root/usr/local/bin/x

Entries: directories, regular files, symlinks (kept as links, never followed), hard links (to an
earlier entry of the same place), fifos and overlay whiteouts (character devices 0:0: a file of the
host's tree that the sandbox deleted). An overlay directory that replaced a host one (deleted and made
again: xattr trusted.overlay.opaque=y) carries the pax header AGENTCELL.opaque=y. Owners are the
sandbox's, not the host's: 1000 (its user) or 0 (its root); modes and mtimes (whole seconds) are kept.

The tree being read (a hostile sandbox's) and the archive being extracted (made by anyone who got a
file to the server) are both untrusted, and both functions run as host root. So they work only
through directory file descriptors: every component is opened with openat(O_NOFOLLOW | O_DIRECTORY)
from the disk's root fd, every opened directory must be on the disk's own filesystem (st_dev), and new
entries are made with O_CREAT | O_EXCL | O_NOFOLLOW, mkdirat, symlinkat, linkat without
AT_SYMLINK_FOLLOW. No path is ever resolved from "/", and no symlink is ever followed: what a name
points to cannot matter, by construction.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

from agentcell.errors import InvalidArgumentError, ResourceExhaustedError

SANDBOX_USER = 1000  # the sandbox's own ids in an archive: its user, else 0 (its root)
OPAQUE_XATTR = "trusted.overlay.opaque"
OPAQUE_PAX = "AGENTCELL.opaque"
MAX_DEPTH = 512  # directory levels; one open fd per level while walking
_CHUNK = 1 << 20

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a name that turned into a fifo since its lstat must not hang the walk
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# what a name that changed since it was listed gives (the sandbox may run during an export): gone, a
# symlink now (ELOOP), a whiteout or socket (ENXIO, ENODEV, EACCES on the nodev disk)
_CHANGED = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.EACCES, errno.EINVAL)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


class Owners(NamedTuple):
    """The sandbox user's host ids: files they own are the sandbox's 1000, any other owner its 0."""

    uid: int
    gid: int


@dataclass(frozen=True, slots=True)
class _Place:
    name: str  # in the archive: "home", "tmp", "root/usr" ...
    disk: tuple[str, ...]  # on the disk: ("home",), (".root", "0", "up") ...
    overlay: bool  # an overlay's upper layer (whiteouts and opaque dirs mean something there)
    skip: frozenset[tuple[str, ...]] = frozenset()  # subtrees that are another overlay's (hidden by its mount)


def places(overlays: Sequence[str], mount_points: Sequence[str] = ()) -> list[_Place]:
    """home, tmp, then one place per overlay path (`overlays[n]` is the upper layer .root/<n>/up).
    `mount_points`: paths inside the overlays that the runtime mounts onto, left out of the walk."""
    found = [_Place("home", ("home",), False), _Place("tmp", ("tmp",), False)]
    for n, path in enumerate(overlays):
        parts = _components(path)
        skip = frozenset(tuple(_components(o))[len(parts):] for o in [*overlays, *mount_points]
                         if o != path and tuple(_components(o))[:len(parts)] == tuple(parts))
        found.append(_Place("/".join(("root", *parts)), (".root", str(n), "up"), True, skip))  # "/": root/...
    return found


def _components(path: str) -> list[str]:
    return [p for p in path.split("/") if p]


# -- writing ---------------------------------------------------------------------------------------


class _Limited:
    """The archive's output: counts what is written and stops past max_bytes."""

    def __init__(self, out: BinaryIO, max_bytes: int) -> None:
        self.out = out
        self.max_bytes = max_bytes
        self.written = 0

    def check(self, more: int) -> None:
        if self.written + more > self.max_bytes:
            raise ResourceExhaustedError(
                f"the sandbox's files take more than the {self.max_bytes} bytes a filesystem snapshot may "
                "hold; delete files (e.g. caches in /tmp or ~/.cache) and try again")

    def write(self, data: bytes) -> int:
        self.check(len(data))
        self.out.write(data)
        self.written += len(data)
        return len(data)

    def tell(self) -> int:
        return self.written


class _Exactly:
    """`size` bytes of an open file: zeros after an early end (a file that shrank while read), never
    more (one that grew), so that the tar entry always matches its header."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.left = size
        self.ended = False

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = b"" if self.ended or n == 0 else os.read(self.fd, n)
        if not data and n:
            self.ended = True
            data = bytes(n)
        self.left -= len(data)
        return data


def _open_dir(parent: int, name: str, dev: int) -> int | None:
    """`name` in `parent` as a directory fd, if it is one on the disk's filesystem (never a symlink's
    target: O_NOFOLLOW); None if it is gone or anything else."""
    try:
        fd = os.open(name, _DIR, dir_fd=parent)
    except OSError as e:
        if e.errno in _CHANGED:
            return None
        raise
    if os.fstat(fd).st_dev != dev:
        os.close(fd)
        return None
    return fd


def _open_path(root: int, parts: Sequence[str], dev: int) -> int | None:
    fd = os.dup(root)
    for part in parts:
        nxt = _open_dir(fd, part, dev)
        os.close(fd)
        if nxt is None:
            return None
        fd = nxt
    return fd


def write_archive(disk_root_fd: int, out_file: BinaryIO, max_bytes: int, owners: Owners, *,
                  overlays: Sequence[str], mount_points: Sequence[str] = ()) -> int:
    """Write the disk's files (home, tmp, each overlay's upper layer; never shm) to `out_file` as a
    disk archive; return its size. Raises ResourceExhaustedError past `max_bytes`.

    `disk_root_fd`: the disk tmpfs's root (an O_PATH fd is enough); `overlays`: the backend's overlay
    paths, `overlays[n]`'s upper layer at .root/<n>/up. Best paused: a running sandbox's changes during
    the walk may or may not be in the archive (never anything outside the disk)."""
    dev = os.fstat(disk_root_fd).st_dev
    out = _Limited(out_file, max_bytes)  # uncompressed: the server may compress at rest
    for place in places(overlays, mount_points):
        fd = _open_path(disk_root_fd, place.disk, dev)
        if fd is None:
            continue  # e.g. an overlay path this host does not have
        try:
            _write_place(out, place, fd, dev, owners)
        finally:
            os.close(fd)
    out.write(bytes(2 * tarfile.BLOCKSIZE))  # the end of the archive
    return out.written


# A ustar header, for the entries that need no pax header (tarfile's own encoder costs ~100 us each)
_USTAR = struct.Struct("100s8s8s8s12s12s8s1s100s8s32s32s8s8s155s12x")


def write_member(fd: int, tf: tarfile.TarFile, member: tarfile.TarInfo) -> None:
    """A regular member's data into `fd`, a chunk at a time (also the template store's unpacker)."""
    src = tf.extractfile(member)
    if src is not None:
        while chunk := src.read(_CHUNK):
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]


def _octal(n: int, size: int) -> bytes:
    return b"%0*o\0" % (size - 1, n)


def _ustar(info: tarfile.TarInfo) -> bytes | None:
    """The header tarfile would write for `info`, or None for one that needs pax records (non-ASCII or
    long names, big numbers, our own keys)."""
    name = info.name + "/" if info.type == tarfile.DIRTYPE else info.name
    if info.pax_headers or not (name.isascii() and info.linkname.isascii()) or len(info.linkname) > 100:
        return None
    if max(info.uid, info.gid) >= 8**7 or info.size >= 8**11 or not 0 <= info.mtime < 8**11:
        return None
    prefix = ""
    if len(name) > 100:  # ustar's prefix field: split at a slash
        cut = name.find("/", max(0, len(name) - 101))
        if cut <= 0 or cut > 155 or len(name) - cut - 1 > 100 or cut == len(name) - 1:
            return None
        prefix, name = name[:cut], name[cut + 1:]
    dev = _octal(0, 8) if info.type in (tarfile.CHRTYPE, tarfile.BLKTYPE) else b""
    buf = _USTAR.pack(name.encode(), _octal(info.mode & 0o7777, 8), _octal(info.uid, 8), _octal(info.gid, 8),
                      _octal(info.size, 12), _octal(int(info.mtime), 12), b" " * 8, info.type,
                      info.linkname.encode(), tarfile.POSIX_MAGIC, b"", b"", dev, dev, prefix.encode())
    return buf[:148] + b"%06o\0" % sum(buf) + buf[155:]


def _emit(out: _Limited, info: tarfile.TarInfo, data: _Exactly | None = None) -> None:
    """One entry: its header(s), then its data padded to a block."""
    header = _ustar(info)
    out.write(header if header is not None else info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
    if data is not None:
        left = info.size
        while left:
            chunk = data.read(min(_CHUNK, left))
            out.write(chunk)
            left -= len(chunk)
        out.write(bytes(-info.size % tarfile.BLOCKSIZE))


def _write_place(out: _Limited, place: _Place, top: int, dev: int, owners: Owners) -> None:
    links: dict[tuple[int, int], str] = {}  # (dev, ino) -> first name: hard links within this place
    # depth-first, one open directory fd per level: (fd, its names left, its path below the place)
    stack: list[tuple[int, Iterator[str], tuple[str, ...]]] = [(top, iter(sorted(os.listdir(top))), ())]
    try:
        while stack:
            fd, names, rel = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                if fd != top:
                    os.close(fd)
                continue
            path = (*rel, name)
            if path in place.skip:
                continue
            sub = _write_entry(out, place, fd, name, path, dev, owners, links)
            if sub is not None:
                if len(stack) >= MAX_DEPTH:
                    os.close(sub)
                    raise ResourceExhaustedError(
                        f"{place.name}/{'/'.join(path)}: directories nested deeper than {MAX_DEPTH} levels "
                        "cannot be snapshotted")
                stack.append((sub, iter(sorted(os.listdir(sub))), path))
    finally:
        for fd, _, _ in stack:
            if fd != top:
                os.close(fd)


def _info(place: _Place, path: tuple[str, ...], st: os.stat_result, owners: Owners) -> tarfile.TarInfo:
    info = tarfile.TarInfo(place.name + "/" + "/".join(path))
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid = SANDBOX_USER if st.st_uid == owners.uid else 0
    info.gid = SANDBOX_USER if st.st_gid == owners.gid else 0
    info.uname = info.gname = ""
    info.mtime = max(0, int(st.st_mtime))
    return info


def _write_entry(out: _Limited, place: _Place, parent: int, name: str,
                 path: tuple[str, ...], dev: int, owners: Owners, links: dict[tuple[int, int], str]) -> int | None:
    """Archive one entry of `parent`; a directory's open fd is returned for the walk to descend."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None  # deleted since the listing
    if st.st_dev != dev:
        return None
    if stat.S_ISDIR(st.st_mode):
        fd = _open_dir(parent, name, dev)
        if fd is None:
            return None
        st = os.fstat(fd)
        info = _info(place, path, st, owners)
        info.type = tarfile.DIRTYPE
        if place.overlay and _opaque(fd):
            info.pax_headers = {OPAQUE_PAX: "y"}
        _emit(out, info)
        return fd
    if stat.S_ISREG(st.st_mode):
        try:
            fd = os.open(name, _READ, dir_fd=parent)
        except OSError as e:
            if e.errno in _CHANGED:
                return None  # gone, or no longer a plain file (ELOOP: a symlink now)
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_dev != dev:
                return None
            info = _info(place, path, st, owners)
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in links:
                info.type = tarfile.LNKTYPE
                info.linkname = links[key]
                _emit(out, info)
                return None
            if st.st_nlink > 1:
                links[key] = info.name
            info.size = st.st_size
            out.check(st.st_size)  # fail before reading a file that cannot fit
            _emit(out, info, _Exactly(fd, st.st_size))
        finally:
            os.close(fd)
        return None
    info = _info(place, path, st, owners)
    if stat.S_ISLNK(st.st_mode):
        try:
            info.linkname = os.readlink(name, dir_fd=parent)  # the link itself, never its target
        except OSError as e:
            if e.errno in _CHANGED:
                return None
            raise
        info.type = tarfile.SYMTYPE
    elif stat.S_ISFIFO(st.st_mode):
        info.type = tarfile.FIFOTYPE
    elif stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        info.type = tarfile.CHRTYPE  # an overlay whiteout (0:0); devmajor/devminor stay 0
    else:
        return None  # sockets, real device nodes: not files
    _emit(out, info)
    return None


def _opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, OPAQUE_XATTR) == b"y"
    except OSError:
        return False


# -- extracting ------------------------------------------------------------------------------------


def extract_archive(in_file: BinaryIO, disk_root_fd: int, host_uid: int, host_gid: int, root_uid: int,
                    root_gid: int, *, overlays: Sequence[str], protected: Sequence[str] = ()) -> int:
    """Recreate a disk archive's files in a fresh disk (host root, before the overlays are mounted);
    return the number of entries. The sandbox's 1000 becomes host_uid/gid, its 0 root_uid/gid.

    `protected`: absolute paths inside the overlays that are mount points of the sandbox's root (the
    runtime's binds): nothing may be put there or below, and the directories leading to one may only
    be plain directories, so that mounting onto them by path goes where it always goes.

    Raises InvalidArgumentError for anything write_archive never makes (absolute names, "..", a name
    through a symlink, a hard link to a name that is not an earlier entry of the same place, a device
    node other than a whiteout, a duplicate, a protected path), ResourceExhaustedError when the disk
    is full."""
    old_umask = os.umask(0)  # modes are set exactly as archived
    ex = _Extractor(disk_root_fd, (host_uid, host_gid), (root_uid, root_gid), places(overlays),
                    [tuple(_components(p)) for p in protected])
    try:
        try:
            count = 0
            with tarfile.open(fileobj=in_file, mode="r:" if in_file.seekable() else "r|") as tf:  # type: ignore[call-overload]
                while (member := tf.next()) is not None:
                    ex.add(member, tf)
                    tf.members.clear()  # tarfile keeps every header it read: memory the sandbox pays for
                    count += 1
            ex.finish()
            return count
        except (tarfile.TarError, EOFError, UnicodeError, OverflowError, ValueError) as e:
            raise InvalidArgumentError(f"not a disk archive (a pax tar of home/, tmp/, root/...): {e}") from None
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhaustedError(
                    "the filesystem snapshot does not fit in the sandbox's disk: create it with a bigger "
                    "disk_mb (or memory_mb)") from None
            if e.errno in (errno.ENAMETOOLONG, errno.EINVAL, errno.EMLINK, errno.EISDIR, errno.ENOTDIR, errno.ELOOP):
                raise InvalidArgumentError(f"a disk archive entry cannot be made: {e}") from None
            raise
    finally:
        ex.close()
        os.umask(old_umask)


class _Extractor:
    def __init__(self, root: int, user: tuple[int, int], sandbox_root: tuple[int, int], known: list[_Place],
                 protected: list[tuple[str, ...]]) -> None:
        self.root = root
        self.protected = protected
        # nested overlays are mount points too, but their names go to their own place
        self.overlay_paths = {tuple(p.name.split("/")[1:]) for p in known if p.overlay}
        self.dev = os.fstat(root).st_dev
        self.user = user
        self.sandbox_root = sandbox_root
        self.places = known
        self.files: dict[str, tuple[_Place, tuple[str, ...]]] = {}  # regular files made: hard link targets
        self.dir_times: list[tuple[_Place, tuple[str, ...], int]] = []
        self._cached: tuple[tuple[str, ...], int] | None = None  # the last parent directory opened

    def close(self) -> None:
        if self._cached is not None:
            os.close(self._cached[1])
            self._cached = None

    # names ----------------------------------------------------------------------------------------

    def _resolve(self, name: str) -> tuple[_Place, tuple[str, ...]]:
        if not name or name.startswith("/") or "\0" in name:
            raise InvalidArgumentError(f"disk archive entry {name!r}: not a relative name")
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise InvalidArgumentError(f"disk archive entry {name!r}: empty, '.' or '..' components are refused")
        best: _Place | None = None
        for place in self.places:
            prefix = place.name.split("/")
            if parts[:len(prefix)] == prefix and (best is None or len(prefix) > len(best.name.split("/"))):
                best = place
        if best is None:
            raise InvalidArgumentError(
                f"disk archive entry {name!r} is not under home/, tmp/ or root/<a writable path>")
        return best, tuple(parts[len(best.name.split("/")):])

    def _ids(self, member: tarfile.TarInfo) -> tuple[int, int]:
        return (self.user[0] if member.uid == SANDBOX_USER else self.sandbox_root[0],
                self.user[1] if member.gid == SANDBOX_USER else self.sandbox_root[1])

    # directories ----------------------------------------------------------------------------------

    def _place_dir(self, place: _Place) -> int:
        """The place's top directory (made if missing, with finish()'s owners and modes)."""
        fd = os.dup(self.root)
        for i, part in enumerate(place.disk):
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError:
                os.mkdir(part, 0o700, dir_fd=fd)
                nxt = os.open(part, _DIR, dir_fd=fd)
                if place.disk[:i + 1] == ("home",):
                    os.fchown(nxt, *self.user)
                    os.fchmod(nxt, 0o755)
                elif place.disk[:i + 1] == ("tmp",):
                    os.fchmod(nxt, 0o1777)
                elif i == 2:  # .root/<n>/up: the overlay's root; finish() gives it the host dir's mode
                    os.fchown(nxt, *self.sandbox_root)
                    os.fchmod(nxt, 0o755)
                elif i == 1:
                    os.fchmod(nxt, 0o755)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise InvalidArgumentError(f"{'/'.join(place.disk[:i + 1])} of the disk is not a directory") from None
                raise
            os.close(fd)
            fd = nxt
            self._same_disk(fd, place.name)
        return fd

    def _same_disk(self, fd: int, name: str) -> None:
        if os.fstat(fd).st_dev != self.dev:
            os.close(fd)
            raise InvalidArgumentError(f"disk archive entry {name!r} leads out of the disk")

    def _dir(self, place: _Place, rel: tuple[str, ...], name: str) -> int:
        """The directory place/rel as an fd owned by the cache (do not close). Missing directories are
        made (an archive lists parents first, a hand-made one may not); a symlink or a file on the
        way is refused: openat(O_NOFOLLOW | O_DIRECTORY) never goes through one."""
        key = (place.name, *rel)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        fd = self._place_dir(place)
        for part in rel:
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    nxt = os.open(part, _DIR, dir_fd=fd)
                    os.fchown(nxt, *(self.user if place.name == "home" else self.sandbox_root))
                except BaseException:
                    os.close(fd)
                    raise
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise InvalidArgumentError(
                        f"disk archive entry {name!r} goes through {part!r}, which is not a directory "
                        "(a symlink or a file)") from None
                raise
            os.close(fd)
            fd = nxt
            self._same_disk(fd, name)
        self.close()
        self._cached = (key, fd)
        return fd

    # entries --------------------------------------------------------------------------------------

    def add(self, member: tarfile.TarInfo, tf: tarfile.TarFile) -> None:
        name = member.name
        place, rel = self._resolve(name)
        if not rel:
            return  # the place's own directory: finish() decides its owner and mode
        self._check_protected(place, rel, member)
        parent = self._dir(place, rel[:-1], name)
        leaf = rel[-1]
        uid, gid = self._ids(member)
        mode = member.mode & 0o7777
        try:
            if member.isdir():
                self._mkdir(parent, leaf, name, uid, gid, mode, place.overlay and member.pax_headers.get(OPAQUE_PAX) == "y")
                self.dir_times.append((place, rel, int(member.mtime)))
                return
            if member.isreg():
                self._file(parent, leaf, uid, gid, mode, member, tf)
                self.files[name] = (place, rel)
                return
            if member.islnk():
                self._hardlink(parent, leaf, member, place)
                return
            if member.issym():
                if "\0" in member.linkname:
                    raise InvalidArgumentError(f"disk archive entry {name!r}: a symlink target with a NUL")
                os.symlink(member.linkname, leaf, dir_fd=parent)
            elif member.isfifo():
                os.mkfifo(leaf, mode & 0o777, dir_fd=parent)
            elif member.ischr() and member.devmajor == 0 and member.devminor == 0:
                os.mknod(leaf, stat.S_IFCHR | (mode & 0o777), 0, dir_fd=parent)  # a whiteout
            else:
                raise InvalidArgumentError(
                    f"disk archive entry {name!r}: device nodes (other than overlay whiteouts, 0:0) and "
                    f"entries of type {member.type!r} are refused")
        except FileExistsError:
            raise InvalidArgumentError(f"disk archive entry {name!r} is there twice") from None
        # the new symlink, fifo or whiteout itself (AT_SYMLINK_NOFOLLOW): never what a link names
        os.chown(leaf, uid, gid, dir_fd=parent, follow_symlinks=False)
        os.utime(leaf, ns=(int(member.mtime) * 10**9,) * 2, dir_fd=parent, follow_symlinks=False)

    def _check_protected(self, place: _Place, rel: tuple[str, ...], member: tarfile.TarInfo) -> None:
        if not place.overlay:
            return
        top = tuple(place.name.split("/")[1:])
        path = top + rel  # the absolute path in the sandbox
        for point in self.protected:
            if point[:len(top)] != top or len(point) == len(top):
                continue  # not inside this overlay
            if path[:len(point)] == point and point not in self.overlay_paths:
                raise InvalidArgumentError(f"disk archive entry {member.name!r}: /{'/'.join(point)} is the "
                                           "sandbox runtime's own mount point")
            if point[:len(path)] == path and not (member.isdir() and OPAQUE_PAX not in member.pax_headers):
                raise InvalidArgumentError(f"disk archive entry {member.name!r} must be a plain directory: it "
                                           f"leads to the mount point /{'/'.join(point)}")

    def _mkdir(self, parent: int, leaf: str, name: str, uid: int, gid: int, mode: int, opaque: bool) -> None:
        try:
            os.mkdir(leaf, 0o700, dir_fd=parent)
        except FileExistsError:
            pass  # made as a parent of an earlier entry: an open with O_NOFOLLOW tells what it is
        try:
            fd = os.open(leaf, _DIR, dir_fd=parent)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise InvalidArgumentError(f"disk archive entry {name!r} is there twice") from None
            raise
        try:
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)  # after the chown, which clears set-id bits
            if opaque:
                os.setxattr(fd, OPAQUE_XATTR, b"y")
        finally:
            os.close(fd)

    def _file(self, parent: int, leaf: str, uid: int, gid: int, mode: int, member: tarfile.TarInfo,
              tf: tarfile.TarFile) -> None:
        fd = os.open(leaf, _CREATE, 0o600, dir_fd=parent)
        try:
            write_member(fd, tf, member)
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)
            os.utime(fd, ns=(int(member.mtime) * 10**9,) * 2)
        finally:
            os.close(fd)

    def _hardlink(self, parent: int, leaf: str, member: tarfile.TarInfo, place: _Place) -> None:
        target = self.files.get(member.linkname)
        if target is None or target[0] is not place:
            raise InvalidArgumentError(
                f"disk archive entry {member.name!r}: a hard link to {member.linkname!r}, which is not an "
                "earlier file of the same place in the archive")
        parent_fd = os.dup(parent)  # _dir() below may replace the cached fd
        try:
            src_dir = self._dir(target[0], target[1][:-1], member.linkname)
            os.link(target[1][-1], leaf, src_dir_fd=src_dir, dst_dir_fd=parent_fd, follow_symlinks=False)
        finally:
            os.close(parent_fd)

    def finish(self) -> None:
        """Directory mtimes, last (adding entries changed them), innermost first."""
        for place, rel, mtime in reversed(self.dir_times):
            fd = self._dir(place, rel, place.name + "/" + "/".join(rel))
            os.utime(fd, ns=(mtime * 10**9,) * 2)


def summary(in_file: BinaryIO) -> dict[str, Any]:
    """Counts of an archive's entries by kind and the bytes of its files (for tests and tools)."""
    kinds: dict[str, int] = {}
    size = 0
    with tarfile.open(fileobj=in_file, mode="r:" if in_file.seekable() else "r|") as tf:  # type: ignore[call-overload]
        for m in tf:
            kind = ("dir" if m.isdir() else "file" if m.isreg() else "symlink" if m.issym() else
                    "hardlink" if m.islnk() else "fifo" if m.isfifo() else "whiteout" if m.ischr() else "other")
            kinds[kind] = kinds.get(kind, 0) + 1
            size += m.size if m.isreg() else 0
    return {"entries": kinds, "file_bytes": size}
