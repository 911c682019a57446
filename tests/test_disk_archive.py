"""Filesystem snapshots of the linux backend (backends/disk_archive.py, LinuxBackend.export_files,
SandboxSpec.files), with real sandboxes running the real agent (commands as the sandbox's user and root).

Round trips keep what a sandbox changed (home, /tmp, the overlays over /usr, /opt ...: files, links,
whiteouts, opaque directories). The attacks: a sandbox's links to host paths must be archived as
links, never read through (also while the sandbox swaps them during an export), and a hostile archive
extracted for a new sandbox must change nothing on the host and fail with a clear error.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import tarfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentcell.backends import disk_archive
from agentcell.backends.base import Limits, SandboxSpec
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox
from agentcell.errors import InvalidArgumentError, ResourceExhaustedError
from agentcell.runtime.protocol import AgentChannel
from tests.helpers import started

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/self/ns/user"),
                                reason="the linux backend needs root and user namespaces")

GIB = 1 << 30


class Box:
    """A sandbox of the real agent, driven by proc.start (as the sandbox's user or its root)."""

    def __init__(self, backend: LinuxBackend, sandbox: LinuxSandbox, channel: AgentChannel) -> None:
        self.backend = backend
        self.sandbox = sandbox
        self.channel = channel

    @classmethod
    async def create(cls, backend: LinuxBackend, **spec: Any) -> Box:
        sb = await backend.create(SandboxSpec(**spec))
        assert isinstance(sb, LinuxSandbox)
        return cls(backend, sb, await AgentChannel.open(sb.sock))

    async def sh(self, cmd: str, user: str | None = None, check: bool = True) -> str:
        req = {"cmd": "/bin/bash", "args": ["-c", cmd], "envs": {}, "cwd": None, "tag": None, "stdin": False,
               "pty": None, "timeout_ms": 60_000, "user": user}  # fmt: skip
        out, err, end = b"", b"", {}
        async for f in self.channel.stream("proc.start", **req):
            f.raise_for_error()
            event = f.header.get("event")
            if event == "stdout":
                out += f.payload
            elif event == "stderr":
                err += f.payload
            elif event == "end":
                end = f.header
        if check:
            assert end.get("exit_code") == 0, (cmd, end, out, err)
        return out.decode()

    async def export(self, dest: Path, max_bytes: int = GIB) -> int:
        await self.backend.pause(self.sandbox)  # as the server does: a consistent archive
        try:
            return await self.backend.export_files(self.sandbox, str(dest), max_bytes)
        finally:
            await self.backend.resume(self.sandbox)

    async def close(self) -> None:
        await self.channel.close()
        await self.backend.kill(self.sandbox)


@pytest.fixture(scope="module")
async def backend() -> AsyncIterator[LinuxBackend]:
    async with started(LinuxBackend(max_sandboxes=100, standbys=1, preload=False)) as be:
        yield be


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def members(path: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(path) as tf:
        return {m.name: m for m in tf.getmembers()}


# -- round trips ---------------------------------------------------------------------------------


async def test_round_trip_keeps_home_tmp_and_the_overlays(backend: LinuxBackend, workdir: Path) -> None:
    a = await Box.create(backend)  # a claimed standby: standbys can be exported too
    b = None
    try:
        await a.sh("set -e; cd ~; echo 'my notes' > notes.txt; chmod 640 notes.txt; mkdir -p proj/sub;"
                   "head -c 1048576 /dev/urandom > proj/sub/blob; ln -s notes.txt link; ln notes.txt hard;"
                   "mkfifo fifo; touch -d '2020-01-02 03:04:05' old; echo t > /tmp/t.txt; mkdir /tmp/empty")
        # as the sandbox's root, through the copy-on-write overlays: a new tool, a deleted host file
        # (whiteout), a host directory deleted and made again (opaque)
        docs = (await a.sh("cd /usr/share/doc && for d in *; do [ $(ls -A $d | wc -l) -ge 2 ] && echo $d; done"
                           " | head -2")).split()
        assert len(docs) == 2, docs
        gone, remade = docs
        gone_file = (await a.sh(f"ls -A /usr/share/doc/{gone} | head -1")).strip()
        await a.sh("set -e; mkdir -p /usr/local/bin; printf '#!/bin/sh\\necho tool ran\\n' > /usr/local/bin/mytool;"
                   "chmod 755 /usr/local/bin/mytool; echo 'root data' > /opt/rootfile;"
                   f"rm /usr/share/doc/{gone}/{gone_file}; rm -r /usr/share/doc/{remade};"
                   f"mkdir /usr/share/doc/{remade}; echo new > /usr/share/doc/{remade}/only", user="root")
        before = await a.sh("cd ~; sha256sum proj/sub/blob notes.txt; stat -c '%n %a %U %Y' notes.txt old proj")
        archive = workdir / "a.tar"
        size = await a.export(archive)
        assert size == archive.stat().st_size and size > 1 << 20

        entries = members(archive)
        assert entries["home/link"].issym() and entries["home/link"].linkname == "notes.txt"
        assert entries["home/hard"].islnk() or entries["home/notes.txt"].islnk()
        assert entries["home/fifo"].isfifo()
        assert entries["home/notes.txt"].uid == 1000 and entries["root/opt/rootfile"].uid == 0
        whiteout = entries[f"root/usr/share/doc/{gone}/{gone_file}"]
        assert whiteout.ischr() and (whiteout.devmajor, whiteout.devminor) == (0, 0)
        assert entries[f"root/usr/share/doc/{remade}"].pax_headers.get(disk_archive.OPAQUE_PAX) == "y"
        assert not any(name.startswith(("shm", ".root", "root/opt/agentcell/python")) for name in entries)

        b = await Box.create(backend, files=str(archive))
        assert b.sandbox.sandbox_id != a.sandbox.sandbox_id
        assert await b.sh("cd ~; sha256sum proj/sub/blob notes.txt; stat -c '%n %a %U %Y' notes.txt old proj") == before
        assert (await b.sh("readlink ~/link; stat -c %F ~/fifo; stat -c %i ~/notes.txt ~/hard | uniq | wc -l")).split() \
            == ["notes.txt", "fifo", "1"]
        assert await b.sh("cat /tmp/t.txt; ls -A /tmp/empty | wc -l") == "t\n0\n"
        assert await b.sh("mytool; stat -c '%U %a' /usr/local/bin/mytool /opt/rootfile; cat /opt/rootfile") \
            == "tool ran\nroot 755\nroot 644\nroot data\n"
        assert await b.sh(f"ls -A /usr/share/doc/{gone} | grep -cx '{gone_file}'", check=False) == "0\n"
        assert await b.sh(f"ls -A /usr/share/doc/{remade}") == "only\n"
        assert (await b.sh("cat /etc/hostname")).strip() == b.sandbox.sandbox_id  # its own, not a's
        await b.sh("echo more >> ~/notes.txt; rm /usr/local/bin/mytool", user="root")  # writable as before
        # and it can be exported again
        again = workdir / "b.tar"
        await b.export(again)
        assert "root/usr/local/bin/mytool" not in members(again)
    finally:
        await a.close()
        if b is not None:
            await b.close()


async def test_user_pip_install_into_the_venv_round_trips(backend: LinuxBackend, workdir: Path) -> None:
    """What `pip install` as the default user leaves (the venv's site-packages and bin are the user's)."""
    a = await Box.create(backend)
    try:
        site = (await a.sh("python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'")).strip()
        await a.sh(f"set -e; mkdir -p {site}/mypkg; echo 'VALUE = 42' > {site}/mypkg/__init__.py;"
                   f"echo mypkg > {site}/mypkg-1.0.pth")
        archive = workdir / "pip.tar"
        await a.export(archive)
    finally:
        await a.close()
    b = await Box.create(backend, files=str(archive))
    try:
        assert await b.sh("python3 -c 'import mypkg; print(mypkg.VALUE)'") == "42\n"
        assert (await b.sh(f"stat -c %U {site}/mypkg")).strip() == "user"
    finally:
        await b.close()


def snapshot_tree(root: Path) -> dict[bytes, tuple[Any, ...]]:
    """Every entry below `root`: (type, mode, size, data or link target, mtime) by its path in bytes."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(os.fsencode(root)):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            data = os.readlink(path) if os.path.islink(path) else \
                Path(os.fsdecode(path)).read_bytes() if os.path.isfile(path) else b""
            mtime = None if os.path.isdir(path) and not os.path.islink(path) else int(st.st_mtime)
            seen[os.path.relpath(path, os.fsencode(root))] = (st.st_mode, st.st_size if not os.path.isdir(path) else 0,
                                                               data, mtime)
    return seen


def test_the_format_round_trips_odd_names_without_a_sandbox(tmp_path: Path) -> None:
    """write_archive / extract_archive alone, on plain directories: names past ustar's 100 bytes (its
    prefix field and pax records), non-ASCII and non-UTF-8 names, long link targets, hard links; the
    headers of plain entries are byte for byte what tarfile writes."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    home = src / "home"
    deep = home / "/".join(["d" * 40] * 5)
    deep.mkdir(parents=True)
    (deep / ("f" * 90)).write_text("deep")
    (home / ("e" * 99)).mkdir()
    (home / "ü" / "ñ").mkdir(parents=True)
    (home / "ü" / "ñ" / "é").write_text("unicode")
    (src / "tmp").mkdir()
    with open(os.path.join(os.fsencode(src), b"tmp/bad\xff"), "wb") as f:
        f.write(b"not utf-8")
    os.symlink("t" * 150, home / "longlink")
    os.symlink("../tmp", home / "rel")
    (home / "a").write_bytes(os.urandom(5000))
    os.link(home / "a", home / "b")
    os.mkfifo(home / "fifo")
    os.utime(home / "a", (1_600_000_000, 1_600_000_000))
    root_fd = os.open(src, os.O_PATH | os.O_DIRECTORY)
    try:
        out = io.BytesIO()
        size = disk_archive.write_archive(root_fd, out, GIB, disk_archive.Owners(0, 0), overlays=["/usr"])
    finally:
        os.close(root_fd)
    assert size == len(out.getvalue())
    out.seek(0)
    with tarfile.open(fileobj=out) as tf:
        for m in tf:
            header = disk_archive._ustar(m)
            if header is not None and len(m.name) < 100:
                assert header == m.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"), m.name
    dst.mkdir()
    dst_fd = os.open(dst, os.O_PATH | os.O_DIRECTORY)
    try:
        out.seek(0)
        disk_archive.extract_archive(out, dst_fd, 0, 0, 0, 0, overlays=["/usr"])
    finally:
        os.close(dst_fd)
    assert snapshot_tree(dst / "home") == snapshot_tree(home)
    assert snapshot_tree(dst / "tmp") == snapshot_tree(src / "tmp")
    assert os.stat(dst / "home" / "a").st_ino == os.stat(dst / "home" / "b").st_ino


# -- a sandbox's links to the host ---------------------------------------------------------------


@pytest.fixture
def host_canary() -> Iterator[tuple[Path, bytes]]:
    """A host directory with a file only host root can read: a sandbox's export must never hold it."""
    secret = f"host-canary-{uuid.uuid4().hex}".encode()
    d = Path(f"/root/agentcell-fsarchive-{uuid.uuid4().hex[:8]}")
    d.mkdir(mode=0o700)
    (d / "secret").write_bytes(secret)
    try:
        yield d, secret
    finally:
        (d / "secret").unlink()
        d.rmdir()


async def test_export_keeps_links_to_host_paths_as_links(backend: LinuxBackend, workdir: Path,
                                                         host_canary: tuple[Path, bytes]) -> None:
    canary_dir, secret = host_canary
    shadow = Path("/etc/shadow").read_bytes() if Path("/etc/shadow").exists() else b""
    links = {"home/shadow": "/etc/shadow", "home/passwd": "/etc/passwd", "home/proc_root": "/proc/1/root",
             "home/up": "..", "home/rootdir": "/", "tmp/canary": str(canary_dir), "tmp/secret": f"{canary_dir}/secret",
             "tmp/self_root": "/proc/self/root/etc"}  # fmt: skip
    a = await Box.create(backend)
    try:
        await a.sh(" && ".join(f"ln -s '{target}' {'~' if name.startswith('home') else '/tmp'}/{name.split('/')[1]}"
                               for name, target in links.items()))
        archive = workdir / "links.tar"
        await a.export(archive)
    finally:
        await a.close()
    entries = members(archive)
    for name, target in links.items():
        assert entries[name].issym() and entries[name].linkname == target, name
    assert not [n for n in entries if n.startswith(tuple(f"{n}/" for n in links))]  # never walked into one
    data = archive.read_bytes()
    assert secret not in data
    for line in shadow.splitlines():
        if b":$" in line:  # a hashed password's line
            assert line not in data


async def test_export_of_a_running_sandbox_swapping_links_never_reads_the_host(
        backend: LinuxBackend, workdir: Path, host_canary: tuple[Path, bytes]) -> None:
    """Unpaused, a sandbox swaps a directory for a link to a host directory as fast as it can: a walk
    that checked a name and then opened it by path would read the host's file some of the time."""
    canary_dir, secret = host_canary
    a = await Box.create(backend)
    try:
        await a.sh("mkdir -p ~/d /tmp/d; echo inner > ~/d/secret; echo inner > /tmp/d/secret")
        await a.sh(f"nohup bash -c 'while :; do for p in ~/d /tmp/d; do mv $p $p.real; ln -s {canary_dir} $p; "
                   "rm $p; mv $p.real $p; done; done' >/dev/null 2>&1 &")
        await asyncio.sleep(0.2)
        swapped = 0  # exports that met the swap half-way (a link, or the directory moved away)
        for i in range(30):
            archive = workdir / f"race{i}.tar"
            await backend.export_files(a.sandbox, str(archive), GIB)
            assert secret not in archive.read_bytes()
            entries = members(archive)
            swapped += "home/d/secret" not in entries or "tmp/d/secret" not in entries
            for m in entries.values():
                assert not (m.issym() and m.name.endswith("/secret"))
            archive.unlink()
        print(f"{swapped} of 30 exports met a swap")
        assert swapped > 0
    finally:
        await a.close()


# -- hostile archives ----------------------------------------------------------------------------


def make_tar(path: Path, entries: list[tuple[str, bytes | str | None, dict[str, Any]]]) -> Path:
    """A hand-made archive: (name, data (bytes: a file) or link target, TarInfo fields)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data, fields in entries:
            info = tarfile.TarInfo(name)
            for k, v in fields.items():
                setattr(info, k, v)
            if isinstance(data, bytes):
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                if data is not None:
                    info.linkname = data
                tf.addfile(info)
    return path


def host_state() -> dict[str, str]:
    watched = ["/etc/passwd", "/etc/shadow", "/etc/hostname", "/etc/hosts"]
    return {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in watched if Path(p).exists()}


SYM, LNK, DIR, CHR, BLK = tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE


@pytest.mark.parametrize("case, entries", [
    ("absolute", [("/root/PWNED", b"x", {})]),
    ("absolute-home", [("/home/user/PWNED", b"x", {})]),
    ("dotdot", [("home/../../../root/PWNED", b"x", {})]),
    ("dotdot-root", [("root/usr/../../../../root/PWNED", b"x", {})]),
    ("outside-places", [("etc/PWNED", b"x", {})]),
    ("not-an-overlay", [("root/bin/PWNED", b"x", {})]),
    ("file-through-symlink", [("home/esc", "{target}", {"type": SYM}), ("home/esc/PWNED", b"x", {})]),
    ("dir-through-symlink", [("tmp/esc", "/", {"type": SYM}), ("tmp/esc/root", None, {"type": DIR}),
                             ("tmp/esc/root/PWNED", b"x", {})]),
    ("through-symlink-in-overlay", [("root/usr/local", "{target}", {"type": SYM}),
                                    ("root/usr/local/PWNED", b"x", {})]),
    ("hardlink-to-host", [("home/pw", "/etc/passwd", {"type": LNK})]),
    ("hardlink-dotdot", [("home/pw", "home/../../../etc/passwd", {"type": LNK})]),
    ("hardlink-to-a-symlink-entry", [("home/s", "/etc/passwd", {"type": SYM}), ("home/pw", "home/s", {"type": LNK})]),
    ("hardlink-across-places", [("tmp/f", b"x", {}), ("home/pw", "tmp/f", {"type": LNK})]),
    ("char-device", [("home/mem", None, {"type": CHR, "devmajor": 1, "devminor": 1})]),
    ("block-device", [("home/sda", None, {"type": BLK, "devmajor": 8, "devminor": 0})]),
    ("duplicate", [("home/f", b"x", {}), ("home/f", b"y", {})]),
    ("runtime-mount-point", [("root/opt/agentcell/python", "/", {"type": SYM})]),
    ("runtime-mount-point-parent", [("root/opt/agentcell", "/tmp", {"type": SYM})]),
    ("runtime-mount-point-parent-whiteout", [("root/var/lib", None, {"type": CHR})]),
    ("runtime-mount-point-parent-opaque", [("root/opt/agentcell", None, {"type": DIR, "pax_headers": {"AGENTCELL.opaque": "y"}})]),
    ("not-a-tar", [("", b"", {})]),
])  # fmt: skip
async def test_hostile_archive_is_refused_and_the_host_is_untouched(
        backend: LinuxBackend, workdir: Path, case: str, entries: list[Any]) -> None:
    target = Path(f"/root/agentcell-fsarchive-target-{uuid.uuid4().hex[:8]}")
    target.mkdir(mode=0o700)
    try:
        if case == "not-a-tar":
            archive = workdir / "junk.tar"
            archive.write_bytes(b"this is not a tar archive" * 100)
        else:
            fixed = [(n, d.format(target=target) if isinstance(d, str) else d, f) for n, d, f in entries]
            archive = make_tar(workdir / f"{case}.tar", fixed)
        before = host_state()
        sandboxes = len(backend._owned)
        with pytest.raises(InvalidArgumentError) as raised:
            await Box.create(backend, files=str(archive))
        print(case, "->", raised.value)
        assert not list(target.iterdir())
        assert not Path("/root/PWNED").exists() and not Path("/home/user/PWNED").exists()
        assert host_state() == before
        assert len(backend._owned) == sandboxes  # the failed sandbox is gone
    finally:
        for child in target.iterdir():
            child.unlink()
        target.rmdir()


async def test_links_where_the_sandbox_setup_writes_are_replaced_not_followed(
        backend: LinuxBackend, workdir: Path) -> None:
    """The sandbox's setup writes /etc/hosts, /etc/hostname and /usr/bin/sudo through the overlays as host
    root: links (or a fifo) a restored sandbox left there are replaced, never written through."""
    target = Path(f"/root/agentcell-fsarchive-target-{uuid.uuid4().hex[:8]}")
    target.mkdir(mode=0o700)
    try:
        archive = make_tar(workdir / "setup-links.tar", [
            ("root/etc/hosts", f"{target}/hosts", {"type": SYM}), ("root/etc/hostname", None, {"type": tarfile.FIFOTYPE}),
            ("root/usr/bin", None, {"type": DIR, "mode": 0o755}), ("root/usr/bin/sudo", f"{target}/sudo", {"type": SYM}),
        ])  # fmt: skip
        before = host_state()
        b = await Box.create(backend, files=str(archive))
        try:
            assert "localhost" in await b.sh("cat /etc/hosts")
            assert (await b.sh("cat /etc/hostname")).strip() == b.sandbox.sandbox_id
            assert (await b.sh("stat -c %F /etc/hosts /etc/hostname /usr/bin/sudo")).splitlines() == ["regular file"] * 3
        finally:
            await b.close()
        assert not list(target.iterdir())
        assert host_state() == before
    finally:
        for child in target.iterdir():
            child.unlink()
        target.rmdir()


async def test_hostile_but_valid_links_stay_inside_the_sandbox(backend: LinuxBackend, workdir: Path) -> None:
    """Links to anywhere are fine as links: in the sandbox they resolve in its own root."""
    archive = make_tar(workdir / "links.tar", [
        ("home/shadow", "/etc/shadow", {"type": SYM}), ("home/up", "../../..", {"type": SYM}),
        ("home/data", b"kept", {"uid": 1000, "gid": 1000, "mode": 0o4755}),  # set-uid: nosuid disk anyway
        ("tmp/dir", None, {"type": DIR, "mode": 0o700, "uid": 1000}), ("tmp/dir/f", b"x", {"uid": 12345}),
    ])
    b = await Box.create(backend, files=str(archive))
    try:
        assert (await b.sh("readlink ~/shadow ~/up; cat ~/data")).split() == ["/etc/shadow", "../../..", "kept"]
        assert await b.sh("cat ~/shadow", check=False) == ""  # the sandbox's own /etc/shadow: not readable
        # an owner that is not the sandbox's user is its root
        assert (await b.sh("stat -c '%U %a' /tmp/dir /tmp/dir/f")).split() == ["user", "700", "root", "644"]
    finally:
        await b.close()


async def test_an_archive_bigger_than_the_disk_fails_cleanly(backend: LinuxBackend, workdir: Path) -> None:
    archive = make_tar(workdir / "big.tar", [("home/big", bytes(24 << 20), {})])
    with pytest.raises(ResourceExhaustedError, match="does not fit"):
        await Box.create(backend, files=str(archive), limits=Limits(disk_mb=16))
    # more entries than the disk has inodes (one per 8 KiB: 2048 for 16 MiB)
    many = make_tar(workdir / "many.tar", [(f"tmp/f{i}", b"", {}) for i in range(3000)])
    with pytest.raises(ResourceExhaustedError, match="does not fit"):
        await Box.create(backend, files=str(many), limits=Limits(disk_mb=16))
    b = await Box.create(backend, files=str(archive), limits=Limits(disk_mb=64))  # fits in a bigger one
    try:
        assert (await b.sh("stat -c %s ~/big")).strip() == str(24 << 20)
    finally:
        await b.close()


async def test_an_archive_that_does_not_exist_is_an_invalid_argument(backend: LinuxBackend, workdir: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot open"):
        await Box.create(backend, files=str(workdir / "missing.tar"))
    with pytest.raises(InvalidArgumentError, match="not a file"):
        await Box.create(backend, files=str(workdir))


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in os.listdir(f"/proc/{p}/task"):
            with open(f"/proc/{p}/task/{task}/children") as f:
                todo += [int(c) for c in f.read().split()]
    return found


async def test_no_process_of_the_sandbox_holds_its_disk_root(backend: LinuxBackend) -> None:
    """The disk's root fd goes to the server only: inside, it would reach the overlays' upper layers
    (and their whiteouts and xattrs) beside the mounts."""
    a = await Box.create(backend)
    try:
        await a.sh("sleep 30 >/dev/null 2>&1 &")
        disk = os.fstat(a.sandbox.disk_fd)
        pids = descendants(a.sandbox.host_pid)
        assert len(pids) >= 2
        for pid in pids:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                assert (st.st_dev, st.st_ino) != (disk.st_dev, disk.st_ino), (pid, fd)
    finally:
        await a.close()


async def test_export_stops_at_max_bytes(backend: LinuxBackend, workdir: Path) -> None:
    a = await Box.create(backend)
    try:
        await a.sh("head -c 3000000 /dev/urandom > ~/blob")
        dest = workdir / "capped.tar"
        with pytest.raises(ResourceExhaustedError, match="snapshot may hold"):
            await a.export(dest, max_bytes=2_000_000)
        assert not dest.exists()
        assert await a.export(dest, max_bytes=4_000_000) > 3_000_000
    finally:
        await a.close()


async def test_export_of_a_killed_sandbox_is_refused(backend: LinuxBackend, workdir: Path) -> None:
    from agentcell.errors import SandboxGoneError

    a = await Box.create(backend)
    await a.close()
    with pytest.raises(SandboxGoneError):
        await backend.export_files(a.sandbox, str(workdir / "gone.tar"), GIB)
