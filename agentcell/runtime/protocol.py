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
import contextlib
import itertools
import json
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from agentcell.errors import SandboxGoneError, error_from_code

PREFIX = struct.Struct(">II")  # header length, payload length
MAX_HEADER = 1 << 20  # 1 MiB of JSON is far more than any legitimate header
MAX_PAYLOAD = 1 << 30  # hard cap on one frame's bytes; file chunks are much smaller
CHUNK = 1 << 20  # file data and process output travel in frames of at most this size


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame."""


@dataclass(slots=True)
class Frame:
    header: dict[str, Any]
    payload: bytes = b""

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
    return Frame(header, payload)


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
    return Frame(header, data[head_len:])


@dataclass
class _Call:
    queue: asyncio.Queue[Frame | None] = field(default_factory=asyncio.Queue)


class AgentChannel:
    """Server side of the socket to one sandbox's agent: concurrent calls multiplexed by id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._write_lock = asyncio.Lock()
        self.closed = asyncio.Event()
        self.close_reason = "the sandbox was stopped"
        self._pump = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def open(cls, sock: Any) -> AgentChannel:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_HEADER)
        return cls(reader, writer)

    async def _read_loop(self) -> None:
        try:
            while True:
                frame = await read_frame(self._reader)
                if frame is None:
                    break
                call = self._calls.get(frame.header.get("id"))  # unknown ids (late frames) are dropped
                if call is not None:
                    call.queue.put_nowait(frame)
        except (ProtocolError, OSError) as e:
            self.close_reason = f"the sandbox agent broke the protocol: {e}"
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for call in self._calls.values():
            call.queue.put_nowait(None)
        with contextlib.suppress(Exception):
            self._writer.close()

    async def close(self, reason: str = "the sandbox was stopped") -> None:
        self.close_reason = reason
        self._shutdown()
        self._pump.cancel()
        with contextlib.suppress(BaseException):
            await self._pump

    async def _send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        if self.closed.is_set():
            raise SandboxGoneError(self.close_reason)
        async with self._write_lock:
            try:
                self._writer.write(encode_frame(header, payload))
                await self._writer.drain()
            except (OSError, RuntimeError) as e:
                self._shutdown()
                raise SandboxGoneError(self.close_reason) from e

    async def stream(self, op: str, payload: bytes = b"", **fields: Any) -> AsyncIterator[Frame]:
        """Send a request and yield its non-final frames; raise the typed error the agent reports.

        Leaving the loop early sends ``cancel`` for the call, so the agent can stop the work
        (a code run is interrupted; a process keeps running, only the subscription ends).
        """
        if "id" in fields or "op" in fields:
            raise ValueError("'id' and 'op' are reserved frame keys; name the field differently")
        call_id = next(self._ids)
        call = _Call()
        self._calls[call_id] = call
        finished = False
        try:
            await self._send({"id": call_id, "op": op, **fields}, payload)
            while True:
                frame = await call.queue.get()
                if frame is None:
                    raise SandboxGoneError(self.close_reason)
                if frame.done:
                    finished = True
                    frame.raise_for_error()
                    if frame.header.keys() - {"id", "done"} or frame.payload:
                        yield frame
                    return
                yield frame
        finally:
            self._calls.pop(call_id, None)
            if not finished and not self.closed.is_set():
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._send({"id": next(self._ids), "op": "cancel", "target": call_id}))

    async def call(self, op: str, payload: bytes = b"", **fields: Any) -> Frame:
        """A unary request: the agent answers with one final frame."""
        last = Frame({})
        async for frame in self.stream(op, payload, **fields):
            last = frame
        return last
