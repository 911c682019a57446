"""The framing between the server and the in-sandbox agent (see docs/internal-protocol.md).

A frame is ``u32 header_len | u32 payload_len | header (JSON object) | payload (raw bytes)``, both
lengths big-endian. Requests carry ``id`` and ``op``; every response frame carries the request's ``id``;
the last one has ``done: true`` and, on failure, ``error: {code, message}``. Frames of different ids
interleave freely, so one socket carries every concurrent call.

The agent runs untrusted code next to it, so the server treats everything it reads as hostile:
sizes are capped and headers must be JSON objects.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import socket
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from agentcell.errors import InvalidArgumentError, ResourceExhaustedError, SandboxGoneError, error_from_code

PREFIX = struct.Struct(">II")  # header length, payload length
MAX_HEADER = 1 << 20  # 1 MiB of JSON is far more than any legitimate header
MAX_PAYLOAD = 64 << 20  # what the agent accepts from the server (code, upload chunks); the server is trusted
CHUNK = 256 << 10  # most bytes of data one frame carries (file data, output, parts of a line or an answer)
MAX_AGENT_FRAME_PAYLOAD = CHUNK  # the server refuses bigger frames from an agent: it chunks everything
# Flow control: the agent may have at most CALL_WINDOW bytes (header + payload) of stream frames of
# one call, and CONN_WINDOW bytes of all its calls together, that the server has not credited back.
# The server credits a frame once its consumer (an HTTP client) has taken it, or when it drops it, so a
# slow reader slows the producer inside the sandbox instead of growing the server.
CALL_WINDOW = 512 << 10
CONN_WINDOW = 4 << 20
CREDIT_BATCH = CALL_WINDOW // 4  # credits go back in batches of at least this many bytes
# Slack for frames the agent emits without waiting (one read of process output, JSON-escaped).
_WINDOW_SLACK = 1 << 20
MAX_ANSWER = 16 << 20  # a unary answer sent in parts (e.g. a long directory listing) is capped here
_MAX_ASSEMBLING = 32 << 20  # ... and all answers of one sandbox being assembled at once
_MAX_UNREAD = 1 << 20  # control frames the agent has not read yet
# A two-way call (net.connect): the server sends at most UP_WINDOW bytes of ``data`` frames that the
# agent has not acknowledged (``{"event": "ack"}``, sent once the sandbox's socket took them), so a
# sandbox that stops reading stops the server, which stops reading its client.
UP_WINDOW = 512 << 10
# ... and the agent's side of it has a window of its own: a tunnel's frames take TUNNEL_WINDOW of call
# credit, each at most TUNNEL_READ bytes, and their connection credit comes back as soon as the server
# has them. A tunnel is a client connection anyone may open to a public port: clients that stop
# reading must not hold the sandbox's CONN_WINDOW, which its envd and code calls share. The server
# holds at most TUNNEL_WINDOW + TUNNEL_READ per tunnel, and tunnels are bounded by its connections.
TUNNEL_WINDOW = 256 << 10
TUNNEL_READ = 64 << 10
TUNNEL_CREDIT_BATCH = TUNNEL_WINDOW // 4
_TUNNEL_SLACK = TUNNEL_READ + 4096  # one read past the window, and a frame header


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame."""


@dataclass(slots=True)
class Frame:
    header: dict[str, Any]
    payload: bytes = b""
    size: int = 0  # header + payload bytes on the wire: what flow control counts

    @property
    def done(self) -> bool:
        return bool(self.header.get("done"))

    def raise_for_error(self) -> None:
        err = self.header.get("error")
        if err:
            raise error_from_code(str(err.get("code", "internal")), str(err.get("message", "agent error")))


def encode_frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return PREFIX.pack(len(head), len(payload)) + head + payload


def pieces(data: bytes, size: int = CHUNK) -> list[bytes]:
    """`data` cut into pieces of at most `size` bytes (one empty piece for empty data)."""
    return [data[i:i + size] for i in range(0, len(data), size)] or [b""]


async def read_frame(reader: asyncio.StreamReader, max_payload: int = MAX_PAYLOAD) -> Frame | None:
    """Read one frame; None at a clean end of stream."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ProtocolError("truncated frame prefix") from None
        return None
    head_len, payload_len = PREFIX.unpack(prefix)
    if head_len > MAX_HEADER or payload_len > max_payload:
        raise ProtocolError(f"frame too large ({head_len}+{payload_len} bytes)")
    try:
        head = await reader.readexactly(head_len)
        payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError:
        raise ProtocolError("truncated frame") from None
    try:
        header = json.loads(head)
    except ValueError:
        raise ProtocolError("frame header is not JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not a JSON object")
    return Frame(header, payload, head_len + payload_len)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> Frame | None:
    """Blocking read of one frame (for single-threaded peers without an event loop); None at EOF."""
    prefix = _recv_exact(sock, PREFIX.size)
    if prefix is None:
        return None
    head_len, payload_len = PREFIX.unpack(prefix)
    if head_len > MAX_HEADER or payload_len > MAX_PAYLOAD:
        raise ProtocolError(f"frame too large ({head_len}+{payload_len} bytes)")
    data = _recv_exact(sock, head_len + payload_len)
    if data is None:
        return None
    header = json.loads(data[:head_len])
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not a JSON object")
    return Frame(header, data[head_len:], head_len + payload_len)


KEEPALIVE = Frame({})  # what stream(keepalive=...) yields when the call stayed quiet that long


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass(eq=False)
class _Call:
    frames: collections.deque[Frame | None] = field(default_factory=collections.deque)  # None: channel closed
    waiter: asyncio.Future[None] | None = None
    uncredited: int = 0  # bytes of this call's frames consumed but not yet credited back
    unacked: int = 0  # two-way calls: bytes of data sent that the agent has not acknowledged
    own_window: bool = False  # a tunnel: its frames are held against its own window, not the connection's
    held: int = 0  # a tunnel's frames received and not yet consumed or dropped
    ack_waiter: asyncio.Future[None] | None = None
    ended: bool = False  # a final frame (or the channel's end) arrived

    def put(self, frame: Frame | None) -> None:
        self.frames.append(frame)
        if frame is None or frame.done:
            self.ended = True
            self._wake_sender()
        if self.waiter is not None:
            _wake(self.waiter)

    def ack(self, nbytes: Any) -> None:
        if isinstance(nbytes, int) and nbytes > 0:
            self.unacked = max(0, self.unacked - nbytes)
            self._wake_sender()

    def _wake_sender(self) -> None:
        if self.ack_waiter is not None:
            _wake(self.ack_waiter)

    async def wait(self, timeout: float | None, until: asyncio.Future[Any] | None) -> bool:
        """Until a frame is queued (True), or `timeout` seconds pass without one or `until` is done (False)."""
        if not self.frames and not (until is not None and until.done()):
            loop = asyncio.get_running_loop()
            self.waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _wake, waiter) if timeout is not None else None
            if until is not None:
                until.add_done_callback(self._until_done)
            try:
                await waiter
            finally:
                self.waiter = None
                if timer is not None:
                    timer.cancel()
                if until is not None:
                    until.remove_done_callback(self._until_done)
        return bool(self.frames)

    def _until_done(self, _: asyncio.Future[Any]) -> None:
        if self.waiter is not None:
            _wake(self.waiter)

    def take(self) -> list[Frame | None]:
        """The frames queued now, up to the first that ends the call (None or a final frame), which
        is left for the next take() when other frames come before it, unless it is a success."""
        batch: list[Frame | None] = []
        while self.frames:
            frame = self.frames[0]
            if batch and (frame is None or (frame.done and frame.header.get("error"))):
                break  # the frames before an error first
            batch.append(self.frames.popleft())
            if frame is None or frame.done:
                break
        return batch


class AgentChannel:
    """Server side of the socket to one sandbox's agent: concurrent calls multiplexed by id.

    Everything the agent sends is treated as hostile: frames are size-capped, and an agent that ignores
    flow control (more un-credited bytes than CONN_WINDOW allows) is cut off, which only ends its own
    sandbox. The server's memory per sandbox is thus bounded by CONN_WINDOW plus the answers being
    assembled (_MAX_ASSEMBLING), whatever the sandbox prints or however slowly clients read.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._write_lock = asyncio.Lock()
        self.buffered = 0  # bytes of stream frames received and not yet consumed or dropped
        self._owed = 0  # connection credit of ended calls, not yet returned
        self._assembling = 0
        self.closed = asyncio.Event()
        self.close_reason = "the sandbox was stopped"
        # a self-reported event's header (set by the server; None: such frames are dropped)
        self.on_report: Callable[[dict[str, Any]], None] | None = None
        self._pump = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def open(cls, sock: Any) -> AgentChannel:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_HEADER)
        return cls(reader, writer)

    async def _read_loop(self) -> None:
        try:
            while True:
                frame = await read_frame(self._reader, MAX_AGENT_FRAME_PAYLOAD)
                if frame is None:
                    break
                call = self._calls.get(frame.header.get("id"))  # type: ignore[arg-type]
                if frame.header.get("event") == "ack":  # not flow-controlled: handled here, never queued
                    if call is not None:
                        call.ack(frame.header.get("bytes"))
                    continue
                if frame.header.get("event") == "report" and frame.header.get("id") == 0:
                    if self.on_report is not None:  # the sandbox's own word (runtime/self_report.py)
                        self.on_report(frame.header)
                    continue
                if frame.done:
                    if call is not None:
                        call.put(frame)
                    continue
                if call is None:  # a late frame of a call we dropped: credit it back at once
                    self._credit(frame.header.get("id"), frame.size)
                    continue
                if call.own_window:
                    call.held += frame.size
                    if call.held > TUNNEL_WINDOW + _TUNNEL_SLACK:
                        raise ProtocolError(f"it sent {call.held} bytes on a tunnel beyond its window")
                    self._return_connection_credit(frame.size)
                    call.put(frame)
                    continue
                self.buffered += frame.size
                if self.buffered > CONN_WINDOW + _WINDOW_SLACK:
                    raise ProtocolError(f"it sent {self.buffered} bytes beyond what the server credited")
                call.put(frame)
        except (ProtocolError, OSError) as e:
            self.close_reason = f"the sandbox agent broke the protocol: {e}"
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for call in self._calls.values():
            call.put(None)
        with contextlib.suppress(Exception):
            self._writer.close()

    async def close(self, reason: str = "the sandbox was stopped") -> None:
        self.close_reason = reason
        self._shutdown()
        self._pump.cancel()
        with contextlib.suppress(BaseException):
            await self._pump

    def _control(self, header: dict[str, Any]) -> None:
        """A small control frame (credit, cancel), written without waiting: it never blocks a caller,
        and frames are whole bytes objects, so it cannot interleave with another frame. An agent that
        makes the server write without ever reading (frames of made-up calls, each credited back)
        would grow the write buffer: past _MAX_UNREAD it is cut off."""
        if self.closed.is_set():
            return
        with contextlib.suppress(Exception):
            self._writer.write(encode_frame({"id": 0, **header}))
            if self._writer.transport.get_write_buffer_size() > _MAX_UNREAD:
                self.close_reason = "the sandbox agent broke the protocol: it stopped reading its socket"
                self._shutdown()

    def _credit(self, call_id: Any, nbytes: int) -> None:
        if nbytes > 0 and isinstance(call_id, int):
            self._control({"op": "credit", "target": call_id, "bytes": nbytes})

    def _return_connection_credit(self, nbytes: int) -> None:
        self._owed += nbytes
        if self._owed >= CREDIT_BATCH:
            self._credit(0, self._owed)
            self._owed = 0

    def _consumed(self, call_id: int, call: _Call, frame: Frame) -> None:
        if call.own_window:  # its connection credit went back on arrival: only the call's is due
            call.held -= frame.size
            call.uncredited += frame.size
            if call.uncredited >= TUNNEL_CREDIT_BATCH:
                self._control({"op": "credit", "target": call_id, "bytes": call.uncredited, "call_only": True})
                call.uncredited = 0
            return
        self.buffered -= frame.size
        call.uncredited += frame.size
        if call.uncredited >= CREDIT_BATCH:
            self._credit(call_id, call.uncredited)
            call.uncredited = 0

    def _release(self, call_id: int, call: _Call, finished: bool, unconsumed: list[Frame]) -> None:
        """The call is over for the server: credit back all it still holds (`unconsumed`: frames given
        to a consumer that did not come back for more), cancel it if it runs."""
        self._calls.pop(call_id, None)
        held = call.uncredited
        if call.own_window:  # a tunnel's connection credit went back as its frames came
            call.held = 0
        else:
            for frame in [*unconsumed, *call.frames]:
                if frame is not None and not frame.done:
                    self.buffered -= frame.size
                    held += frame.size
        call.frames.clear()
        if not finished:
            self._control({"op": "cancel", "target": call_id})
        if call.own_window:
            return
        # What an ended call still holds only matters to the connection's window: return it in batches
        # (most calls end with a few small frames, and a frame per call would double the writes).
        self._return_connection_credit(held)

    async def _send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        if self.closed.is_set():
            raise SandboxGoneError(self.close_reason)
        data = encode_frame(header, payload)
        if PREFIX.unpack_from(data)[0] > MAX_HEADER or len(payload) > MAX_PAYLOAD:
            # the agent would drop the connection: this call fails, the sandbox lives
            raise InvalidArgumentError(f"the request is too large for the sandbox ({len(data)} bytes); send less at once")
        async with self._write_lock:
            try:
                self._writer.write(data)
                await self._writer.drain()
            except (OSError, RuntimeError) as e:
                self._shutdown()
                raise SandboxGoneError(self.close_reason) from e

    def _new_call(self, fields: dict[str, Any]) -> tuple[int, _Call]:
        if "id" in fields or "op" in fields:
            raise ValueError("'id' and 'op' are reserved frame keys; name the field differently")
        call_id = next(self._ids)
        call = _Call()
        self._calls[call_id] = call
        return call_id, call

    async def _batches(self, call_id: int, call: _Call, keepalive: float | None,
                       until: asyncio.Future[Any] | None) -> AsyncIterator[list[Frame]]:
        """The call's frames in batches of those that arrived together, the final one last (with its
        error raised); an empty batch after `keepalive` seconds without a frame; the end, once `until`
        is done. A batch is credited once the consumer comes back for the next."""
        finished = False
        batch: list[Frame] = []
        try:
            while True:
                if not await call.wait(keepalive, until):
                    if until is not None and until.done():
                        return
                    yield []
                    continue
                for frame in call.take():
                    if frame is None:
                        raise SandboxGoneError(self.close_reason)
                    if frame.done:
                        finished = True
                        frame.raise_for_error()
                    batch.append(frame)
                yield batch
                if finished:
                    return
                for frame in batch:  # the consumer came back for more: it took these
                    self._consumed(call_id, call, frame)
                batch = []
        finally:
            self._release(call_id, call, finished, batch)

    async def batches(self, op: str, payload: bytes = b"", keepalive: float | None = None,
                      until: asyncio.Future[Any] | None = None, **fields: Any) -> AsyncIterator[list[Frame]]:
        """Send a request and yield its frames in batches (all that arrived together, so a consumer can
        pass them on at once), the final frame last; an empty batch whenever the call stays quiet for
        `keepalive` seconds. Raises the typed error the agent reports.

        Leaving the loop early, or `until` completing (the client went away), sends ``cancel`` for the
        call, so the agent can stop the work (a code run is interrupted; a process keeps running, only
        the subscription ends).
        """
        call_id, call = self._new_call(fields)
        batches = self._batches(call_id, call, keepalive, until)
        try:
            await self._send({"id": call_id, "op": op, **fields}, payload)
            async for batch in batches:
                yield batch
        finally:
            await batches.aclose()

    async def stream(self, op: str, payload: bytes = b"", keepalive: float | None = None,
                     **fields: Any) -> AsyncIterator[Frame]:
        """Send a request and yield its non-final frames (and the final one if it carries data), or
        KEEPALIVE whenever the call stays quiet for `keepalive` seconds; see batches()."""
        async for batch in self.batches(op, payload, keepalive, None, **fields):
            if not batch:
                yield KEEPALIVE
            for frame in batch:
                if not frame.done or frame.header.keys() - {"id", "done"} or frame.payload:
                    yield frame

    async def call(self, op: str, payload: bytes = b"", **fields: Any) -> Frame:
        """A unary request: the agent answers with one final frame, or a long answer in parts."""
        call_id, call = self._new_call(fields)
        return await self._answer(call_id, call, self._send({"id": call_id, "op": op, **fields}, payload))

    async def upload(self, op: str, chunks: AsyncIterator[bytes], **fields: Any) -> Frame:
        """A request whose data comes in pieces (``data`` frames, then ``eof``), e.g. a file upload.

        The chunks are sent as the socket takes them, so a big upload never sits in the server's
        memory. An agent that answers early (an error, e.g. the disk is full) stops the sending.
        """
        call_id, call = self._new_call(fields)

        async def send_all() -> None:
            await self._send({"id": call_id, "op": op, "stream": True, **fields})
            async for chunk in chunks:
                for piece in pieces(chunk):
                    if call.frames:
                        return  # answered already: no use sending the rest
                    await self._send({"id": call_id, "op": "data"}, piece)
            await self._send({"id": call_id, "op": "data", "eof": True})

        return await self._answer(call_id, call, send_all())

    def duplex(self, op: str, **fields: Any) -> Duplex:
        """A two-way call (``net.connect``): see Duplex. Nothing is sent until Duplex.open()."""
        call_id, call = self._new_call(fields)
        call.own_window = True
        return Duplex(self, call_id, call, {"id": call_id, "op": op, **fields})

    async def _answer(self, call_id: int, call: _Call, request: Any) -> Frame:
        batches = self._batches(call_id, call, None, None)
        parts: list[bytes] = []
        assembled = 0
        try:
            await request
            async for batch in batches:
                for frame in batch:
                    if frame.done:
                        return self._assembled(call_id, frame, parts)
                    if frame.header.get("event") == "part":
                        assembled += len(frame.payload)
                        self._assembling += len(frame.payload)
                        if assembled > MAX_ANSWER or self._assembling > _MAX_ASSEMBLING:
                            raise ResourceExhaustedError(
                                f"the sandbox's answer to this call is over {MAX_ANSWER >> 20} MiB; ask for less "
                                "(e.g. list a smaller directory or a lower depth)")
                        parts.append(frame.payload)
            raise ProtocolError("the call ended without an answer")
        finally:
            self._assembling -= assembled
            await batches.aclose()

    @staticmethod
    def _assembled(call_id: int, final: Frame, parts: list[bytes]) -> Frame:
        if not final.header.get("parts"):
            return final
        try:
            answer = json.loads(b"".join(parts))
        except ValueError:
            raise ProtocolError("the agent sent an answer in parts that is not JSON") from None
        if not isinstance(answer, dict):
            raise ProtocolError("the agent sent an answer in parts that is not a JSON object")
        return Frame({**answer, "id": call_id, "done": True})


class Duplex:
    """A call whose data flows both ways, e.g. a TCP connection inside the sandbox (``net.connect``).

    write()/write_eof() send ``data`` frames within UP_WINDOW un-acknowledged bytes (the agent
    acknowledges what the sandbox's socket took); batches() yields what the agent sends back
    (``data`` and ``eof`` frames, flow-controlled like any stream, then the final frame).
    aclose() ends the call: a call still running is cancelled, so the agent closes the socket.
    """

    def __init__(self, channel: AgentChannel, call_id: int, call: _Call, request: dict[str, Any]) -> None:
        self._channel = channel
        self._id = call_id
        self._call = call
        self._request = request
        self._batches: AsyncIterator[list[Frame]] | None = None
        self._eof_sent = False

    async def open(self, until: asyncio.Future[Any] | None = None, first: bytes = b"") -> AsyncIterator[list[Frame]]:
        """Send the request, with `first` bytes of data (at most CHUNK: a request head) in the same
        frame; returns the call's batches (see AgentChannel.batches), which end the call when closed.
        `until` done (the client left) ends them too."""
        self._batches = self._channel._batches(self._id, self._call, None, until)
        self._call.unacked += len(first)
        try:
            await self._channel._send(self._request, first)
        except BaseException:
            await self.aclose()
            raise
        return self._batches

    @property
    def ended(self) -> bool:
        return self._call.ended or self._id not in self._channel._calls

    async def write(self, data: bytes) -> bool:
        """Send `data` once the window has room; False if the call has ended (nothing more is taken)."""
        for piece in pieces(data):
            if not piece:
                continue
            while self._call.unacked and self._call.unacked + len(piece) > UP_WINDOW and not self.ended:
                self._call.ack_waiter = waiter = asyncio.get_running_loop().create_future()
                try:
                    await waiter
                finally:
                    self._call.ack_waiter = None
            if self.ended or self._eof_sent:
                return False
            self._call.unacked += len(piece)
            await self._channel._send({"id": self._id, "op": "data"}, piece)
        return True

    async def write_eof(self) -> None:
        """No more data from this side (the agent shuts down the socket's writing half)."""
        if not self._eof_sent and not self.ended:
            self._eof_sent = True
            await self._channel._send({"id": self._id, "op": "data", "eof": True})

    async def aclose(self) -> None:
        if self._batches is not None:
            await self._batches.aclose()  # type: ignore[attr-defined]
        if self._id in self._channel._calls:  # the batches never started: release the call here
            self._channel._release(self._id, self._call, self._call.ended, [])


async def line_dicts(frames: AsyncIterator[Frame]) -> AsyncIterator[dict[str, Any]]:
    """The E2B lines of a ``code.run`` stream as dicts (lines may come in several ``line`` frames)."""
    buf = bytearray()
    async for frame in frames:
        if frame.header.get("event") != "line":
            continue
        buf += frame.payload
        if not frame.header.get("more"):
            yield json.loads(buf)
            buf.clear()
