"""Secrets put into requests on their way out, taken out of the answers on their way back (issue 7).

The egress proxy (network/proxy.py) hands a connection here when the host it names is listed for one
of the sandbox's secrets or rules, or when it is TLS from a sandbox with secrets. The trust boundary: the value lives in the server's memory only; the
sandbox holds a placeholder (network/secrets.py).

- TLS (port 443) is terminated with a certificate for that host from the server's egress CA, which
  the sandbox trusts (network/ca.py); the upstream connection verifies the real host's certificate
  (the system trust store, plus `--egress-ca-bundle`), so the value only ever goes to that host.
- Each HTTP/1.1 request is parsed (h11). A request whose target or headers carry a placeholder of a
  secret *not* listed for this host is refused (403) and reported. Placeholders of this host's
  secrets are replaced in header values. The request goes upstream with `Connection: close`; the
  answer comes back as bytes, with every secret's value replaced by its placeholder (a value split
  across reads is still caught), then the connection ends (one request per connection).
- Bodies: a placeholder of another host's secret in a body ends the request unsent (streamed and
  scanned). A secret created with `"bodies": true` is also replaced in bodies, which are then read
  whole (at most 8 MiB) so their length can be set.
- Not covered: compressed answers (a value in a gzip body is not seen), HTTP/2 (ALPN offers
  http/1.1 only, clients fall back).

A sandbox that has secrets has all its HTTP(S) read, so that a placeholder on its way anywhere else is
refused and reported (code tricked into sending its "key" elsewhere): TLS to any host is terminated
here (each request then goes upstream on a connection of its own; an `Upgrade`, e.g. a WebSocket,
becomes a byte relay after its head), plain HTTP to hosts without secrets is scanned as it passes
(`scan_relay`). Such a sandbox's HTTPS therefore runs at the proxy's speed, not the kernel's.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import h11

from agentcell.network.ca import EgressCA
from agentcell.network.secrets import Secret, SecretSet

MAX_HEAD = 64 << 10
MAX_BODY = 8 << 20  # a body read whole for substitution (secrets with "bodies": true)
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
    """Replaces values by their stand-ins in a byte stream split anywhere."""

    def __init__(self, pairs: list[tuple[bytes, bytes]]) -> None:
        self.pairs = pairs
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


async def _body(conn: h11.Connection, client: _Client) -> AsyncIterator[bytes]:
    """A request's body as it arrives; ConnectionError if the client leaves before its end."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await client.read()
            if not data:
                raise ConnectionError("the client left in the middle of a request")
            conn.receive_data(data)
        elif isinstance(event, h11.Data):
            yield bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return
        else:
            raise ConnectionError(f"unexpected {type(event).__name__} in a request body")


def foreign_placeholder(data: bytes, others: list[Secret]) -> Secret | None:
    return next((s for s in others if s.placeholder.encode() in data), None)


async def serve_secret_host(first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                            host: str, dst: str, dport: int, tls: bool, secrets: SecretSet, ca: EgressCA,
                            upstream_ssl: ssl.SSLContext, upstream_socket: Callable[[], Awaitable[Any]],
                            on_event: Event) -> None:
    """Serve one connection whose requests must be read: to a host a secret or rule is listed for, or
    any TLS from a sandbox that has secrets (see the module docstring)."""
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

    async def refuse(leaked: Secret) -> None:
        on_event(leak_event(base, leaked))
        await client.write(leak_refusal(leaked))

    named = _named_hosts(request)
    if named != {host.lower()}:
        # a front end (a CDN) routes by Host: a request to this host's address that names another
        # would take the value to that other site
        on_event({**base, "verdict": "denied", "rule": "host-mismatch", "named": sorted(named)[:4], "state": "denied"})
        await client.write(b"HTTP/1.1 421 Misdirected Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        return

    if leaked is not None:
        await refuse(leaked)
        return
    used: list[str] = []
    headers = []
    injected = [(n.lower().encode(), v.encode()) for n, v in secrets.headers_for(host)]
    replaced = {n for n, _ in injected}
    upgrade = any(n == b"upgrade" for n, _ in request.headers)  # WebSocket: raw bytes after the head
    for name, value in request.headers:
        if name in (b"connection", b"keep-alive", b"proxy-connection") or name in replaced:
            continue
        for s in mine:
            if s.placeholder.encode() in value:
                value = value.replace(s.placeholder.encode(), s.value.encode())
                used.append(s.name)
        headers.append((name, value))
    headers += injected  # E2B's network.rules: set, whatever the sandbox sent
    body: bytes | None = None
    if any(s.bodies for s in mine):  # opt-in: the body is read whole (capped), then substituted
        chunks, size = [], 0
        async for data in _body(conn, client):
            size += len(data)
            if size > MAX_BODY:
                await client.write(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            chunks.append(data)
        body = b"".join(chunks)
        leaked = foreign_placeholder(body, others)
        if leaked is not None:
            await refuse(leaked)
            return
        for s in mine:
            if s.bodies and s.placeholder.encode() in body:
                body = body.replace(s.placeholder.encode(), s.value.encode())
                used.append(s.name)
        headers = [(n, v) for n, v in headers if n not in (b"content-length", b"transfer-encoding")]
        headers.insert(-1, (b"content-length", str(len(body)).encode()))
    headers.append((b"connection", b"upgrade" if upgrade else b"close"))
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
        if upgrade:  # the head (checked above), then both ways as bytes; answers still lose the values
            up_writer.write(upstream.send(h11.Request(method=request.method, target=request.target,
                                                      headers=headers)))
            trailing = conn.trailing_data[0]
            if trailing:
                up_writer.write(trailing)
            await asyncio.gather(_client_to_upstream(client, up_writer), _upstream_to_client(up_reader, client,
                                                                                          secrets))
            return
        up_writer.write(upstream.send(h11.Request(method=request.method, target=request.target, headers=headers)))
        if body is not None:
            bytes_out = len(body)
            if body:
                up_writer.write(upstream.send(h11.Data(data=body)))
        else:  # streamed as it comes; a foreign placeholder in it ends the request unsent
            keep = max((len(s.placeholder) for s in others), default=1) - 1
            tail = b""
            async for data in _body(conn, client):
                window = tail + data
                leaked = foreign_placeholder(window, others)
                if leaked is not None:
                    await refuse(leaked)
                    return  # the upstream connection is aborted with the request incomplete
                tail = window[-keep:] if keep > 0 else b""
                bytes_out += len(data)
                up_writer.write(upstream.send(h11.Data(data=data)))
                await up_writer.drain()
        up_writer.write(upstream.send(h11.EndOfMessage()))
        await up_writer.drain()
        redact = Redactor(secrets.values())
        while chunk := await up_reader.read(CHUNK):
            bytes_in += len(chunk)
            out = redact.feed(chunk)
            if out:
                await client.write(out)
        await client.write(redact.feed(b"", final=True))
        on_event({**base, "verdict": "allowed", "rule": "secret" if used or injected else "inspected",
                  "secrets": sorted(set(used)),
                  "headers_set": sorted({n.decode() for n, _ in injected}), "bytes_out": bytes_out,
                  "bytes_in": bytes_in, "state": "closed"})
    finally:
        up_writer.transport.abort()


async def scan_relay(reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter, secrets: SecretSet,
                     refuse: Callable[[Secret], Awaitable[None]]) -> None:
    """Copy a plaintext stream upstream, refusing (and stopping) at any placeholder in it."""
    if not secrets.secrets:
        await _copy(reader, up_writer)
        return
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


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while chunk := await reader.read(CHUNK):
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


def _named_hosts(request: h11.Request) -> set[str]:
    """Every host a request names: its Host headers and an absolute-form target (ports dropped)."""
    names = [v.decode(errors="replace") for n, v in request.headers if n == b"host"]
    if request.target.lower().startswith((b"http://", b"https://")):
        names.append(request.target.split(b"/")[2].decode(errors="replace"))
    return {_without_port(n) for n in names}


def _without_port(authority: str) -> str:
    authority = authority.strip().lower()
    if authority.startswith("["):  # [v6]:port
        return authority[1:authority.find("]")] if "]" in authority else authority
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


async def _client_to_upstream(client: _Client, up_writer: asyncio.StreamWriter) -> None:
    while data := await client.read():
        up_writer.write(data)
        await up_writer.drain()
    if up_writer.can_write_eof():
        up_writer.write_eof()


async def _upstream_to_client(up_reader: asyncio.StreamReader, client: _Client, secrets: SecretSet) -> None:
    redact = Redactor(secrets.values())
    while chunk := await up_reader.read(CHUNK):
        out = redact.feed(chunk)
        if out:
            await client.write(out)
    await client.write(redact.feed(b"", final=True))


def leak_event(base: dict[str, Any], leaked: Secret) -> dict[str, Any]:
    return {**base, "verdict": "denied", "rule": "secret-elsewhere", "secret": leaked.name, "state": "denied"}


def leak_refusal(leaked: Secret) -> bytes:
    return _refusal(f"the placeholder of secret {leaked.name} may only go to {', '.join(leaked.hosts)}")


def _refusal(why: str) -> bytes:
    body = f"agentcell: {why}\n".encode()
    return (b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body))
