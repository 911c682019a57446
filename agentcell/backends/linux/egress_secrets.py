"""Secrets put into requests on their way out, taken out of the answers on their way back (issue 7).

The egress proxy (egress_proxy.py) hands a connection here when the host it names is listed for one
of the sandbox's secrets. The trust boundary: the value lives in the server's memory only; the
sandbox holds a placeholder (backends/secrets.py).

- TLS (port 443) is terminated with a certificate for that host from the server's egress CA, which
  the sandbox trusts (egress_ca.py); the upstream connection verifies the real host's certificate
  (the system trust store, plus `--egress-ca-bundle`), so the value only ever goes to that host.
- Each HTTP/1.1 request is parsed (h11). A request whose target or headers carry a placeholder of a
  secret *not* listed for this host is refused (403) and reported. Placeholders of this host's
  secrets are replaced in header values. The request goes upstream with `Connection: close`; the
  answer comes back as bytes, with every secret's value replaced by its placeholder (a value split
  across reads is still caught), then the connection ends (one request per connection).
- Not covered: bodies (a placeholder in a body goes through as is), compressed answers (a value in a
  gzip body is not seen), HTTP/2 (ALPN offers http/1.1 only, clients fall back).

Plain HTTP to a host without secrets, from a sandbox that has some, is scanned too (`scan_relay`): a
placeholder on its way anywhere else is refused and reported, in case code was tricked into sending
its "key" elsewhere. Over TLS to such a host nothing is read; the placeholder is useless there.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

import h11

from agentcell.backends.linux.egress_ca import EgressCA
from agentcell.backends.secrets import Secret, SecretSet

MAX_HEAD = 64 << 10
CHUNK = 64 << 10
Event = Callable[[dict[str, Any]], None]


class _Client:
    """The sandbox's side of the connection: plain, or TLS terminated here over memory BIOs (the
    ClientHello was already read by the proxy, so it is fed in first)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bytes,
                 ctx: ssl.SSLContext | None) -> None:
        self.reader, self.writer = reader, writer
        self.pending = first
        self.tls: ssl.SSLObject | None = None
        if ctx is not None:
            self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
            self.tls = ctx.wrap_bio(self.incoming, self.outgoing, server_side=True)

    async def _feed(self) -> bool:
        data = self.pending or await self.reader.read(CHUNK)
        self.pending = b""
        if not data:
            self.incoming.write_eof()
            return False
        self.incoming.write(data)
        return True

    async def _flush(self) -> None:
        out = self.outgoing.read()
        if out:
            self.writer.write(out)
            await self.writer.drain()

    async def handshake(self) -> None:
        if self.tls is None:
            return
        while True:
            try:
                self.tls.do_handshake()
                await self._flush()
                return
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._feed():
                    raise ConnectionError("the client left during the TLS handshake") from None

    async def read(self) -> bytes:
        if self.tls is None:
            data = self.pending or await self.reader.read(CHUNK)
            self.pending = b""
            return data
        while True:
            try:
                return self.tls.read(CHUNK)
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._feed():
                    return b""
            except ssl.SSLZeroReturnError:
                return b""

    async def write(self, data: bytes) -> None:
        if self.tls is None:
            self.writer.write(data)
            await self.writer.drain()
            return
        self.tls.write(data)
        await self._flush()


class Redactor:
    """Replaces `values` by their placeholders in a byte stream split anywhere."""

    def __init__(self, secrets: list[Secret]) -> None:
        self.pairs = [(s.value.encode(), s.placeholder.encode()) for s in secrets]
        self.keep = max((len(v) for v, _ in self.pairs), default=1) - 1
        self.tail = b""

    def feed(self, data: bytes, final: bool = False) -> bytes:
        buf = self.tail + data
        for value, placeholder in self.pairs:
            buf = buf.replace(value, placeholder)
        if final or self.keep <= 0:
            self.tail = b""
            return buf
        # a value may start in the last `keep` bytes: hold them back for the next read
        self.tail, out = buf[-self.keep:], buf[:-self.keep]
        return out


def foreign_placeholder(data: bytes, others: list[Secret]) -> Secret | None:
    return next((s for s in others if s.placeholder.encode() in data), None)


async def serve_secret_host(first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                            host: str, dst: str, dport: int, tls: bool, secrets: SecretSet, ca: EgressCA,
                            upstream_ssl: ssl.SSLContext, upstream_socket: Callable[[], Awaitable[Any]],
                            on_event: Event) -> None:
    """Serve one connection to a host some secret is listed for (see the module docstring)."""
    client = _Client(reader, writer, first, ca.server_context(host) if tls else None)
    await client.handshake()
    mine, others = secrets.for_host(host), [s for s in secrets.secrets if not s.serves(host)]
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    request: h11.Request | None = None
    while request is None:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await client.read()
            if not data:
                return
            conn.receive_data(data)
        elif isinstance(event, h11.Request):
            request = event
        else:
            return
    raw_head = request.target + b"".join(n + b":" + v for n, v in request.headers)
    leaked = foreign_placeholder(raw_head, others)
    base = {"time": time.time(), "proto": "tcp", "dst": dst, "dport": dport, "domain": host,
            "method": request.method.decode(errors="replace"), "path": request.target.split(b"?")[0].decode(
                errors="replace")[:200]}
    if leaked is not None:
        on_event({**base, "verdict": "denied", "rule": "secret-elsewhere", "secret": leaked.name, "state": "denied"})
        await client.write(_refusal(f"the placeholder of secret {leaked.name} may only go to "
                                    f"{', '.join(leaked.hosts)}"))
        return
    used: list[str] = []
    headers = []
    for name, value in request.headers:
        if name in (b"connection", b"keep-alive", b"proxy-connection"):
            continue
        for s in mine:
            if s.placeholder.encode() in value:
                value = value.replace(s.placeholder.encode(), s.value.encode())
                used.append(s.name)
        headers.append((name, value))
    headers.append((b"connection", b"close"))
    sock = await upstream_socket()
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    try:
        async with asyncio.timeout(10):
            await loop.sock_connect(sock, (dst, dport))
            up_reader, up_writer = await asyncio.open_connection(
                sock=sock, ssl=upstream_ssl if tls else None, server_hostname=host if tls else None, limit=CHUNK)
    except (OSError, ssl.SSLError, TimeoutError) as e:
        sock.close()
        on_event({**base, "verdict": "denied", "rule": "upstream", "error": str(e)[:200], "state": "denied"})
        await client.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        return
    upstream = h11.Connection(h11.CLIENT)
    bytes_out = bytes_in = 0
    try:
        up_writer.write(upstream.send(h11.Request(method=request.method, target=request.target, headers=headers)))
        while True:  # the body, as it comes
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await client.read()
                if not data:
                    return
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Data):
                bytes_out += len(event.data)
                up_writer.write(upstream.send(h11.Data(data=event.data)))
                await up_writer.drain()
            elif isinstance(event, h11.EndOfMessage):
                up_writer.write(upstream.send(h11.EndOfMessage()))
                await up_writer.drain()
                break
            else:
                return
        redact = Redactor(list(secrets.secrets))
        while chunk := await up_reader.read(CHUNK):
            bytes_in += len(chunk)
            out = redact.feed(chunk)
            if out:
                await client.write(out)
        await client.write(redact.feed(b"", final=True))
        on_event({**base, "verdict": "allowed", "rule": "secret", "secrets": sorted(set(used)), "bytes_out": bytes_out,
                  "bytes_in": bytes_in, "state": "closed"})
    finally:
        up_writer.transport.abort()


async def scan_relay(reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter, secrets: SecretSet,
                     refuse: Callable[[Secret], Awaitable[None]]) -> None:
    """Copy a plaintext stream upstream, refusing (and stopping) at any placeholder in it."""
    keep = max(len(s.placeholder) for s in secrets.secrets) - 1
    tail = b""
    while chunk := await reader.read(CHUNK):
        window = tail + chunk
        leaked = foreign_placeholder(window, list(secrets.secrets))
        if leaked is not None:
            await refuse(leaked)
            return
        up_writer.write(chunk)
        await up_writer.drain()
        tail = window[-keep:]
    if up_writer.can_write_eof():
        up_writer.write_eof()


def _refusal(why: str) -> bytes:
    body = f"agentcell: {why}\n".encode()
    return (b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body))
