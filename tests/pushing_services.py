"""Services of a test "internet" that keep talking to whoever reached them once, and a DNS server that
leaves some names unanswered (run inside the internet's namespace by tests/test_egress_tenants.py).

Arguments: PEER DNS (two addresses of the namespace).
* UDP PEER:5000: every datagram's sender is sent b"for:" + the datagram every 20 ms from then on,
  for as long as this runs (a peer that never lets a flow's conntrack entry expire);
* TCP PEER:5001: a connection's first line is its tag; b"for:<tag>\\n" is written every 20 ms until the
  connection breaks;
* UDP DNS:53: `fast.test` is 203.0.113.10 (TTL 5), names under `blackhole.test` are never answered (an
  upstream that drops queries), anything else is NXDOMAIN.
Prints "ready" once everything listens.
"""

from __future__ import annotations

import asyncio
import socket
import sys

import dns.message
import dns.rcode
import dns.rrset

PUSH_EVERY_S = 0.02


class Pusher(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.targets: dict[tuple[str, int], bytes] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.DatagramTransport = transport  # type: ignore[assignment]
        asyncio.get_running_loop().create_task(self.push())

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.targets[addr] = b"for:" + data

    async def push(self) -> None:
        while True:
            for addr, payload in list(self.targets.items()):
                self.transport.sendto(payload, addr)
            await asyncio.sleep(PUSH_EVERY_S)


async def push_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        tag = (await asyncio.wait_for(reader.readline(), 10)).strip()
        while True:
            writer.write(b"for:" + tag + b"\n")
            await writer.drain()
            await asyncio.sleep(PUSH_EVERY_S)
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        writer.close()


class Dns(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.DatagramTransport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            q = dns.message.from_wire(data)
        except Exception:
            return
        name = q.question[0].name.to_text().lower()
        if name.endswith("blackhole.test."):
            return  # never answered: the resolver's query stays in flight until its timeout
        r = dns.message.make_response(q)
        if name == "fast.test.":
            r.answer.append(dns.rrset.from_text_list(name, 5, "IN", "A", ["203.0.113.10"]))
        else:
            r.set_rcode(dns.rcode.NXDOMAIN)
        self.transport.sendto(r.to_wire(), addr)


async def main() -> None:
    peer, resolver = sys.argv[1], sys.argv[2]
    loop = asyncio.get_running_loop()
    await loop.create_datagram_endpoint(Pusher, local_addr=(peer, 5000), family=socket.AF_INET)
    server = await asyncio.start_server(push_tcp, peer, 5001, reuse_address=True)
    await loop.create_datagram_endpoint(Dns, local_addr=(resolver, 53), family=socket.AF_INET)
    print("ready", flush=True)
    await asyncio.Event().wait()
    del server


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
