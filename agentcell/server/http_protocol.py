"""uvicorn's httptools protocol plus the connection limits uvicorn lacks.

httptools (llhttp, in C) instead of h11 (pure Python): parsing a request and framing its response
cost a trivial run_code about 0.3 ms of the server's CPU with h11.

- Header deadline: a connection must deliver a complete request line and headers within
  `header_timeout` seconds of being opened, and of the previous response ending on a keep-alive
  connection (408, or a plain close if it sent nothing). uvicorn only times out idle keep-alive
  connections after a response, so a client that connects and trickles header bytes (slowloris) would
  otherwise hold its connection forever.
- Keep-alive: a connection idle between requests (no byte of the next one yet) is closed after
  KEEP_ALIVE seconds, not header_timeout: longer than clients keep idle connections for reuse (httpx 5 s,
  the SDK's 60 s), so a client never reuses a connection at the moment the server closes it (the
  request would fail with a reset). The next request's first byte starts its header deadline.
- Connection cap: at most `max_connections` open connections (uvicorn's `limit_concurrency` is checked
  per request, so idle connections would still pile up). At the cap, a new connection takes the place
  of the connection that has waited longest for its request headers (slow, idle, or idle keep-alive),
  if that one has waited at least EVICT_AFTER seconds; only when every connection is busy with a
  request is the new one answered 503 and closed. So a flood of slow or idle connections cannot lock
  out clients that send whole requests.
- Header size: at most MAX_HEAD bytes of request line and headers (431 and close). llhttp sets no
  bound of its own, and uvicorn keeps the headers it has parsed so far.
- Body bytes are read from the socket only once the app asks for them, 64 KiB at a time; a body that
  waits (for the router's checks, or for the body budget) stays in the kernel, not in the server.
- Writes made in one turn of the event loop go out in one send (_CoalescingTransport): uvicorn writes
  a response's head, each body chunk and the chunked end apart, so a whole short response (a
  run_code's lines and end) took three sends and up to three wakeups of the client.
- Lingering close (linger.py): a connection closing after a response that went out before the
  request's body was read drops the rest of that body (bounded) before it closes, so that the client
  reads the response instead of a reset.
- Upgrade requests (WebSocket, or any other protocol) reach the app as plain HTTP requests that carry
  a RawConnection in `scope["extensions"]["agentcell.upgrade"]`. The router checks routing and
  credentials as for any request; for a port served out of a sandbox, ports.py forwards the request
  and, if the sandbox's server answers 101, takes the connection over and relays its bytes. Why bytes
  and not WebSocket messages (uvicorn's websockets/wsproto support): the server has nothing to do
  with the messages, a byte relay serves every upgrade protocol and every WebSocket extension
  (compression is negotiated end to end), costs no parsing, and needs no extra dependency. A request
  that asks to upgrade but is not taken over gets its response and the connection closes.

The server always uses this class (`serve()` passes it as uvicorn's `http=`).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from agentcell.server.linger import Lingering
from agentcell.server.peer import PEER_EXTENSION, PeerCredentials, peer_credentials

log = logging.getLogger("agentcell.server")
READ_SIZE = 64 << 10
# Seconds a connection must have waited for its headers before a newcomer may replace it: far longer
# than a real client takes to send them once connected, far shorter than an attacker's flood can
# refill (it would need max_connections / EVICT_AFTER new connections per second).
EVICT_AFTER = 0.1
KEEP_ALIVE = 75.0  # seconds an idle keep-alive connection stays open (uvicorn's timeout_keep_alive too)
MAX_HEAD = 64 << 10  # bytes of request line and headers (h11, uvicorn's other parser, allows 16 KiB)
COALESCE_MAX = 64 << 10  # pending response bytes written to the socket at once, not at the turn's end
RAW_BUFFER = 64 << 10  # bytes of an upgraded connection read ahead of the relay; then reading pauses
UPGRADE_EXTENSION = "agentcell.upgrade"
# A callable in every request's scope that cuts the connection off mid-response (no chunked end),
# as a proxy does when the sandbox behind it dies: SDKs read that as "the sandbox was killed".
DROP_EXTENSION = "agentcell.drop"


def _raw_response(status: str, message: str) -> bytes:
    code = int(status.split()[0])
    body = json.dumps({"code": code, "message": message}).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n")
    if code == 503:
        head += "retry-after: 1\r\n"
    return head.encode() + b"\r\n" + body


class _Throttled:
    """Log a line at most once per `interval` seconds (an attack must not flood the log)."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.last = -interval

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            log.warning(msg, *args)


class _CoalescingTransport:
    """A transport whose writes within one turn of the event loop reach the socket as one write, at
    the end of that turn (at once when COALESCE_MAX bytes are pending, or before a close)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 linger: Callable[[], bool] | None = None) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._size = 0
        self._linger = linger  # asked at close(): True if the protocol lingers instead (linger.py)
        self.lingering = False

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)
        self._size += len(data)
        if self._size >= COALESCE_MAX:
            self._flush()

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        pending, self._pending, self._size = self._pending, [], 0
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._size

    def write_eof(self) -> None:
        self._flush()  # what was written before the EOF goes first
        if not self._transport.is_closing() and self._transport.can_write_eof():
            self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        if self.lingering:
            return
        if self._linger is not None and self._linger():
            self.lingering = True
            return
        self._transport.close()

    def close_now(self) -> None:
        """Close, without lingering."""
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def abort(self) -> None:
        self._pending, self._size = [], 0
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


class RawConnection:
    """A client connection that asked to upgrade, as a byte stream once the app takes it over.

    Until take_over() its bytes after the request head are buffered (reading pauses past RAW_BUFFER);
    if the app answers instead, the connection closes after the response.
    """

    def __init__(self, protocol: GuardedHttpToolsProtocol) -> None:
        self._protocol = protocol
        self._buffer = bytearray()
        self._eof = False
        self._waiter: asyncio.Future[None] | None = None
        self.taken = False
        self.lost: asyncio.Future[None] = protocol.loop.create_future()  # the connection is gone

    # --- from the protocol ---

    def feed(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) > RAW_BUFFER:
            self._protocol.flow.pause_reading()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def connection_lost(self) -> None:
        self.feed_eof()
        if not self.lost.done():
            self.lost.set_result(None)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # --- for the app ---

    def take_over(self) -> RawConnection:
        """The connection is the app's from now on: uvicorn's request/response cycle is over."""
        self.taken = True
        cycle = self._protocol.cycle
        cycle.response_started = cycle.response_complete = True  # uvicorn sends nothing more on it
        return self

    async def read(self) -> bytes:
        """The next bytes from the client; b"" at its EOF (or once the connection is lost)."""
        while not self._buffer and not self._eof:
            self._waiter = self._protocol.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = bytes(self._buffer)
        self._buffer.clear()
        self._protocol.flow.resume_reading()
        return data

    def write(self, data: bytes) -> None:
        if data and not self._protocol.transport.is_closing():
            self._protocol.transport.write(data)

    async def drain(self) -> None:
        """Until the client has taken most of what was written (or is gone)."""
        await self._protocol.flow.drain()

    def write_eof(self) -> None:
        if not self._protocol.transport.is_closing():
            self._protocol.transport.write_eof()

    def close(self) -> None:
        self._protocol.transport.close()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    header_timeout: ClassVar[float] = 10.0
    max_connections: ClassVar[int] = 1024
    # This server's connections that wait for request headers, longest-waiting first (set per server
    # by guarded_protocol()).
    waiting: ClassVar[dict[GuardedHttpToolsProtocol, float]] = {}
    at_cap_log: ClassVar[_Throttled] = _Throttled()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._head_bytes = 0  # bytes received while waiting for the current request's headers
        self._idle = False  # the timer waits for a kept-alive connection's next request
        self._upgrade: RawConnection | None = None  # after a request head that asks to upgrade
        self._peer: PeerCredentials | None = None  # a unix socket's peer (peer.py), read once per connection
        self._lingering: Lingering | None = None  # closing after an early answer (linger.py)

    # --- connection lifecycle ---

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections and not self._evict_one():
            self._refused = True
            self.transport = transport
            transport.write(_raw_response(
                "503 Service Unavailable",
                f"the server has too many open connections (limit {self.max_connections}); retry shortly"))
            transport.close()
            self.at_cap_log.warning("refusing new connections: %d open (--max-connections)", len(self.connections))
            return
        self._peer = peer_credentials(transport.get_extra_info("socket"))
        self._context = contextvars.copy_context()  # the connection's, before any request set anything
        if hasattr(transport, "max_size"):
            transport.max_size = READ_SIZE  # type: ignore[attr-defined]  # asyncio's default: 256 KiB
        super().connection_made(_CoalescingTransport(transport, self.loop, self._linger))  # type: ignore[arg-type]
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._lingering is not None:
            self._lingering.done()
        if self._upgrade is not None:
            self._upgrade.connection_lost()
        if not self._refused:
            super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        if self._lingering is not None:
            self._lingering.done()
            return False
        if self._upgrade is not None:
            self._upgrade.feed_eof()
            return True  # half-closed: the relay may still write to the client
        return super().eof_received()  # type: ignore[func-returns-value]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._lingering is not None:
            self._drop_body(data)
            return
        if self._upgrade is not None:  # past an upgrade request's head: no longer HTTP
            self._upgrade.feed(data)
            return
        if self._header_timer is not None:
            if not self._head_bytes and self._idle:  # a kept-alive connection's next request begins
                self._arm_header_timer()
            self._head_bytes += len(data)  # (a body sent along with the headers counts too: <= READ_SIZE)
            if self._head_bytes > MAX_HEAD + READ_SIZE:
                self._cancel_header_timer()
                self.transport.write(_raw_response(
                    "431 Request Header Fields Too Large",
                    f"the request line and headers are over {MAX_HEAD >> 10} KiB"))
                self.transport.close()
                return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        """uvicorn's data_received, but the bytes after an upgrade request's head are kept (uvicorn
        without a WebSocket library drops them and answers the next bytes with a 400)."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade as e:
            if self._upgrade is not None:
                self._upgrade.feed(data[e.args[0]:])

    # --- lingering close (linger.py) ---

    def _linger(self) -> bool:
        """At a close: linger if a complete response went out before the request's body was read."""
        cycle = self.cycle
        if (cycle is None or not cycle.response_complete or not cycle.more_body or cycle.disconnected
                or self._upgrade is not None or self.transport.is_closing()):
            return False
        transport: _CoalescingTransport = self.transport  # type: ignore[assignment]
        self._cancel_header_timer()
        self._lingering = Lingering(self.loop, transport._transport, transport.close_now)
        self.waiting[self] = time.monotonic()  # at the connection cap, a newcomer may take its place
        return True

    def shutdown(self) -> None:
        if self._lingering is not None:  # a stopping server does not wait for refused bodies
            self._lingering.done()
            return
        super().shutdown()

    def _drop_body(self, data: bytes) -> None:
        """The parser finds the body's end; uvicorn drops body bytes once the response is complete."""
        if not self._lingering.received(data):  # type: ignore[union-attr]
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._lingering.done()  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._lingering is not None:
            self._lingering.done()  # the whole body is in: nothing unread is left to cause a reset

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()  # the request line and headers are in
        super().on_headers_complete()
        self.scope.setdefault("extensions", {})[DROP_EXTENSION] = self._drop  # type: ignore[typeddict-item]
        if self._peer is not None:
            self.scope["extensions"][PEER_EXTENSION] = self._peer  # type: ignore[typeddict-item]
        if self.parser.should_upgrade() and self.cycle is not None and self.cycle.scope is self.scope:
            self._upgrade = RawConnection(self)
            self.scope.setdefault("extensions", {})[UPGRADE_EXTENSION] = self._upgrade  # type: ignore[typeddict-item]
            self.cycle.keep_alive = False  # not taken over: close after the response
        if any(name == b"transfer-encoding" or (name == b"content-length" and value.strip(b"0 \t"))
               for name, value in self.headers):
            # A request with a body: stop reading until the app asks for the body (uvicorn's
            # receive() resumes reading). Otherwise uvicorn buffers 64 KiB+ of every body that waits
            # for an auth check or for the body budget (bodies.py), per connection.
            self.flow.pause_reading()

    def _drop(self) -> None:
        """Close the connection without ending the response; the app's later sends are discarded."""
        if self.cycle is not None:
            self.cycle.disconnected = True
        self.transport.close()

    def on_response_complete(self) -> None:
        # Called from inside the request's task: what it schedules (the keep-alive and header timers, a
        # pipelined request's task) would capture that request's context, and with it the sandbox's record
        # (kept alive until the timer fell due: a minute of every request's records, seen in the soak) and
        # its other request-scoped values (a pipelined request would start with them). The connection's own
        # context instead.
        self._context.copy().run(self._on_response_complete)

    def _on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # the base class starts a request whose headers are in already
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._arm_header_timer(KEEP_ALIVE)

    # --- waiting for request headers ---

    def _arm_header_timer(self, idle: float = 0.0) -> None:
        """Wait header_timeout for a request's headers; or, `idle` > 0, that long for its first byte."""
        self._cancel_header_timer()
        self._head_bytes = 0
        self._idle = idle > 0
        self._header_timer = self.loop.call_later(max(idle, self.header_timeout), self._stop_waiting)
        self.waiting[self] = time.monotonic()

    def _cancel_header_timer(self) -> None:
        self.waiting.pop(self, None)
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _stop_waiting(self) -> None:
        """Close a connection that did not send its request headers in time (or was evicted)."""
        if self._lingering is not None:  # evicted while dropping a refused body
            self._lingering.done()
            return
        if self._header_timer is None or self.transport.is_closing():
            return  # the headers came in the meantime
        self._cancel_header_timer()
        if self._head_bytes:  # a request was begun: say why it is cut off (an idle connection just closes)
            self.transport.write(_raw_response(
                "408 Request Timeout", "the request line and headers did not arrive in time"))
        self.transport.close()

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest for headers, if it waited long enough."""
        oldest = next(iter(self.waiting.items()), None)
        if oldest is None or time.monotonic() - oldest[1] < EVICT_AFTER:
            return False  # nobody, or the longest-waiting one is still young (so are the rest)
        self.at_cap_log.warning("at the connection limit (%d): closing connections that send no request",
                                self.max_connections)
        oldest[0]._stop_waiting()
        return True


def guarded_protocol(header_timeout: float, max_connections: int) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn's `http=`, with these limits and its own bookkeeping."""
    attrs = {"header_timeout": header_timeout, "max_connections": max_connections, "waiting": {},
             "at_cap_log": _Throttled()}
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), attrs)
