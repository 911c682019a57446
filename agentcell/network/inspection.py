"""Intercepted connections read as HTTP/1.1, request by request (docs/network.md, "The proxy").

The egress proxy (proxy.py) hands a connection here when what it carries must be read: the sandbox has
name rules (every request must name the host the connection was checked for), or secrets or E2B
`network.rules` (a value goes in only where it may, and comes out of every answer). TLS is terminated
first, with a certificate for the claimed host from the server's egress CA, which every sandbox trusts
(ca.py); the upstream connection then verifies the real host's certificate for that same name.

Every request on the connection, not only the first:
- must name exactly the host the connection was checked for: its Host and an absolute-form target,
  after h11 has parsed them (two Host headers, a folded one, a target naming another host: 421 for
  TLS, where that is the standard answer, 403 for plain HTTP; the connection ends);
- CONNECT is refused (it would open a tunnel the proxy cannot read);
- a placeholder of a secret not listed for this host, anywhere in the request, ends it unsent (403,
  `secret.refused`, rule `secret-elsewhere`);
- this host's placeholders are replaced by their values (headers; bodies for secrets created with
  `"bodies": true`) and E2B's rule headers are set **only** when the value can reach nobody but that
  host: over TLS verified for the host, or over plain HTTP to a host the operator marked plain-HTTP
  (`serve --egress-plain-http-host`) at an address the sandbox's resolver answered for it. Anything
  else is refused (403, `secret.refused`, rule `secret-plaintext`) and nothing is sent;
- the request goes upstream as h11 wrote it (its own framing: what the upstream parses is what was
  checked; hop-by-hop headers dropped); connections are kept alive when both sides want it.

Every answer to a sandbox that has secrets is redacted (redaction.py): its headers, its body after the
transfer coding is undone and a gzip or deflate content coding is decoded, its trailers; its framing is
then made afresh, so the sandbox always gets well-formed HTTP. Not spoken: HTTP/2 (ALPN offers
http/1.1; clients fall back), client certificates, an upstream certificate that does not verify.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11

from agentcell.network.claims import authority_host
from agentcell.network.redaction import DECODABLE, BodyDecoder, Redactor
from agentcell.network.secrets import Secret, SecretSet, placeholder_in

MAX_HEAD = 64 << 10
MAX_BODY = 8 << 20  # a body read whole for substitution (secrets with "bodies": true)
CHUNK = 256 << 10  # a read at most (the sandbox side, the upstream side)
CONNECT_TIMEOUT_S = 10.0
IDLE_S = 60.0  # a kept-alive connection may wait this long for its next request
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization",
                         b"proxy-authenticate", b"te", b"trailer", b"transfer-encoding", b"upgrade"})
Event = Callable[[dict[str, Any]], None]


class Refused(Exception):
    """A request the proxy will not send: `status` and the text the sandbox gets, and the event."""

    def __init__(self, status: int, why: str, event: dict[str, Any]) -> None:
        super().__init__(why)
        self.status, self.why, self.event = status, why, event


@dataclass
class Connection:
    """What the proxy decided about one intercepted connection."""

    host: str  # the name it was checked for (SNI or Host)
    dst: str
    dport: int
    tls: bool
    secrets: SecretSet
    may_send_secrets: bool  # TLS verified for `host`, or plain HTTP the operator allows (see the docstring)
    upstream_socket: Callable[[], Awaitable[socket.socket]]
    upstream_ssl: ssl.SSLContext | None
    on_event: Event
    # network.egressProxy: the stream to dst:dport through the sandbox's SOCKS5 proxy (tunnel.py)
    dial: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] | None = None

    def event(self, **fields: Any) -> dict[str, Any]:
        return {"time": time.time(), "proto": "tcp", "dst": self.dst, "dport": self.dport, "domain": self.host,
                **fields}


class ClientSide:
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
                data = self.tls.read(CHUNK)
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._feed():
                    return b""
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            return data + self._more()

    def _more(self) -> bytes:
        """What else is decrypted already (a read returns one TLS record: 16 KiB at most)."""
        assert self.tls is not None
        parts = []
        size = 0
        while size < CHUNK:
            try:
                part = self.tls.read(CHUNK - size)
            except (ssl.SSLWantReadError, ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break
            if not part:
                break
            parts.append(part)
            size += len(part)
        return b"".join(parts)

    async def write(self, data: bytes) -> None:
        if not data:
            return
        if self.tls is None:
            self.writer.write(data)
            await self.writer.drain()
            return
        self.tls.write(data)
        await self._flush()

    async def write_parts(self, parts: list[Any] | None) -> None:
        """Pieces of one message (h11's framing and the data as it came), without joining them."""
        if not parts:
            return
        if self.tls is None:
            for part in parts:  # (writelines joins them: a copy of the data)
                self.writer.write(part)
            await self.writer.drain()
            return
        for part in parts:
            self.tls.write(part)
        await self._flush()


class _Upstream:
    """One connection to the real host (TLS verified for the claimed name), kept across requests."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)

    async def send(self, event: h11.Event) -> None:
        data = self.h11.send(event)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def next_event(self) -> h11.Event:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self.reader.read(CHUNK)
            self.h11.receive_data(data)  # b"": the upstream closed (h11 says what that means)

    def close(self) -> None:
        self.writer.transport.abort()


class HttpRelay:
    def __init__(self, conn: Connection, client: ClientSide) -> None:
        self.conn = conn
        self.client = client
        self.down = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.up: _Upstream | None = None
        self.secrets = conn.secrets
        self.mine = conn.secrets.for_host(conn.host)
        self.others = [s for s in conn.secrets.secrets if not s.serves(conn.host)]
        self.injected = [(n.lower().encode(), v.encode()) for n, v in conn.secrets.headers_for(conn.host)]
        self.redacting = bool(conn.secrets.secrets)

    # -- the sandbox's side ------------------------------------------------------------------------

    async def _next_request_event(self, timeout: float | None) -> h11.Event:
        while True:
            event = self.down.next_event()
            if event is not h11.NEED_DATA:
                return event
            async with asyncio.timeout(timeout):
                data = await self.client.read()
            self.down.receive_data(data)

    async def _answer(self, status: int, text: str, close: bool = True) -> None:
        """A short answer of the proxy's own, where h11's state allows one."""
        if self.down.our_state not in (h11.SEND_RESPONSE, h11.IDLE) or self.down.their_state is h11.IDLE:
            return
        body = f"agentcell: {text}\n".encode()
        headers = [("content-type", "text/plain"), ("content-length", str(len(body)))]
        if close:
            headers.append(("connection", "close"))
        with contextlib.suppress(h11.LocalProtocolError, OSError, ConnectionError):
            response = h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase)
            await self.client.write(self.down.send(response)
                                    + self.down.send(h11.Data(data=body)) + self.down.send(h11.EndOfMessage()))

    # -- checks --------------------------------------------------------------------------------------

    def _check(self, request: h11.Request) -> tuple[list[tuple[bytes, bytes]], list[str]]:
        """The headers to send upstream and the secrets put in, or Refused."""
        base = self.conn.event(method=request.method.decode("latin-1")[:16],
                               path=request.target.split(b"?")[0].decode("latin-1")[:200])
        named = _named_hosts(request)
        if named != {self.conn.host}:
            # a front end (a CDN) routes by Host: a request on this connection naming another host
            # would reach a site that was never checked (domain fronting, a keep-alive second request)
            raise Refused(421 if self.conn.tls else 403, f"this connection was checked for {self.conn.host}; a "
                          "request on it may not name another host",
                          {**base, "kind": "net.deny", "verdict": "denied", "rule": "host-mismatch",
                           "named": sorted(named)[:4], "state": "denied"})
        if request.method.upper() == b"CONNECT":
            raise Refused(405, "CONNECT is not allowed through the egress proxy",
                          {**base, "kind": "net.deny", "verdict": "denied", "rule": "connect", "state": "denied"})
        head = request.target + b"".join(n + b":" + v for n, v in request.headers)
        leaked = placeholder_in(head, self.others)
        if leaked is not None:
            raise _elsewhere(leaked, base)
        if not self.conn.may_send_secrets:
            wanted = placeholder_in(head, self.mine)
            if wanted is not None or self.injected:
                raise _plaintext(wanted, self.conn.host, base)
        used: list[str] = []
        out: list[tuple[bytes, bytes]] = []
        replaced = {n for n, _ in self.injected}
        for raw_name, value in request.headers.raw_items():
            name = raw_name.lower()
            if name in _HOP_BY_HOP or name in replaced or (name == b"content-length" and _chunked(request)):
                continue
            if name == b"accept-encoding" and self.redacting:
                value = _decodable(value)  # an answer must come in an encoding the redactor can read
            for s in self.mine:
                if s.placeholder.encode() in value:
                    value = value.replace(s.placeholder.encode(), s.value.encode())
                    used.append(s.name)
            out.append((raw_name, value))
        if not any(n.lower() == b"host" for n, _ in out):  # HTTP/1.0 with an absolute target: h11 sends 1.1
            out.insert(0, (b"Host", self.conn.host.encode()))
        if _chunked(request):
            out.append((b"Transfer-Encoding", b"chunked"))
        if _upgrade(request):
            out += [(b"Connection", b"upgrade"),
                    (b"Upgrade", next(v for n, v in request.headers if n == b"upgrade"))]
        elif _wants_close(request):
            out.append((b"Connection", b"close"))
        out += self.injected  # E2B's network.rules: set, whatever the sandbox sent
        return out, used

    # -- one request after another -------------------------------------------------------------------

    async def run(self) -> None:
        try:
            try:
                await self.client.handshake()
            except ssl.SSLError as e:  # most often: a client that does not trust the egress CA
                self.conn.on_event(self.conn.event(kind="net.deny", verdict="denied", rule="tls-handshake",
                                                   error=str(e)[:200], state="denied"))
                return
            first = True
            while True:
                try:
                    event = await self._next_request_event(None if first else IDLE_S)
                except (h11.RemoteProtocolError, TimeoutError) as e:
                    if isinstance(e, h11.RemoteProtocolError):
                        self.conn.on_event(self.conn.event(kind="net.deny", verdict="denied", rule="unparsed",
                                                           error=str(e)[:120], state="denied"))
                        await self._answer(400, f"a request the egress proxy cannot read: {e}")
                    return
                if not isinstance(event, h11.Request):
                    return  # ConnectionClosed: the sandbox is done
                first = False
                if not await self._serve(event):
                    return
                if self.down.our_state is not h11.DONE or self.down.their_state is not h11.DONE \
                        or self.up is None or self.up.h11.our_state is not h11.DONE \
                        or self.up.h11.their_state is not h11.DONE:
                    return
                self.down.start_next_cycle()
                self.up.h11.start_next_cycle()
        finally:
            if self.up is not None:
                self.up.close()

    async def _serve(self, request: h11.Request) -> bool:
        """One request and its answer; False when the connection must end."""
        try:
            headers, used = self._check(request)
        except Refused as r:
            self.conn.on_event(r.event)
            await self._answer(r.status, r.why)
            return False
        body: bytes | None = None
        if any(s.bodies for s in self.mine) and self.conn.may_send_secrets:
            try:
                body, used_in_body = await self._whole_body()
            except Refused as r:
                self.conn.on_event(r.event)
                await self._answer(r.status, r.why)
                return False
            used += used_in_body
            headers = [(n, v) for n, v in headers if n.lower() not in (b"content-length", b"transfer-encoding")]
            headers.append((b"Content-Length", str(len(body)).encode()))
        if self.up is None and not await self._connect():
            return False
        assert self.up is not None
        up = self.up
        stats: dict[str, Any] = {"body_out": 0, "body_in": 0, "status": None}  # (a connection's bytes: flow_events)
        try:
            await up.send(h11.Request(method=request.method, target=request.target, headers=headers))
            if _upgrade(request):
                return await self._upgraded(request, used, stats)
            # the body goes up while the answer comes down (an early answer, 100-continue)
            sending = asyncio.ensure_future(self._send_body(body, stats))
            answering = asyncio.ensure_future(self._relay_answer(request, stats))
            try:
                await asyncio.wait((sending, answering), return_when=asyncio.FIRST_COMPLETED)
                refusal = sending.exception() if sending.done() and not sending.cancelled() else None
                if isinstance(refusal, Refused):
                    self.conn.on_event(refusal.event)
                    return False
                answered = await answering and sending.done()  # (a body never finished: no next request)
            finally:
                for task in (sending, answering):
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.gather(sending, answering, return_exceptions=True)
        except (OSError, ConnectionError, h11.ProtocolError, ssl.SSLError) as e:
            self.conn.on_event(self.conn.event(kind="net.connect", verdict="allowed", rule="inspected",
                                               error=str(e)[:200] or type(e).__name__, state="request", **stats))
            return False
        self.conn.on_event(self.conn.event(
            kind="net.connect", verdict="allowed", rule="secret" if used or self.injected else "inspected",
            method=request.method.decode("latin-1")[:16], path=request.target.split(b"?")[0].decode("latin-1")[:200],
            secrets=sorted(set(used)), headers_set=sorted({n.decode() for n, _ in self.injected}),
            state="request", **stats))
        return answered

    async def _connect(self) -> bool:
        conn = self.conn
        if conn.dial is not None:
            return await self._connect_tunneled(conn, conn.dial)
        sock = await conn.upstream_socket()
        sock.setblocking(False)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await asyncio.get_running_loop().sock_connect(sock, (conn.dst, conn.dport))
                reader, writer = await asyncio.open_connection(
                    sock=sock, ssl=conn.upstream_ssl if conn.tls else None,
                    server_hostname=conn.host if conn.tls else None, limit=CHUNK)
        except (OSError, ssl.SSLError, TimeoutError) as e:
            sock.close()
            conn.on_event(conn.event(kind="net.deny", verdict="denied", rule="upstream",
                                     error=str(e)[:200] or type(e).__name__, state="denied"))
            await self._answer(502, f"{conn.host}:{conn.dport} could not be reached"
                                    + (" with a certificate valid for it" if isinstance(e, ssl.SSLError) else ""))
            return False
        self.up = _Upstream(reader, writer)
        return True

    async def _connect_tunneled(self, conn: Connection,
                                dial: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]) -> bool:
        """_connect through the sandbox's SOCKS5 proxy, TLS to the host inside the tunnel. Fails closed."""
        writer = None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await dial()
                if conn.tls:
                    assert conn.upstream_ssl is not None
                    await writer.start_tls(conn.upstream_ssl, server_hostname=conn.host)
        except (OSError, ssl.SSLError, TimeoutError) as e:
            if writer is not None:
                writer.transport.abort()
            rule = "egress-proxy" if not isinstance(e, ssl.SSLError) else "upstream"
            conn.on_event(conn.event(kind="net.deny", verdict="denied", rule=rule,
                                     error=str(e)[:200] or type(e).__name__, state="denied"))
            await self._answer(502, f"{conn.host}:{conn.dport} could not be reached"
                                    + (" with a certificate valid for it" if isinstance(e, ssl.SSLError)
                                       else " through the sandbox's egress proxy"))
            return False
        self.up = _Upstream(reader, writer)
        return True

    async def _body_events(self) -> AsyncIterator[bytes]:
        """The request's body as it arrives; ConnectionError if the sandbox leaves before its end."""
        while True:
            event = await self._next_request_event(None)
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise ConnectionError(f"unexpected {type(event).__name__} in a request body")

    async def _whole_body(self) -> tuple[bytes, list[str]]:
        chunks, size = [], 0
        async for data in self._body_events():
            size += len(data)
            if size > MAX_BODY:
                raise Refused(413, f"a body this sandbox's secrets are put into is at most {MAX_BODY >> 20} MiB",
                              self.conn.event(kind="net.deny", verdict="denied", rule="body-too-large", state="denied"))
            chunks.append(data)
        body = b"".join(chunks)
        leaked = placeholder_in(body, self.others)
        if leaked is not None:
            raise _elsewhere(leaked, self.conn.event())
        used = []
        for s in self.mine:
            if s.bodies and s.placeholder.encode() in body:
                body = body.replace(s.placeholder.encode(), s.value.encode())
                used.append(s.name)
        return body, used

    async def _send_body(self, body: bytes | None, stats: dict[str, Any]) -> None:
        up = self.up
        assert up is not None
        if body is not None:
            stats["body_out"] = len(body)
            if body:
                await up.send(h11.Data(data=body))
            await up.send(h11.EndOfMessage())
            return
        keep = max((len(s.placeholder) for s in self.others), default=1) - 1
        tail = b""
        async for data in self._body_events():  # streamed; a foreign placeholder ends it unsent
            window = tail + data
            leaked = placeholder_in(window, self.others)
            if leaked is not None:  # the request stays incomplete upstream: it is dropped there
                up.close()
                refusal = _elsewhere(leaked, self.conn.event())
                await self._answer(403, refusal.why)
                raise refusal
            tail = window[-keep:] if keep > 0 else b""
            stats["body_out"] += len(data)
            await up.send(h11.Data(data=data))
        await up.send(h11.EndOfMessage())

    async def _relay_answer(self, request: h11.Request, stats: dict[str, Any]) -> bool:
        """The upstream's answer, to the sandbox, redacted where it must be; False to end the connection."""
        up = self.up
        assert up is not None
        redactor = Redactor(self.secrets.values()) if self.redacting else None
        decoder: BodyDecoder | None = None
        while True:
            event = await up.next_event()
            if isinstance(event, h11.InformationalResponse):
                await self.client.write(self.down.send(h11.InformationalResponse(
                    status_code=event.status_code, headers=_redacted(event.headers.raw_items(), redactor))))
                continue
            if isinstance(event, h11.Response):
                stats["status"] = event.status_code
                headers, coding = _answer_headers(event, redactor)
                if coding is not None and coding not in DECODABLE:
                    await self._answer(502, f"{self.conn.host} answered in the content coding {coding!r}, which the "
                                            "egress proxy cannot read to take secrets out")
                    return False
                if coding is not None:
                    decoder = BodyDecoder(coding)
                await self.client.write(self.down.send(h11.Response(status_code=event.status_code, headers=headers,
                                                                    reason=event.reason)))
                continue
            if isinstance(event, h11.Data):
                stats["body_in"] += len(event.data)
                if redactor is None and decoder is None:  # as it came: no copy more than h11's own
                    await self.client.write_parts(self.down.send_with_data_passthrough(event))
                    continue
                pieces = decoder.feed(bytes(event.data)) if decoder is not None else [bytes(event.data)]
                for piece in pieces:
                    out = redactor.feed(piece) if redactor is not None else piece
                    if out:
                        await self.client.write(self.down.send(h11.Data(data=out)))
                continue
            if isinstance(event, h11.EndOfMessage):
                rest = decoder.end() if decoder is not None else b""
                if redactor is not None:
                    rest = redactor.feed(rest, final=True)
                if rest:
                    await self.client.write(self.down.send(h11.Data(data=rest)))
                await self.client.write(self.down.send(h11.EndOfMessage(
                    headers=_redacted(event.headers.raw_items(), redactor))))
                return self.down.our_state is h11.DONE
            return False  # ConnectionClosed before the answer ended

    async def _upgraded(self, request: h11.Request, used: list[str], stats: dict[str, Any]) -> bool:
        """An Upgrade (a WebSocket): its head was checked; after the 101, bytes both ways (the answers
        still lose every secret's value)."""
        up = self.up
        assert up is not None
        redactor = Redactor(self.secrets.values()) if self.redacting else None
        event = await up.next_event()
        while isinstance(event, h11.InformationalResponse) and event.status_code != 101:
            event = await up.next_event()
        if not isinstance(event, h11.InformationalResponse):
            await self._answer(502, f"{self.conn.host} did not switch protocols")
            return False
        await self.client.write(self.down.send(h11.InformationalResponse(
            status_code=101, headers=_redacted(event.headers.raw_items(), redactor))))
        self.conn.on_event(self.conn.event(kind="net.connect", verdict="allowed", rule="secret" if used else "inspected",
                                           method=request.method.decode("latin-1")[:16], upgrade=True,
                                           secrets=sorted(set(used)), state="open"))
        client_rest, up_rest = self.down.trailing_data[0], up.h11.trailing_data[0]

        async def outbound() -> None:
            if client_rest:
                up.writer.write(client_rest)
            while data := await self.client.read():
                up.writer.write(data)
                await up.writer.drain()
            if up.writer.can_write_eof():
                up.writer.write_eof()

        async def inbound() -> None:
            if up_rest:
                await self.client.write(redactor.feed(up_rest) if redactor else up_rest)
            while data := await up.reader.read(CHUNK):
                stats["body_in"] += len(data)
                await self.client.write(redactor.feed(data) if redactor else data)
            if redactor is not None:
                await self.client.write(redactor.feed(b"", final=True))

        with contextlib.suppress(OSError, ConnectionError, ssl.SSLError):
            await asyncio.gather(outbound(), inbound())
        return False


async def serve_inspected(first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          conn: Connection, server_ctx: ssl.SSLContext | None) -> None:
    """Serve one intercepted connection request by request (see the module docstring)."""
    await HttpRelay(conn, ClientSide(reader, writer, first, server_ctx)).run()


# -- helpers ------------------------------------------------------------------------------------------


def _elsewhere(leaked: Secret, base: dict[str, Any]) -> Refused:
    return Refused(403, f"the placeholder of secret {leaked.name} may only go to {', '.join(leaked.hosts)}",
                   {**base, "kind": "secret.refused", "verdict": "denied", "rule": "secret-elsewhere",
                    "secret": leaked.name, "state": "denied"})


def _plaintext(secret: Secret | None, host: str, base: dict[str, Any]) -> Refused:
    what = f"secret {secret.name}" if secret is not None else f"the headers set for {host} (network.rules)"
    return Refused(403, f"{what} may only be sent to {host} over HTTPS (or plain HTTP to a host the operator "
                        "allows it for, at an address its name resolved to)",
                   {**base, "kind": "secret.refused", "verdict": "denied", "rule": "secret-plaintext",
                    "secret": secret.name if secret is not None else f"rules:{host}", "state": "denied"})


def _named_hosts(request: h11.Request) -> set[str | None]:
    """Every host a request names: its Host header and an absolute-form target (ports dropped); None
    for one that is not a host name."""
    names: list[str | None] = [authority_host(v) for n, v in request.headers if n == b"host"]
    target = request.target
    if target.lower().startswith((b"http://", b"https://")):
        names.append(authority_host(target.split(b"/", 3)[2]))
    elif not target.startswith(b"/") and target != b"*":
        names.append(None)  # authority-form (CONNECT) or junk: never one of ours
    return set(names) if names else {None}


def _chunked(request: h11.Request) -> bool:
    return any(n == b"transfer-encoding" for n, _ in request.headers)


def _upgrade(request: h11.Request) -> bool:
    return any(n == b"upgrade" for n, _ in request.headers) and any(
        n == b"connection" and b"upgrade" in v.lower() for n, v in request.headers)


def _wants_close(request: h11.Request) -> bool:
    return request.http_version == b"1.0" or any(
        n == b"connection" and b"close" in v.lower() for n, v in request.headers)


def _decodable(value: bytes) -> bytes:
    offered = [c.strip() for c in value.split(b",")]
    kept = [c for c in offered if c.split(b";")[0].strip().lower() in (b"gzip", b"x-gzip", b"deflate", b"identity")]
    return b", ".join(kept) if kept else b"identity"


def _redacted(headers: Any, redactor: Redactor | None) -> list[tuple[bytes, bytes]]:
    items = list(headers)
    if redactor is None:
        return items
    return [(n, redactor.text(bytes(v))) for n, v in items]


def _answer_headers(response: h11.Response, redactor: Redactor | None) -> tuple[list[tuple[bytes, bytes]], str | None]:
    """The answer's headers for the sandbox, and the content coding to undo (None: none).

    Untouched answers keep their Content-Length; h11 frames everything else itself (chunked for
    HTTP/1.1 clients), so a body that redaction changed never carries a length it no longer has."""
    coding: str | None = None
    if redactor is not None:
        codings = [c.strip().lower() for n, v in response.headers if n == b"content-encoding"
                   for c in v.decode("latin-1").split(",") if c.strip() and c.strip().lower() != "identity"]
        if len(codings) > 1:
            coding = ",".join(codings)  # layered codings: not read, refused
        elif codings:
            coding = codings[0]
    out = []
    for raw_name, value in response.headers.raw_items():
        name = raw_name.lower()
        if name == b"connection" and b"close" in value.lower():
            out.append((b"Connection", b"close"))  # the upstream ends it: so does the sandbox's side
        if name in _HOP_BY_HOP:
            continue
        if redactor is not None and name in (b"content-length", b"content-encoding"):
            continue
        out.append((raw_name, redactor.text(value) if redactor is not None else value))
    return out, coding
