"""envd parity of the files API: signed /files URLs, symlink entries, metadata on overwrite, and
directory watchers (WatchDir stream and the CreateWatcher polling trio), through the unchanged `e2b`
package and agentcell's own SDK, on real sandboxes."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import httpx
import pytest
from e2b import AsyncSandbox as E2BAsyncSandbox
from e2b import FileNotFoundException, FilesystemEventType, FileType, SandboxException
from e2b import Sandbox as E2BSandbox

from agentcell import AsyncSandbox, Sandbox
from agentcell.errors import FileNotFoundException as AgentcellFileNotFound
from agentcell.sdk.models import FilesystemEventType as ACEventType
from tests.helpers import sh

WATCHERS_PER_SANDBOX = 32  # runtime/watcher.py MAX_WATCHERS


@pytest.fixture(scope="module")
def sbx(e2b_env: str) -> Iterator[E2BSandbox]:
    s = E2BSandbox.create(secure=True)
    yield s
    s.kill()


@pytest.fixture(scope="module")
def own(server_url: str) -> Iterator[Sandbox]:
    with Sandbox.create(api_url=server_url, timeout=300) as s:
        yield s


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/octet-stream"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _with_query(url: str, **changes: str | None) -> str:
    parts = urllib.parse.urlsplit(url)
    q = dict(urllib.parse.parse_qsl(parts.query))
    for k, v in changes.items():
        if v is None:
            q.pop(k, None)
        else:
            q[k] = v
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(q)))


# --- signed URLs ------------------------------------------------------------------------------------


def test_signed_download_and_upload_urls(sbx: E2BSandbox) -> None:
    sbx.files.write("signed/a.txt", "alpha")
    url = sbx.download_url("signed/a.txt")
    assert "signature=v1_" in url and sbx.sandbox_id not in url  # under E2B_SANDBOX_URL: no sandbox named
    assert _get(url) == (200, b"alpha")
    assert _get(sbx.download_url("signed/a.txt", "user", use_signature_expiration=120)) == (200, b"alpha")

    status, body = _post(sbx.upload_url("signed/up.bin"), b"\x00uploaded")
    assert status == 200 and json.loads(body)[0]["path"] == "/home/user/signed/up.bin"
    assert sbx.files.read("signed/up.bin", format="bytes") == b"\x00uploaded"
    status, _ = _post(sbx.upload_url("signed/up2.txt", use_signature_expiration=60), b"two")
    assert status == 200 and sbx.files.read("signed/up2.txt") == "two"


def test_signed_url_refusals_are_envds(sbx: E2BSandbox) -> None:
    sbx.files.write("signed/b.txt", "beta")
    good = sbx.download_url("signed/b.txt", use_signature_expiration=120)
    cases = {
        "tampered": _with_query(good, signature=good.split("signature=")[1].split("&")[0][:-2] + "AA"),
        "other path": _with_query(good, path="signed/a.txt"),
        "other op": sbx.upload_url("signed/b.txt", use_signature_expiration=120),  # a write signature, GET
        "later expiry": _with_query(good, signature_expiration=str(int(time.time()) + 9999)),
    }
    for what, url in cases.items():
        status, body = _get(url)
        assert (status, json.loads(body)) == (401, {"code": 401, "message": "invalid signature"}), what
    status, body = _get(sbx.download_url("signed/b.txt", use_signature_expiration=-120))
    assert (status, json.loads(body)) == (401, {"code": 401, "message": "signature is already expired"})
    status, body = _get(_with_query(good, signature=None, signature_expiration=None))
    assert (status, json.loads(body)) == (401, {"code": 401, "message": "missing signature query parameter"})
    # The same refusals when the Host names the sandbox (E2B's own routing)
    host = f"49983-{sbx.sandbox_id}.localhost"
    base = os.environ["E2B_SANDBOX_URL"]
    r = httpx.get(base + "/files", params={"path": "signed/b.txt"}, headers={"Host": host})
    assert (r.status_code, r.json()["message"]) == (401, "missing signature query parameter")
    r = httpx.get(base + "/files", params={"path": "signed/b.txt"}, headers={"Host": host, "X-Access-Token": "nope"})
    assert (r.status_code, r.json()["message"]) == (401, "access token present in header but does not match")
    r = httpx.get(good, headers={"Host": host})
    assert (r.status_code, r.content) == (200, b"beta")
    # An upload through a tampered URL writes nothing
    bad_up = _with_query(sbx.upload_url("signed/evil.txt"), path="signed/other.txt")
    assert _post(bad_up, b"x")[0] == 401 and not sbx.files.exists("signed/other.txt")


def test_signed_url_of_one_sandbox_reads_only_that_sandbox(e2b_env: str, sbx: E2BSandbox) -> None:
    other = E2BSandbox.create(secure=False)  # agentcell gives every sandbox a token: its URLs are signed too
    try:
        other.files.write("signed/b.txt", "other's")
        sbx.files.write("signed/b.txt", "beta")
        assert _get(other.download_url("signed/b.txt")) == (200, b"other's")
        assert _get(sbx.download_url("signed/b.txt")) == (200, b"beta")
    finally:
        other.kill()
    status, _ = _get(other.download_url("signed/b.txt"))  # its sandbox is gone: its signature names none
    assert status == 401


def test_own_sdk_signed_urls(own: Sandbox) -> None:
    own.files.write("signed/own.txt", "mine")
    assert _get(own.download_url("signed/own.txt")) == (200, b"mine")
    assert _get(own.download_url("signed/own.txt", use_signature_expiration=30)) == (200, b"mine")
    assert _get(own.download_url("signed/own.txt", use_signature_expiration=-1))[0] == 401
    assert _post(own.upload_url("signed/own2.txt", use_signature_expiration=30), b"two")[0] == 200
    assert own.files.read("signed/own2.txt") == "two"
    # e2b's signature and ours are the same function of the same inputs
    from e2b.sandbox.signature import get_signature

    from agentcell.sdk.files import signature

    theirs = get_signature("/a b", "read", None, "tok", 60)
    assert signature("/a b", "read", None, "tok", theirs["expiration"]) == theirs["signature"]
    assert signature("/a b", "write", "user", "t0k", None) == get_signature("/a b", "write", "user", "t0k")["signature"]


# --- symlinks and metadata --------------------------------------------------------------------------


def test_symlink_entries_report_the_target(sbx: E2BSandbox, own: Sandbox) -> None:
    for s in (sbx, own):
        s.files.write("links/file.txt", "x")
        s.files.make_dir("links/dir")
        sh(s, "cd links && ln -sf file.txt to_file && ln -sfn dir to_dir && ln -sf missing dangling")  # type: ignore[arg-type]
        info = s.files.get_info("links/to_file")
        # e2b 2.63 maps envd's is_symlink to SYMLINK; the target's absolute path comes with it
        assert info.type.value == "symlink" and info.symlink_target == "/home/user/links/file.txt"
        assert info.name == "to_file" and info.path == "/home/user/links/to_file"
        listed = {e.name: e for e in s.files.list("links")}
        assert listed["to_dir"].symlink_target == "/home/user/links/dir"
        assert listed["dangling"].symlink_target == "/home/user/links/missing"
        assert listed["file.txt"].symlink_target is None and listed["file.txt"].type.value == "file"


def test_symlink_wire_type_is_the_targets(sbx: E2BSandbox) -> None:
    sbx.files.write("links2/file.txt", "x")
    sh(sbx, "cd links2 && ln -sf file.txt l && mkdir -p d && ln -sfn d ld")  # type: ignore[arg-type]
    r = httpx.post(f"{os.environ['E2B_SANDBOX_URL']}/filesystem.Filesystem/ListDir",
                   json={"path": "links2"}, headers={"E2b-Sandbox-Id": sbx.sandbox_id,
                                                     "X-Access-Token": sbx._envd_access_token or ""})
    entries = {e["name"]: e for e in r.json()["entries"]}
    assert entries["l"]["type"] == "FILE_TYPE_FILE" and entries["l"]["isSymlink"]
    assert entries["ld"]["type"] == "FILE_TYPE_DIRECTORY" and entries["ld"]["symlinkTarget"] == "/home/user/links2/d"


def test_overwrite_without_metadata_clears_it(sbx: E2BSandbox) -> None:
    sbx.files.write("meta.txt", "first", metadata={"author": "a"})
    assert sbx.files.get_info("meta.txt").metadata == {"author": "a"}
    assert sbx.files.write("meta.txt", "second").metadata is None
    assert sbx.files.get_info("meta.txt").metadata is None
    sbx.files.write("meta.txt", "third", metadata={"k": "v"})
    assert sbx.files.get_info("meta.txt").metadata == {"k": "v"}  # replaced, not merged


# --- watchers -------------------------------------------------------------------------------------


def _kinds(events: list, name: str) -> list:
    return [e.type for e in events if e.name == name]


def test_watch_sync_event_types(sbx: E2BSandbox) -> None:
    sbx.files.make_dir("w1")
    sbx.files.write("w1/old.txt", "o")
    h = sbx.files.watch_dir("w1")
    sbx.files.write("w1/new.txt", "n")
    events = h.get_new_events()
    assert [(e.name, e.type) for e in events] == [("new.txt", FilesystemEventType.CREATE),
                                                 ("new.txt", FilesystemEventType.CHMOD),
                                                 ("new.txt", FilesystemEventType.WRITE)]
    sh(sbx, "cd w1 && echo more >> old.txt && chmod 600 old.txt && mv old.txt moved.txt && rm new.txt")  # type: ignore[arg-type]
    events = h.get_new_events()
    assert FilesystemEventType.WRITE in _kinds(events, "old.txt")
    assert FilesystemEventType.CHMOD in _kinds(events, "old.txt")
    assert FilesystemEventType.RENAME in _kinds(events, "old.txt")
    assert FilesystemEventType.CREATE in _kinds(events, "moved.txt")
    assert FilesystemEventType.REMOVE in _kinds(events, "new.txt")
    assert h.get_new_events() == []
    h.stop()
    with pytest.raises(SandboxException):
        h.get_new_events()


def test_watch_sync_recursive_and_later_dirs(sbx: E2BSandbox) -> None:
    sbx.files.make_dir("w2/a")
    h = sbx.files.watch_dir("w2", recursive=True, include_entry=True)
    sbx.files.write("w2/a/f.txt", "x")
    sbx.files.make_dir("w2/later/deeper")
    sbx.files.write("w2/later/deeper/g.txt", "y")
    sh(sbx, "mkdir -p w2/shell/sub && echo z > w2/shell/sub/h.txt")  # type: ignore[arg-type]
    time.sleep(0.2)
    events = h.get_new_events()
    names = {e.name for e in events}
    assert {"a/f.txt", "later", "later/deeper", "later/deeper/g.txt", "shell", "shell/sub", "shell/sub/h.txt"} <= names
    write = next(e for e in events if e.name == "later/deeper/g.txt" and e.type == FilesystemEventType.WRITE)
    assert write.entry is not None and write.entry.path == "/home/user/w2/later/deeper/g.txt"
    assert write.entry.type == FileType.FILE
    h.stop()


def test_watch_errors_are_envds(sbx: E2BSandbox, own: Sandbox) -> None:
    with pytest.raises(FileNotFoundException):
        sbx.files.watch_dir("no/such/dir")
    sbx.files.write("plain.txt", "x")
    with pytest.raises(SandboxException) as info:
        sbx.files.watch_dir("plain.txt")
    assert "not a directory" in str(info.value)
    # Removing an unknown watcher: not_found, as envd
    r = httpx.post(f"{os.environ['E2B_SANDBOX_URL']}/filesystem.Filesystem/RemoveWatcher",
                   json={"watcherId": "wnope"}, headers={"E2b-Sandbox-Id": sbx.sandbox_id,
                                                         "X-Access-Token": sbx._envd_access_token or ""})
    assert r.status_code == 404 and r.json() == {"code": "not_found", "message": "watcher with id wnope not found"}
    with pytest.raises(AgentcellFileNotFound):
        own.files.watch_dir("no/such/dir")


def test_watch_async_stream(e2b_env: str) -> None:
    async def main() -> None:
        s = await E2BAsyncSandbox.create()
        try:
            await s.files.make_dir("aw/sub")
            got: list = []
            seen = asyncio.Event()

            def on_event(e: object) -> None:
                got.append(e)
                if getattr(e, "name", "") == "later/f.txt" and e.type == FilesystemEventType.WRITE:  # type: ignore[attr-defined]
                    seen.set()

            h = await s.files.watch_dir("aw", on_event=on_event, recursive=True)
            await s.files.write("aw/sub/x.txt", "1")
            await s.files.make_dir("aw/later")
            await s.files.write("aw/later/f.txt", "2")
            await asyncio.wait_for(seen.wait(), 10)
            assert ("sub/x.txt", FilesystemEventType.CREATE) in [(e.name, e.type) for e in got]
            await h.stop()
            with pytest.raises(FileNotFoundException):
                await s.files.watch_dir("nope", on_event=on_event)
        finally:
            await s.kill()

    asyncio.run(main())


def test_own_sdk_watch_sync_and_async(server_url: str, own: Sandbox) -> None:
    own.files.make_dir("ow")
    h = own.files.watch_dir("ow")
    own.files.write("ow/a.txt", "x")
    assert [(e.name, e.type) for e in h.get_new_events()][0] == ("a.txt", ACEventType.CREATE)
    h.stop()

    async def main() -> None:
        async with await AsyncSandbox.create(api_url=server_url) as s:
            await s.files.make_dir("ow")
            got: list = []
            done = asyncio.Event()
            exits: list = []
            h = await s.files.watch_dir("ow", lambda e: (got.append(e), done.set()), on_exit=exits.append,
                                        include_entry=True)
            await s.files.write("ow/b.txt", "y")
            await asyncio.wait_for(done.wait(), 10)
            assert got[0].name == "b.txt" and got[0].entry is not None
            await h.stop()
            # A short timeout ends the stream by itself: on_exit gets the deadline error
            h2 = await s.files.watch_dir("ow", lambda e: None, on_exit=exits.append, timeout=1)
            for _ in range(50):
                if exits:
                    break
                await asyncio.sleep(0.1)
            assert len(exits) == 1 and exits[0] is not None
            await h2.stop()

    asyncio.run(main())


def test_watcher_limit_per_sandbox(sbx: E2BSandbox) -> None:
    sbx.files.make_dir("lim")
    handles = [sbx.files.watch_dir("lim") for _ in range(WATCHERS_PER_SANDBOX)]
    with pytest.raises(SandboxException) as info:
        sbx.files.watch_dir("lim")
    assert "watchers" in str(info.value)
    handles.pop().stop()
    handles.append(sbx.files.watch_dir("lim"))  # room again
    for h in handles:
        h.stop()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _agent_rss_kib(s: E2BSandbox) -> int:
    return int(sh(s, "grep VmRSS /proc/1/status | awk '{print $2}'")[1])  # type: ignore[arg-type]


FLOOD = "python3 -c \"import os\nfor i in range(100000):\n  p='flood/f%d' % i\n  open(p,'w').close(); os.unlink(p)\""


def test_event_flood_is_bounded(e2b_env: str, server: object) -> None:
    """100k creations (200k events) into an unpolled watcher and a stalled stream: the watcher ends
    with envd's overflow error; neither the agent nor the server grows with the flood."""
    s = E2BSandbox.create()
    try:
        s.files.make_dir("flood")
        h = s.files.watch_dir("flood")
        agent_before = _agent_rss_kib(s)
        server_pid = getattr(server, "pid", None)
        server_before = _rss_kib(server_pid) if server_pid else 0
        sh(s, FLOOD, timeout=120)  # type: ignore[arg-type]
        agent_growth = _agent_rss_kib(s) - agent_before
        with pytest.raises(SandboxException) as info:
            h.get_new_events()
        assert "overflow" in str(info.value)
        h.stop()
        assert agent_growth < 32 << 10, f"the agent grew by {agent_growth} KiB"
        if server_pid:
            assert _rss_kib(server_pid) - server_before < 32 << 10
        print(f"\nflood: agent RSS +{agent_growth} KiB")

        # A stream whose client stops reading: the kernel queue fills, and the stream ends with an error
        async def stalled() -> list:
            a = await E2BAsyncSandbox.connect(s.sandbox_id)
            exits: list = []
            flooded = threading.Event()

            def slow(e: object) -> None:
                flooded.wait(120)  # blocks the client's event loop: nothing is read until the flood is over

            h2 = await a.files.watch_dir("flood", on_event=slow, on_exit=exits.append, timeout=0)
            flood = threading.Thread(target=lambda: (sh(s, FLOOD, 120), flooded.set()))  # type: ignore[arg-type]
            flood.start()
            for _ in range(300):
                if exits:
                    break
                await asyncio.sleep(0.1)
            flood.join()
            await h2.stop()
            return exits

        exits = asyncio.run(stalled())
        # Whether the kernel's queue overflows depends on how much the socket buffers between the
        # agent and the stalled client absorbed (megabytes on loopback); either way the stream ended,
        # with envd's overflow error if it did, and nothing grew without bound.
        assert exits, "the stalled watch never ended"
        assert exits[0] is None or "overflow" in str(exits[0]), exits
        assert _agent_rss_kib(s) - agent_before < 32 << 10
    finally:
        s.kill()


def test_watchers_end_with_the_sandbox(e2b_env: str) -> None:
    async def main() -> list:
        s = await E2BAsyncSandbox.create()
        await s.files.make_dir("k")
        exits: list = []
        await s.files.watch_dir("k", on_event=lambda e: None, on_exit=exits.append, timeout=0)
        await s.kill()
        for _ in range(100):
            if exits:
                break
            await asyncio.sleep(0.1)
        return exits

    exits = asyncio.run(main())
    assert len(exits) == 1 and exits[0] is not None
