"""`agentcell mcp` (agentcell/mcp/) with the official MCP client (mcp.client.stdio,
mcp.client.streamable_http) against a real server: over stdio, over /mcp of `agentcell serve` and over the
standalone `agentcell mcp --http`. Tools and their content (text, PNG and SVG images), resources, errors,
the session rule (another session sees nothing; a session's end kills its sandboxes unless kept), bounds,
and the endpoint's auth.
"""

from __future__ import annotations

import asyncio
import base64
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, ImageContent, TextContent

from agentcell import Sandbox
from agentcell.mcp import TOOL_NAMES
from tests.helpers import wait_until
from tests.servers import REPO, ServerProcess, free_port

KEY = "mcp-test-key-" + os.urandom(6).hex()
ISSUE_TOOLS = {"create_sandbox", "run_code", "run_command", "read_file", "write_file", "list_files", "upload_url",
               "get_host", "pause_sandbox", "resume_sandbox", "snapshot_sandbox", "kill_sandbox", "get_report",
               "list_sandboxes"}
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
ACCEPT = {"Accept": "application/json, text/event-stream"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHART = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
SVG = "from IPython.display import SVG, display\ndisplay(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\"/>'))"


@pytest.fixture(scope="module")
def keyed() -> Iterator[ServerProcess]:
    """A server with an API key (the session's has none), so /mcp's auth can be tested."""
    log = Path(tempfile.gettempdir()) / f"agentcell-test-mcp-{os.getpid()}.log"
    with ServerProcess(log, "--egress-uplink", "none", env={"AGENTCELL_SERVER_API_KEY": KEY}) as srv:
        yield srv


def texts(result: CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def call(session: ClientSession, tool: str, **args: Any) -> CallToolResult:
    result = await session.call_tool(tool, args)
    assert not result.is_error, f"{tool} failed: {texts(result)}"
    return result


async def create(session: ClientSession, **args: Any) -> str:
    return (await call(session, "create_sandbox", **args)).structured_content["sandbox_id"]  # type: ignore[index]


def alive(server: ServerProcess, sandbox_id: str) -> bool:
    ids = {s.sandbox_id for s in Sandbox.list(api_url=server.url, api_key=KEY)}
    return sandbox_id in ids


@asynccontextmanager
async def over_stdio(server: ServerProcess, *args: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=sys.executable, args=["-m", "agentcell", "mcp", "--api-url", server.url,
                                                                 *args],
                                   env={**os.environ, "AGENTCELL_API_KEY": KEY}, cwd=str(REPO))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


@asynccontextmanager
async def over_http(url: str, headers: dict[str, str]) -> AsyncIterator[ClientSession]:
    async with httpx2.AsyncClient(headers=headers, timeout=60) as http, \
            streamable_http_client(url, http_client=http) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def test_stdio_tools_content_and_session_end(keyed: ServerProcess) -> None:
    async with over_stdio(keyed) as s:
        names = {t.name for t in (await s.list_tools()).tools}
        assert ISSUE_TOOLS <= names and names == set(TOOL_NAMES)
        sid = await create(s, timeout=120, metadata={"by": "mcp"})
        kept = await create(s, timeout=120, keep=True)

        assert texts(await call(s, "run_code", sandbox_id=sid, code="print(1+1)")).strip() == "2"
        assert "Out: 42" in texts(await call(s, "run_code", sandbox_id=sid, code="x = 41\nx + 1"))
        chart = await call(s, "run_code", sandbox_id=sid, code=CHART)
        images = [c for c in chart.content if isinstance(c, ImageContent)]
        assert [i.mime_type for i in images] == ["image/png"]
        assert base64.b64decode(images[0].data).startswith(PNG_MAGIC)
        svg = [c for c in (await call(s, "run_code", sandbox_id=sid, code=SVG)).content if isinstance(c, ImageContent)]
        assert [i.mime_type for i in svg] == ["image/svg+xml"] and b"<svg" in base64.b64decode(svg[0].data)
        js = await call(s, "create_code_context", sandbox_id=sid, language="javascript")
        assert "3" in texts(await call(s, "run_code", sandbox_id=sid, code="1 + 2",
                                       context=js.structured_content["context"]))  # type: ignore[index]
        error = await call(s, "run_code", sandbox_id=sid, code="1/0")  # the code's error, not the tool's
        assert "ZeroDivisionError" in texts(error)

        out = texts(await call(s, "run_command", sandbox_id=sid, command="echo out; echo err >&2; exit 3"))
        assert "exit code: 3" in out and "out" in out and "err" in out
        bg = await call(s, "run_command", sandbox_id=sid, command="sleep 30", background=True)
        pid = bg.structured_content["pid"]  # type: ignore[index]
        running = await call(s, "run_command", sandbox_id=sid, command=f"tr '\\0' ' ' < /proc/{pid}/cmdline")
        assert "sleep 30" in texts(running)

        await call(s, "write_file", sandbox_id=sid, path="/home/user/notes/a.txt", content="héllo")
        await call(s, "write_file", sandbox_id=sid, path="/home/user/b.bin",
                   content=base64.b64encode(b"\x00\x01").decode(), encoding="base64")
        assert texts(await call(s, "read_file", sandbox_id=sid, path="/home/user/notes/a.txt")) == "héllo"
        listing = texts(await call(s, "list_files", sandbox_id=sid, path="/home/user", depth=2))
        assert "/home/user/notes/a.txt" in listing and "/home/user/b.bin" in listing
        res = await s.read_resource(f"sandbox://{sid}/files/home/user/notes/a.txt")
        assert res.contents[0].text == "héllo"  # type: ignore[union-attr]
        for _ in range(100):  # the record stores its events a moment after they happen
            report = (await s.read_resource(f"sandbox://{sid}/report")).contents[0].text  # type: ignore[union-attr]
            if "sleep 30" in report:
                break
            await asyncio.sleep(0.1)
        assert "sleep 30" in report and "PROCESSES" in report
        assert "sleep 30" in texts(await call(s, "get_report", sandbox_id=sid))
        assert '"processes"' in texts(await call(s, "get_report", sandbox_id=sid, format="json"))

        host = (await call(s, "get_host", sandbox_id=sid, port=8000)).structured_content
        assert host["host"].startswith(f"8000-{sid}.")  # type: ignore[index]
        # the sandbox's network decides: this server gives sandboxes no uplink, so the fetch fails inside it
        fetch = await s.call_tool("upload_url", {"sandbox_id": sid, "url": "http://192.0.2.1/x", "path": "/tmp/x"})
        assert fetch.is_error and "192.0.2.1" in texts(fetch)

        # errors carry the server's message
        unknown = await s.call_tool("run_code", {"sandbox_id": "nosuchsandbox", "code": "1"})
        assert unknown.is_error and "not found in this session" in texts(unknown)
        bad = await s.call_tool("run_code", {"sandbox_id": sid, "code": "1", "language": "cobol"})
        assert bad.is_error and "cobol" in texts(bad)
        missing = await s.call_tool("read_file", {"sandbox_id": sid, "path": "/nope"})
        assert missing.is_error and "/nope" in texts(missing)

        await call(s, "pause_sandbox", sandbox_id=sid)
        assert '"paused"' in texts(await call(s, "list_sandboxes"))
        await call(s, "resume_sandbox", sandbox_id=sid)
        assert texts(await call(s, "run_code", sandbox_id=sid, code="print(x)")).strip() == "41"
        assert alive(keyed, sid) and alive(keyed, kept)
    # the client is gone (stdin closed): its sandbox with it, the kept one lives on
    wait_until("the session's sandbox is killed", lambda: not alive(keyed, sid))
    assert alive(keyed, kept)
    Sandbox.kill(kept, api_url=keyed.url, api_key=KEY)


async def test_http_sessions_see_only_their_own_sandboxes(keyed: ServerProcess) -> None:
    url = keyed.url + "/mcp"
    async with over_http(url, {"Authorization": f"Bearer {KEY}"}) as a:
        sid = await create(a)
        kept = await create(a, keep=True)
        assert texts(await call(a, "run_code", sandbox_id=sid, code="print(1+1)")).strip() == "2"
        async with over_http(url, {"X-API-KEY": KEY}) as b:
            assert '"sandboxes": []' in texts(await call(b, "list_sandboxes"))
            for tool, args in (("run_code", {"code": "1"}), ("kill_sandbox", {}), ("read_file", {"path": "/etc"})):
                refused = await b.call_tool(tool, {"sandbox_id": sid, **args})
                assert refused.is_error and "not found in this session" in texts(refused)
            with pytest.raises(Exception, match="not found in this session"):
                await b.read_resource(f"sandbox://{sid}/report")
            own = await create(b)
        # b's session ended (its client deleted it): its sandbox is gone, a's are not
        wait_until("session b's sandbox is killed", lambda: not alive(keyed, own))
        assert alive(keyed, sid)
        # one of the session's sandboxes killed behind its back: the server's message, not a crash
        doomed = await create(a)
        Sandbox.kill(doomed, api_url=keyed.url, api_key=KEY)
        gone = await a.call_tool("run_code", {"sandbox_id": doomed, "code": "1"})
        assert gone.is_error and doomed in texts(gone), texts(gone)
        await call(a, "snapshot_sandbox", sandbox_id=sid, name="mcp-snap")
        assert '"killed": true' in texts(await call(a, "kill_sandbox", sandbox_id=sid))
        assert not alive(keyed, sid)
        gone = await a.call_tool("run_code", {"sandbox_id": sid, "code": "1"})
        assert gone.is_error and "not found in this session" in texts(gone)
    assert alive(keyed, kept)
    Sandbox.kill(kept, api_url=keyed.url, api_key=KEY)


def test_http_endpoint_auth_and_protocol(keyed: ServerProcess) -> None:
    init, accept = INIT, ACCEPT
    for headers in ({}, {"X-API-KEY": "wrong"}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(keyed.url + "/mcp", json=init, headers={**accept, **headers}, timeout=10)
        assert r.status_code == 401, (headers, r.text)
        assert "API key" in r.json()["message"]
    ok = httpx.post(keyed.url + "/mcp", json=init, headers={**accept, "X-API-KEY": KEY}, timeout=10)
    assert ok.status_code == 200 and ok.headers["mcp-session-id"]
    # the stateless 2026-07-28 era has no session to own sandboxes: refused, so "auto" clients fall back
    r = httpx.post(keyed.url + "/mcp", json={"jsonrpc": "2.0", "id": 3, "method": "server/discover"},
                   headers={**accept, "X-API-KEY": KEY, "mcp-protocol-version": "2026-07-28"}, timeout=10)
    assert r.status_code == 400 and "session" in r.json()["error"]["message"]
    # the server's Host/Origin rules hold for /mcp as for the API
    r = httpx.post(keyed.url + "/mcp", json=init, headers={**accept, "X-API-KEY": KEY, "Origin": "https://evil.example"},
                   timeout=10)
    assert r.status_code == 403


def test_no_mcp_and_unix_socket_servers(tmp_path: Path) -> None:
    # both start at once (each constructor launches its process; entering waits until it answers)
    off = ServerProcess(tmp_path / "off.log", "--no-mcp", "--egress-uplink", "none")
    uds = ServerProcess(tmp_path / "uds.log", "--egress-uplink", "none", uds=str(tmp_path / "agentcell.sock"))
    with off, uds:
        r = httpx.post(off.url + "/mcp", json=INIT, headers={**ACCEPT, "X-API-KEY": "k"}, timeout=10)
        assert r.status_code == 404
        # a server that has no TCP listener to call itself back on says so, and what to run instead
        with uds.http_client() as http:
            r = http.post("/mcp", json=INIT, headers=ACCEPT)
        assert r.status_code == 501 and "agentcell mcp --http" in r.json()["message"]


async def test_standalone_http_bounds(keyed: ServerProcess, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "mcp.log"
    with log.open("wb") as out:
        import subprocess

        proc = subprocess.Popen([sys.executable, "-m", "agentcell", "mcp", "--http", "--port", str(port), "--api-url",
                                 keyed.url, "--max-sandboxes", "1", "--max-output", "1000"],
                                # a key in its environment is not lent to clients that send none
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "AGENTCELL_API_KEY": KEY})
    try:
        url = f"http://127.0.0.1:{port}/mcp"

        def up() -> bool:
            try:
                return httpx.get(url, timeout=1).status_code > 0
            except httpx.TransportError:
                return False

        wait_until("agentcell mcp --http answers", up, timeout=30)
        # a web page under another name must not drive it (DNS rebinding)
        r = httpx.post(url, json={}, headers={"Host": "evil.example", "X-API-KEY": KEY}, timeout=5)
        assert r.status_code in (400, 403, 421), r.text
        async with over_http(url, {"X-API-KEY": KEY}) as s:
            both = await asyncio.gather(s.call_tool("create_sandbox", {}), s.call_tool("create_sandbox", {}))
            made = [r for r in both if not r.is_error]
            assert len(made) == 1, [texts(r) for r in both]  # concurrent creates cannot pass the bound together
            assert "--max-sandboxes 1" in texts(next(r for r in both if r.is_error))
            sid = made[0].structured_content["sandbox_id"]  # type: ignore[index]
            long = texts(await call(s, "run_code", sandbox_id=sid, code="print('x' * 5000)"))
            assert "more characters of stdout not shown" in long and len(long) < 1500
        wait_until("the session's sandbox is killed", lambda: not alive(keyed, sid))
        # a session is bound to the key that opened it: another key's request for it is answered 404
        opened = httpx.post(url, json=INIT, headers={**ACCEPT, "X-API-KEY": KEY}, timeout=10)
        r = httpx.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, timeout=10,
                       headers={**ACCEPT, "X-API-KEY": "other", "mcp-session-id": opened.headers["mcp-session-id"]})
        assert r.status_code == 404
        async with over_http(url, {}) as nokey:  # no key: the agentcell server refuses the calls
            refused = await nokey.call_tool("create_sandbox", {})
            assert refused.is_error and "API key" in texts(refused)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
