"""One OCI layer (a tar, maybe gzip- or zstd-compressed) unpacked into its own directory, for overlayfs.

The directory is what overlayfs wants of a lower layer: an OCI whiteout (``.wh.NAME``) becomes an
overlay whiteout (a character device 0:0 named NAME), an opaque marker (``.wh..wh..opq``) the xattr
``trusted.overlay.opaque=y`` on its directory. Hard links must name an earlier file of the same layer.

Owners are shifted, never the host's: an image's id N is stored as host id ``ID_BASE + N`` (ids of
images must be below ``ID_RANGE``), so no stored file belongs to a host user, a setuid-root program of
the image is setuid to an id nobody on the host has, and inside a sandbox (a user namespace whose ids
0..65535 map to ID_BASE.. through an idmapped mount) it is the image's own root again. Set-id bits are
kept. Only ``user.*`` xattrs are set as they are. A file capability (``security.capability``) is
stored as a namespaced (v3) one whose root id is ID_BASE: the kernel honours it only in a user
namespace whose root is ID_BASE (a sandbox's, through its id mapping), never on the host; the image's
value is also recorded in the layer's metadata. Other xattrs are dropped (their names are recorded).

Layers are untrusted and this runs as host root, so, as backends/disk_archive.py does, it works through
directory fds only: every component is opened with openat(O_NOFOLLOW | O_DIRECTORY) from the layer's
root fd, new entries are made with O_CREAT | O_EXCL | O_NOFOLLOW, mkdirat, symlinkat, mknodat and
linkat without following: no symlink of the layer is ever followed, no name leaves the directory.
Absolute names and ``..`` are refused; device nodes (but whiteouts) are left out and recorded. The decompressed stream, the bytes
written (a sparse file counts at its full size), the entries and the size of any one header are
bounded: a decompression bomb stops at the budget, never at the disk's end.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import os
import shutil
import stat
import subprocess
import tarfile
import zlib
from dataclasses import dataclass, field
from typing import BinaryIO

from agentcell.backends import disk_archive
from agentcell.errors import BackendUnavailableError, InvalidArgumentError, ResourceExhaustedError

ID_BASE = 0x50000000  # image id N is host id ID_BASE + N: a range no host user has
ID_RANGE = 65536
OPAQUE_XATTR = "trusted.overlay.opaque"
WHITEOUT = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
MAX_DEPTH = 256
MAX_HEADER_BYTES = 1 << 20  # one pax or GNU long-name header: tarfile reads it whole into memory
CAPABILITY_XATTR = "security.capability"
_CAP_REVISION_MASK, _CAP_REVISION_2, _CAP_REVISION_3, _CAP_EFFECTIVE = 0xFF000000, 0x02000000, 0x03000000, 0x1
_CAP_V2_SIZE, _CAP_V3_SIZE = 20, 24
_CHUNK = 1 << 20

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC

TAR_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": "",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
}


@dataclass
class Unpacked:
    """What a layer held: its uncompressed digest and size, and what the runtime must know of it."""

    diff_id: str
    tar_bytes: int = 0  # the uncompressed tar's size
    file_bytes: int = 0  # the files' sizes (what the directory holds)
    entries: int = 0
    capabilities: dict[str, str] = field(default_factory=dict)  # path -> security.capability (hex)
    dropped_xattrs: list[str] = field(default_factory=list)  # "path: name", for the record
    dropped_devices: list[str] = field(default_factory=list)  # device nodes left out (never made)


class _Counted:
    """The decompressed stream: hashed (the layer's diff_id) and cut off past `limit` bytes."""

    def __init__(self, inner: BinaryIO, limit: int, what: str) -> None:
        self.inner = inner
        self.limit = limit
        self.what = what
        self.count = 0
        self.sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = _CHUNK
        n = min(n, self.limit - self.count + 1)  # never ask for more than one byte over the budget
        data = self.inner.read(n)
        self.count += len(data)
        if self.count > self.limit:
            raise ResourceExhaustedError(
                f"{self.what} unpacks to more than the {self.limit} bytes left of the image's size ceiling "
                "(serve --max-image-mb): too big, or a decompression bomb")
        self.sha.update(data)
        return data

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass


class _BoundedInfo(tarfile.TarInfo):
    """A tar header whose extended headers (pax, GNU long names) are small: tarfile reads them whole."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                         tarfile.SOLARIS_XHDTYPE) and self.size > MAX_HEADER_BYTES:
            raise ResourceExhaustedError(f"a layer's extended tar header takes {self.size} bytes (at most "
                                         f"{MAX_HEADER_BYTES} are read)")
        return super()._proc_member(tarfile_)  # type: ignore[misc]


def namespaced_capability(raw: bytes) -> bytes | None:
    """An image's file capability (v2, or v3 of the image's root) as a v3 one whose root is ID_BASE: the
    kernel honours it only in a user namespace whose root is host id ID_BASE (a sandbox's), never on
    the host, where that id is nobody's root. None for what is no capability of the image's root."""
    if len(raw) == _CAP_V2_SIZE and int.from_bytes(raw[:4], "little") & _CAP_REVISION_MASK == _CAP_REVISION_2:
        data = raw[4:20]
    elif len(raw) == _CAP_V3_SIZE and int.from_bytes(raw[:4], "little") & _CAP_REVISION_MASK == _CAP_REVISION_3 \
            and int.from_bytes(raw[20:24], "little") == 0:
        data = raw[4:20]
    else:
        return None
    magic = _CAP_REVISION_3 | (int.from_bytes(raw[:4], "little") & _CAP_EFFECTIVE)
    return magic.to_bytes(4, "little") + data + ID_BASE.to_bytes(4, "little")


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def unpack_layer(blob_path: str, media_type: str, digest: str, diff_id: str, dest_fd: int, *,
                 max_bytes: int, max_entries: int) -> Unpacked:
    """Unpack the layer blob at `blob_path` into the empty directory `dest_fd` (host root, a private
    directory). `digest` (of the blob) and `diff_id` (of its uncompressed tar, the image config's) are
    verified; `max_bytes` bounds the uncompressed tar and the files written, `max_entries` the entries.

    Raises InvalidArgumentError for a corrupt or hostile layer (the directory is then to be thrown away),
    ResourceExhaustedError past a bound."""
    if media_type not in TAR_TYPES:
        raise InvalidArgumentError(f"layer {digest}: media type {media_type!r} is not a tar layer agentcell unpacks")
    if file_digest(blob_path) != digest:  # skopeo verified it on the way in; this store's copy is checked again
        raise InvalidArgumentError(f"layer {digest}: the blob's content does not match its digest")
    compression = TAR_TYPES[media_type]
    ex = _Extractor(dest_fd, Unpacked(diff_id), max_bytes, max_entries)
    with open(blob_path, "rb") as raw:
        zstd: subprocess.Popen[bytes] | None = None
        stream: BinaryIO
        if compression == "gzip":
            stream = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[assignment]
        elif compression == "zstd":
            if shutil.which("zstd") is None:
                raise BackendUnavailableError("the image has zstd-compressed layers: install zstd (apt-get install zstd)")
            zstd = subprocess.Popen(["zstd", "-dcq", "--no-progress"], stdin=raw, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL)
            assert zstd.stdout is not None
            stream = zstd.stdout
        else:
            stream = raw
        counted = _Counted(stream, max_bytes, f"layer {digest}")
        try:
            try:
                with tarfile.open(fileobj=counted, mode="r|", tarinfo=_BoundedInfo) as tf:  # type: ignore[call-overload]
                    while (member := _next(tf)) is not None:
                        ex.add(member, tf)
                        tf.members.clear()  # tarfile keeps every header: memory the image's author picks
                counted.drain()  # the tar's end blocks and padding: part of the diff_id
                ex.finish()
            except (tarfile.TarError, EOFError, UnicodeError, OverflowError, ValueError, gzip.BadGzipFile, zlib.error) as e:
                raise InvalidArgumentError(f"layer {digest} is not a valid tar: {e}") from None
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise ResourceExhaustedError("the template store's filesystem is full") from None
                if e.errno in (errno.ENAMETOOLONG, errno.EINVAL, errno.EMLINK, errno.EISDIR, errno.ENOTDIR, errno.ELOOP):
                    raise InvalidArgumentError(f"layer {digest}: an entry cannot be made: {e}") from None
                raise
        finally:
            ex.close()
            if zstd is not None:
                zstd.kill()
                zstd.wait()
    if zstd is not None and zstd.returncode not in (0, -9):
        raise InvalidArgumentError(f"layer {digest}: not valid zstd data")
    got = "sha256:" + counted.sha.hexdigest()
    if got != diff_id:
        raise InvalidArgumentError(f"layer {digest}: its uncompressed content is {got}, the image config says {diff_id}")
    ex.result.tar_bytes = counted.count
    return ex.result


def _next(tf: tarfile.TarFile) -> tarfile.TarInfo | None:
    """The next entry; None at the end, also at an end without the last entry's padding and the two
    zero blocks (umoci 0.4's `insert` writes such layers): the entries are whole, and the diff_id
    check still holds the stream to the image config's digest."""
    try:
        return tf.next()
    except tarfile.ReadError as e:
        if str(e) == "unexpected end of data" and tf.offset > 0:
            return None
        raise


def _parts(name: str, what: str) -> tuple[str, ...]:
    if "\0" in name:
        raise InvalidArgumentError(f"layer entry {name!r}: a NUL in a name")
    if name.startswith("/"):
        raise InvalidArgumentError(f"layer entry {name!r}: absolute names are refused ({what})")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise InvalidArgumentError(f"layer entry {name!r}: '..' is refused ({what})")
    if len(parts) > MAX_DEPTH:
        raise InvalidArgumentError(f"layer entry {name[:200]!r}...: nested deeper than {MAX_DEPTH} levels")
    return parts


def _ids(member: tarfile.TarInfo) -> tuple[int, int]:
    if not (0 <= member.uid < ID_RANGE and 0 <= member.gid < ID_RANGE):
        raise InvalidArgumentError(f"layer entry {member.name!r}: owner {member.uid}:{member.gid} is outside "
                                   f"the ids 0..{ID_RANGE - 1} a sandbox maps")
    return ID_BASE + member.uid, ID_BASE + member.gid


class _Extractor:
    def __init__(self, root: int, result: Unpacked, max_bytes: int, max_entries: int) -> None:
        self.root = root
        self.dev = os.fstat(root).st_dev
        self.result = result
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.files: set[tuple[str, ...]] = set()  # regular files made: what hard links may name
        self.dir_times: list[tuple[tuple[str, ...], int]] = []
        self._cached: tuple[tuple[str, ...], int] | None = None

    def close(self) -> None:
        if self._cached is not None:
            os.close(self._cached[1])
            self._cached = None

    def _dir(self, rel: tuple[str, ...], name: str) -> int:
        """The directory `rel` of the layer (an fd the cache owns), missing ones made; a symlink or a
        file on the way is refused: openat(O_NOFOLLOW | O_DIRECTORY) never goes through one."""
        if self._cached is not None and self._cached[0] == rel:
            return self._cached[1]
        fd = os.dup(self.root)
        for part in rel:
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    nxt = os.open(part, _DIR, dir_fd=fd)
                    os.fchown(nxt, ID_BASE, ID_BASE)
                    os.fchmod(nxt, 0o755)
                except BaseException:
                    os.close(fd)
                    raise
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise InvalidArgumentError(f"layer entry {name!r} goes through {part!r}, which is not a "
                                               "directory (a symlink or a file): refused") from None
                raise
            os.close(fd)
            fd = nxt
            if os.fstat(fd).st_dev != self.dev:
                os.close(fd)
                raise InvalidArgumentError(f"layer entry {name!r} leads out of the layer")
        self.close()
        self._cached = (rel, fd)
        return fd

    def _clear(self, parent: int, leaf: str, name: str, *, for_dir: bool) -> bool:
        """An existing `leaf` before an entry of the same name: a later entry replaces a non-directory
        (tar's rule); a directory stays (for a directory entry: True) and a non-directory may not
        replace it."""
        try:
            st = os.stat(leaf, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            if for_dir:
                return True
            raise InvalidArgumentError(f"layer entry {name!r} would replace a directory of the same layer")
        os.unlink(leaf, dir_fd=parent)
        return False

    def add(self, member: tarfile.TarInfo, tf: tarfile.TarFile) -> None:
        res = self.result
        res.entries += 1
        if res.entries > self.max_entries:
            raise ResourceExhaustedError(f"a layer holds more than {self.max_entries} entries")
        parts = _parts(member.name, "a name")
        if not parts:  # the layer's root itself ("./")
            if member.isdir():
                uid, gid = _ids(member)
                os.fchown(self.root, uid, gid)
                os.fchmod(self.root, member.mode & 0o7777)
                self.dir_times.append(((), int(member.mtime)))
                return
            raise InvalidArgumentError(f"layer entry {member.name!r}: the layer's root must be a directory")
        parent = self._dir(parts[:-1], member.name)
        leaf = parts[-1]
        if leaf.startswith(WHITEOUT):
            self._whiteout(parent, parts, member)
            return
        uid, gid = _ids(member)
        mode = member.mode & 0o7777
        if member.isdir():
            if not self._clear(parent, leaf, member.name, for_dir=True):
                os.mkdir(leaf, 0o700, dir_fd=parent)
            fd = os.open(leaf, _DIR, dir_fd=parent)
            try:
                os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)  # after the chown, which clears set-id bits
                self._xattrs(fd, parts, member)
            finally:
                os.close(fd)
            self.dir_times.append((parts, int(member.mtime)))
            return
        self._clear(parent, leaf, member.name, for_dir=False)
        self.files.discard(parts)
        if member.isreg():
            self._file(parent, leaf, parts, uid, gid, mode, member, tf)
            self.files.add(parts)
            return
        if member.islnk():
            self._hardlink(parent, leaf, member)
            return
        if member.issym():
            if "\0" in member.linkname:
                raise InvalidArgumentError(f"layer entry {member.name!r}: a symlink target with a NUL")
            os.symlink(member.linkname, leaf, dir_fd=parent)  # kept as it is: never followed here
        elif member.isfifo():
            os.mkfifo(leaf, 0o600, dir_fd=parent)
        elif member.ischr() and member.devmajor == 0 and member.devminor == 0:
            os.mknod(leaf, stat.S_IFCHR | 0o600, 0, dir_fd=parent)  # an overlay whiteout already
        elif member.ischr() or member.isblk():
            # not made, only recorded: a sandbox gets its own /dev (rootfs builders such as mmdebstrap put
            # /dev/console, /dev/null ... in their tars), and no layer may hold a host device
            if len(res.dropped_devices) < 1000:
                res.dropped_devices.append(member.name)
            return
        else:
            raise InvalidArgumentError(f"layer entry {member.name!r}: entries of type {member.type!r} are refused")
        os.chown(leaf, uid, gid, dir_fd=parent, follow_symlinks=False)  # the new entry itself, never a target
        if not member.issym():
            os.chmod(leaf, mode & 0o777, dir_fd=parent)  # a fifo or whiteout just made here, not a link
        os.utime(leaf, ns=(int(member.mtime) * 10**9,) * 2, dir_fd=parent, follow_symlinks=False)

    def _whiteout(self, parent: int, parts: tuple[str, ...], member: tarfile.TarInfo) -> None:
        leaf = parts[-1]
        if leaf == OPAQUE_MARKER:  # the directory hides all of the layers below
            os.setxattr(parent, OPAQUE_XATTR, b"y")
            return
        if leaf.startswith(WHITEOUT + WHITEOUT):
            return  # other AUFS bookkeeping (.wh..wh.plnk ...): meaningless here
        hidden = leaf[len(WHITEOUT):]
        if hidden in ("", ".", ".."):
            raise InvalidArgumentError(f"layer entry {member.name!r}: a whiteout of nothing")
        self._clear(parent, hidden, member.name, for_dir=False)
        self.files.discard((*parts[:-1], hidden))
        os.mknod(hidden, stat.S_IFCHR | 0o600, 0, dir_fd=parent)
        os.chown(hidden, ID_BASE, ID_BASE, dir_fd=parent, follow_symlinks=False)

    def _file(self, parent: int, leaf: str, parts: tuple[str, ...], uid: int, gid: int, mode: int,
              member: tarfile.TarInfo, tf: tarfile.TarFile) -> None:
        res = self.result
        res.file_bytes += member.size  # a sparse file's full size: it is written out whole
        if res.file_bytes > self.max_bytes:
            raise ResourceExhaustedError(
                f"layer entry {member.name!r}: the layer's files take more than {self.max_bytes} bytes "
                "(a huge or sparse file)")
        fd = os.open(leaf, _CREATE, 0o600, dir_fd=parent)
        try:
            disk_archive.write_member(fd, tf, member)
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)  # after the chown: set-id bits stay (owned by the shifted ids)
            self._xattrs(fd, parts, member)
            os.utime(fd, ns=(int(member.mtime) * 10**9,) * 2)
        finally:
            os.close(fd)

    def _xattrs(self, fd: int, parts: tuple[str, ...], member: tarfile.TarInfo) -> None:
        for key, value in member.pax_headers.items():
            if not key.startswith("SCHILY.xattr."):
                continue
            name = key[len("SCHILY.xattr."):]
            raw = value.encode("utf-8", "surrogateescape")
            path = "/" + "/".join(parts)
            if name.startswith("user."):
                os.setxattr(fd, name, raw)
            elif name == CAPABILITY_XATTR:
                self.result.capabilities[path] = raw.hex()
                nscap = namespaced_capability(raw)
                if nscap is not None:
                    os.setxattr(fd, CAPABILITY_XATTR, nscap)
            elif len(self.result.dropped_xattrs) < 1000:
                self.result.dropped_xattrs.append(f"{path}: {name}")

    def _hardlink(self, parent: int, leaf: str, member: tarfile.TarInfo) -> None:
        target = _parts(member.linkname, "a hard link's target")
        if target not in self.files:
            raise InvalidArgumentError(
                f"layer entry {member.name!r}: a hard link to {member.linkname!r}, which is not an earlier "
                "file of the same layer")
        parent_fd = os.dup(parent)  # _dir() below may replace the cached fd
        try:
            src_dir = self._dir(target[:-1], member.linkname)
            os.link(target[-1], leaf, src_dir_fd=src_dir, dst_dir_fd=parent_fd, follow_symlinks=False)
        finally:
            os.close(parent_fd)

    def finish(self) -> None:
        """Directory mtimes, last (adding entries changed them), innermost first."""
        for rel, mtime in reversed(self.dir_times):
            fd = self._dir(rel, "/".join(rel))
            os.utime(fd, ns=(mtime * 10**9,) * 2)
