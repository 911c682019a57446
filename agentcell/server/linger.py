"""Lingering close: a connection that closes after an early answer reads and drops the rest of the
request body, within bounds, before it closes.

An early answer is any response sent before the request's body was read (a 401 or 403 from the
router, a 404, a 413 or 403 on an upload, a 429 or 503 while a body waits): the edge marks it
`Connection: close` (edge.py). Closing a socket with unread bytes in its receive buffer makes the
kernel answer with RST, not FIN, and a client still writing its body (the JS SDK's fetch, undici,
and any client that reads only once its body is sent) fails with EPIPE or ECONNRESET without ever
reading the answer waiting for it. So the server sends the answer and a FIN (half-close), reads
and drops the body until its end (the parser says where), then closes; after LINGER_BYTES more
bytes or LINGER_SECONDS, it closes anyway, as nginx's lingering_close does. The body is never
kept and never read without bound: a 1 GB body to a 401 costs at most LINGER_BYTES of reading.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

LINGER_BYTES = 64 << 20  # bytes of an unread body dropped at most before the close
LINGER_SECONDS = 10.0  # seconds the client has to finish sending it


class Lingering:
    """One connection's lingering close (started by the protocol, which feeds it what arrives)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport, close: Callable[[], None]) -> None:
        self._transport = transport
        self._close = close
        self._left = LINGER_BYTES
        self._timer = loop.call_later(LINGER_SECONDS, self.done)
        if transport.can_write_eof():
            transport.write_eof()  # the answer, then FIN: the client sees the answer end
        transport.resume_reading()  # (reading waits for the app to ask for a body)

    def received(self, data: bytes) -> bool:
        """Count dropped bytes; False once past the bound (the connection is closed then)."""
        self._left -= len(data)
        if self._left < 0:
            self.done()
            return False
        return True

    def done(self) -> None:
        """The body ended, the client left, or a bound was reached: close now."""
        self._timer.cancel()
        self._close()
