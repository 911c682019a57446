"""The file collector (agentcell/record/linux/file_events.py), for real: sandboxes of the linux
backend with the real agent, their disks watched by fanotify from the host, and the exact events that
what they run leaves in the record."""

from __future__ import annotations

import asyncio
import os
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from agentcell.backends.base import SandboxSpec
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox
from agentcell.record.linux import file_events
from agentcell.record.linux.target import WatchTarget
from agentcell.runtime.protocol import KEEPALIVE, AgentChannel
from tests.helpers import started

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="fanotify filesystem marks and the linux backend need root")

Event = dict[str, Any]


class Box:
    def __init__(self, sandbox: LinuxSandbox, channel: AgentChannel) -> None:
        self.sandbox = sandbox
        self.channel = channel
        self.id = sandbox.sandbox_id

    async def sh(self, cmd: str, user: str = "user", timeout: float = 120) -> str:
        out, code = b"", None
        async with asyncio.timeout(timeout):
            async for f in self.channel.stream("proc.start", cmd="/bin/sh", args=["-c", cmd], user=user):
                if f is KEEPALIVE:
                    continue
                if f.header.get("event") == "end":
                    code = f.header.get("exit_code")
                out += f.payload
        assert code == 0, (cmd, code, out[-2000:])
        return out.decode(errors="replace")

    async def py(self, code: str, user: str = "user") -> str:
        return await self.sh(f"python3 -c {_quote(textwrap.dedent(code))}", user)


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def target(sb: LinuxSandbox) -> WatchTarget:
    return WatchTarget(sb.sandbox_id, sb.host_pid, (sb.owners.uid,), sb.cgroups, sb.disk_fd)


class Record:
    """The sink: every event, per sandbox."""

    def __init__(self) -> None:
        self.events: dict[str, list[Event]] = {}

    def __call__(self, sandbox_id: str, ev: Event) -> None:
        self.events.setdefault(sandbox_id, []).append(ev)

    def of(self, box: Box, kind: str | None = None, under: str = "") -> list[Event]:
        return [e for e in self.events.get(box.id, []) if (kind is None or e["kind"] == kind)
                and str(e.get("path", "")).startswith(under)]

    async def wait(self, box: Box, pred: Callable[[list[Event]], bool], timeout: float = 10) -> list[Event]:
        deadline = time.monotonic() + timeout
        while not pred(self.events.get(box.id, [])):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; events: {self.events.get(box.id, [])[-30:]}")
            await asyncio.sleep(0.05)
        return self.events.get(box.id, [])


@pytest.fixture(scope="module")
async def backend() -> AsyncIterator[LinuxBackend]:
    async with started(LinuxBackend(max_sandboxes=20, standbys=0, ready_timeout=90)) as be:
        yield be


@pytest.fixture(scope="module")
async def record_and_collector() -> AsyncIterator[tuple[Record, file_events.FileCollector]]:
    rec = Record()
    col = file_events.FileCollector(rec)
    await col.start()
    yield rec, col
    await col.close()


@pytest.fixture
def record(record_and_collector: tuple[Record, file_events.FileCollector]) -> Record:
    return record_and_collector[0]


@pytest.fixture
def collector(record_and_collector: tuple[Record, file_events.FileCollector]) -> file_events.FileCollector:
    return record_and_collector[1]


async def new_box(backend: LinuxBackend, collector: file_events.FileCollector) -> Box:
    sb = await backend.create(SandboxSpec("fe" + uuid.uuid4().hex[:12]))
    assert isinstance(sb, LinuxSandbox)
    collector.watch(target(sb))
    return Box(sb, await AgentChannel.open(sb.sock))


@pytest.fixture(scope="module")
async def box(backend: LinuxBackend, record_and_collector: tuple[Record, file_events.FileCollector]
              ) -> AsyncIterator[Box]:
    b = await new_box(backend, record_and_collector[1])
    yield b
    await backend.kill(b.sandbox)
    record_and_collector[1].unwatch(b.id)


def brief(events: list[Event]) -> list[tuple[Any, ...]]:
    out = []
    for e in events:
        if e["kind"] == "file.rename":
            out.append((e["kind"], e["path"], e["to"]))
            out[-1] += ("dir",) if e.get("dir") else ()
        elif e["kind"] == "file.chmod":
            out.append((e["kind"], e["path"], e["mode"]))
        elif e["kind"] == "file.write":
            out.append((e["kind"], e["path"], e["size"]))
        else:
            out.append((e["kind"], e["path"]) + (("dir",) if e.get("dir") else ()))
    return out


async def test_create_write_rename_chmod_delete_with_the_sandboxs_paths(box: Box, record: Record) -> None:
    def seen(kind: str, path: str) -> Callable[[list[Event]], bool]:
        return lambda ev: any(e["kind"] == kind and e["path"] == path for e in ev)

    # in steps: the collector reads sizes and modes when it sees the events, so a file must still be there
    await box.sh("mkdir /tmp/d && printf abc > /tmp/d/g && mv /tmp/d/g /tmp/d/h && chmod 600 /tmp/d/h")
    await record.wait(box, seen("file.chmod", "/tmp/d/h"))
    await box.sh("printf hello > /home/user/f1 && printf x > /dev/shm/s && rm /dev/shm/s")
    await record.wait(box, seen("file.delete", "/dev/shm/s"))
    await box.sh("mv /tmp/d /tmp/e && touch /home/user/f1 && rm -r /tmp/e")
    events = await record.wait(box, lambda ev: seen("file.delete", "/tmp/e")(ev) and seen("file.write", "/home/user/f1")(ev))
    mine = [e for e in events if e["path"].startswith(("/tmp/", "/home/user/f1", "/dev/shm/"))]
    got = brief(mine)
    writes = {g[1]: g[2] for g in got if g[0] == "file.write"}
    assert writes.get("/dev/shm/s", "?") in (None, 1)  # deleted at once: its size is unknown if the collector was late
    assert writes == {"/tmp/d/g": 3, "/home/user/f1": 5, "/dev/shm/s": writes.get("/dev/shm/s")}, got
    assert [g for g in got if g[0] != "file.write"] == [
        ("file.create", "/tmp/d", "dir"),
        ("file.create", "/tmp/d/g"),
        ("file.rename", "/tmp/d/g", "/tmp/d/h"),
        ("file.chmod", "/tmp/d/h", "0600"),
        ("file.create", "/home/user/f1"),
        ("file.create", "/dev/shm/s"),
        ("file.delete", "/dev/shm/s"),
        ("file.rename", "/tmp/d", "/tmp/e", "dir"),
        ("file.delete", "/tmp/e/h"),
        ("file.delete", "/tmp/e", "dir"),
    ], got
    # a pending write goes out before its file is renamed or deleted, under the name it was written to
    assert got.index(("file.write", "/tmp/d/g", 3)) < got.index(("file.rename", "/tmp/d/g", "/tmp/d/h"))
    shm = [g for g in got if g[:2] == ("file.write", "/dev/shm/s")][0]
    assert got.index(shm) < got.index(("file.delete", "/dev/shm/s"))
    for e in mine:
        assert e["source"] == "host"
        assert e["host_pid"] > 0  # its process's sandbox pid: only while it lives (see the symlink test)
    assert not [e for e in events if e["kind"] == "file.chmod" and e["path"] == "/home/user/f1"]  # touch: times only


async def test_a_write_through_a_symlink_names_the_real_file_and_the_writer(box: Box, record: Record) -> None:
    # the shell writes itself (a redirection) and lives on: the event names it by its pid in the sandbox
    out = await box.sh("printf 1 > /tmp/real && ln -s /tmp/real /home/user/link && printf 12345 > /home/user/link"
                       " && echo $$ && sleep 2")
    events = await record.wait(box, lambda ev: any(e["kind"] == "file.write" and e["path"] == "/tmp/real"
                                                   and e["size"] == 5 for e in ev))
    assert ("file.create", "/home/user/link") in brief(events)
    assert not [e for e in events if e["kind"] == "file.write" and e["path"] == "/home/user/link"]
    write = [e for e in events if e["kind"] == "file.write" and e["path"] == "/tmp/real"][-1]
    assert write["pid"] == int(out.split()[0]) != write["host_pid"]


async def test_ten_thousand_writes_are_one_event(box: Box, record: Record) -> None:
    await box.py("""
        with open("/home/user/big", "w") as f:
            for _ in range(10_000):
                f.write("x")
                f.flush()
        for _ in range(10_000):  # reopened each time: 10,000 closes as well
            with open("/home/user/again", "a") as f:
                f.write("y")
    """)
    await record.wait(box, lambda ev: len([e for e in ev if e["kind"] == "file.write"
                                           and e["path"] in ("/home/user/big", "/home/user/again")]) >= 2)
    await asyncio.sleep(1.5)  # nothing more comes
    writes = record.of(box, "file.write", "/home/user/big") + record.of(box, "file.write", "/home/user/again")
    assert [(e["path"], e["size"]) for e in writes] == [("/home/user/big", 10_000), ("/home/user/again", 10_000)]
    for e in writes:  # the kernel merges a burst of writes into fewer notifications: a lower bound
        assert 1 <= e["count"] <= 10_000
        assert e["first"] <= e["time"]
    print("counts seen:", [e["count"] for e in writes])


async def test_a_file_kept_open_shows_at_its_close_or_the_kill(
        backend: LinuxBackend, collector: file_events.FileCollector, record: Record) -> None:
    """Writes are seen at the close: a file written through an fd kept open shows when it is closed,
    and one a background process still holds shows once the kill has closed it, before unwatch returns."""
    b = await new_box(backend, collector)
    try:
        await b.sh("nohup python3 -c 'import time\nf = open(\"/tmp/held\", \"w\")\n"
                   "for i in range(5):\n    f.write(\"x\" * 100); f.flush()\ntime.sleep(600)' "
                   ">/dev/null 2>&1 & sleep 0.5")
        await b.py("""
            import mmap, os
            fd = os.open("/tmp/mapped", os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(fd, 4096)
            m = mmap.mmap(fd, 4096)
            m[:5] = b"hello"
            m.close()
            os.close(fd)
        """)
        await record.wait(b, lambda ev: any(e["kind"] == "file.write" and e["path"] == "/tmp/mapped" for e in ev))
        await asyncio.sleep(0.5)
        assert not record.of(b, "file.write", "/tmp/held")  # still open: not closed, not yet recorded
    finally:
        await backend.kill(b.sandbox)
        collector.unwatch(b.id)
    held = record.of(b, "file.write", "/tmp/held")
    assert [(e["path"], e["size"], e["count"]) for e in held] == [("/tmp/held", 500, 1)]


async def test_root_writes_through_the_overlays(box: Box, record: Record) -> None:
    await box.sh("echo x > /etc/agentcell-fe && chmod 640 /etc/passwd && rm /usr/lib/os-release"
                 " && mkdir -p /usr/local/lib/fe-pkg && echo 'v=1' > /usr/local/lib/fe-pkg/__init__.py"
                 " && echo more >> /etc/hostname", user="root")
    events = await record.wait(box, lambda ev: any(e["kind"] == "file.write" and e["path"] == "/etc/hostname"
                                                   for e in ev))
    got = brief([e for e in events if e["path"].startswith(("/etc", "/usr"))])
    # writes go out once their file is quiet: after the rest, in no set order
    assert [g for g in got if g[0] != "file.write"] == [
        ("file.create", "/etc/agentcell-fe"),
        ("file.chmod", "/etc/passwd", "0640"),  # copied up by the overlay first: that is no create
        ("file.delete", "/usr/lib/os-release"),  # a whiteout in the upper layer
        ("file.create", "/usr/local/lib/fe-pkg", "dir"),  # /usr/local, /usr/local/lib: copied up, not made
        ("file.create", "/usr/local/lib/fe-pkg/__init__.py"),
    ], got
    assert sorted(g for g in got if g[0] == "file.write") == [
        ("file.write", "/etc/agentcell-fe", 2),
        ("file.write", "/etc/hostname", len(box.id) + 1 + 5),
        ("file.write", "/usr/local/lib/fe-pkg/__init__.py", 4),
    ], got
    # made again where the lower file was deleted: a create (the overlay renames it over the whiteout)
    await box.sh("echo again > /usr/lib/os-release && rm -r /usr/local/lib/fe-pkg", user="root")
    events = await record.wait(box, lambda ev: any(e["kind"] == "file.delete" and e["path"] == "/usr/local/lib/fe-pkg"
                                                   for e in ev))
    assert ("file.create", "/usr/lib/os-release") in brief(events)
    assert ("file.delete", "/usr/local/lib/fe-pkg/__init__.py") in brief(events)


async def test_no_events_for_another_sandbox_or_outside_the_disk(
        backend: LinuxBackend, box: Box, collector: file_events.FileCollector, record: Record) -> None:
    other = await new_box(backend, collector)
    try:
        marker = "only-" + uuid.uuid4().hex[:8]
        await other.sh(f"echo a > /tmp/{marker} && echo b > /dev/null && echo c > /proc/self/comm"
                       f" && (echo d > /proc/sys/kernel/hostname || true) && ls / > /home/user/{marker}")
        await box.sh("echo z > /tmp/box-own")
        await record.wait(other, lambda ev: any(e["kind"] == "file.write" and e["path"] == f"/home/user/{marker}"
                                                for e in ev))
        await record.wait(box, lambda ev: any(e["path"] == "/tmp/box-own" and e["kind"] == "file.write" for e in ev))
        assert not [e for e in record.of(box) if marker in str(e.get("path"))]
        assert not [e for e in record.of(other) if "box-own" in str(e.get("path"))]
        places = ("/home/user/", "/tmp/", "/dev/shm/", "/usr", "/etc", "/var", "/opt", "/root", "/srv", "/mnt")
        for e in record.of(other):
            assert e["kind"].startswith("file.") and e["path"].startswith(places), e
            assert e["source"] == "host"
    finally:
        await backend.kill(other.sandbox)
        collector.unwatch(other.id)


async def test_a_flood_of_creations_is_bounded_and_counted(
        backend: LinuxBackend, collector: file_events.FileCollector, record: Record) -> None:
    flood = await new_box(backend, collector)
    try:
        t0 = time.monotonic()
        await flood.py("""
            import os
            os.mkdir("/tmp/fl")
            for i in range(100_000):  # each removed again: the disk's inodes are not what is tested
                os.close(os.open(f"/tmp/fl/{i}", os.O_CREAT | os.O_WRONLY, 0o644))
                os.unlink(f"/tmp/fl/{i}")
        """)
        elapsed = time.monotonic() - t0
        stats = collector.stats(flood.id)
        assert stats["pending"] <= file_events.MAX_PENDING and stats["paths"] <= file_events.PATH_CACHE
        assert stats["path_chars"] <= file_events.PATH_CACHE_BYTES
        await backend.kill(flood.sandbox)
        collector.unwatch(flood.id)  # reads the rest of its queue, reports what was dropped
        creates = record.of(flood, "file.create", "/tmp/fl/")
        dropped = record.of(flood, "record.dropped")
        by_reason: dict[str, int] = {}
        for e in dropped:
            by_reason[e["reason"]] = by_reason.get(e["reason"], 0) + e["count"]
        print(f"flood: {elapsed:.1f} s, {len(creates)} creates recorded, dropped {by_reason}, stats {stats}")
        assert len(creates) <= file_events.BURST + file_events.RATE * (time.monotonic() - t0 + 1)
        rate_dropped = sum(c for r, c in by_reason.items() if r.startswith("over the file events rate"))
        assert rate_dropped > 0
        overflows = sum(c for r, c in by_reason.items() if r.startswith("kernel queue overflow"))
        deletes = record.of(flood, "file.delete", "/tmp/fl/")
        if not overflows:  # every one of them is either in the record or counted
            assert len(creates) + len(deletes) + rate_dropped == 200_000
    finally:
        await backend.kill(flood.sandbox)
        collector.unwatch(flood.id)


async def test_names_cannot_hide_or_break_events(box: Box, record: Record, collector: file_events.FileCollector) -> None:
    """A directory named like a deleted one, a name that is not UTF-8, a newline in a name."""
    await box.py("""
        import os
        os.mkdir("/tmp/x (deleted)")
        open("/tmp/x (deleted)/inside", "w").close()
        open(b"/tmp/\\xff\\xfe", "w").close()
        open("/tmp/two\\nlines", "w").close()
    """)
    # and deep, long names: the collector's cache of them stays within its bounds
    await box.py("""
        import os
        p = "/tmp/deep"
        os.mkdir(p)
        for i in range(60):
            p += "/" + chr(97 + i % 26) * 60
            os.mkdir(p)
            open(p + "/f", "w").close()
    """)
    events = await record.wait(box, lambda ev: any(e["path"] == "/tmp/two\nlines" for e in ev)
                               and len([e for e in ev if e["path"].startswith("/tmp/deep/") and e["path"].endswith("/f")]) == 60)
    assert collector.stats(box.id)["path_chars"] <= file_events.PATH_CACHE_BYTES
    got = brief(events)
    assert ("file.create", "/tmp/x (deleted)/inside") in got
    assert ("file.create", "/tmp/\\xff\\xfe") in got  # the bytes, escaped: valid text
    for e in events:
        e["path"].encode()  # no lone surrogates


async def test_pending_writes_are_bounded(box: Box) -> None:
    """Beyond max_pending files written at once, the oldest one's write goes out at once."""
    rec = Record()
    small = file_events.FileCollector(rec, max_pending=8)
    await small.start()
    small.watch(target(box.sandbox))
    try:
        await box.py("""
            import time
            files = [open(f"/tmp/many{i}", "w") for i in range(50)]
            for _ in range(3):
                for f in files:
                    f.write("x")
                    f.flush()
                time.sleep(0.3)
        """)
        await asyncio.sleep(0.3)
        assert small.stats(box.id)["pending"] <= 8
        events = await rec.wait(box, lambda ev: len({e["path"] for e in ev if e["kind"] == "file.write"}) == 50)
        counts: dict[str, int] = {}
        for e in events:
            if e["kind"] == "file.write":
                counts[e["path"]] = counts.get(e["path"], 0) + e["count"]
        assert sorted(counts) == sorted(f"/tmp/many{i}" for i in range(50))
    finally:
        small.unwatch(box.id)
        await small.close()


async def test_a_sandbox_it_cannot_watch_gets_a_note_not_an_error(box: Box) -> None:
    rec = Record()
    col = file_events.FileCollector(rec)
    await col.start()
    t = target(box.sandbox)
    col.watch(WatchTarget(t.sandbox_id, t.host_pid, t.host_uids, t.cgroup, -1))  # no disk: nothing to mark
    assert [e["kind"] for e in rec.of(box)] == ["record.dropped"]
    assert rec.of(box)[0]["reason"].startswith("no file events for this sandbox")
    col.unwatch(box.id)
    await col.close()


async def test_rm_rf_of_a_tree_made_before_the_watch_names_every_file(box: Box) -> None:
    """The collector never saw these directories made, and they are gone when it looks: the batch's
    own deletes of them name their files."""
    await box.sh("mkdir -p /home/user/old/a/b && touch /home/user/old/a/b/f1 /home/user/old/a/f2 /home/user/old/f3")
    rec = Record()
    col = file_events.FileCollector(rec)
    await col.start()
    col.watch(target(box.sandbox))
    try:
        await box.sh("rm -rf /home/user/old")
        events = await rec.wait(box, lambda ev: any(e["path"] == "/home/user/old" for e in ev))
        assert sorted(brief(events)) == sorted([
            ("file.delete", "/home/user/old/a/b/f1"), ("file.delete", "/home/user/old/a/b", "dir"),
            ("file.delete", "/home/user/old/a/f2"), ("file.delete", "/home/user/old/a", "dir"),
            ("file.delete", "/home/user/old/f3"), ("file.delete", "/home/user/old", "dir"),
        ]), events
    finally:
        col.unwatch(box.id)
        await col.close()


async def test_pip_install_into_the_venv_is_recorded(box: Box, record: Record) -> None:
    """`pip install` of a wheel (made in the sandbox: no network) as the default user: its files land in
    the venv's overlay and are recorded at the paths the sandbox imports them from."""
    site = (await box.sh("python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'")).strip()
    await box.py("""
        import zipfile
        with zipfile.ZipFile("/tmp/fepkg-1.0-py3-none-any.whl", "w") as z:
            z.writestr("fepkg/__init__.py", "VALUE = 42\\n")
            z.writestr("fepkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\\nName: fepkg\\nVersion: 1.0\\n")
            z.writestr("fepkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\\nGenerator: t\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n")
            z.writestr("fepkg-1.0.dist-info/RECORD", "")
    """)
    await box.sh("python3 -m pip install --no-index --no-deps --no-cache-dir -q /tmp/fepkg-1.0-py3-none-any.whl"
                 " && python3 -c 'import fepkg; assert fepkg.VALUE == 42'")
    events = await record.wait(box, lambda ev: any(e["kind"] == "file.write" and e["path"] == f"{site}/fepkg/__init__.py"
                                                   for e in ev))
    got = brief([e for e in events if e["path"].startswith(site)])
    assert ("file.create", f"{site}/fepkg", "dir") in got
    assert ("file.write", f"{site}/fepkg/__init__.py", 11) in got
    assert any(g[0] == "file.create" and g[1].startswith(f"{site}/fepkg-1.0.dist-info/") for g in got)
    assert not [g for g in got if "/work/" in g[1]]  # nothing of the overlays' insides
