"""Snapshots, fork, pauses without memory: E2B's create_snapshot, list_snapshots, delete_snapshot,
Sandbox.create(snapshot_id), fork, pause(mode="filesystem"), connect(on_resume="reboot"), hibernation,
and paused sandboxes kept across a server restart. On the linux backend a snapshot keeps the files
(a create from it is a cold start); on gvisor (AGENTCELL_TEST_BACKEND=gvisor) it keeps memory too."""

from __future__ import annotations

import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from agentcell import Sandbox
from agentcell.errors import SandboxException
from tests.conftest import BACKEND_ARGS as _SESSION_BACKEND_ARGS
from tests.conftest import ServerProcess
from tests.helpers import sh

_BACKEND = os.environ.get("AGENTCELL_TEST_BACKEND", "linux")
GVISOR = _BACKEND == "gvisor"
MEMORY = _BACKEND in ("gvisor", "microvm")  # backends whose snapshots keep memory
BACKEND_ARGS = _SESSION_BACKEND_ARGS
memory_only = pytest.mark.skipif(not MEMORY, reason="memory snapshots need the gvisor or microvm backend")


def test_snapshot_then_create_from_it(server_url: str) -> None:
    src = Sandbox.create(api_url=server_url, timeout=120)
    try:
        src.files.write("/home/user/notes/a.txt", "from the source")
        src.files.write("/tmp/scratch.txt", "tmp too")
        # a change to the root's copy-on-write layer, as the sandbox's root
        assert sh(src, "echo tool > /usr/local/bin/mytool && chmod 755 /usr/local/bin/mytool", user="root")[0] == 0
        assert sh(src, "rm -f /etc/motd", user="root")[0] == 0  # a deletion (whiteout) of the template's file
        src.run_code("live = 1")
        snap = src.create_snapshot(name=f"s-{src.sandbox_id[:8]}")
        assert snap.names == [f"s-{src.sandbox_id[:8]}:default"] and snap.snapshot_id == snap.names[0]
        assert src.run_code("live + 1").text == "2"  # the source runs on
        listed = Sandbox.list_snapshots(api_url=server_url).next_items()
        assert snap.snapshot_id in [s.snapshot_id for s in listed]
        mine = src.list_snapshots().next_items()
        assert [s.snapshot_id for s in mine] == [snap.snapshot_id]
        assert mine[0].mode == ("full" if MEMORY else "filesystem")  # the most the backend keeps
        assert [s.snapshot_id for s in Sandbox.list_snapshots(name=snap.names[0], api_url=server_url).next_items()] \
            == [snap.snapshot_id]
        assert Sandbox.list_snapshots(name="no-such-name", api_url=server_url).next_items() == []
        a = Sandbox.create(snap.snapshot_id, api_url=server_url)
        b = Sandbox.create(snap.snapshot_id.split(":")[0], api_url=server_url)  # the name alone works too
        try:
            for child in (a, b):
                assert child.sandbox_id != src.sandbox_id
                assert child.files.read("/home/user/notes/a.txt") == "from the source"
                assert child.files.read("/tmp/scratch.txt") == "tmp too"
                assert sh(child, "/usr/local/bin/mytool >/dev/null; cat /usr/local/bin/mytool")[1] == "tool\n"
                assert sh(child, "test -e /etc/motd; echo $?")[1] == "1\n"
                # linux: files only, a cold start; gvisor, microvm: its memory too
                assert ("live" in child.run_code("dir()").text) is MEMORY
                assert sh(child, "stat -c %U /home/user/notes/a.txt /usr/local/bin/mytool")[1] == "user\nroot\n"
            a.files.write("/home/user/notes/a.txt", "changed in a")
            assert b.files.read("/home/user/notes/a.txt") == "from the source"
            assert src.files.read("/home/user/notes/a.txt") == "from the source"
        finally:
            a.kill()
            b.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id, api_url=server_url) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id, api_url=server_url) is False
        with pytest.raises(SandboxException):
            Sandbox.create(snap.snapshot_id, api_url=server_url)
    finally:
        src.kill()


def test_snapshot_names_and_errors(server_url: str) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=60)
    try:
        for bad in ("UPPER", "has space", "../x", "x" * 80):
            r = httpx.post(f"{server_url}/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": bad})
            assert r.status_code == 400, bad
        name = f"dup-{sbx.sandbox_id[:8]}"
        snap = sbx.create_snapshot(name=name)
        try:
            r = httpx.post(f"{server_url}/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": name})
            assert r.status_code == 409
        finally:
            Sandbox.delete_snapshot(snap.snapshot_id, api_url=server_url)
        r = httpx.delete(f"{server_url}/templates/base")
        assert r.status_code == 400  # a built-in template is not a snapshot
    finally:
        sbx.kill()


def test_pause_without_memory_and_reboot(server_url: str) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=120)
    try:
        sbx.files.write("/home/user/marker.txt", "persisted")
        sbx.run_code("x = 1")
        boot = sbx.files.read("/proc/sys/kernel/random/boot_id")
        sbx.pause()
        sbx.connect()
        assert sbx.files.read("/proc/sys/kernel/random/boot_id") == boot  # a resume, not a start
        assert sbx.pause(mode="filesystem") is True
        info = sbx.get_info()
        assert info.state == "paused" and info.pause_mode == "filesystem"
        assert not sbx.is_running()
        sbx.connect()  # a cold start from its files, same id, same token
        assert sbx.is_running()
        assert sbx.files.read("/home/user/marker.txt") == "persisted"
        assert "NameError" in str(sbx.run_code("x").error)
        assert sbx.files.read("/proc/sys/kernel/random/boot_id") != boot  # a cold start: a new boot
        # on_resume="reboot" of a sandbox paused with its memory: its files, a fresh start
        sbx.run_code("y = 2")
        sbx.files.write("/home/user/second.txt", "2")
        sbx.pause()
        Sandbox.connect(sbx.sandbox_id, on_resume="reboot", api_url=server_url)
        assert sbx.files.read("/home/user/second.txt") == "2"
        assert "NameError" in str(sbx.run_code("y").error)
    finally:
        sbx.kill()


def test_snapshots_taken_at_once_all_succeed(server_url: str) -> None:
    """Each snapshot holds the most its sandbox can make until it is written, not all the quota has left:
    snapshots of several sandboxes taken at once all succeed (the second of two was refused, 429 "use all
    of their 10240 MiB", while the first was written: found by the hour-long soak)."""
    sandboxes = [Sandbox.create(api_url=server_url, timeout=120) for _ in range(3)]
    try:
        for sbx in sandboxes:  # a copy long enough for the others to begin meanwhile
            sbx.commands.run("head -c 60000000 /dev/urandom > /home/user/big.bin")
        barrier = threading.Barrier(len(sandboxes))

        def snapshot(sbx: Sandbox) -> str:
            barrier.wait()
            return sbx.create_snapshot(mode="filesystem").snapshot_id

        with ThreadPoolExecutor(len(sandboxes)) as pool:
            snaps = list(pool.map(snapshot, sandboxes))  # a refusal raises here
        for snap in snaps:
            child = Sandbox.create(snap, api_url=server_url, timeout=60)
            assert child.commands.run("stat -c %s /home/user/big.bin").stdout.strip() == "60000000"
            child.kill()
            assert Sandbox.delete_snapshot(snap, api_url=server_url)
    finally:
        for sbx in sandboxes:
            sbx.kill()


def test_snapshot_quota_refuses_and_leaves_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    srv = ServerProcess(tmp_path / "server.log", "--standbys", "0", "--snapshot-quota-mb", "2",
                        "--state-dir", str(state), *BACKEND_ARGS)
    srv.wait_ready()
    try:
        sbx = Sandbox.create(api_url=srv.url, timeout=60)
        sbx.commands.run("head -c 4000000 /dev/urandom > /home/user/big")
        for body in ({}, {"memory": False}):  # gvisor: a memory snapshot alone is bigger than 2 MiB
            r = httpx.post(f"{srv.url}/sandboxes/{sbx.sandbox_id}/snapshots", json=body)
            assert r.status_code == 429, r.text
            if not body and GVISOR:  # refused before its memory image is written
                assert "memory alone" in r.text, r.text
            assert list((state / "snapshots").iterdir()) == []
        assert sbx.run_code("1 + 1").text == "2"  # it runs on
        sbx.commands.run("rm /home/user/big")
        snap = sbx.create_snapshot(mode="filesystem")
        assert Sandbox.delete_snapshot(snap.snapshot_id, api_url=srv.url)
        # the state dir is the server's alone
        assert stat.S_IMODE(os.stat(state / "snapshots").st_mode) == 0o700
        assert sh(sbx, f"ls {state} 2>&1; echo $?")[1].strip().endswith("2")
        sbx.kill()
    finally:
        srv.stop()


def test_paused_sandboxes_survive_a_server_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    args = ("--standbys", "0", "--state-dir", str(state), *BACKEND_ARGS)
    srv = ServerProcess(tmp_path / "a.log", *args)
    srv.wait_ready()
    try:
        frozen = Sandbox.create(api_url=srv.url, timeout=60, metadata={"k": "v"})
        frozen.files.write("/home/user/f.txt", "frozen")
        frozen.pause()  # with its memory: a stopping server writes its files to disk
        cold = Sandbox.create(api_url=srv.url, timeout=60)
        cold.files.write("/home/user/c.txt", "cold")
        cold.pause(mode="filesystem")
        running = Sandbox.create(api_url=srv.url, timeout=60)
    finally:
        srv.stop()
    srv2 = ServerProcess(tmp_path / "b.log", *args)
    srv2.wait_ready()
    try:
        for sbx, path, text in ((frozen, "/home/user/f.txt", "frozen"), (cold, "/home/user/c.txt", "cold")):
            back = Sandbox.connect(sbx.sandbox_id, api_url=srv2.url)
            assert back.files.read(path) == text
            assert back.get_info().metadata == ({"k": "v"} if sbx is frozen else {})
            back.kill()
        with pytest.raises(SandboxException):
            Sandbox.connect(running.sandbox_id, api_url=srv2.url)  # a running sandbox dies with its server
        assert not any(state.glob("paused/*"))  # resumed and killed: nothing left behind
    finally:
        srv2.stop()


def test_official_sdk_snapshots(e2b_env: str) -> None:
    from e2b import Sandbox as E2BSandbox

    sbx = E2BSandbox.create(timeout=60)
    try:
        sbx.files.write("/home/user/test.txt", "content from original sandbox")
        snapshot = sbx.create_snapshot()
        try:
            new = E2BSandbox.create(snapshot.snapshot_id)
            try:
                assert new.files.read("/home/user/test.txt") == "content from original sandbox"
            finally:
                new.kill()
            assert any(s.snapshot_id == snapshot.snapshot_id
                       for s in E2BSandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items())
        finally:
            assert E2BSandbox.delete_snapshot(snapshot.snapshot_id)
        assert sbx.pause(keep_memory=False)
        assert not sbx.is_running()
        resumed = sbx.connect()
        assert resumed.files.read("/home/user/test.txt") == "content from original sandbox"
        [fork] = sbx.fork()  # on linux a filesystem fork, of the files the filesystem pause kept
        try:
            assert isinstance(fork, E2BSandbox)
            assert fork.files.read("/home/user/test.txt") == "content from original sandbox"
        finally:
            fork.kill()
    finally:
        sbx.kill()


@memory_only
def test_fork_copies_memory_into_independent_sandboxes(server_url: str) -> None:
    src = Sandbox.create(api_url=server_url, timeout=120)
    try:
        src.run_code("import random, uuid\ncounter = 41")
        src.files.write("/tmp/state.txt", "before fork")
        forks = src.fork(count=3, timeout=60)
        assert all(isinstance(f, Sandbox) for f in forks), forks
        try:
            ids = {f.sandbox_id for f in forks}
            assert len(ids) == 3 and src.sandbox_id not in ids
            draws = set()
            for f in forks:
                assert f.run_code("counter + 1").text == "42"  # its memory
                assert f.files.read("/tmp/state.txt") == "before fork"
                assert sh(f, "hostname")[1].strip() == f.sandbox_id  # its own name
                draws.add(f.run_code("(random.random(), str(uuid.uuid4()))").text)
                f.run_code("counter = -1")
                f.files.write("/tmp/state.txt", f.sandbox_id)
            assert len(draws) == 3  # random generators reseeded in each
            assert src.run_code("counter").text == "41"  # the source is untouched
            assert src.files.read("/tmp/state.txt") == "before fork"
            assert src.fork(count=1)  # and can fork again
        finally:
            for f in forks:
                if isinstance(f, Sandbox):
                    f.kill()
    finally:
        src.kill()


@memory_only
def test_hibernation_frees_memory_and_keeps_state(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "server.log", "--standbys", "0", "--hibernate-after", "1",
                        "--state-dir", str(tmp_path / "state"), *BACKEND_ARGS)
    srv.wait_ready()
    try:
        sbx = Sandbox.create(api_url=srv.url, timeout=120)
        sbx.run_code("big = bytearray(64 << 20); big[123] = 7")
        sbx.pause()
        deadline = time.monotonic() + 30
        while not any((tmp_path / "state" / "paused").glob("*.image")):
            assert time.monotonic() < deadline, "never hibernated"
            time.sleep(0.2)
        assert sbx.get_info().state == "paused"
        sbx.connect()
        assert sbx.run_code("big[123], len(big)").text == "(7, 67108864)"
        sbx.kill()
    finally:
        srv.stop()
