"""SOCKS5 proxies and a target only they reach, run inside the tests' internet namespace by
tests/test_egress_proxy.py (a real RFC 1928 / RFC 1929 server, written here so that the test sees what
the proxy saw).

argv: a JSON object:
  "proxies": [{"listen": "ADDR:PORT", "auth": ["user", "password"] | null, "tls": "PEM path" | null}],
  "target": "ADDR" (HTTP on ports 9000 and 9001: the answer names the peer it saw),
  "log": path (one line per event: "greeting LISTEN PEER", "auth-ok/auth-failed LISTEN user",
          "connect LISTEN DST:PORT", "target PEER PORT").
Each proxy dials out from its own listening address, so a target sees which proxy it came through.
Prints "ready" once everything listens.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import ssl
import struct
import sys
from typing import Any

LOG: Any = None


def note(line: str) -> None:
    LOG.write(line + "\n")
    LOG.flush()


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        else:  # TLS has no half-close: the whole connection ends with either side
            writer.close()
    except (OSError, ConnectionError):
        writer.transport.abort()


def socks_server(listen: str, auth: list[str] | None):  # type: ignore[no-untyped-def]
    host, _, port = listen.rpartition(":")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[0]
        try:
            version, count = await reader.readexactly(2)
            methods = await reader.readexactly(count)
            note(f"greeting {listen} {peer}")
            if version != 5:
                return
            wanted = 2 if auth else 0
            if wanted not in methods:
                writer.write(b"\x05\xff")
                await writer.drain()
                note(f"no-method {listen} {list(methods)}")
                return
            writer.write(bytes([5, wanted]))
            if auth:
                _, ulen = await reader.readexactly(2)
                user = (await reader.readexactly(ulen)).decode()
                (plen,) = await reader.readexactly(1)
                password = (await reader.readexactly(plen)).decode()
                ok = [user, password] == auth
                writer.write(b"\x01\x00" if ok else b"\x01\x01")
                note(f"{'auth-ok' if ok else 'auth-failed'} {listen} {user}")
                if not ok:
                    await writer.drain()
                    return
            _, cmd, _, atyp = await reader.readexactly(4)
            if atyp == 1:
                dst = str(ipaddress.IPv4Address(await reader.readexactly(4)))
            elif atyp == 3:
                (n,) = await reader.readexactly(1)
                dst = (await reader.readexactly(n)).decode()
            else:
                dst = str(ipaddress.IPv6Address(await reader.readexactly(16)))
            (dport,) = struct.unpack("!H", await reader.readexactly(2))
            note(f"connect {listen} {dst}:{dport}")
            try:
                up_reader, up_writer = await asyncio.open_connection(dst, dport, local_addr=(host, 0))
            except OSError:
                writer.write(b"\x05\x05\x00\x01\0\0\0\0\0\0")  # connection refused
                await writer.drain()
                return
            bound = up_writer.get_extra_info("sockname")
            writer.write(b"\x05\x00\x00\x01" + socket.inet_aton(bound[0]) + struct.pack("!H", bound[1]))
            await writer.drain()
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except (asyncio.IncompleteReadError, OSError, ssl.SSLError, ValueError):
            pass
        finally:
            writer.close()

    return host, int(port), serve


async def target(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    peer = writer.get_extra_info("peername")[0]
    port = writer.get_extra_info("sockname")[1]
    note(f"target {peer} {port}")
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ")[1].decode() if head.count(b" ") >= 2 else "/"
        body = f"target saw {peer} port={port} path={path}\n".encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
        pass
    writer.close()


async def main() -> None:
    global LOG
    config = json.loads(sys.argv[1])
    LOG = open(config["log"], "a")  # noqa: SIM115 - for the process's life
    servers = []
    for proxy in config["proxies"]:
        host, port, serve = socks_server(proxy["listen"], proxy.get("auth"))
        ctx = None
        if proxy.get("tls"):
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(proxy["tls"])
        servers.append(await asyncio.start_server(serve, host, port, ssl=ctx, reuse_address=True))
    for port in (9000, 9001):
        servers.append(await asyncio.start_server(target, config["target"], port, reuse_address=True))
    print("ready", flush=True)
    await asyncio.Event().wait()
    del servers


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
