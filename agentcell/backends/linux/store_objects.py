"""The runtime store's files, stored once by content (runtime_store.py builds its parts from them).

Every regular file of every part is a hard link to an *object*, ``objects/<hh>/<sha256>-<mode>``: two venvs
with the same packages (or two builds of the same package tree) hold the same objects, and a part costs
only its directories and links. An object whose content is the host's file as it is *is* that host
file (a hard link to it: no byte copied); a rewritten one (runtime_store._Rewriter) is written here.
A host file someone other than root could change in place (a venv a user owns) is never an object:
it is linked into its own venv's part only (_shareable).

Hashing gigabytes at every start would cost seconds, so a :class:`HashCache` remembers each file's
digest by ``(device, inode, size, mtime_ns)``: an unchanged file is never read again, a changed one
(new inode, size or mtime) is. The same cache tells whether an object is still what its name says:
an object is valid only while its own ``(device, inode, size, mtime_ns)`` maps to its digest, so a host
file edited in place (same inode, new mtime) stops being used as an object at the next build.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import marshal
import os
import shutil
import stat
import time

OBJECTS = "objects"
HASHES = "hashes"  # the hash cache's file in the store's root
KEEP_HASH_S = 30 * 24 * 3600  # a cache entry nobody looked up for this long is dropped
_DAY = 86400

Digest = bytes  # sha256, 32 bytes
FileKey = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


def file_key(st: os.stat_result) -> FileKey:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def digest_of(path: str) -> Digest:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


def _shareable(st: os.stat_result) -> bool:
    """May a host file be an object, linked into other venvs' parts? Only if no one but root can change
    it in place: a file of a venv user X owns, shared with the part of a server running from another
    venv, would let X change what that server's zygote (root) and sandboxes run. Such files are linked
    into their own venv's part only, as they were before the store shared anything (X can change that
    server's code anyway)."""
    return st.st_uid == 0 and not st.st_mode & 0o022


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # another filesystem (EXDEV), too many links, an immutable file ...
        shutil.copy2(src, dst, follow_symlinks=False)
        os.chmod(dst, os.lstat(src).st_mode & 0o755)


class HashCache:
    """file key -> (digest, the day it was last looked up), kept in one marshal file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: dict[FileKey, tuple[Digest, int]] = {}
        self.changed = False
        self.today = int(time.time()) // _DAY
        self.journal: list[tuple[FileKey, Digest]] = []  # what put() added (a build's worker sends it back)
        with contextlib.suppress(OSError, ValueError, EOFError, TypeError):
            with open(path, "rb") as f:
                loaded = marshal.load(f)
            if isinstance(loaded, dict):
                self.entries = loaded

    def get(self, st: os.stat_result) -> Digest | None:
        key = file_key(st)
        hit = self.entries.get(key)
        if hit is None:
            return None
        if hit[1] != self.today:
            self.entries[key] = (hit[0], self.today)
            self.changed = True
        return hit[0]

    def put(self, st: os.stat_result, digest: Digest) -> None:
        self.entries[file_key(st)] = (digest, self.today)
        self.changed = True
        self.journal.append((file_key(st), digest))

    def digest(self, path: str, st: os.stat_result) -> Digest:
        """The file's digest: from the cache, or read and hashed now (and remembered)."""
        hit = self.get(st)
        if hit is None:
            hit = digest_of(path)
            self.put(st, hit)
        return hit

    def digest_data(self, st: os.stat_result, data: bytes) -> Digest:
        """The digest of a file already read (`data` is its content): from the cache, or of `data`."""
        hit = self.get(st)
        if hit is None:
            hit = hashlib.sha256(data).digest()
            self.put(st, hit)
        return hit

    def covers(self, stats: list[os.stat_result]) -> bool:
        return all(file_key(st) in self.entries for st in stats)

    def save(self) -> None:
        if not self.changed:
            return
        oldest = self.today - KEEP_HASH_S // _DAY
        self.entries = {k: v for k, v in self.entries.items() if v[1] >= oldest}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            marshal.dump(self.entries, f)
        os.replace(tmp, self.path)
        self.changed = False


class Objects:
    """The store's objects: placing a part's file is linking it to the object of its content."""

    def __init__(self, root: str, hashes: HashCache) -> None:
        self.dir = os.path.join(root, OBJECTS)
        self.hashes = hashes
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        if len(os.listdir(self.dir)) < 256:  # the 256 fan-out directories, made once (not per object)
            for i in range(256):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(os.path.join(self.dir, f"{i:02x}"), 0o700)
        self.new_bytes = 0  # bytes this store did not hold before (written here or linked from the host)
        self.written_bytes = 0  # of which written here
        self.used: set[str] = set()  # object names placed since the last take_used()

    def path(self, digest: Digest, mode: int) -> str:
        h = digest.hex()
        return os.path.join(self.dir, h[:2], f"{h}-{mode & 0o7777:o}")

    def _valid(self, obj: str, digest: Digest) -> os.stat_result | None:
        try:
            st = os.lstat(obj)
        except FileNotFoundError:
            return None
        if stat.S_ISREG(st.st_mode) and _shareable(st):
            known = self.hashes.get(st)
            if known is None and st.st_uid == 0:  # made by another worker of this build, or a lost cache
                with contextlib.suppress(OSError):
                    known = digest_of(obj)
                    if known == digest:
                        self.hashes.put(st, known)
            if known == digest:
                return st
        os.unlink(obj)  # edited in place since (a host file's inode), or not ours: made again
        return None

    def _link_out(self, obj: str, dst: str) -> None:
        for attempt in range(8):
            try:
                os.link(obj, dst)
                break
            except FileNotFoundError:
                # another worker replaced the object by its equal copy while link(2) held the inode it
                # replaced, whose last link was going (the kernel says ENOENT): the new one is there
                if attempt == 7:
                    raise
            except OSError as e:
                if e.errno != errno.EMLINK:  # an empty __init__.py in every package of every part ...
                    raise
                shutil.copy2(obj, dst)
                break
        self.used.add(os.path.basename(obj))

    def place_host_file(self, src: str, st: os.stat_result, dst: str, data: bytes | None = None) -> None:
        """`dst` gets the content of host file `src` (as it is, `data` if already read), through the
        object of that content if the file may be shared (see _shareable), else directly."""
        digest = self.hashes.digest(src, st) if data is None else self.hashes.digest_data(st, data)
        if not _shareable(st):
            _link_or_copy(src, dst)
            return
        obj = self.path(digest, st.st_mode)
        if self._valid(obj, digest) is None:
            try:
                os.link(src, obj, follow_symlinks=False)  # the host's own inode: nothing copied
            except FileExistsError:
                pass  # another worker of this build linked the same content just now
            except OSError:  # another filesystem, an immutable file ...
                self._write_object(obj, src_path=src, st=st)
            else:
                self.new_bytes += st.st_size
        self._link_out(obj, dst)

    def place_bytes(self, data: bytes, st: os.stat_result, dst: str) -> None:
        """`dst` gets `data` (a rewritten file), with `st`'s mode (not setuid, not writable by others)
        and mtime (a .pyc header compares its source's), through the object of that content."""
        digest = hashlib.sha256(data).digest()
        mode = st.st_mode & 0o755
        obj = self.path(digest, mode)
        if self._valid(obj, digest) is None:
            self._write_object(obj, data=data, st=st, mode=mode)
        self._link_out(obj, dst)

    def adopt(self, path: str) -> None:
        """A file made in place (py_compile's .pyc): replaced by the link to the object of its content."""
        st = os.lstat(path)
        digest = digest_of(path)
        obj = self.path(digest, st.st_mode)
        if self._valid(obj, digest) is None:
            os.link(path, obj)
            self.hashes.put(st, digest)
            self.new_bytes += st.st_size
            self.written_bytes += st.st_size
            self.used.add(os.path.basename(obj))
            return
        tmp = path + ".adopt"
        os.link(obj, tmp)
        os.replace(tmp, path)
        self.used.add(os.path.basename(obj))

    def _write_object(self, obj: str, *, data: bytes | None = None, src_path: str | None = None,
                      st: os.stat_result, mode: int | None = None) -> None:
        tmp = f"{obj}.{os.getpid()}.tmp"  # (workers are processes: their pids differ)
        if src_path is not None:
            shutil.copyfile(src_path, tmp, follow_symlinks=False)
            data_len = st.st_size
        else:
            assert data is not None
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            data_len = len(data)
        os.chmod(tmp, (st.st_mode if mode is None else mode) & 0o7777 & ~0o7022)  # never setuid, never writable by others
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
        self.hashes.put(os.lstat(tmp), hashlib.sha256(data).digest() if data is not None else digest_of(tmp))
        os.replace(tmp, obj)
        self.new_bytes += data_len
        self.written_bytes += data_len

    def take_used(self) -> set[str]:
        used, self.used = self.used, set()
        return used
