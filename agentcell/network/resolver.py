"""The egress DNS resolver: a sandbox's only resolver, answering only the names its policy allows.

Why a resolver of our own (docs/network.md):
- A name the policy does not allow is answered here (REFUSED, with RFC 8914's "Blocked") and never
  forwarded. A query is itself a message to whoever runs that name's authoritative server, so
  forwarding it would leak data to a domain the policy denies.
- Each address it answers for an allowed name is *pinned* for that sandbox (`pin`) before the answer
  goes out, so that the router lets the sandbox reach exactly the addresses its allowed names
  resolved to, and the connection that follows the answer finds its address open.
- An answer pointing into the never-list (DNS rebinding: an allowed name that resolves to 10.0.0.5 or
  169.254.169.254) loses those records and pins nothing there.

Sandboxes ask over UDP (`PolicyResolver`) or TCP (`serve_tcp`, for answers too big for a datagram).
What one sandbox may hold at once is bounded per sandbox first and in all second, with a reserve per
sandbox that the others cannot take (network/quota.py): MAX_PENDING queries being forwarded in all,
MAX_PENDING_PER_SOURCE of one sandbox, and however full the rest is, a sandbox with fewer than
PENDING_RESERVE in flight gets one more; so at most MAX_PENDING + PENDING_RESERVE x sandboxes are in
flight (each a task and an upstream socket: ~4,300 at 1,000 sandboxes). TCP clients likewise.
Everything a sandbox's address has here (queries in flight, TCP clients) ends when its slot is given
back (`forget`): the next sandbox with that address never gets an answer to a query it did not ask.
Upstream queries go over UDP from a fresh socket each (random port and id), over TCP when the answer
was truncated, each socket made by `make_socket`:
the server makes them inside the router's namespace, so they leave through the egress uplink and
never from the host's own network.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import dns.asyncquery
import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from agentcell.network.ask import STAND_IN_TTL
from agentcell.network.quota import KeyedQuota
from agentcell.network.router import NeverList

log = logging.getLogger("agentcell.dns")

PIN_MIN_S = 30  # a pin outlives a tiny TTL: clients cache answers longer than they say
PIN_MAX_S = 3600
UPSTREAM_TIMEOUT_S = 2.0
MAX_PENDING = 256  # queries being forwarded at once, all sandboxes together; more are dropped ...
MAX_PENDING_PER_SOURCE = 32  # ... and of one sandbox, so that its flood cannot crowd out the others ...
PENDING_RESERVE = 4  # ... but a sandbox with fewer than this in flight always gets one more (glibc asks 2)
MAX_TCP_CLIENTS = 128  # DNS-over-TCP connections open at once, all sandboxes together
MAX_TCP_PER_SOURCE = 8
TCP_RESERVE = 2
TCP_IDLE_S = 10.0

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Pin = tuple[Address, int, str]  # (address, seconds, the name it was answered for)


class RuleError(ValueError):
    """A domain rule that is not a host name or a `*.` wildcard."""


def _name(text: str) -> dns.name.Name:
    try:
        return dns.name.from_text(text.strip().lower().rstrip(".") + ".")
    except (dns.exception.DNSException, UnicodeError) as e:
        raise RuleError(f"not a domain name: {text!r} ({e})") from None


@dataclass(frozen=True)
class _Rule:
    base: dns.name.Name
    wildcard: bool  # "*.example.com": every name below example.com, not example.com itself

    @classmethod
    def parse(cls, text: str) -> _Rule:
        wildcard = text.strip().startswith("*.")
        base = _name(text.strip()[2:] if wildcard else text)
        if base == dns.name.root or any(b"*" in label for label in base.labels):
            raise RuleError(f"not a domain rule: {text!r} (a name, or *. followed by a name)")
        return cls(base, wildcard)

    def matches(self, name: dns.name.Name) -> bool:
        if self.wildcard:
            return name != self.base and name.is_subdomain(self.base)
        return name == self.base


class DomainRules:
    """Which names a sandbox may resolve: none of `deny`; of the rest, those in `allow` (every name
    when `allow` is empty)."""

    def __init__(self, allow: Iterable[str] = (), deny: Iterable[str] = ()) -> None:
        self.allow = [_Rule.parse(r) for r in allow]
        self.deny = [_Rule.parse(r) for r in deny]

    def allows(self, name: dns.name.Name) -> bool:
        # dnspython compares names (==, is_subdomain) without regard to case
        if any(r.matches(name) for r in self.deny):
            return False
        return not self.allow or any(r.matches(name) for r in self.allow)


_DEFAULT_NEVER = NeverList()


class PolicyResolver(asyncio.DatagramProtocol):
    """Answers queries from sandboxes. `rules_for(source ip)` gives the sandbox's DomainRules (None:
    a stranger, or a sandbox without internet); `pin(source ip, pins)` is awaited with the addresses
    of an answer before the answer is sent; `make_socket(family, type)` makes each upstream socket (default:
    a plain one in the caller's namespace, for tests); `on_refused(source ip, name)` hears of each
    name refused, `on_answered(source ip, name, type, addresses, rcode)` of each query answered.
    `stand_in(source ip, name, for_a)`, for a name the rules refuse: an address to answer instead of
    refusing (network ask: a name to be asked about, not resolved before it is allowed; network/ask.py),
    "" for a query of another type than A (answered with no records), None to refuse."""

    def __init__(self, upstream: tuple[str, int], rules_for: Callable[[str], DomainRules | None],
                 pin: Callable[[str, list[Pin]], Awaitable[None]],
                 make_socket: Callable[[int, int], Awaitable[socket.socket]] | None = None,
                 on_refused: Callable[[str, str], None] | None = None, never_list: NeverList | None = None,
                 on_answered: Callable[[str, str, str, list[str], str], None] | None = None,
                 stand_in: Callable[[str, str, bool], str | None] | None = None) -> None:
        self.never = never_list or _DEFAULT_NEVER
        self.stand_in = stand_in
        self.upstream = upstream
        self.on_refused = on_refused
        self.on_answered = on_answered
        self.rules_for = rules_for
        self.pin = pin
        self.make_socket = make_socket
        self.transport: asyncio.DatagramTransport | None = None
        self.pending: set[asyncio.Task[None]] = set()
        self.quota = KeyedQuota(MAX_PENDING, MAX_PENDING_PER_SOURCE, PENDING_RESERVE)  # queries being answered
        self.tcp_clients = KeyedQuota(MAX_TCP_CLIENTS, MAX_TCP_PER_SOURCE, TCP_RESERVE)  # serve_tcp's connections
        self._work: dict[str, set[asyncio.Task[None]]] = {}  # source -> its queries and TCP clients being served
        self._forgotten: set[str] = set()  # sources whose slot was given back and not claimed again

    def forget(self, source: str) -> int:
        """The sandbox at `source` is gone: cancel its queries in flight and close its TCP clients (their
        quotas come back as they end), and ignore what it sent until `admit(source)`. Returns how many
        were cancelled."""
        self._forgotten.add(source)
        work = self._work.pop(source, set())
        for task in work:
            task.cancel()
        return len(work)

    def admit(self, source: str) -> None:
        """A new sandbox has `source`: its queries are answered again."""
        self._forgotten.discard(source)

    def _track(self, source: str, task: asyncio.Task[None]) -> None:
        work = self._work.setdefault(source, set())
        work.add(task)

        def untrack(t: asyncio.Task[None]) -> None:
            work.discard(t)
            if not work and self._work.get(source) is work:
                del self._work[source]

        task.add_done_callback(untrack)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        query = _parse_query(data)
        if query is None:
            return  # not a DNS query: no answer (an answer to junk helps nobody but a reflector)
        source = addr[0]
        if source in self._forgotten:
            return  # sent by a sandbox that is gone, read late: its slot's next sandbox must not get the answer
        if not self.quota.take(source):
            return  # the client retries; a flood does not grow the server, nor starve the others
        task = asyncio.ensure_future(self._answer_udp(query, addr))
        self.pending.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self.pending.discard(t)
            self.quota.give(source)

        task.add_done_callback(done)
        self._track(source, task)

    async def _answer_udp(self, query: dns.message.Message, addr: tuple[str, int]) -> None:
        response = await self.answer(query, addr[0])
        if response is not None and self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(response.to_wire(max_size=512 if response.edns < 0 else 1232,
                                                   prefer_truncation=True), addr)

    async def answer(self, query: dns.message.Message, source: str) -> dns.message.Message | None:
        """The response to `query` from `source` (None: the upstream did not answer in time)."""
        name = query.question[0].name
        rules = self.rules_for(source)
        if rules is None or not rules.allows(name):
            text = name.to_text(omit_final_dot=True)
            for_a = query.question[0].rdtype == dns.rdatatype.A and query.question[0].rdclass == dns.rdataclass.IN
            stand_in = self.stand_in(source, text.lower(), for_a) if self.stand_in is not None else None
            if stand_in is not None:  # never forwarded: answered here, to be asked about at connect
                return _stand_in_answer(query, stand_in)
            if self.on_refused is not None:
                self.on_refused(source, text)
            return _refused(query, f"agentcell: {text} is not allowed here")
        forwarded = dns.message.make_query(name, query.question[0].rdtype, query.question[0].rdclass)
        try:
            reply = await self._forward(forwarded)
        except (dns.exception.DNSException, OSError, TimeoutError) as e:
            log.debug("upstream failed for %s: %s", name, e)
            self._answered(source, query, [], "SERVFAIL")
            return _servfail(query)
        response = dns.message.make_response(query)
        response.set_rcode(reply.rcode())
        response.flags |= reply.flags & dns.flags.RA
        response.answer, pins = self._screen(reply.answer, source, name)
        if pins:
            try:
                await self.pin(source, pins)
            except Exception as e:  # an answer whose addresses are not open would only fail later
                log.warning("could not pin %s for %s: %s", name, source, e)
                self._answered(source, query, [], "SERVFAIL")
                return _servfail(query)
        self._answered(source, query, [str(a) for rrset in response.answer for a in rrset
                                       if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)],
                       dns.rcode.to_text(reply.rcode()))
        return response

    async def lookup(self, name: str) -> list[str]:
        """The IPv4 addresses `name` resolves to upstream, minus the never-list (for the egress itself:
        a name allowed after its sandbox got a stand-in for it)."""
        reply = await self._forward(dns.message.make_query(name, dns.rdatatype.A))
        return [rd.address for rrset in reply.answer if rrset.rdtype == dns.rdatatype.A for rd in rrset
                if ipaddress.ip_address(rd.address) not in self.never]

    async def answers(self, name: str) -> list[str]:
        """The IPv4 addresses `name` resolves to upstream, as they are (the egress proxy's address check,
        tunnel.py, refuses a name with any forbidden one)."""
        reply = await self._forward(dns.message.make_query(name, dns.rdatatype.A))
        return [rd.address for rrset in reply.answer if rrset.rdtype == dns.rdatatype.A for rd in rrset]

    def _answered(self, source: str, query: dns.message.Message, addresses: list[str], rcode: str) -> None:
        if self.on_answered is not None:
            q = query.question[0]
            self.on_answered(source, q.name.to_text(omit_final_dot=True), dns.rdatatype.to_text(q.rdtype),
                             addresses[:32], rcode)

    async def _forward(self, query: dns.message.Message) -> dns.message.Message:
        if self.make_socket is None:
            reply = await dns.asyncquery.udp(query, self.upstream[0], timeout=UPSTREAM_TIMEOUT_S,
                                             port=self.upstream[1])
            if reply.flags & dns.flags.TC:
                reply = await dns.asyncquery.tcp(query, self.upstream[0], timeout=UPSTREAM_TIMEOUT_S,
                                                 port=self.upstream[1])
            return reply
        family = socket.AF_INET6 if ":" in self.upstream[0] else socket.AF_INET
        async with asyncio.timeout(UPSTREAM_TIMEOUT_S):
            reply = await self._exchange(query, await self.make_socket(family, socket.SOCK_DGRAM))
            if reply.flags & dns.flags.TC:  # too big for a datagram: ask again over TCP
                reply = await self._exchange(query, await self.make_socket(family, socket.SOCK_STREAM))
            return reply

    async def _exchange(self, query: dns.message.Message, sock: socket.socket) -> dns.message.Message:
        loop = asyncio.get_running_loop()
        stream = sock.type == socket.SOCK_STREAM
        try:
            sock.setblocking(False)
            if stream:
                await loop.sock_connect(sock, self.upstream)
                wire = query.to_wire()
                await loop.sock_sendall(sock, struct.pack("!H", len(wire)) + wire)
            else:
                sock.connect(self.upstream)  # the kernel drops datagrams from anyone else
                await loop.sock_sendall(sock, query.to_wire())
            while True:
                if stream:
                    (length,) = struct.unpack("!H", await _recv_exactly(loop, sock, 2))
                    data = await _recv_exactly(loop, sock, length)
                else:
                    data = await loop.sock_recv(sock, 65535)
                try:
                    reply = dns.message.from_wire(data)
                except dns.exception.DNSException:
                    if stream:
                        raise
                    continue
                if query.is_response(reply):
                    return reply
        finally:
            sock.close()

    def _screen(self, rrsets: list[dns.rrset.RRset], source: str,
                asked: dns.name.Name) -> tuple[list[dns.rrset.RRset], list[Pin]]:
        """The answer minus records into the never-list, and the pins for what stays."""
        kept, pins = [], []
        name = asked.to_text(omit_final_dot=True)
        for rrset in rrsets:
            if rrset.rdtype not in (dns.rdatatype.A, dns.rdatatype.AAAA):
                kept.append(rrset)
                continue
            good = [rd for rd in rrset if ipaddress.ip_address(rd.address) not in self.never]
            if len(good) != len(rrset):
                log.info("dropped %d record(s) of %s into private ranges (rebinding?) for %s",
                         len(rrset) - len(good), rrset.name, source)
            if not good:
                continue
            seconds = min(max(rrset.ttl, PIN_MIN_S), PIN_MAX_S)
            pins += [(ipaddress.ip_address(rd.address), seconds, name) for rd in good]
            if len(good) == len(rrset):
                kept.append(rrset)
            else:
                kept.append(dns.rrset.from_rdata_list(rrset.name, rrset.ttl, good))
        return kept, pins


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise ConnectionError("the upstream closed the connection")
        buf += chunk
    return buf


def _parse_query(data: bytes) -> dns.message.Message | None:
    try:
        query = dns.message.from_wire(data)
    except dns.exception.DNSException:
        return None
    if query.flags & dns.flags.QR or len(query.question) != 1:
        return None
    return query


def _refused(query: dns.message.Message, why: str) -> dns.message.Message:
    r = dns.message.make_response(query)
    r.set_rcode(dns.rcode.REFUSED)
    if query.edns >= 0:
        r.use_edns(0, options=[dns.edns.EDEOption(dns.edns.EDECode.BLOCKED, why[:200])])
    return r


def _stand_in_answer(query: dns.message.Message, address: str) -> dns.message.Message:
    """`address` for an A query (a short TTL); no records for any other type ("": NOERROR, the name exists)."""
    r = dns.message.make_response(query)
    q = query.question[0]
    if address:
        r.answer.append(dns.rrset.from_text(q.name, STAND_IN_TTL, "IN", "A", address))
    return r


def _servfail(query: dns.message.Message) -> dns.message.Message:
    r = dns.message.make_response(query)
    r.set_rcode(dns.rcode.SERVFAIL)
    return r


async def serve(host: str, port: int, resolver: PolicyResolver) -> asyncio.DatagramTransport:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: resolver, local_addr=(host, port))
    return transport


async def serve_tcp(resolver: PolicyResolver, *, sock: socket.socket | None = None, host: str | None = None,
                    port: int | None = None) -> asyncio.Server:
    """DNS over TCP (RFC 7766: two-byte length, queries in order), for answers a datagram cannot hold."""
    clients = resolver.tcp_clients

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = writer.get_extra_info("peername")[0]
        if source in resolver._forgotten or not clients.take(source):
            writer.close()
            return
        task = asyncio.current_task()
        if task is not None:
            resolver._track(source, task)  # type: ignore[arg-type]
        try:
            while True:
                async with asyncio.timeout(TCP_IDLE_S):
                    (length,) = struct.unpack("!H", await reader.readexactly(2))
                    data = await reader.readexactly(length)
                query = _parse_query(data)
                if query is None:
                    return
                response = await resolver.answer(query, source)
                if response is None:
                    return
                wire = response.to_wire(max_size=65535)
                writer.write(struct.pack("!H", len(wire)) + wire)
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, OSError):
            pass
        except asyncio.CancelledError:  # forget(): its sandbox is gone
            writer.transport.abort()
        finally:
            clients.give(source)
            writer.close()

    if sock is not None:
        return await asyncio.start_server(handle, sock=sock, limit=1 << 16)
    return await asyncio.start_server(handle, host, port, limit=1 << 16)
