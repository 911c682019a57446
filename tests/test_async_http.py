"""agentcell.sdk.fast_async_http against a real HTTP server on loopback TCP and on a unix socket.

The server is a small asyncio one (httptools parses its requests) whose paths answer in the ways the
client must handle: Content-Length, chunked and close-delimited bodies, a stall, an endless stream, a
close after the response. It records its connections, so the tests can check which connection served a
request and that the server saw the client leave.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httptools
import pytest

from agentcell.errors import SandboxException, ServerUnreachableException, TimeoutException
from agentcell.sdk import fast_async_http as fah
from agentcell.sdk.config import Endpoint


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    conn: int


@dataclass
class _Conn:
    id: int
    transport: asyncio.Transport
    closed: asyncio.Event = field(default_factory=asyncio.Event)


def _head(status: str = "200 OK", **headers: str | int) -> bytes:
    lines = [f"HTTP/1.1 {status}\r\n"] + [f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items()]
    return ("".join(lines) + "\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class ScriptedServer:
    """Answers by path; see `_answer`."""

    def __init__(self) -> None:
        self.conns: list[_Conn] = []
        self.requests: list[Request] = []

    def protocol(self) -> asyncio.Protocol:
        return _ServerProtocol(self)

    async def _answer(self, conn: _Conn, req: Request) -> None:
        t = conn.transport
        path = req.path.split("?", 1)[0]
        if path == "/cl":
            t.write(_head(content_length=5, x_conn=conn.id) + b"hello")
        elif path == "/chunked":
            t.write(_head(transfer_encoding="chunked", x_conn=conn.id) + _chunk(b"hel"))
            await asyncio.sleep(0.01)
            t.write(_chunk(b"lo ") + _chunk(b"world") + b"0\r\n\r\n")
        elif path == "/close-delimited":
            t.write(_head(x_conn=conn.id) + b"until ")
            await asyncio.sleep(0.01)
            t.write(b"the end")
            t.close()
        elif path == "/lines":  # lines split across chunks, chunks arriving one by one
            t.write(_head(transfer_encoding="chunked"))
            for part in (b"a\nb", b"c\n", b"\nd", b"e"):
                await asyncio.sleep(0.005)
                t.write(_chunk(part))
            t.write(b"0\r\n\r\n")
        elif path == "/then-close":  # a keep-alive answer, then the server drops the idle connection
            t.write(_head(content_length=2, x_conn=conn.id) + b"ok")
            t.close()
        elif path == "/stall":  # the head, then nothing
            t.write(_head(transfer_encoding="chunked", x_conn=conn.id) + _chunk(b"first"))
        elif path == "/silent":
            pass
        elif path == "/endless":
            t.write(_head(transfer_encoding="chunked", x_conn=conn.id))
            while not t.is_closing():
                t.write(_chunk(b"tick\n"))
                await asyncio.sleep(0.005)
        elif path == "/echo":
            t.write(_head(content_length=len(req.body), x_conn=conn.id,
                          x_te=req.headers.get("transfer-encoding", "-"), x_cl=req.headers.get("content-length", "-"))
                    + req.body)
        elif path == "/continue":  # an informational response first
            t.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await asyncio.sleep(0.01)
            t.write(_head(content_length=4, x_conn=conn.id) + b"done")
        elif path == "/extra":  # bytes after the end of the response
            t.write(_head(content_length=2, x_conn=conn.id) + b"okHTTP/1.1 200 OK\r\n\r\n")
        elif path == "/status":
            t.write(_head("404 Not Found", content_length=9, x_conn=conn.id, X_Mixed_Case="v") + b"not there")
        else:
            t.write(_head("500 Internal Server Error", content_length=0))


class _ServerProtocol(asyncio.Protocol):
    def __init__(self, server: ScriptedServer) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.url = b""
        self.conn: _Conn | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn = _Conn(len(self.server.conns), transport)  # type: ignore[arg-type]
        self.server.conns.append(self.conn)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def eof_received(self) -> bool:
        assert self.conn is not None
        self.conn.closed.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        assert self.conn is not None
        self.conn.closed.set()

    def on_message_begin(self) -> None:
        self.headers, self.body, self.url = {}, bytearray(), b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        assert self.conn is not None
        req = Request(self.parser.get_method().decode(), self.url.decode(), self.headers, bytes(self.body), self.conn.id)
        self.server.requests.append(req)
        task = asyncio.get_running_loop().create_task(self.server._answer(self.conn, req))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


@dataclass
class Served:
    server: ScriptedServer
    endpoint: Endpoint

    @property
    def http(self) -> fah.AsyncFastHTTP:
        return fah.client(self.endpoint)

    async def get(self, path: str, **kw: object) -> fah.Response:
        kw.setdefault("connect", 5)
        kw.setdefault("read", 5)
        return await self.http.request("GET", path, headers={}, **kw)  # type: ignore[arg-type]


@pytest.fixture(params=["tcp", "unix"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    loop = asyncio.get_running_loop()
    server = ScriptedServer()
    tmp = tempfile.mkdtemp(prefix="agentcell-http-test-")
    if request.param == "tcp":
        srv = await loop.create_server(server.protocol, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        endpoint = Endpoint(f"http://127.0.0.1:{port}")
    else:
        path = os.path.join(tmp, "http.sock")
        srv = await loop.create_unix_server(server.protocol, path)
        endpoint = Endpoint("http://localhost", path)
    try:
        yield Served(server, endpoint)
    finally:
        fah.client(endpoint).close()
        srv.close()
        for c in server.conns:
            c.transport.abort()
        await srv.wait_closed()
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)


def _idle(s: Served) -> int:
    return len(s.http._idle)


async def test_keep_alive_reuses_one_connection(served: Served) -> None:
    ids = []
    for _ in range(5):
        r = await served.get("/cl")
        assert (r.status, r.content) == (200, b"hello")
        ids.append(r.headers["X-Conn"])
    assert len(set(ids)) == 1 and len(served.server.conns) == 1
    req = served.server.requests[0]
    assert req.headers["host"] == served.endpoint.base_url.split("//", 1)[1]
    assert req.headers["accept-encoding"] == "identity" and "content-length" not in req.headers


async def test_server_closed_idle_connection_is_not_reused(served: Served) -> None:
    r = await served.get("/then-close")
    assert r.content == b"ok"
    first = served.server.conns[0]
    await first.closed.wait()  # the server has dropped it; the client may not have noticed yet
    r = await served.get("/cl")
    assert r.content == b"hello" and r.headers["x-conn"] != "0"
    assert len(served.server.conns) == 2


async def test_idle_connection_closed_without_the_loop_noticing_is_dropped(served: Served) -> None:
    await served.get("/cl")
    [conn] = served.http._idle
    served.server.conns[0].transport.abort()
    await asyncio.sleep(0)  # the server's socket closes; the client's loop has not polled it since
    assert not conn.eof and not conn.lost  # so only the peek at the socket can tell the connection is gone
    assert not conn.alive()
    r = await served.get("/cl")
    assert r.content == b"hello" and len(served.server.conns) == 2


async def test_bodies_content_length_chunked_and_close_delimited(served: Served) -> None:
    assert (await served.get("/chunked")).content == b"hello world"
    r = await served.get("/close-delimited")
    assert r.content == b"until the end"
    assert len(served.server.conns) == 1 and _idle(served) == 0  # it reused the connection, which then ended
    r = await served.get("/cl", stream=True)
    assert [c async for c in r.aiter_bytes()] == [b"hello"]
    assert _idle(served) == 1
    r = await served.get("/continue")
    assert (r.status, r.content, r.headers.get("x-conn")) == (200, b"done", "1")
    r = await served.get("/extra")
    assert r.content == b"ok" and _idle(served) == 0  # out of step: not reused
    r = await served.get("/status")
    assert r.status_code == 404 and r.text == "not there"
    assert r.headers.get("x-mixed-case") == "v" and "X-MIXED-CASE" in r.headers and r.headers.get("nope") is None


async def test_aiter_lines_across_chunk_boundaries(served: Served) -> None:
    r = await served.get("/lines", stream=True)
    assert [line async for line in r.aiter_lines()] == [b"a", b"bc", b"", b"de"]
    assert _idle(served) == 1


async def test_early_aclose_closes_the_connection(served: Served) -> None:
    r = await served.get("/endless", stream=True)
    lines = r.aiter_lines()
    assert await anext(lines) == b"tick"
    await r.aclose()
    await asyncio.wait_for(served.server.conns[0].closed.wait(), 5)  # the server saw the client leave
    assert _idle(served) == 0


async def test_read_timeout_raises_and_closes(served: Served) -> None:
    with pytest.raises(fah.ReadTimeout) as ei:
        await served.get("/silent", read=0.2)
    assert isinstance(fah.transport_error(ei.value, "call"), TimeoutException)
    r = await served.get("/stall", read=0.2, stream=True)
    chunks = r.aiter_bytes()
    assert await anext(chunks) == b"first"
    with pytest.raises(fah.ReadTimeout):
        await anext(chunks)
    await asyncio.wait_for(served.server.conns[1].closed.wait(), 5)
    await asyncio.wait_for(served.server.conns[0].closed.wait(), 5)
    assert _idle(served) == 0


async def test_cancellation_mid_response_does_not_pool_the_connection(served: Served) -> None:
    got_one = asyncio.Event()

    async def consume() -> None:
        r = await served.get("/endless", stream=True)
        async for _ in r.aiter_bytes():
            got_one.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_one.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(served.server.conns[0].closed.wait(), 5)
    assert _idle(served) == 0

    task = asyncio.create_task(served.get("/silent"))  # cancelled while waiting for the head
    while len(served.server.requests) < 2:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(served.server.conns[1].closed.wait(), 5)
    assert _idle(served) == 0
    assert (await served.get("/cl")).content == b"hello"


async def test_100_concurrent_requests(served: Served) -> None:
    responses = await asyncio.gather(*(served.get("/chunked") for _ in range(100)))
    assert all(r.content == b"hello world" for r in responses)
    assert len(served.server.conns) <= 100
    assert _idle(served) == min(len(served.server.conns), 64)
    before = len(served.server.conns)
    await asyncio.gather(*(served.get("/cl") for _ in range(20)))
    assert len(served.server.conns) == before  # served by idle connections


async def test_request_bodies(served: Served) -> None:
    http = served.http
    r = await http.request("POST", "/echo", body=b"small", headers={"X-A": "1"}, connect=5, read=5)
    assert (r.content, r.headers["x-cl"], r.headers["x-te"]) == (b"small", "5", "-")
    big = os.urandom(3 << 20)
    r = await http.request("POST", "/echo", body=big, headers={}, connect=5, read=5)
    assert r.content == big and r.headers["x-cl"] == str(len(big))

    async def parts() -> AsyncIterator[bytes]:
        for i in range(50):
            yield bytes([i]) * 10_000
            await asyncio.sleep(0)

    r = await http.request("PUT", "/echo", body=parts(), headers={}, connect=5, read=5)
    assert r.content == b"".join(bytes([i]) * 10_000 for i in range(50)) and r.headers["x-te"] == "chunked"
    r = await http.request("POST", "/echo", headers={}, connect=5, read=5)
    assert r.content == b"" and r.headers["x-cl"] == "0"
    assert len(served.server.conns) == 1
    with pytest.raises(fah.LocalProtocolError):
        await http.request("GET", "/cl", headers={"X-Bad": "a\r\nInjected: 1"}, connect=5, read=5)


async def test_path_is_encoded_like_httpx(served: Served) -> None:
    await served.get("/echo/a b/é" + "?" + "q=1")
    assert served.server.requests[-1].path == "/echo/a%20b/%C3%A9?q=1"


async def test_connect_errors(tmp_path: object) -> None:
    missing = Endpoint("http://localhost", os.path.join(tempfile.gettempdir(), "agentcell-no-such.sock"))
    with pytest.raises(fah.ConnectError) as ei:
        await fah.client(missing).request("GET", "/", headers={}, connect=1, read=1)
    e = fah.transport_error(ei.value, "GET /")
    # its own kind (the CLI says it in one line), still a SandboxException for code that catches those
    assert type(e) is ServerUnreachableException and isinstance(e, SandboxException)
    assert "cannot reach the agentcell server (ConnectError" in str(e)


async def test_one_pool_per_loop_and_closed_loops_are_dropped(served: Served) -> None:
    await served.get("/cl")

    def other_loop() -> str:
        async def go() -> str:
            r = await fah.client(served.endpoint).request("GET", "/cl", headers={}, connect=5, read=5)
            return r.headers["x-conn"]
        return asyncio.run(go())

    a = await asyncio.to_thread(other_loop)
    b = await asyncio.to_thread(other_loop)
    assert len({"0", a, b}) == 3  # each loop opened its own connection
    await asyncio.wait_for(served.server.conns[int(a)].closed.wait(), 5)  # dropped when b's loop came
    assert sum(1 for lp in fah._clients if lp.is_closed()) == 1  # b's, until the next new loop
    fah._drop_closed_loops()
    await asyncio.wait_for(served.server.conns[int(b)].closed.wait(), 5)
