"""The services of the tests' "internet" (run inside its network namespace by tests/test_egress.py
with the namespace's addresses as arguments).

On every address of the namespace: HTTP on 80 and 8080 (the answer names the address and Host it got,
and /redirect?to=URL redirects), DNS on 53 (UDP and TCP, a small zone; any address answers, so a
"foreign resolver" is one too), a TCP listener on 853 (DoT's port), a UDP echo on 7 and 443.
Prints "ready" once everything listens.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import os
import socket
import ssl
import struct
import sys

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

ZONE: dict[str, list[tuple[str, str]]] = {
    "allowed.test.": [("A", "203.0.113.10")],
    "other.test.": [("A", "198.51.100.20")],
    "api.wild.test.": [("A", "203.0.113.11")],
    "denied.test.": [("A", "203.0.113.12")],
    "secret.test.": [("A", "203.0.113.10")],
    "plain.test.": [("A", "203.0.113.10")],  # a host the operator lets secrets reach over plain HTTP
    "rebind.test.": [("A", "10.1.2.3")],
    "meta.test.": [("A", "169.254.169.254")],
    "flip.test.": [],
    "big.test.": [("A", f"203.0.113.{100 + i}") for i in range(60)],  # > 512 bytes: EDNS0 or TCP
    "huge.test.": [("A", f"198.51.100.{100 + i}") for i in range(100)],  # > 1232 bytes: TCP
}
queries: list[str] = []


def answer(data: bytes) -> bytes | None:
    try:
        q = dns.message.from_wire(data)
    except Exception:
        return None
    name = q.question[0].name.to_text().lower()
    queries.append(name)
    record(f"dns {name}".encode())  # (which names reached the internet's resolver)
    r = dns.message.make_response(q)
    if name == "flip.test.":  # DNS rebinding over time: public at first, private afterwards
        ZONE[name] = [("A", "203.0.113.13" if queries.count(name) == 1 else "10.1.2.3")]
    records = [v for kind, v in ZONE.get(name, []) if dns.rdatatype.from_text(kind) == q.question[0].rdtype]
    if name not in ZONE:
        r.set_rcode(dns.rcode.NXDOMAIN)
    elif records:
        r.answer.append(dns.rrset.from_text_list(name, 5, "IN", "A", records))
    return r.to_wire()


class Udp(asyncio.DatagramProtocol):
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.DatagramTransport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = answer(data) if self.kind == "dns" else b"echo:" + data
        if reply is not None and self.kind == "dns" and len(reply) > 512:  # truncated: ask over TCP
            r = dns.message.from_wire(reply)
            r.answer = []
            r.flags |= dns.flags.TC
            reply = r.to_wire()
        if reply is not None:
            self.transport.sendto(reply, addr)


def record(head: bytes) -> None:
    """Every request head, for tests that must know what reached the internet (INET_LOG)."""
    path = os.environ.get("INET_LOG")
    if path:
        with open(path, "ab") as f:
            f.write(head + b"\n----\n")


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
        return None
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    body = await reader.readexactly(min(length, 1 << 20)) if length else b""
    record(head + body)
    return head, body


def _echo_answer(head: bytes, body: bytes, keep: bool = False) -> bytes:
    """The request (head and body) as the answer, its Authorization in a header too; by path:
    /chunked (in 7-byte chunks, so that any value is split), /gzip (gzip-encoded), /b64 (Base64)."""
    auth = next((line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                 if line.lower().startswith(b"authorization:")), b"")
    path = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b"/"
    payload = head + body
    extra = b"Connection: %s\r\n" % (b"keep-alive" if keep else b"close")
    if path.startswith(b"/chunked"):
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(payload[i:i + 7]), payload[i:i + 7]) for i in range(0, len(payload), 7))
        return b"HTTP/1.1 200 OK\r\nX-Echo-Auth: %s\r\nTransfer-Encoding: chunked\r\n%s\r\n%s0\r\n\r\n" % (
            auth, extra, chunks)
    if path.startswith(b"/gzip"):
        payload, extra = gzip.compress(payload), extra + b"Content-Encoding: gzip\r\n"
    elif path.startswith(b"/b64"):
        payload = base64.b64encode(payload)
    return b"HTTP/1.1 200 OK\r\nX-Echo-Auth: %s\r\nContent-Length: %d\r\n%s\r\n%s" % (auth, len(payload), extra,
                                                                                       payload)


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTPS: answers with the request it got (_echo_answer); /keepalive... keeps the connection."""
    try:
        while (request := await _read_request(reader)) is not None:
            line = request[0].split(b"\r\n", 1)[0]
            if b" /big/" in line:  # N bytes, streamed (throughput through the proxy's TLS)
                await _big(int(line.split(b" ")[1][5:]), writer)
                break
            keep = b" /keepalive" in line
            writer.write(_echo_answer(*request, keep=keep))
            await writer.drain()
            if not keep:
                break
    except OSError:
        pass
    writer.close()


async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Plain HTTP: a greeting naming the address and Host it got; /echo... answers as the HTTPS echo
    does; /keepalive... answers and keeps the connection for the next request."""
    try:
        while True:
            request = await _read_request(reader)
            if request is None:
                break
            line = request[0].split(b"\r\n", 1)[0]
            if b" /echo" in line or b" /keepalive" in line:
                keep = b" /keepalive" in line
                writer.write(_echo_answer(*request, keep=keep))
                await writer.drain()
                if keep:
                    continue
                break
            await _greet(request[0], writer)
            break
    except OSError:
        pass
    writer.close()


async def _greet(head: bytes, writer: asyncio.StreamWriter) -> None:
    lines = head.decode(errors="replace").split("\r\n")
    target = lines[0].split(" ")[1] if len(lines[0].split(" ")) > 1 else "/"
    host = next((line.split(":", 1)[1].strip() for line in lines[1:] if line.lower().startswith("host:")), "")
    local = writer.get_extra_info("sockname")[0]
    if target.startswith("/redirect?to="):
        writer.write(f"HTTP/1.1 302 Found\r\nLocation: {target[13:]}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                     .encode())
    else:
        if target.startswith("/big/"):  # N bytes, streamed
            await _big(int(target[5:]), writer)
        else:
            body = f"hello from {local} host={host} path={target}\n".encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
            writer.write(body)
    await writer.drain()


_TEXT = os.urandom(1 << 19).hex().encode()  # 1 MiB of text: what an API answers looks more like this than b"x" * n


async def _big(left: int, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % left)
    chunk = _TEXT
    while left > 0:
        writer.write(chunk[:left])
        left -= len(chunk)
        await writer.drain()


async def dns_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        (n,) = struct.unpack("!H", await reader.readexactly(2))
        reply = answer(await reader.readexactly(n))
        if reply:
            writer.write(struct.pack("!H", len(reply)) + reply)
            await writer.drain()
    except (asyncio.IncompleteReadError, OSError):
        pass
    writer.close()


async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(1)  # the client speaks first (a ClientHello), as TLS does
    writer.write(b"dot-listener\n")
    await writer.drain()
    writer.close()


async def main() -> None:
    loop = asyncio.get_running_loop()
    servers = [await asyncio.start_server(http, "0.0.0.0", port, reuse_address=True) for port in (80, 8080)]
    servers.append(await asyncio.start_server(dns_tcp, "0.0.0.0", 53, reuse_address=True))
    servers.append(await asyncio.start_server(hold, "0.0.0.0", 853, reuse_address=True))
    tls_cert = os.environ.get("INET_TLS_CERT")  # cert + key PEM: HTTPS echo on 443; else a listener that says hello
    if tls_cert:
        # per address: INET_TLS_ROGUE="ADDRESS=PEM" gives one address a certificate of its own
        rogue_address, _, rogue_cert = os.environ.get("INET_TLS_ROGUE", "").partition("=")
        for address in sys.argv[1:]:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(rogue_cert if address == rogue_address else tls_cert)
            servers.append(await asyncio.start_server(echo, address, 443, ssl=ctx, reuse_address=True))
    else:
        servers.append(await asyncio.start_server(hold, "0.0.0.0", 443, reuse_address=True))
    # UDP per address: a socket on 0.0.0.0 would answer from whichever address routes back, and a
    # client (rightly) ignores an answer from an address it did not ask
    for address in sys.argv[1:]:
        for port, kind in ((53, "dns"), (7, "echo"), (443, "echo")):
            await loop.create_datagram_endpoint(lambda kind=kind: Udp(kind), local_addr=(address, port),
                                                family=socket.AF_INET)
    print("ready", flush=True)
    await asyncio.Event().wait()
    del servers


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
