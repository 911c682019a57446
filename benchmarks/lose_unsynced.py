"""A filesystem that forgets what was not fsynced: a power cut for the state dir, simulated in FUSE.

    .venv/bin/python benchmarks/lose_unsynced.py BACKING MOUNTPOINT CONTROL_SOCKET

It passes every call through to BACKING (a tmpfs: what the writer sees, the page cache) and keeps, beside it, a
model of what a disk would hold after a power cut, following the strictest reading of POSIX:

* a file's data is on disk as it was at its last `fsync`/`fdatasync` (never synced: empty);
* a directory's entries (a create, a rename, an unlink, a mkdir) are on disk as they were at the
  directory's last `fsync` (never synced: none);
* everything BACKING held at the mount, or at a `settle` (the kernel's periodic writeback), is on disk.

A real filesystem keeps at least this much (ext4 and xfs usually more), so state that is whole on this
model's disk is whole on theirs. Every call that changes something is a step; `arm N PREFIX` makes the
N-th step from now on a path under PREFIX the cut: it and every later change anywhere fail with EIO (the
machine is off), and `image DEST UNDER` writes what the disk holds under UNDER then into DEST, for a
restarted server to read.

The control socket takes one command per connection and answers one line:
`settle` · `arm N [PREFIX]` (N 0: never; PREFIX /: every path) · `steps` (how many under PREFIX since the
arm) · `cut` (`no`, or `yes <step> <path>`) · `image DEST [UNDER]` · `log` (the steps counted since the
arm, one per line).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mfusepy


@dataclass
class Node:
    """An inode as the disk holds it."""

    kind: str  # "file", "dir", "symlink"
    mode: int
    uid: int
    gid: int
    data: bytes = b""  # a file's synced data
    entries: dict[str, int] = field(default_factory=dict)  # a directory's synced names -> inodes
    target: str = ""  # a symlink's


class Disk:
    """What a power cut leaves: the synced data and entries of every inode, by BACKING's inode number."""

    def __init__(self, backing: Path) -> None:
        self.backing = backing
        self.root = os.lstat(backing).st_ino
        self.nodes: dict[int, Node] = {}
        self.settle()

    def settle(self) -> None:
        """Everything BACKING holds now is on disk (a `sync`)."""
        self.nodes = {}
        self._take_tree(self.backing)

    def _take_tree(self, path: Path) -> None:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            self.sync_dir(path)
            for name in os.listdir(path):
                self._take_tree(path / name)
        elif stat.S_ISREG(st.st_mode):
            self.sync_file(path)

    def _node(self, st: os.stat_result, path: Path) -> Node:
        node = self.nodes.get(st.st_ino)
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "symlink" if stat.S_ISLNK(st.st_mode) else "file"
        if node is None or node.kind != kind:  # (BACKING is a tmpfs: an inode number is never reused)
            node = Node(kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                        target=os.readlink(path) if kind == "symlink" else "")
            self.nodes[st.st_ino] = node
        node.mode, node.uid, node.gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
        return node

    def sync_file(self, path: Path) -> None:
        """A file's data (and its mode) on disk as `path` (a name or /proc/self/fd/N) holds it now."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        self._node(st, path).data = b"".join(chunks)

    def sync_dir(self, path: Path) -> None:
        """A directory's entries on disk as they are now (a new child's inode is known, its data not)."""
        node = self._node(os.lstat(path), path)
        entries = {}
        for name in os.listdir(path):
            with contextlib.suppress(FileNotFoundError):  # gone meanwhile
                child = os.lstat(path / name)
                if stat.S_ISDIR(child.st_mode) or stat.S_ISREG(child.st_mode) or stat.S_ISLNK(child.st_mode):
                    self._node(child, path / name)
                    entries[name] = child.st_ino
        node.entries = entries

    def write_to(self, dest: Path, under: str = "/") -> None:
        """The disk's tree below `under` (a path in the mount), as a restarted machine would find it,
        into `dest` (made; hard links kept). FileNotFoundError if `under` is not on the disk."""
        ino = self.root
        for name in Path(under).parts[1:]:
            ino = self.nodes[ino].entries.get(name, -1)
            if self.nodes.get(ino, Node("file", 0, 0, 0)).kind != "dir":
                raise FileNotFoundError(f"{under} is not a directory on the disk")
        dest.mkdir(parents=True)
        self._write_dir(self.nodes[ino], dest, {}, {ino})

    def _write_dir(self, node: Node, dest: Path, written: dict[int, Path], above: set[int]) -> None:
        for name, ino in sorted(node.entries.items()):
            child, path = self.nodes[ino], dest / name
            if ino in written:
                os.link(written[ino], path)
                continue
            if child.kind == "dir":
                if ino in above:  # a directory renamed under itself on the model's disk: not followed
                    continue
                path.mkdir()
                self._write_dir(child, path, written, above | {ino})
            elif child.kind == "symlink":
                os.symlink(child.target, path)
                continue
            else:
                path.write_bytes(child.data)
                written[ino] = path
            os.chmod(path, child.mode)
            os.chown(path, child.uid, child.gid)
        os.chmod(dest, node.mode)
        os.chown(dest, node.uid, node.gid)


class Cut(Exception):
    pass


class LoseUnsynced(mfusepy.Operations):
    """A passthrough to BACKING that tells the Disk of every fsync, and counts (and cuts at) changes."""

    use_ns = True  # utimens' times in nanoseconds

    def __init__(self, backing: Path) -> None:
        self.backing = backing
        self.disk = Disk(backing)
        self._mutex = threading.Lock()
        self.steps: list[tuple[str, str]] = []
        self.cut_at = 0
        self.prefix = "/"
        self.cut: tuple[str, str] | None = None

    # --- the control socket's commands -------------------------------------------------------------

    def command(self, line: str) -> str:
        word, _, arg = line.strip().partition(" ")
        with self._mutex:
            if word == "settle":
                self.disk.settle()
            elif word == "arm":
                n, _, prefix = arg.partition(" ")
                self.steps, self.cut_at, self.prefix, self.cut = [], int(n), prefix or "/", None
            elif word == "steps":
                return str(len(self.steps))
            elif word == "cut":
                return "no" if self.cut is None else f"yes {self.cut[0]} {self.cut[1]}"
            elif word == "image":
                dest, _, under = arg.partition(" ")
                self.disk.write_to(Path(dest), under or "/")
            elif word == "log":
                return "".join(f"{op} {path}\n" for op, path in self.steps)
            else:
                return f"unknown command {word!r}"
        return "ok"

    def _step(self, op: str, path: str) -> None:
        """A change is about to be made: refused if the power is off, or if this is the cut."""
        if self.cut is not None:
            raise mfusepy.FuseOSError(errno.EIO)
        if not (path + "/").startswith(self.prefix.rstrip("/") + "/"):
            return
        self.steps.append((op, path))
        if len(self.steps) == self.cut_at:
            self.cut = (op, path)
            raise mfusepy.FuseOSError(errno.EIO)

    def _path(self, path: str) -> Path:
        return self.backing / path.lstrip("/")

    def _change(self, op: str, path: str, call, *args):  # noqa: ANN001, ANN202
        with self._mutex:
            self._step(op, path)
            return _os(call, *args)

    # --- reads --------------------------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict:
        st = _os(os.fstat, fh) if fh is not None else _os(os.lstat, self._path(path))
        return {key: getattr(st, key) for key in (
            "st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime", "st_mtime", "st_ctime")}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *_os(os.listdir, self._path(path))]

    def readlink(self, path: str) -> str:
        return _os(os.readlink, self._path(path))

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._path(path), amode):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def statfs(self, path: str) -> dict:
        sv = os.statvfs(self._path(path))
        return {key: getattr(sv, key) for key in (
            "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag",
            "f_frsize", "f_namemax")}

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_TRUNC | os.O_CREAT):
            with self._mutex:
                self._step("open-truncate", path)
                return _os(os.open, self._path(path), flags | os.O_CLOEXEC)
        return _os(os.open, self._path(path), flags | os.O_CLOEXEC)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return _os(os.pread, fh, size, offset)

    def opendir(self, path: str) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    # --- changes ------------------------------------------------------------------------------------

    def create(self, path: str, mode: int, flags: int = os.O_WRONLY) -> int:  # type: ignore[override]
        with self._mutex:
            self._step("create", path)
            return _os(os.open, self._path(path), flags | os.O_CREAT | os.O_CLOEXEC, mode)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return self._change("write", path, os.pwrite, fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self._change("truncate", path, os.truncate, fh if fh is not None else self._path(path), length)
        return 0

    def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> int:
        if mode:
            raise mfusepy.FuseOSError(errno.EOPNOTSUPP)
        self._change("fallocate", path, os.posix_fallocate, fh, offset, size)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        self._change("mkdir", path, os.mkdir, self._path(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        self._change("rmdir", path, os.rmdir, self._path(path))
        return 0

    def unlink(self, path: str) -> int:
        self._change("unlink", path, os.unlink, self._path(path))
        return 0

    def rename(self, old: str, new: str) -> int:
        self._change("rename", f"{old} -> {new}", os.rename, self._path(old), self._path(new))
        return 0

    def link(self, target: str, source: str) -> int:
        self._change("link", f"{target} = {source}", os.link, self._path(source), self._path(target))
        return 0

    def symlink(self, target: str, source: str) -> int:
        self._change("symlink", target, os.symlink, source, self._path(target))
        return 0

    def chmod(self, path: str, mode: int) -> int:
        self._change("chmod", path, os.chmod, self._path(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        self._change("chown", path, os.lchown, self._path(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        ns = None if times is None else times
        self._change("utimens", path, lambda p: os.utime(p, ns=ns, follow_symlinks=False), self._path(path))
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        with self._mutex:
            self._step("fdatasync" if datasync else "fsync", path)
            _os(os.fsync, fh)
            _os(self.disk.sync_file, Path(f"/proc/self/fd/{fh}"))
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        with self._mutex:
            self._step("fsyncdir", path)
            _os(self.disk.sync_dir, self._path(path))
        return 0


def _os(call, *args):  # noqa: ANN001, ANN202
    """An os call, its OSError as the errno FUSE answers."""
    try:
        return call(*args)
    except OSError as e:
        raise mfusepy.FuseOSError(e.errno or errno.EIO) from None


def serve_control(fs: LoseUnsynced, path: Path) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()

    def loop() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                line = conn.makefile().readline()
                try:
                    answer = fs.command(line)
                except Exception as e:  # a bad command is answered, never the end of the filesystem
                    answer = f"error {type(e).__name__}: {e}"
                conn.sendall((answer.rstrip("\n") + "\n").encode())

    threading.Thread(target=loop, daemon=True).start()


def control(sock: Path, command: str, timeout: float = 60) -> str:
    """One command to a running filesystem's control socket; its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        s.sendall(command.encode() + b"\n")
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    answer = data.decode()
    if answer.startswith(("error ", "unknown command")):
        raise RuntimeError(f"lose_unsynced {command!r}: {answer.strip()}")
    return answer.rstrip("\n") if not command.startswith("log") else answer


@dataclass
class Mounted:
    path: Path  # the mount point: what the writer uses
    backing: Path
    sock: Path

    def control(self, command: str) -> str:
        return control(self.sock, command)


@contextlib.contextmanager
def mounted(work: Path) -> Iterator[Mounted]:
    """This filesystem mounted at work/mnt (over work/backing) while the block runs; unmounted after."""
    m = Mounted(work / "mnt", work / "backing", work / "control.sock")
    m.path.mkdir(parents=True)
    m.backing.mkdir()
    # a tmpfs, whose inode numbers are never reused: the model knows an inode by its number
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g,mode=0755", "lose_unsynced", str(m.backing)], check=True)
    log = (work / "lose_unsynced.log").open("wb")
    proc = subprocess.Popen([sys.executable, __file__, str(m.backing), str(m.path), str(m.sock)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (os.path.ismount(m.path) and m.sock.exists()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lose_unsynced did not mount; its log: {work / 'lose_unsynced.log'}")
            time.sleep(0.05)
        yield m
    finally:
        subprocess.run(["umount", "-l", str(m.path)], check=False, capture_output=True)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        subprocess.run(["umount", "-l", str(m.backing)], check=False, capture_output=True)


def main() -> None:
    backing, mountpoint, sock = (Path(a).absolute() for a in sys.argv[1:4])  # libfuse may chdir to /
    fs = LoseUnsynced(backing)
    serve_control(fs, sock)
    # single-threaded: the steps are in one order; allow_other + default_permissions: the kernel checks
    # access as on any filesystem (the server's helpers may run as other users)
    mfusepy.FUSE(fs, str(mountpoint), foreground=True, nothreads=True, allow_other=True,
                 default_permissions=True, fsname="lose_unsynced")


if __name__ == "__main__":
    main()
