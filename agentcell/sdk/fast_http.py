"""The sync SDK's HTTP client for the calls that must be quick: run_code, commands, file reads and the
filesystem RPCs. urllib3 keep-alive pools, over TCP or the embedded server's unix socket.

httpx spends about 1 ms of CPU on each request (its URL, header and cookie models and httpcore's state
machine: more than the server and the sandbox together spend on a trivial run); urllib3 on http.client
about 0.3 ms. The sync control plane and multipart uploads stay on httpx; the async SDK has its own
client on asyncio (fast_async_http).
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import urllib3
from urllib3.connection import HTTPConnection
from urllib3.exceptions import HTTPError, TimeoutError

from agentcell.errors import SandboxException
from agentcell.sdk import transport
from agentcell.sdk.config import Endpoint
from agentcell.sdk.transport import HEALTH_PATH, PROBE_TIMEOUT_S, probe_headers, transport_failure

Response = urllib3.BaseHTTPResponse
_POOL_SIZE = 64  # connections kept open per endpoint (more are opened when needed, then closed)
_ONE_WRITE = 64 << 10  # bodies up to this size go out in the same write as the request head


class _OneWrite(HTTPConnection):
    """Sends a request's head and its small body in one write: urllib3 writes them apart, which wakes
    the server twice."""

    _body: bytes | None = None

    def request(self, method: str, url: str, body: Any = None, headers: Any = None, **kwargs: Any) -> None:
        if not isinstance(body, bytes) or len(body) > _ONE_WRITE:
            super().request(method, url, body, headers, **kwargs)
            return
        self._body = body
        try:
            super().request(method, url, None, {**(headers or {}), "Content-Length": str(len(body))}, **kwargs)
        finally:
            self._body = None

    def send(self, data: Any) -> None:
        body, self._body = self._body, None  # the first send of a request is its head
        super().send(data + body if body is not None else data)


class _TCPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _OneWrite


class _UnixConnection(_OneWrite):
    def __init__(self, *args: Any, socket_path: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._socket_path = socket_path

    def _new_conn(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)  # type: ignore[arg-type]
            sock.connect(self._socket_path)
        except OSError as e:
            sock.close()
            raise urllib3.exceptions.NewConnectionError(self, f"cannot connect to {self._socket_path}: {e}") from e
        return sock


class _UnixPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _UnixConnection  # type: ignore[assignment]


class FastHTTP:
    """One endpoint's pool. Thread-safe; each request takes a connection and returns it when its
    response has been read (or closes it, when the caller stops reading early)."""

    def __init__(self, endpoint: Endpoint) -> None:
        url = urllib.parse.urlsplit(endpoint.base_url)
        self._prefix = url.path.rstrip("/")
        self._pool: urllib3.HTTPConnectionPool
        if endpoint.uds:
            self._pool = _UnixPool(url.hostname or "localhost", maxsize=_POOL_SIZE, retries=False,
                                   socket_path=endpoint.uds)
        elif url.scheme == "http":
            self._pool = _TCPPool(url.hostname or "localhost", url.port, maxsize=_POOL_SIZE, retries=False)
        else:
            self._pool = urllib3.connection_from_url(endpoint.base_url, maxsize=_POOL_SIZE, retries=False)

    def request(self, method: str, path: str, *, body: Any = None, headers: dict[str, str],
                connect: float | None, read: float | None, stream: bool = False) -> Response:
        """Raises urllib3's errors (see `transport_error`)."""
        return self._pool.urlopen(method, self._prefix + path, body=body, headers=headers, retries=False,
                                  redirect=False, timeout=urllib3.Timeout(connect=connect, read=read),
                                  preload_content=not stream, release_conn=not stream)

    def close(self) -> None:
        self._pool.close()


JSON_HEADERS = {"Content-Type": "application/json"}  # what goes with json_body()


def json_body(obj: Any) -> bytes:
    """JSON as httpx's `json=` sends it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def lines(r: Response) -> Iterator[bytes]:
    """The lines of a streamed response as they arrive (without their newlines)."""
    buf = b""
    for chunk in r.stream(None):
        buf += chunk
        if b"\n" in buf:
            *complete, buf = buf.split(b"\n")
            yield from complete
    if buf:
        yield buf


def chunks(r: Response) -> Iterator[bytes]:
    """A streamed response's body, piece by piece as it arrives."""
    yield from r.stream(None, decode_content=True)  # gzip (files.read(gzip=True)) decoded


def finish(r: Response, complete: bool) -> None:
    """Return the connection to the pool; close it first if the body was not read to its end, so the
    server sees the client leave (a run is interrupted, a subscription ends)."""
    if not complete:
        r.close()
    r.release_conn()


def transport_error(e: HTTPError, what: str) -> SandboxException:
    return transport_failure(e, what, isinstance(e, TimeoutError))


def cut_off_error(client: FastHTTP, e: HTTPError, what: str, sandbox_id: str | None) -> SandboxException:
    """transport_error for a response that had begun: if the sandbox has gone meanwhile, say so."""
    timed_out = isinstance(e, TimeoutError)
    gone = False
    if sandbox_id and not timed_out:
        try:
            r = client.request("GET", HEALTH_PATH, headers=probe_headers(sandbox_id),
                               connect=PROBE_TIMEOUT_S, read=PROBE_TIMEOUT_S)
            gone = r.status == 502
        except HTTPError:
            pass
    return transport.cut_off_error(e, what, timed_out, gone)


_lock = threading.Lock()
_clients: dict[Endpoint, FastHTTP] = {}


def client(endpoint: Endpoint) -> FastHTTP:
    c = _clients.get(endpoint)
    if c is None:
        with _lock:
            c = _clients.get(endpoint)
            if c is None:
                c = _clients[endpoint] = FastHTTP(endpoint)
    return c


def close_clients() -> None:
    with _lock:
        for c in _clients.values():
            c.close()
        _clients.clear()
