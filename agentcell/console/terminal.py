"""The terminal: a WebSocket (wsproto, sans-io, on the raw upgraded connection) bridged to a real PTY
in the sandbox (envd's process.Process/Start with a pty: `/bin/bash -i -l` as the sandbox's user in
/home/user, as E2B's PTY).

Server to client: binary frames, the PTY's bytes. Client to server: binary or text frames, keystrokes,
except a text frame that is a JSON object `{"resize": [cols, rows]}`. The shell's exit closes with
1000; a PTY stream that ends otherwise (the sandbox went away) closes with 1011 and a reason.

Bounded: one PTY message is in flight towards the client at a time and the next is read only once the
client's socket has taken it (RawConnection.drain), so a client that stops reading stops the PTY's
stream (its output then waits in the sandbox); keystrokes are read from the socket only as fast as
they reach the PTY, and a text message larger than MAX_TEXT closes with 1009.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from typing import Any

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from agentcell.console.responses import error
from agentcell.console.upstream import ENVD, Stream, Upstream, UpstreamError, error_message
from agentcell.sdk.connect_rpc import envelope
from agentcell.sdk.models import PtySize
from agentcell.sdk.pty import UPDATE, input_message, resize_message, start_message
from agentcell.server.http_protocol import UPGRADE_EXTENSION

log = logging.getLogger("agentcell.console")
START = "/process.Process/Start"
SEND_INPUT = "/process.Process/SendInput"
SEND_SIGNAL = "/process.Process/SendSignal"
MAX_TEXT = 64 << 10
MAX_COLS, MAX_ROWS = 1000, 1000
_AS_USER = (b"authorization", b"Basic dXNlcjo=")  # base64("user:")
_CONNECT_STREAM = [(b"content-type", b"application/connect+json"), (b"connect-protocol-version", b"1"), _AS_USER]
_CONNECT_UNARY = [(b"content-type", b"application/json"), (b"connect-protocol-version", b"1"), _AS_USER]


def size_param(value: str | None, default: int, most: int) -> int:
    try:
        n = int(value) if value else default
    except ValueError:
        n = default
    return max(1, min(most, n))


class _Envelopes:
    """Connect stream envelopes (flags u8, length u32) from a byte stream."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, chunk: bytes) -> list[tuple[int, dict[str, Any]]]:
        self.buf += chunk
        out = []
        while len(self.buf) >= 5:
            flags, size = self.buf[0], int.from_bytes(self.buf[1:5], "big")
            if len(self.buf) < 5 + size:
                break
            body = bytes(self.buf[5:5 + size])
            del self.buf[:5 + size]
            out.append((flags, json.loads(body) if body else {}))
        return out


def _pid(items: list[tuple[int, dict[str, Any]]]) -> int | None:
    for flags, msg in items:
        start = (msg.get("event") or {}).get("start") if not flags & 0x02 else None
        if start is not None and start.get("pid") is not None:
            return int(start["pid"])
    return None


def _stream_error(items: list[tuple[int, dict[str, Any]]]) -> str:
    for flags, msg in items:
        if flags & 0x02 and isinstance(msg.get("error"), dict):
            return str(msg["error"].get("message") or msg["error"].get("code"))
    return "the stream ended before the shell started"


class Terminal:
    def __init__(self, upstream: Upstream, outer: dict[str, Any], sandbox_id: str, token: str) -> None:
        self.upstream = upstream
        self.outer = outer
        self.sandbox_id = sandbox_id
        self.token = token
        self.ws = WSConnection(ConnectionType.SERVER)
        self.raw: Any = None
        self.pid: int | None = None
        self.closed = False

    def _scope(self, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
        return self.upstream.scope(self.outer, "POST", path, b"",
                                   [*headers, *self.upstream.sandbox_headers(self.sandbox_id, ENVD, self.token)])

    async def _unary(self, path: str, message: dict[str, Any]) -> None:
        reply = await self.upstream.request(self._scope(path, _CONNECT_UNARY), json.dumps(message).encode())
        if reply.status != 200:
            raise UpstreamError(reply.status, error_message(reply.body, reply.status))

    def _write(self, event: Any) -> None:
        if self.closed:
            return
        with contextlib.suppress(LocalProtocolError):
            self.raw.write(self.ws.send(event))
        if isinstance(event, CloseConnection):
            self.closed = True

    async def _close(self, code: int, reason: str = "") -> None:
        self._write(CloseConnection(code=code, reason=reason[:120]))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.raw.drain(), 2.0)

    async def start(self, size: PtySize) -> Stream:
        message = start_message(size, "/home/user", None)
        stream = await self.upstream.stream(self._scope(START, _CONNECT_STREAM), envelope(message))
        if stream.status != 200:
            body = await stream.read(64 << 10)
            await stream.close()
            raise UpstreamError(stream.status if stream.status < 500 else 502, error_message(body, stream.status))
        return stream

    async def _to_client(self, stream: Stream, decoder: _Envelopes, first: list[tuple[int, dict[str, Any]]]) -> None:
        """The PTY's output to the client; the close code when the stream ends."""
        ended = False

        async def handle(items: list[tuple[int, dict[str, Any]]]) -> bool:
            for flags, msg in items:
                if flags & 0x02:  # end of stream: an error, or nothing
                    return True
                event = msg.get("event") or {}
                if "start" in event:
                    self.pid = int(event["start"].get("pid"))
                data = (event.get("data") or {}).get("pty")
                if data:
                    self._write(BytesMessage(data=base64.b64decode(data)))
                    await self.raw.drain()
                if "end" in event:
                    nonlocal ended
                    ended = True
            return False

        done = await handle(first)
        if not done:
            async for chunk in stream.chunks():
                if await handle(decoder.feed(chunk)):
                    break
        if ended:
            await self._close(1000, "the shell exited")
        else:
            await self._close(1011, f"sandbox {self.sandbox_id} is gone")

    async def _from_client(self) -> None:
        text = ""
        while not self.closed:
            data = await self.raw.read()
            if not data:
                return
            try:
                self.ws.receive_data(data)
            except RemoteProtocolError:
                await self._close(1002, "protocol error")
                return
            for event in self.ws.events():
                if isinstance(event, CloseConnection):
                    self._write(event.response())
                    return
                if isinstance(event, Ping):
                    self._write(event.response())
                elif isinstance(event, BytesMessage):
                    if event.data and self.pid is not None:
                        await self._unary(SEND_INPUT, input_message(self.pid, bytes(event.data)))
                elif isinstance(event, TextMessage):
                    text += event.data
                    if len(text) > MAX_TEXT:
                        await self._close(1009, "message too big")
                        return
                    if not event.message_finished:
                        continue
                    message, text = text, ""
                    await self._text(message)

    async def _text(self, message: str) -> None:
        if self.pid is None:
            return
        if message.startswith("{"):
            try:
                parsed = json.loads(message)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and isinstance(parsed.get("resize"), list) and len(parsed["resize"]) == 2:
                cols, rows = (size_param(str(v), 80, MAX_COLS) for v in parsed["resize"])
                await self._unary(UPDATE, resize_message(self.pid, PtySize(rows=rows, cols=cols)))
                return
        await self._unary(SEND_INPUT, input_message(self.pid, message.encode()))

    async def serve(self, receive: Any, send: Any, size: PtySize) -> None:
        raw = self.outer["extensions"][UPGRADE_EXTENSION]
        path = self.outer["path"] + ("?" + self.outer["query_string"].decode("latin-1")
                                     if self.outer.get("query_string") else "")
        try:
            self.ws.initiate_upgrade_connection(list(self.outer["headers"]), path)
            request = next(self.ws.events())
        except (RemoteProtocolError, StopIteration) as e:
            await error(400, f"not a WebSocket handshake: {e}")(self.outer, receive, send)
            return
        if not isinstance(request, Request):
            await error(400, "not a WebSocket handshake")(self.outer, receive, send)
            return
        stream = await self.start(size)  # before the 101: a refusal is an HTTP answer
        decoder = _Envelopes()
        try:
            first: list[tuple[int, dict[str, Any]]] = []
            async for chunk in stream.chunks():  # up to the start event (its pid)
                first += decoder.feed(chunk)
                if first:
                    break
            self.pid = _pid(first)
            if self.pid is None:  # no shell (the sandbox's PTY limit, ...): still an HTTP answer
                await error(502, f"the terminal did not start: {_stream_error(first)}")(self.outer, receive, send)
                return
            self.raw = raw.take_over()
            self.raw.write(self.ws.send(AcceptConnection()))
            out = asyncio.get_running_loop().create_task(self._to_client(stream, decoder, first))
            into = asyncio.get_running_loop().create_task(self._from_client())
            try:
                await asyncio.wait({out, into, self.raw.lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (out, into):
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            if into.done() and not into.cancelled() and (e := into.exception()) is not None:
                log.info("terminal on %s: %s", self.sandbox_id, e)
                await self._close(1011, str(e))
        finally:
            if self.pid is not None:  # (a shell that exited already: the signal finds nothing)
                with contextlib.suppress(Exception):
                    await self._unary(SEND_SIGNAL, {"process": {"pid": self.pid}, "signal": "SIGNAL_SIGKILL"})
            await stream.close()
            if self.raw is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.raw.drain(), 1.0)
                self.raw.close()
