"""The egress proxy: connections on ports 80 and 443 of sandboxes whose policy names domains, held
until their first bytes name a host, checked, then relayed (docs/network.md).

Why: a domain rule the router enforces by pinned addresses alone trusts the address; many names share
one (CDNs, virtual hosting), so a sandbox allowed `api.example.com` could reach `evil.example.net` on
the same address, or a denied name at an address it learned elsewhere (DoH, a hard-coded IP). Here the
name a connection claims (TLS SNI, HTTP Host; network/claims.py) must itself be allowed, and, under an
allow list, must be a name the address was answered for.

How the connections get here: the router's prerouting chain hands new TCP connections to ports 80 and
443 from intercepted links to this proxy's transparent socket (nftables `tproxy`, a fwmark and a
local route in the router namespace), so the original destination is the accepted socket's own
address. The proxy's upstream socket is made inside the router namespace and leaves through the
uplink like forwarded traffic. Since intercepted connections never cross the router's forward chain,
the decision (`Egress.check_claim`) applies the never-list and the address rules too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agentcell.network.ca import EgressCA
from agentcell.network.claims import MAX_PEEK, MORE, Claim, claimed_host
from agentcell.network.inspection import (
    foreign_placeholder,
    leak_event,
    leak_refusal,
    scan_relay,
    serve_secret_host,
)
from agentcell.network.quota import KeyedQuota
from agentcell.network.secrets import Secret, SecretSet

log = logging.getLogger("agentcell.egress")

PROXY_PORT = 15001  # in the router namespace only
FWMARK = 0x1
ROUTE_TABLE = 100
INTERCEPTED_PORTS = (80, 443)
CLAIM_TIMEOUT_S = 10.0  # a client that names no host within this is dropped
CONNECT_TIMEOUT_S = 10.0
CHUNK = 256 << 10
MAX_CONNECTIONS = 4096  # intercepted connections at once, all sandboxes together
MAX_PER_SANDBOX = 256  # ... and of one sandbox, so that one cannot take them all
IP_TRANSPARENT = 19

Decide = Callable[[int, str, int, Claim], tuple[bool, str]]  # (slot, ip, port, claim) -> (allowed, rule)


def listening_socket() -> socket.socket:
    """The proxy's transparent socket; call it in the router namespace (NetnsWorker)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
    sock.bind(("0.0.0.0", PROXY_PORT))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def tproxy_statement() -> str:
    ports = ", ".join(str(p) for p in INTERCEPTED_PORTS)
    return f"meta l4proto tcp th dport {{ {ports} }} tproxy ip to :{PROXY_PORT} meta mark set {FWMARK:#x} accept"


def routing_commands() -> list[str]:
    """ip(8) commands that deliver marked packets locally (tproxy's other half)."""
    return [f"rule add fwmark {FWMARK} lookup {ROUTE_TABLE}", f"route add local 0.0.0.0/0 dev lo table {ROUTE_TABLE}"]


class Interceptor:
    def __init__(self, slot_of: Callable[[str], int | None], decide: Decide,
                 upstream_socket: Callable[[], Awaitable[socket.socket]],
                 on_event: Callable[[int, dict[str, Any]], None], secrets_for: Callable[[int], SecretSet],
                 ca: EgressCA, upstream_ssl: ssl.SSLContext) -> None:
        self.secrets_for = secrets_for
        self.ca = ca
        self.upstream_ssl = upstream_ssl
        self.slot_of = slot_of
        self.decide = decide
        self.upstream_socket = upstream_socket
        self.on_event = on_event
        self.server: asyncio.Server | None = None
        self.quota = KeyedQuota(MAX_CONNECTIONS, MAX_PER_SANDBOX)

    async def start(self, sock: socket.socket) -> None:
        self.server = await asyncio.start_server(self._handle, sock=sock, limit=CHUNK)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        src = writer.get_extra_info("peername")[0]
        dst, dport = writer.get_extra_info("sockname")[:2]  # the original destination (tproxy)
        slot = self.slot_of(src)
        if slot is None or not self.quota.take(slot):
            writer.transport.abort()
            return
        try:
            await self._serve(slot, dst, dport, reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            self.quota.give(slot)
            writer.close()

    async def _serve(self, slot: int, dst: str, dport: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        first = b""
        claim: Claim | None = MORE
        async with asyncio.timeout(CLAIM_TIMEOUT_S):
            while claim is MORE:
                chunk = await reader.read(MAX_PEEK)
                if not chunk:
                    return
                first += chunk
                claim = claimed_host(first)
        assert claim is not None
        allowed, rule = self.decide(slot, dst, dport, claim)
        if not allowed:
            self.on_event(slot, {"time": time.time(), "proto": "tcp", "dst": dst, "dport": dport,
                                 "domain": claim.host, "claim": claim.kind, "verdict": "denied", "rule": rule,
                                 "state": "denied"})
            if claim.kind == "http":  # say why; a TLS client just sees the connection end
                body = f"agentcell: {claim.host} is not allowed from this sandbox ({rule})\n".encode()
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                with contextlib.suppress(OSError):
                    await writer.drain()
            return
        secrets = self.secrets_for(slot)
        # TLS from a sandbox with secrets is read too, so that a placeholder sent anywhere else is seen
        if claim.host and (secrets.intercepts(claim.host) or (secrets.secrets and claim.kind == "tls")):
            await serve_secret_host(first, reader, writer, host=claim.host, dst=dst, dport=dport,
                                    tls=claim.kind == "tls", secrets=secrets, ca=self.ca,
                                    upstream_ssl=self.upstream_ssl, upstream_socket=self.upstream_socket,
                                    on_event=lambda event: self.on_event(slot, event))
            return
        scan = bool(secrets.secrets) and claim.kind == "http"  # plaintext from a sandbox with secrets: no placeholder out

        async def refuse(leaked: Secret) -> None:
            self.on_event(slot, leak_event({"time": time.time(), "proto": "tcp", "dst": dst, "dport": dport,
                                            "domain": claim.host}, leaked))
            writer.write(leak_refusal(leaked))
            with contextlib.suppress(OSError):
                await writer.drain()

        if scan:
            leaked = foreign_placeholder(first, list(secrets.secrets))
            if leaked is not None:
                await refuse(leaked)
                return
        sock = await self.upstream_socket()
        try:
            sock.setblocking(False)
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await asyncio.get_running_loop().sock_connect(sock, (dst, dport))
        except BaseException:
            sock.close()
            raise
        up_reader, up_writer = await asyncio.open_connection(sock=sock, limit=CHUNK)
        try:
            up_writer.write(first)
            outbound = scan_relay(reader, up_writer, secrets, refuse) if scan else _pipe(reader, up_writer)
            await asyncio.gather(outbound, _pipe(up_reader, writer))
        finally:
            up_writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close; the other direction goes on (HTTP keep-alive, TLS close_notify)."""
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, ConnectionError):
        writer.transport.abort()
