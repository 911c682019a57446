"""The async SDK's HTTP client: HTTP/1.1 keep-alive on asyncio, over TCP or the embedded server's unix
socket, with llhttp (httptools) parsing the responses. The counterpart of fast_http for AsyncSandbox.

httpx.AsyncClient cost the client far more CPU than the server spent: a burst of 100 concurrent
AsyncSandbox.create() + run_code("1+1") burned 3.4-8 s of client CPU (0.45 s in the server), nearly all
in httpcore's pool (`_assign_requests_to_connections` is O(requests x connections) per event: 4.7 M
`is_idle` calls per burst) and in a failed `import sniffio` on every request; without that, still ~1 ms
per request. Here a request takes an idle connection from a deque (O(1)), writes its head and small body
in one write and reads the response through a C parser: the same burst costs the client 0.13-0.15 s of
CPU, a run_code("1+1") round trip ~0.5 ms (httpx: 2.2-2.7 ms, 7-10 ms once its pool held a burst's
connections).

- One pool per (event loop, endpoint): at most _POOL_SIZE idle connections kept, more opened when
  needed and closed after use. A connection goes back only once its whole response has arrived and
  allowed keep-alive (aclose() before that closes it, so the server sees the client leave); one the
  server closed while idle is noticed (EOF peek) and dropped before reuse,
  and none is kept idle longer than _IDLE_EXPIRY (the server closes idle ones after 75 s). No retries:
  a failed request is never sent twice.
- A request cancelled or failing midway closes its connection, never pools it.
- Timeouts: `connect` bounds opening a connection, `read` each wait for response bytes (and for the
  socket to take a body's bytes); None waits forever. They raise ConnectTimeout / ReadTimeout /
  WriteTimeout (all `Timeout`); other transport failures raise HTTPError subclasses. `transport_error`
  maps them to the SDK's exceptions.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import httptools

from agentcell.errors import SandboxException
from agentcell.sdk import transport
from agentcell.sdk.config import Endpoint
from agentcell.sdk.fast_http import json_body
from agentcell.sdk.transport import HEALTH_PATH, PROBE_TIMEOUT_S, probe_headers, transport_failure

__all__ = ["AsyncFastHTTP", "HTTPError", "Response", "Timeout", "client", "json_body", "transport_error", "with_query"]

_POOL_SIZE = 64  # idle connections kept per endpoint and loop (more are opened when needed, then closed)
_IDLE_EXPIRY = 60.0  # seconds an idle connection may be reused (the agentcell server closes them at 75 s)
_ONE_WRITE = 64 << 10  # bodies up to this size go out in the same write as the request head
_HIGH_WATER = 256 << 10  # buffered response bytes at which reading from the socket pauses
_LOW_WATER = 64 << 10  # ... and resumes
_SAFE_PATH = re.compile(r"[!-~]*")  # printable ASCII without space: sent as given
_PATH_SAFE_CHARS = "/:@!$&'()*+,;=-._~%?"
_BODYFUL = frozenset({"POST", "PUT", "PATCH"})


class HTTPError(Exception):
    """A transport failure (no HTTP response, or a broken one)."""


class ConnectError(HTTPError):
    pass


class ReadError(HTTPError):
    pass


class WriteError(HTTPError):
    pass


class RemoteProtocolError(HTTPError):
    pass


class LocalProtocolError(HTTPError):
    """The request cannot be sent (e.g. a header value with a line break)."""


class Timeout(HTTPError):
    pass


class ConnectTimeout(Timeout):
    pass


class ReadTimeout(Timeout):
    pass


class WriteTimeout(Timeout):
    pass


def transport_error(e: HTTPError, what: str) -> SandboxException:
    return transport_failure(e, what, isinstance(e, Timeout))


async def cut_off_error(client: AsyncFastHTTP, e: HTTPError, what: str, sandbox_id: str | None) -> SandboxException:
    """transport_error for a response that had begun: if the sandbox has gone meanwhile, say so."""
    timed_out = isinstance(e, Timeout)
    gone = False
    if sandbox_id and not timed_out:
        try:
            r = await client.request("GET", HEALTH_PATH, headers=probe_headers(sandbox_id),
                                     connect=PROBE_TIMEOUT_S, read=PROBE_TIMEOUT_S)
            gone = r.status == 502
        except HTTPError:
            pass
    return transport.cut_off_error(e, what, timed_out, gone)


def _expire(fut: asyncio.Future[None], exc: type[Timeout], timeout: float) -> None:
    if not fut.done():
        fut.set_exception(exc(f"no progress for {timeout:g} s"))


class Headers:
    """A response's headers; case-insensitive lookup (the last value wins, as for a dict)."""

    __slots__ = ("_raw", "_map")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = raw
        self._map: dict[str, str] | None = None

    def _lookup(self) -> dict[str, str]:
        m = self._map
        if m is None:
            m = self._map = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self._raw}
        return m

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._lookup().get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return self._lookup()[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._lookup()

    def get_list(self, name: str) -> list[str]:
        key = name.lower().encode("latin-1")
        return [v.decode("latin-1") for k, v in self._raw if k.lower() == key]

    def items(self) -> list[tuple[str, str]]:
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self._raw]

    def __repr__(self) -> str:
        return f"Headers({self.items()!r})"


class _Connection(asyncio.Protocol):
    """One keep-alive connection: asyncio's callbacks feed llhttp, whose callbacks fill the current
    response's state; the request's task waits on `waiter`, woken by every event."""

    def __init__(self, pool: AsyncFastHTTP) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.sock: socket.socket | None = None  # the raw socket
        self.peek = False  # check an idle connection with a peek at its socket (not over TLS)
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[None] | None = None
        self.idle_since = 0.0
        self.lost = False  # connection_lost ran
        self.eof = False
        self.reusable = True  # False once anything happened that the next request must not see
        self.write_paused = False
        self.read_paused = False
        self.begin(False)
        self.active = False

    # --- per request ---------------------------------------------------------------------------------

    def begin(self, head: bool) -> None:
        self.active = True
        self.head = head
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.until_close = False  # the body ends when the server closes the connection
        self.informational = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.error: HTTPError | None = None

    async def wait(self, timeout: float | None, exc: type[Timeout]) -> None:
        """Until the next event (bytes, end of message, EOF, loss, writable again); raises `exc` after
        `timeout` seconds without one."""
        fut = self.loop.create_future()
        self.waiter = fut
        timer = self.loop.call_later(timeout, _expire, fut, exc, timeout) if timeout is not None else None
        try:
            await fut
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def take_chunk(self) -> bytes:
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.read_paused and self.buffered <= _LOW_WATER and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()
        return chunk

    def alive(self) -> bool:
        """For an idle connection: still open, and nothing (no EOF, no stray byte) arrived since."""
        if self.lost or self.eof or not self.reusable or self.transport is None or self.transport.is_closing():
            return False
        if self.peek and self.sock is not None:
            try:
                self.sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return True
            except OSError:
                return False
            return False  # EOF (b"") or an unexpected byte
        return True

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()

    # --- asyncio callbacks ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.active or self.complete:
            self.reusable = False  # bytes nobody asked for: the connection is out of step
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.error = RemoteProtocolError(f"the server's response is not valid HTTP: {e}")
            self.abort()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self.reusable = False
        if self.active and not self.complete:
            if self.headers_done and self.until_close:
                self.complete = True
            elif self.error is None:
                self.error = RemoteProtocolError("the server closed the connection before the response ended")
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.reusable = False
        if self.active and not self.complete and self.error is None:
            self.error = (ReadError(f"{type(exc).__name__}: {exc}") if exc is not None else
                          RemoteProtocolError("the server closed the connection before the response ended"))
        self._wake()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake()

    # --- llhttp callbacks ----------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            raise RemoteProtocolError("the server sent bytes after the end of its response")
        if self.informational:
            self.informational = False
            self.raw_headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.informational = True  # 100 Continue and the like: the real response follows
            return
        self.status = status
        self.headers_done = True
        if self.head or status == 101:
            self.complete = True  # no body; the parser would wait for one, so the connection is not reused
            self.reusable = False
            return
        if status not in (204, 304):
            self.until_close = not any(
                (k := name.lower()) == b"content-length" or (k == b"transfer-encoding" and b"chunked" in v.lower())
                for name, v in self.raw_headers)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered >= _HIGH_WATER and not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.informational:
            return
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True


class Response:
    """A response: status, headers, and the body (read(), or streamed with aiter_bytes / aiter_lines).
    A streamed response must be read to its end or aclose()d; its connection goes back to the pool when
    its body has fully arrived, and is closed otherwise."""

    __slots__ = ("status", "headers", "_conn", "_read_timeout", "_content")

    def __init__(self, conn: _Connection, read_timeout: float | None) -> None:
        self.status = conn.status
        self.headers = Headers(conn.raw_headers)
        self._conn: _Connection | None = conn
        self._read_timeout = read_timeout
        self._content: bytes | None = None

    @property
    def status_code(self) -> int:
        return self.status

    @property
    def content(self) -> bytes:
        if self._content is None:
            raise RuntimeError("the response body was not read; await read() first")
        return self._content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)

    async def _next(self) -> bytes | None:
        """The next piece of the body, or None at its end (when the connection goes back to the pool)."""
        conn = self._conn
        if conn is None:
            return None
        try:
            while True:
                if conn.chunks:
                    return conn.take_chunk()
                if conn.complete:
                    self._release()
                    return None
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self._read_timeout, ReadTimeout)
        except BaseException:
            self._abort()
            raise

    async def read(self) -> bytes:
        if self._content is None:
            parts: list[bytes] = []
            while (chunk := await self._next()) is not None:
                parts.append(chunk)
            self._content = parts[0] if len(parts) == 1 else b"".join(parts)
        return self._content

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body piece by piece as it arrives."""
        while (chunk := await self._next()) is not None:
            yield chunk

    aiter_raw = aiter_bytes

    async def aiter_lines(self) -> AsyncIterator[bytes]:
        """The body's lines as they arrive, without their newlines."""
        buf = b""
        while (chunk := await self._next()) is not None:
            buf += chunk
            if b"\n" in buf:
                *complete, buf = buf.split(b"\n")
                for line in complete:
                    yield line
        if buf:
            yield buf

    async def aclose(self) -> None:
        """Done with the response: its connection is pooled if the whole body has arrived from the
        server (and it allows keep-alive), else closed so the server sees the client leave."""
        conn = self._conn
        if conn is None:
            return
        if conn.complete and conn.error is None:
            self._release()  # unread pieces are dropped: the connection is at a message boundary
        else:
            self._conn = None
            conn.close()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.pool.put(conn)

    def _abort(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<Response [{self.status}]>"


Body = bytes | bytearray | memoryview | AsyncIterable[bytes] | None


class AsyncFastHTTP:
    """One endpoint's pool on one event loop (use `client()`); not for use from other loops."""

    def __init__(self, endpoint: Endpoint, loop: asyncio.AbstractEventLoop) -> None:
        url = urllib.parse.urlsplit(endpoint.base_url)
        self.loop = loop
        self._prefix = url.path.rstrip("/")
        self._uds = endpoint.uds
        self._tls = url.scheme == "https"
        if url.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme in {endpoint.base_url!r}")
        self._host = url.hostname or "localhost"
        self._port = url.port or (443 if self._tls else 80)
        netloc = f"[{self._host}]" if ":" in self._host else self._host
        if url.port is not None and url.port != (443 if self._tls else 80):
            netloc += f":{url.port}"
        self._host_line = f"Host: {netloc}\r\n"
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self._tls else None
        self._idle: collections.deque[_Connection] = collections.deque()
        self._closed = False

    # --- the pool ------------------------------------------------------------------------------------

    def _take(self) -> _Connection | None:
        idle = self._idle
        if not idle:
            return None
        now = time.monotonic()
        while idle and now - idle[0].idle_since > _IDLE_EXPIRY:
            idle.popleft().close()
        while idle:
            conn = idle.pop()  # the most recently used: the others age out
            if conn.alive():
                return conn
            conn.close()
        return None

    def put(self, conn: _Connection) -> None:
        conn.active = False
        conn.chunks.clear()
        if (not conn.keep_alive or not conn.reusable or conn.lost or self._closed or len(self._idle) >= _POOL_SIZE
                or conn.transport is None or conn.transport.get_write_buffer_size()):
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    async def _open(self, timeout: float | None) -> _Connection:
        loop = self.loop
        conn = _Connection(self)
        where = self._uds or f"{self._host}:{self._port}"
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(timeout):
                if self._uds:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.setblocking(False)
                    await loop.sock_connect(sock, self._uds)
                    await loop.create_unix_connection(lambda: conn, sock=sock)
                else:
                    sock = await self._tcp_socket()
                    await loop.create_connection(lambda: conn, sock=sock, ssl=self._ssl,
                                                 server_hostname=self._host if self._tls else None)
        except TimeoutError as e:
            if sock is not None:
                sock.close()
            raise ConnectTimeout(f"connecting to {where}: {e or f'no answer within {timeout} s'}") from None
        except (OSError, ssl.SSLError) as e:
            if sock is not None:
                sock.close()
            raise ConnectError(f"cannot connect to {where}: {e}") from None
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        conn.sock = sock
        conn.peek = not self._tls
        return conn

    async def _tcp_socket(self) -> socket.socket:
        try:
            infos = [(socket.AF_INET6 if ":" in self._host else socket.AF_INET, (self._host, self._port))]
            socket.inet_pton(infos[0][0], self._host)
        except OSError:  # a name, not an address
            found = await self.loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
            infos = [(family, addr) for family, _, _, _, addr in found]
        error: OSError | None = None
        for family, addr in infos:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                await self.loop.sock_connect(sock, addr)
                return sock
            except OSError as e:
                sock.close()
                error = e
            except BaseException:
                sock.close()
                raise
        raise error or OSError(f"no address for {self._host}")

    def close(self) -> None:
        """Close the idle connections (those in use close when their responses end)."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    def _abandon(self) -> None:
        """For a pool whose loop is closed: close the sockets without the loop."""
        self._closed = True
        while self._idle:
            conn = self._idle.pop()
            if conn.sock is not None:
                conn.sock.close()

    # --- requests ------------------------------------------------------------------------------------

    def _head(self, method: str, path: str, headers: dict[str, str], length: int | None) -> bytes:
        target = self._prefix + path
        if not _SAFE_PATH.fullmatch(target):
            target = urllib.parse.quote(target.split("#", 1)[0], safe=_PATH_SAFE_CHARS)
        lines = [f"{method} {target} HTTP/1.1\r\n", self._host_line]
        for k, v in headers.items():
            if "\n" in v or "\r" in v or "\n" in k or "\r" in k or ":" in k:
                raise LocalProtocolError(f"invalid HTTP header {k!r}: no line breaks (and no ':' in names)")
            lines.append(f"{k}: {v}\r\n")
        if "Accept-Encoding" not in headers:
            lines.append("Accept-Encoding: identity\r\n")
        if length is None:
            lines.append("Transfer-Encoding: chunked\r\n")
        elif length or method in _BODYFUL:
            lines.append(f"Content-Length: {length}\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    async def request(self, method: str, path: str, *, body: Body = None, headers: dict[str, str],
                      connect: float | None, read: float | None, stream: bool = False) -> Response:
        """Send a request and wait for its response's head (and, unless `stream`, its whole body).
        `path` is already URL-encoded (query included); a body that is an async iterable goes out chunked.
        Raises HTTPError's subclasses."""
        data = bytes(body) if isinstance(body, bytearray | memoryview) else body
        if data is None or isinstance(data, bytes):
            head = self._head(method, path, headers, len(data) if data else 0)
        else:
            head = self._head(method, path, headers, None)
        conn = self._take()
        if conn is None:
            conn = await self._open(connect)
        try:
            conn.begin(method == "HEAD")
            transport = conn.transport
            assert transport is not None
            if not data:
                transport.write(head)
            elif isinstance(data, bytes):
                if len(data) <= _ONE_WRITE:
                    transport.write(head + data)
                else:
                    transport.write(head)
                    transport.write(data)
                    await self._drain(conn, read)
            else:
                transport.write(head)
                await self._send_chunked(conn, data, read)
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                if conn.lost:
                    raise ReadError("the connection closed before the response arrived")
                await conn.wait(read, ReadTimeout)
            response = Response(conn, read)
            if not stream:
                await response.read()
            return response
        except BaseException:
            conn.abort()
            raise

    async def _drain(self, conn: _Connection, timeout: float | None) -> bool:
        """Wait until the socket takes more of the body; False once the server answered or closed (so
        sending stops: the request was not sent whole and the connection is not reused)."""
        while conn.write_paused:
            if conn.headers_done or conn.error is not None or conn.lost:
                conn.reusable = False
                return False
            await conn.wait(timeout, WriteTimeout)
        if conn.lost and not conn.headers_done:
            raise WriteError("the connection closed while the request was being sent")
        return not conn.headers_done

    async def _send_chunked(self, conn: _Connection, body: AsyncIterable[bytes], timeout: float | None) -> None:
        transport = conn.transport
        assert transport is not None
        async for chunk in body:
            if chunk:
                transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                if not await self._drain(conn, timeout):
                    return
        transport.write(b"0\r\n\r\n")


_lock = threading.Lock()
_clients: dict[asyncio.AbstractEventLoop, dict[Endpoint, AsyncFastHTTP]] = {}


def client(endpoint: Endpoint) -> AsyncFastHTTP:
    """The running loop's pool for `endpoint`."""
    loop = asyncio.get_running_loop()
    per_loop = _clients.get(loop)
    if per_loop is None:
        with _lock:
            _drop_closed_loops()  # asyncio.run() called again and again would leak their sockets
            per_loop = _clients.setdefault(loop, {})
    c = per_loop.get(endpoint)
    if c is None:
        c = per_loop[endpoint] = AsyncFastHTTP(endpoint, loop)
    return c


def _drop_closed_loops() -> None:
    """Close the idle connections of loops that are closed (no loop tells when it closes; a new loop's
    first request looks)."""
    for old in [lp for lp in _clients if lp.is_closed()]:
        for pool in _clients.pop(old).values():
            pool._abandon()


def with_query(path: str, params: dict[str, str] | None) -> str:
    return f"{path}?{urllib.parse.urlencode(params)}" if params else path
