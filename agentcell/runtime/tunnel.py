"""``net.connect``: a TCP connection to one of the sandbox's own ports, relayed over the agent protocol.

This is how a port served inside the sandbox (E2B's `get_host(port)`) is reached: the sandbox's
network namespace has only loopback, and the server neither can nor should enter it, so the agent
(already inside) connects to 127.0.0.1:port (or [::1]:port) and relays bytes both ways.

- Server -> sandbox: the request's ``data`` frames, written to the socket as they arrive. The server
  keeps at most protocol.UP_WINDOW bytes un-acknowledged; the agent acknowledges bytes once the socket
  has taken them (``{"event": "ack", "bytes": n}``, not flow-controlled: tiny, and the server handles
  them on arrival). A sandbox server that stops reading thus stops the sending, and the agent holds
  at most the window. ``eof`` shuts down the socket's writing half.
- Sandbox -> server: ``{"event": "data"}`` frames of at most TUNNEL_READ bytes, within the tunnel's own
  window (TUNNEL_WINDOW of call credit; the server returns their connection credit on arrival, so
  clients that stop reading cannot stall the sandbox's other calls), then ``{"event": "eof"}`` when
  the sandbox's side stops writing. The socket is read only while there is credit.
- The call ends when both directions are done; a cancel (the client left) closes the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from agentcell.errors import InvalidArgumentError, SandboxError
from agentcell.runtime.protocol import CHUNK, TUNNEL_READ, TUNNEL_WINDOW, UP_WINDOW, Frame

if TYPE_CHECKING:
    from agentcell.runtime.agent import Call

CONNECT_TIMEOUT = 10.0  # a full listen backlog drops SYNs: do not wait for the kernel's retries forever
NOT_OPEN = "port is not open"  # the server maps this answer to E2B's 502 body


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    errors: list[str] = []
    for host in ("127.0.0.1", "::1"):  # a server bound to [::1] only is still found
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                return await asyncio.open_connection(host, port, limit=TUNNEL_READ)
        except (OSError, TimeoutError) as e:
            errors.append(f"{host}: {e.strerror if isinstance(e, OSError) and e.strerror else 'timed out'}")
    raise SandboxError(f"{NOT_OPEN}: nothing accepted a connection on port {port} ({'; '.join(errors)})",
                       "unavailable")


class _Upstream:
    """Writes the server's ``data`` frames to the socket and acknowledges them once it took them."""

    def __init__(self, call: Call, writer: asyncio.StreamWriter) -> None:
        self.call = call
        self.writer = writer
        self.unacked = 0
        self.eof = False
        self.kick = asyncio.Event()

    def on_data(self, frame: Frame) -> None:
        if self.eof:
            return
        self.unacked += len(frame.payload)
        if self.unacked > UP_WINDOW + CHUNK:  # the server is trusted; this is a bug, not an attack
            self.eof = True
        elif frame.payload and not self.writer.is_closing():
            self.writer.write(frame.payload)
        if frame.header.get("eof"):
            self.eof = True
        self.kick.set()

    async def run(self) -> None:
        """Until the server's side is done (eof) or the socket cannot take more."""
        while True:
            await self.kick.wait()
            self.kick.clear()
            try:
                await self.writer.drain()  # the socket's buffer is below its high-water mark
            except (OSError, RuntimeError):
                return  # the sandbox's side closed: further data is dropped, the call ends with downstream
            if self.unacked and not self.call.cancelled:
                self.call.agent.write({"id": self.call.id, "event": "ack", "bytes": self.unacked})
                self.unacked = 0
            if self.eof:
                with contextlib.suppress(OSError, RuntimeError):
                    if self.writer.can_write_eof() and not self.writer.is_closing():
                        self.writer.write_eof()
                return


async def _downstream(call: Call, reader: asyncio.StreamReader) -> int:
    total = 0
    while True:
        await call.wait_credit()  # read no further than the server takes
        if call.cancelled:
            return total
        try:
            data = await reader.read(TUNNEL_READ)
        except OSError:  # reset by the sandbox's side: the stream ends as at EOF
            data = b""
        if not data:
            await call.send({"event": "eof"})
            return total
        total += len(data)
        await call.send({"event": "data"}, data)


async def relay(call: Call, frame: Frame) -> dict[str, int]:
    port = frame.header.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise InvalidArgumentError(f"invalid port {port!r}")
    call.credit = TUNNEL_WINDOW  # before any frame: the server holds this call to that window
    reader, writer = await _connect(port)
    up = _Upstream(call, writer)
    if frame.payload:  # the first bytes (a request head) came with the request
        up.on_data(Frame({}, frame.payload))
    call.take_data(up.on_data)
    down = asyncio.create_task(_downstream(call, reader))
    up_task = asyncio.create_task(up.run())
    try:
        received, _ = await asyncio.gather(down, up_task)
        writer.close()  # both sides are done: what is still buffered goes out, then FIN
        return {"received": received}
    finally:
        call.take_data(None)
        down.cancel()
        up_task.cancel()
        if not writer.is_closing():
            writer.transport.abort()  # cancelled (the client left) or failed: drop the connection now
