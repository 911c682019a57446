"""E2B behaviours the official SDKs' own suites check, through the unchanged e2b packages and ours.

A sandbox killed while a request is in flight: the server cuts the response's connection, as E2B's
proxy does, and the SDKs (theirs after a health probe, ours too) raise "killed / end of life".
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from e2b import AsyncSandbox as E2BAsyncSandbox
from e2b import Sandbox as E2BSandbox
from e2b import TimeoutException as E2BTimeout
from e2b_code_interpreter import AsyncSandbox as CodeAsyncSandbox
from e2b_code_interpreter import Sandbox as CodeSandbox

from agentcell import AsyncSandbox, Sandbox
from agentcell.errors import SandboxNotRunningException


def _kill_later(kill, delay: float = 1.0) -> threading.Thread:  # type: ignore[no-untyped-def]
    t = threading.Thread(target=lambda: (time.sleep(delay), kill()), daemon=True)
    t.start()
    return t


def test_e2b_command_wait_raises_killed(e2b_env: str) -> None:
    sbx = E2BSandbox.create()
    cmd = sbx.commands.run("sleep 60", background=True)
    sbx.kill()
    with pytest.raises(E2BTimeout) as info:
        cmd.wait()
    assert "sandbox was killed or reached its end of life" in str(info.value)


def test_e2b_command_killed_mid_stream(e2b_env: str) -> None:
    sbx = E2BSandbox.create()
    _kill_later(sbx.kill)
    started = time.monotonic()
    with pytest.raises(E2BTimeout) as info:
        sbx.commands.run("sleep 60")
    assert "end of life" in str(info.value)
    assert time.monotonic() - started < 15


def test_e2b_code_interpreter_run_code_killed(e2b_env: str) -> None:
    sbx = CodeSandbox.create()
    _kill_later(sbx.kill)
    with pytest.raises(E2BTimeout) as info:
        sbx.run_code("import time; time.sleep(300)", timeout=300)
    assert "sandbox was killed while the request was in progress" in str(info.value)


async def test_e2b_async_killed_mid_request(e2b_env: str) -> None:
    code = await CodeAsyncSandbox.create()
    run = asyncio.ensure_future(code.run_code("import time; time.sleep(300)", timeout=300))
    await asyncio.sleep(1)
    await code.kill()
    with pytest.raises(E2BTimeout, match="killed while the request was in progress"):
        await run

    sbx = await E2BAsyncSandbox.create()
    cmd = await sbx.commands.run("sleep 60", background=True)
    await sbx.kill()
    with pytest.raises(E2BTimeout, match="end of life"):
        await cmd.wait()


def test_agentcell_sdk_killed_mid_request(server_url: str) -> None:
    sbx = Sandbox.create(api_url=server_url)
    _kill_later(sbx.kill)
    with pytest.raises(SandboxNotRunningException, match="end of life"):
        sbx.run_code("import time; time.sleep(300)", timeout=300)

    sbx = Sandbox.create(api_url=server_url)
    _kill_later(sbx.kill)
    with pytest.raises(SandboxNotRunningException, match="end of life"):
        sbx.commands.run("sleep 60")


async def test_agentcell_async_sdk_killed_mid_request(server_url: str) -> None:
    sbx = await AsyncSandbox.create(api_url=server_url)
    run = asyncio.ensure_future(sbx.run_code("import time; time.sleep(300)", timeout=300))
    await asyncio.sleep(1)
    await sbx.kill()
    with pytest.raises(SandboxNotRunningException, match="end of life"):
        await run

    sbx = await AsyncSandbox.create(api_url=server_url)
    cmd = await sbx.commands.run("sleep 60", background=True)
    await sbx.kill()
    with pytest.raises(SandboxNotRunningException, match="end of life"):
        await cmd.wait()


def test_run_code_error_still_ends_normally(server_url: str) -> None:
    """Cutting connections is for a dead sandbox only: a crashing context still ends its stream."""
    with Sandbox.create(api_url=server_url) as sbx:
        ex = sbx.run_code("import os; os._exit(3)")
        assert ex.error is not None
        assert sbx.run_code("1 + 1").text == "2"


# --- metrics over time --------------------------------------------------------------------------


def test_e2b_metrics_range_and_real_disk_and_cache(e2b_env: str) -> None:
    import datetime

    before = datetime.datetime.now(datetime.UTC)
    sbx = E2BSandbox.create(timeout=120)
    try:
        first = sbx.get_metrics()
        assert len(first) >= 1
        m = first[-1]
        assert m.cpu_count >= 1 and m.mem_total > 0 and m.disk_total > 0 and m.mem_used > 0
        # 64 MiB written to the disk (a tmpfs): diskUsed and the page cache show it
        sbx.commands.run("head -c 67108864 /dev/zero > /home/user/big && sync")
        time.sleep(1.1)  # a request's fresh sample is taken at most once a second
        m = sbx.get_metrics()[-1]
        assert m.disk_used >= 64 << 20, m
        assert m.mem_cache >= 64 << 20, m
        sbx.commands.run("rm /home/user/big")
        time.sleep(1.1)
        assert sbx.get_metrics()[-1].disk_used < 16 << 20

        now = datetime.datetime.now(datetime.UTC)
        ranged = sbx.get_metrics(start=before, end=now)
        assert ranged and all(before.timestamp() - 1 <= r.timestamp.timestamp() <= now.timestamp() + 1 for r in ranged)
        assert len(ranged) >= 3  # every sample taken so far is kept
        assert sbx.get_metrics(start=before - datetime.timedelta(hours=1),
                               end=before - datetime.timedelta(minutes=30)) == []
    finally:
        sbx.kill()


def test_metrics_history_is_sampled_without_requests(server_url: str) -> None:
    import httpx

    with Sandbox.create(api_url=server_url) as sbx:
        time.sleep(11)  # two of the server's 5 s sampling rounds
        r = httpx.get(f"{server_url}/sandboxes/{sbx.sandbox_id}/metrics", params={"start": 0, "end": int(time.time()) - 1})
        assert r.status_code == 200 and len(r.json()) >= 1, r.text
        stamps = [m["timestampUnix"] for m in r.json()]
        assert stamps == sorted(stamps)
        bad = httpx.get(f"{server_url}/sandboxes/{sbx.sandbox_id}/metrics", params={"start": "yesterday"})
        assert bad.status_code == 400 and "start" in bad.json()["message"]
        bad = httpx.get(f"{server_url}/sandboxes/{sbx.sandbox_id}/metrics", params={"start": 100, "end": 50})
        assert bad.status_code == 400


# --- agentcell's SDK mirrors e2b's: pty, get_metrics, idempotent create, list order, input streams -------


def test_agentcell_pty_sync(server_url: str) -> None:
    from agentcell.sdk.models import PtySize

    with Sandbox.create(api_url=server_url) as sbx:
        term = sbx.pty.create(PtySize(rows=24, cols=80))
        sbx.pty.send_stdin(term.pid, b"stty size; echo $TERM; tty\n")
        out = bytearray()
        for _, _, chunk in term:
            out += chunk or b""
            if b"/dev/pts/" in out:
                break
        sbx.pty.resize(term.pid, PtySize(rows=40, cols=100))
        sbx.pty.send_stdin(term.pid, b"stty size; exit 0\n")
        term.wait(on_pty=out.extend)
        text = out.decode(errors="replace")
        assert "24 80" in text and "40 100" in text and "xterm-256color" in text and "/dev/pts/" in text, text


async def test_agentcell_pty_async(server_url: str) -> None:
    from agentcell.sdk.models import PtySize

    sbx = await AsyncSandbox.create(api_url=server_url)
    try:
        out = bytearray()
        term = await sbx.pty.create(PtySize(rows=10, cols=50), on_data=out.extend)
        await sbx.pty.send_stdin(term.pid, b"stty size\n")
        deadline = time.monotonic() + 10
        while b"10 50" not in out and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert b"10 50" in out
        assert await sbx.pty.kill(term.pid)
    finally:
        await sbx.kill()


def test_agentcell_get_metrics_and_properties(server_url: str) -> None:
    import datetime

    before = datetime.datetime.now(datetime.UTC)
    with Sandbox.create(api_url=server_url) as sbx:
        m = sbx.get_metrics()
        assert m and m[-1].mem_used > 0 and m[-1].disk_total > 0 and m[-1].cpu_count >= 1
        assert Sandbox.get_metrics(sbx.sandbox_id, api_url=server_url)
        assert sbx.get_metrics(start=before - datetime.timedelta(hours=2), end=before - datetime.timedelta(hours=1)) == []
        assert sbx.sandbox_domain and sbx.get_host(80).endswith(sbx.sandbox_domain)
        assert sbx.envd_api_url == server_url and sbx.download_url("/tmp/x").startswith(sbx.envd_direct_url + "/files?")
        assert Sandbox.default_template == "base" and Sandbox.default_sandbox_timeout == 300


def test_idempotent_create(server_url: str, e2b_env: str) -> None:
    import uuid

    key = f"retry-{uuid.uuid4().hex}"
    a = Sandbox.create(api_url=server_url, idempotency_key=key, metadata={"k": "1"})
    try:
        b = Sandbox.create(api_url=server_url, idempotency_key=key, metadata={"k": "1"})
        assert b.sandbox_id == a.sandbox_id  # a retried create gets the same sandbox
        assert b.run_code("1 + 1").text == "2"
        with pytest.raises(Exception, match="different create request"):
            Sandbox.create(api_url=server_url, idempotency_key=key, metadata={"k": "2"})
        with pytest.raises(Exception, match="lowercase"):
            Sandbox.create(api_url=server_url, idempotency_key="Not Valid")
        e = E2BSandbox.create(idempotency_key=key + "-e2b")
        try:
            assert E2BSandbox.create(idempotency_key=key + "-e2b").sandbox_id == e.sandbox_id
        finally:
            e.kill()
    finally:
        a.kill()


async def test_idempotent_concurrent_creates_make_one_sandbox(server_url: str) -> None:
    import uuid

    key = f"burst-{uuid.uuid4().hex}"
    boxes = await asyncio.gather(*(AsyncSandbox.create(api_url=server_url, idempotency_key=key) for _ in range(5)))
    assert len({b.sandbox_id for b in boxes}) == 1
    await boxes[0].kill()


def test_list_order_retain_output_stream_input(server_url: str) -> None:
    a = Sandbox.create(api_url=server_url, metadata={"suite": "order"})
    b = Sandbox.create(api_url=server_url, metadata={"suite": "order"})
    try:
        from agentcell.sdk.models import SandboxQuery

        q = SandboxQuery(metadata={"suite": "order"})
        asc = [i.sandbox_id for i in Sandbox.list(query=q, order="asc", api_url=server_url)]
        desc = [i.sandbox_id for i in Sandbox.list(query=q, order="desc", api_url=server_url)]
        assert asc == [a.sandbox_id, b.sandbox_id] and desc == asc[::-1]

        seen: list[str] = []
        r = a.commands.run("seq 3", retain_output=False, on_stdout=seen.append)
        assert r.stdout == "" and "".join(seen) == "1\n2\n3\n"

        h = a.commands.run("cat", background=True, stdin=True)
        a.commands.stream_input(h.pid, (f"line {i}\n" for i in range(3)))
        a.commands.close_stdin(h.pid)
        assert h.wait().stdout == "line 0\nline 1\nline 2\n"
        with pytest.raises(Exception, match="iterable of chunks"):
            a.commands.stream_input(h.pid, "one string")
    finally:
        a.kill()
        b.kill()


def test_files_write_options_sync(server_url: str) -> None:
    with Sandbox.create(api_url=server_url) as sbx:
        payload = b"compressible " * 10_000
        info = sbx.files.write("/home/user/z.txt", payload, gzip=True, metadata={"Owner": "agent"})
        assert info.path == "/home/user/z.txt"
        assert sbx.files.read("/home/user/z.txt", format="bytes", gzip=True) == payload
        assert b"".join(sbx.files.read("/home/user/z.txt", format="stream", gzip=True)) == payload
        assert sbx.files.get_info("/home/user/z.txt").metadata == {"owner": "agent"}  # keys lowercased, as envd
        sbx.files.write("/home/user/z.txt", "plain", use_octet_stream=False)  # multipart; clears the metadata
        assert sbx.files.read("/home/user/z.txt") == "plain"
        assert not sbx.files.get_info("/home/user/z.txt").metadata
        sbx.files.write_files([{"path": "/tmp/a", "data": "A"}, {"path": "/tmp/b", "data": "B"}], metadata={"k": "v"})
        assert sbx.files.get_info("/tmp/b").metadata == {"k": "v"}
        sbx.files.write_files([{"path": "/tmp/c", "data": "C" * 5000}], gzip=True)
        assert sbx.files.read("/tmp/c") == "C" * 5000
        with pytest.raises(Exception, match="octet-stream"):
            sbx.files.write("/tmp/d", "x", gzip=True, use_octet_stream=False)


async def test_files_write_options_async(server_url: str) -> None:
    sbx = await AsyncSandbox.create(api_url=server_url)
    try:
        payload = b"async " * 20_000
        await sbx.files.write("/tmp/z", payload, gzip=True, metadata={"a": "b"})
        assert await sbx.files.read("/tmp/z", format="bytes", gzip=True) == payload
        stream = await sbx.files.read("/tmp/z", format="stream", gzip=True)
        assert b"".join([c async for c in stream]) == payload
        assert (await sbx.files.get_info("/tmp/z")).metadata == {"a": "b"}
        await sbx.files.write("/tmp/z", "again", use_octet_stream=False)
        assert await sbx.files.read("/tmp/z") == "again"
    finally:
        await sbx.kill()
