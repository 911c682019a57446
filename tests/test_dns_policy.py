"""The egress DNS resolver (network/resolver.py), between a client and a fake upstream, on loopback.

The upstream is a real DNS server (dnspython on a UDP socket) that logs every query it gets, so the
tests can assert that a name the policy refuses never left the resolver.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import dns.asyncquery
import dns.edns
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
import pytest_asyncio

from agentcell.network.resolver import DomainRules, Pin, PolicyResolver, RuleError, serve, serve_tcp

ZONE = {  # name -> (type, value)
    "allowed.example.": ("A", "203.0.113.10"),
    "api.wild.example.": ("A", "198.51.100.7"),
    "wild.example.": ("A", "198.51.100.8"),
    "secret.example.": ("A", "203.0.113.66"),
    "rebind.example.": ("A", "10.1.2.3"),
    "meta.example.": ("A", "169.254.169.254"),
    "v6.example.": ("AAAA", "2001:db8::10"),
}


class Upstream(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.seen: list[str] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        q = dns.message.from_wire(data)
        name = q.question[0].name.to_text().lower()
        self.seen.append(name)
        r = dns.message.make_response(q)
        if name in ZONE:
            kind, value = ZONE[name]
            if dns.rdatatype.from_text(kind) == q.question[0].rdtype:
                r.answer.append(dns.rrset.from_text(name, 5, "IN", kind, value))
                if name == "rebind.example.":  # one good record next to the private one
                    r.answer[0].add(dns.rrset.from_text(name, 5, "IN", "A", "203.0.113.77")[0])
        else:
            r.set_rcode(dns.rcode.NXDOMAIN)
        assert self.transport is not None
        if name.startswith("slow"):  # an upstream that takes its time
            asyncio.get_running_loop().call_later(1.5, self.transport.sendto, r.to_wire(), addr)
        else:
            self.transport.sendto(r.to_wire(), addr)


@dataclass
class Setup:
    port: int
    upstream: Upstream
    rules: dict[str, DomainRules | None]
    pins: list[tuple[str, str, int, str]] = field(default_factory=list)
    tcp_port: int = 0

    async def ask(self, name: str, kind: str = "A", edns: bool = True) -> dns.message.Message:
        q = dns.message.make_query(name, kind, use_edns=0 if edns else False)
        return await dns.asyncquery.udp(q, "127.0.0.1", port=self.port, timeout=3)


@pytest_asyncio.fixture
async def setup() -> AsyncIterator[Setup]:
    loop = asyncio.get_running_loop()
    upstream = Upstream()
    up_transport, _ = await loop.create_datagram_endpoint(lambda: upstream, local_addr=("127.0.0.1", 0))
    up_port = up_transport.get_extra_info("sockname")[1]
    rules: dict[str, DomainRules | None] = {"127.0.0.1": DomainRules(), "127.0.0.2": DomainRules()}
    s = Setup(0, upstream, rules)
    async def pin(src: str, pins: list[Pin]) -> None:
        s.pins.extend((src, str(addr), secs, name) for addr, secs, name in pins)

    made: list[int] = []

    async def make_socket(family: int, kind: int) -> socket.socket:  # how the server makes them in the router
        made.append(kind)
        return socket.socket(family, kind)

    resolver = PolicyResolver(("127.0.0.1", up_port), lambda ip: rules.get(ip), pin, make_socket)
    transport = await serve("127.0.0.1", 0, resolver)
    s.port = transport.get_extra_info("sockname")[1]
    tcp = await serve_tcp(resolver, host="127.0.0.1", port=0)
    s.tcp_port = tcp.sockets[0].getsockname()[1]
    try:
        yield s
    finally:
        tcp.close()
        transport.close()
        up_transport.close()


async def test_an_allowed_name_is_answered_and_pinned(setup: Setup) -> None:
    setup.rules["127.0.0.1"] = DomainRules(allow=["allowed.example"])
    r = await setup.ask("allowed.example")
    assert r.rcode() == dns.rcode.NOERROR
    assert [rd.address for rd in r.answer[0]] == ["203.0.113.10"]
    assert setup.pins == [("127.0.0.1", "203.0.113.10", 30, "allowed.example")]  # TTL 5 s, pinned 30 s


async def test_a_refused_name_never_leaves(setup: Setup) -> None:
    setup.rules["127.0.0.1"] = DomainRules(allow=["allowed.example"])
    r = await setup.ask("secret.example")
    assert r.rcode() == dns.rcode.REFUSED
    ede = [o for o in r.options if isinstance(o, dns.edns.EDEOption)]
    assert ede and ede[0].code == dns.edns.EDECode.BLOCKED
    exfil = await setup.ask("c2VjcmV0.secret.example", "TXT", edns=False)
    assert exfil.rcode() == dns.rcode.REFUSED
    assert setup.upstream.seen == [] and setup.pins == []


async def test_wildcards_deny_and_case(setup: Setup) -> None:
    setup.rules["127.0.0.1"] = DomainRules(allow=["*.wild.example", "Allowed.Example."], deny=["secret.example"])
    assert (await setup.ask("API.wild.example")).rcode() == dns.rcode.NOERROR
    assert (await setup.ask("wild.example")).rcode() == dns.rcode.REFUSED  # a wildcard is not its apex
    assert (await setup.ask("allowed.example.")).rcode() == dns.rcode.NOERROR
    setup.rules["127.0.0.1"] = DomainRules(deny=["*.wild.example"])  # no allow list: all but the denied
    assert (await setup.ask("api.wild.example")).rcode() == dns.rcode.REFUSED
    assert (await setup.ask("secret.example")).rcode() == dns.rcode.NOERROR
    setup.rules["127.0.0.1"] = DomainRules(allow=["secret.example"], deny=["secret.example"])
    assert (await setup.ask("secret.example")).rcode() == dns.rcode.REFUSED  # deny wins


async def test_rebinding_answers_lose_their_private_records(setup: Setup) -> None:
    r = await setup.ask("rebind.example")
    assert [rd.address for rd in r.answer[0]] == ["203.0.113.77"]
    assert [p[1] for p in setup.pins] == ["203.0.113.77"]
    r = await setup.ask("meta.example")
    assert r.rcode() == dns.rcode.NOERROR and r.answer == []
    assert "169.254.169.254" not in [p[1] for p in setup.pins]


async def test_ipv6_answers_and_unknown_names(setup: Setup) -> None:
    r = await setup.ask("v6.example", "AAAA")
    assert [rd.address for rd in r.answer[0]] == ["2001:db8::10"]
    assert ipaddress.ip_address(setup.pins[-1][1]) == ipaddress.ip_address("2001:db8::10")
    assert (await setup.ask("nowhere.example")).rcode() == dns.rcode.NXDOMAIN


async def test_strangers_and_junk(setup: Setup) -> None:
    setup.rules["127.0.0.1"] = None  # a sandbox without internet (or an address that is no sandbox)
    assert (await setup.ask("allowed.example")).rcode() == dns.rcode.REFUSED
    assert setup.upstream.seen == []
    loop = asyncio.get_running_loop()
    got: asyncio.Future[bytes] = loop.create_future()

    class Client(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            if not got.done():
                got.set_result(data)

    transport, _ = await loop.create_datagram_endpoint(Client, remote_addr=("127.0.0.1", setup.port))
    try:
        transport.sendto(b"\x00not dns at all")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(got), 0.3)  # junk gets no answer (no reflection)
    finally:
        transport.close()
    setup.rules["127.0.0.1"] = DomainRules()
    assert (await setup.ask("allowed.example")).rcode() == dns.rcode.NOERROR  # still serving


async def test_tcp_queries_follow_the_same_rules(setup: Setup) -> None:
    setup.rules["127.0.0.1"] = DomainRules(allow=["allowed.example"])
    ok = await dns.asyncquery.tcp(dns.message.make_query("allowed.example", "A"), "127.0.0.1",
                                  port=setup.tcp_port, timeout=3)
    assert [rd.address for rd in ok.answer[0]] == ["203.0.113.10"]
    no = await dns.asyncquery.tcp(dns.message.make_query("secret.example", "A"), "127.0.0.1",
                                  port=setup.tcp_port, timeout=3)
    assert no.rcode() == dns.rcode.REFUSED
    assert setup.upstream.seen == ["allowed.example."]


async def test_one_sandboxs_flood_does_not_starve_another(setup: Setup) -> None:
    loop = asyncio.get_running_loop()
    flood = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    flood.bind(("127.0.0.1", 0))
    try:
        for i in range(400):  # more than the resolver's whole budget, each held 1.5 s by the upstream
            flood.sendto(dns.message.make_query(f"slow{i}.example", "A").to_wire(), ("127.0.0.1", setup.port))
        await asyncio.sleep(0.2)
        q = dns.message.make_query("allowed.example", "A")
        t = loop.time()
        r = await dns.asyncquery.udp(q, "127.0.0.1", port=setup.port, timeout=1, source="127.0.0.2")
        assert r.rcode() == dns.rcode.NOERROR and loop.time() - t < 0.5
        assert sum(1 for n in setup.upstream.seen if n.startswith("slow")) <= 32  # one source's share
    finally:
        flood.close()


def test_bad_rules_are_refused() -> None:
    for bad in ("", "*", "*.", "a..b", "exa*mple.com", "x" * 300):
        with pytest.raises(RuleError):
            DomainRules(allow=[bad])
    assert DomainRules(allow=["bücher.example"]).allows(dns.name.from_text("xn--bcher-kva.example."))
