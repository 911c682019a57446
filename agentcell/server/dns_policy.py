"""The egress DNS resolver: a sandbox's only resolver, answering only the names its policy allows.

A building block of issue 7 (docs/network.md), not yet serving sandboxes. Why a resolver of our own:
- A name the policy does not allow is answered here (REFUSED, with RFC 8914's "Blocked") and never
  forwarded. A query is itself a message to whoever runs that name's authoritative server, so
  forwarding it would leak data to a domain the policy denies.
- Each address it answers for an allowed name is *pinned* for that sandbox (`pin`), so that the router
  lets the sandbox reach exactly the addresses its allowed names resolved to. The later SNI/Host check
  compares against the name the address was pinned for.
- An answer pointing into the never-list (DNS rebinding: an allowed name that resolves to 10.0.0.5 or
  169.254.169.254) loses those records and pins nothing there.

UDP only so far: an answer too big for a datagram comes back truncated, and the client's TCP retry has
no listener yet.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import dns.asyncquery
import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset

from agentcell.backends.linux.egress import NEVER_V4, NEVER_V6

log = logging.getLogger("agentcell.dns")

PIN_MIN_S = 30  # a pin outlives a tiny TTL: clients cache answers longer than they say
PIN_MAX_S = 3600
UPSTREAM_TIMEOUT_S = 2.0
MAX_PENDING = 256  # queries being forwarded at once, all sandboxes together; more are dropped

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


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


_NEVER = [ipaddress.ip_network(n) for n in (*NEVER_V4, *NEVER_V6)]


def never(addr: Address) -> bool:
    """An address no sandbox may be pointed at: the router's never-list, seen from the resolver."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return never(addr.ipv4_mapped)
    return any(addr in net for net in _NEVER)


class PolicyResolver(asyncio.DatagramProtocol):
    """Answers queries from sandboxes. `rules_for(source ip)` gives the sandbox's DomainRules (None:
    a stranger, or a sandbox without internet); `pin(source ip, address, seconds, name)` is called for
    every address answered."""

    def __init__(self, upstream: tuple[str, int], rules_for: Callable[[str], DomainRules | None],
                 pin: Callable[[str, Address, int, str], None]) -> None:
        self.upstream = upstream
        self.rules_for = rules_for
        self.pin = pin
        self.transport: asyncio.DatagramTransport | None = None
        self.pending: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            query = dns.message.from_wire(data)
        except dns.exception.DNSException:
            return  # not DNS: no answer (an answer to junk helps nobody but a reflector)
        if query.flags & dns.flags.QR or len(query.question) != 1:
            return
        if len(self.pending) >= MAX_PENDING:
            return  # the client retries; a flood does not grow the server
        task = asyncio.ensure_future(self._answer(query, addr))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _answer(self, query: dns.message.Message, addr: tuple[str, int]) -> None:
        source = addr[0]
        name = query.question[0].name
        rules = self.rules_for(source)
        if rules is None or not rules.allows(name):
            self._send(_refused(query, f"agentcell: {name.to_text(omit_final_dot=True)} is not allowed here"), addr)
            return
        forwarded = dns.message.make_query(name, query.question[0].rdtype, query.question[0].rdclass)
        try:
            reply = await dns.asyncquery.udp(forwarded, self.upstream[0], timeout=UPSTREAM_TIMEOUT_S,
                                             port=self.upstream[1])
        except (dns.exception.DNSException, OSError) as e:
            log.debug("upstream failed for %s: %s", name, e)
            self._send(_servfail(query), addr)
            return
        response = dns.message.make_response(query)
        response.set_rcode(reply.rcode())
        response.flags |= reply.flags & dns.flags.RA
        response.answer = self._screen(reply.answer, source, name)
        self._send(response, addr)

    def _screen(self, rrsets: list[dns.rrset.RRset], source: str, asked: dns.name.Name) -> list[dns.rrset.RRset]:
        """The answer minus records into the never-list; pins what stays."""
        kept = []
        for rrset in rrsets:
            if rrset.rdtype not in (dns.rdatatype.A, dns.rdatatype.AAAA):
                kept.append(rrset)
                continue
            good = [rd for rd in rrset if not never(ipaddress.ip_address(rd.address))]
            if len(good) != len(rrset):
                log.info("dropped %d record(s) of %s into private ranges (rebinding?) for %s",
                         len(rrset) - len(good), rrset.name, source)
            if not good:
                continue
            seconds = min(max(rrset.ttl, PIN_MIN_S), PIN_MAX_S)
            for rd in good:
                self.pin(source, ipaddress.ip_address(rd.address), seconds, asked.to_text(omit_final_dot=True))
            if len(good) == len(rrset):
                kept.append(rrset)
            else:
                kept.append(dns.rrset.from_rdata_list(rrset.name, rrset.ttl, good))
        return kept

    def _send(self, message: dns.message.Message, addr: tuple[str, int]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(message.to_wire(max_size=512 if message.edns < 0 else 1232,
                                                  prefer_truncation=True), addr)


def _refused(query: dns.message.Message, why: str) -> dns.message.Message:
    r = dns.message.make_response(query)
    r.set_rcode(dns.rcode.REFUSED)
    if query.edns >= 0:
        r.use_edns(0, options=[dns.edns.EDEOption(dns.edns.EDECode.BLOCKED, why[:200])])
    return r


def _servfail(query: dns.message.Message) -> dns.message.Message:
    r = dns.message.make_response(query)
    r.set_rcode(dns.rcode.SERVFAIL)
    return r


async def serve(host: str, port: int, resolver: PolicyResolver) -> asyncio.DatagramTransport:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: resolver, local_addr=(host, port))
    return transport
