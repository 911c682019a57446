"""Connection events (network/flow_events.py): conntrack and NFLOG read from the router namespace.

The network part builds, like tests/test_egress_router.py, a router namespace, two stand-ins for
sandbox namespaces and an "internet" namespace on documentation ranges that also answers on a
forbidden address (10.1.2.3): an HTTP server and a UDP echo. The router's only route leads there, so
nothing can leave the machine. The host's links, addresses, routes and ruleset must be unchanged and
every namespace made here gone at the end. The parsing part needs no network and no root.
"""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agentcell.network.flow_events import (
    EventCollector,
    EventsError,
    deny_log,
    deny_rules,
    enable_accounting,
    nflog_socket,
    parse_packet,
    slot_of,
)
from agentcell.network.policy import NetworkPolicy
from agentcell.network.router import Router, link_addresses
from tests.egress_world import router_world

TAG = f"acev{os.getpid() % 100000}"
INET, SBX1, SBX2 = f"{TAG}-inet", f"{TAG}-s1", f"{TAG}-s2"
WEB, OTHER_WEB, FORBIDDEN = "203.0.113.10", "198.51.100.20", "10.1.2.3"
PORT, UDP_PORT = 8080, 9999
BODY = b"x" * 20000  # the HTTP response body: bigger than one segment, so bytes_in is meaningful

HTTP = f"""
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"x" * {len(BODY)}
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("0.0.0.0", {PORT}), H).serve_forever()
"""

# bound to one address (argv[1]): a socket on 0.0.0.0 would answer from the uplink's address
UDP_ECHO = f"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], {UDP_PORT}))
while True:
    data, peer = s.recvfrom(2048)
    s.sendto(data, peer)
"""

# argv: ip port timeout -> prints "ok <bytes received>" or the error's name
GET = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    s.sendall(b"GET / HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    s.close()
    print("ok", len(got))
except OSError as e:
    print(type(e).__name__)
"""

# argv: ip port count -> sends `count` datagrams from one socket, prints how many echoes came back
UDP_SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[1], int(sys.argv[2])))
n = int(sys.argv[3])
for i in range(n):
    try:
        s.send(b"p%d" % i)
    except OSError:
        pass
s.settimeout(0.3)
got = 0
try:
    while True:
        s.recv(2048)
        got += 1
except OSError:
    pass
print(got)
"""


# argv: src dst dport -> one UDP datagram with a forged source address (raw socket, IP_HDRINCL)
SPOOF = """
import socket, struct, sys
src, dst, dport = socket.inet_aton(sys.argv[1]), socket.inet_aton(sys.argv[2]), int(sys.argv[3])
udp = struct.pack(">HHHH", 40000, dport, 8 + 4, 0) + b"ping"
ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0, src, dst)
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
s.sendto(ip + udp, (sys.argv[2], 0))
print("sent")
"""


def _ours() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(TAG)]


async def run_in(ns: str, script: str, *args: str) -> str:
    p = await asyncio.create_subprocess_exec("ip", "netns", "exec", ns, sys.executable, "-c", script, *args,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await p.communicate()
    return out.decode().strip() or err.decode().strip()


async def until(pred: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def net() -> Iterator[Router]:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    with router_world(TAG, (WEB, OTHER_WEB, FORBIDDEN)) as world:
        for args in ([HTTP], [UDP_ECHO, WEB], [UDP_ECHO, FORBIDDEN]):
            world.spawn(INET, "-c", *args)
        router = world.router
        router.set_policy(1, NetworkPolicy.parse(True, deny_out=[f"{OTHER_WEB}/32"]))
        router.set_policy(2, NetworkPolicy.parse(True))
        enable_accounting(router.path, tcp_time_wait=1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = subprocess.run(["ip", "netns", "exec", INET, sys.executable, "-c", GET, WEB, str(PORT), "1"],
                               capture_output=True, text=True, check=False)
            if r.stdout.startswith("ok"):
                break
            time.sleep(0.1)
        yield router
    assert not _ours(), "namespaces left behind"


class Collected:
    def __init__(self, router: Router) -> None:
        self.log: list[tuple[int, dict[str, Any]]] = []
        self.collector = EventCollector(lambda slot, event: self.log.append((slot, event)))
        self.collector.start(router.path, asyncio.get_running_loop())

    def events(self, slot: int, **match: Any) -> list[dict[str, Any]]:
        return [e for s, e in self.log if s == slot and all(e.get(k) == v for k, v in match.items())]


@pytest.fixture
async def col(net: Router) -> Any:
    c = Collected(net)
    try:
        yield c
    finally:
        c.collector.close()
    assert c.collector.stats["callback_errors"] == 0


# --- with real traffic -----------------------------------------------------------------------------


async def test_an_allowed_get_opens_then_closes_with_bytes(col: Collected) -> None:
    out = await run_in(SBX1, GET, WEB, str(PORT), "2")
    assert out.startswith("ok"), out
    received = int(out.split()[1])
    assert received > len(BODY)
    opened = await until(lambda: col.events(1, state="open", dst=WEB, dport=PORT))
    assert len(opened) == 1, col.events(1)
    ev = opened[0]
    assert ev["proto"] == "tcp" and ev["verdict"] == "allowed" and ev["src"] == link_addresses(1)[1]
    assert ev["bytes_in"] == 0 and isinstance(ev["time"], float) and abs(ev["time"] - time.time()) < 10
    # TIME_WAIT is 1 s in this router (enable_accounting(tcp_time_wait=1)); the DESTROY follows it
    closed = await until(lambda: col.events(1, state="closed", id=ev["id"]), timeout=15)
    assert len(closed) == 1, col.events(1)
    c = closed[0]
    assert (c["dst"], c["dport"], c["proto"], c["verdict"]) == (WEB, PORT, "tcp", "allowed")
    assert c["bytes_in"] >= received  # L3 bytes: the payload plus IP and TCP headers
    assert 0 < c["bytes_out"] < 2000  # the request, the handshake and the ACKs
    assert c["start"] is not None and c["stop"] is not None and c["stop"] >= c["start"]


async def test_a_forbidden_address_is_a_denied_event_naming_the_rule(col: Collected) -> None:
    assert not (await run_in(SBX1, GET, FORBIDDEN, str(PORT), "0.5")).startswith("ok")
    denied = await until(lambda: col.events(1, state="denied", dst=FORBIDDEN))
    assert denied, col.events(1)
    ev = denied[0]
    assert (ev["verdict"], ev["rule"], ev["proto"], ev["dport"]) == ("denied", "never4", "tcp", PORT)
    assert ev["bytes_in"] == ev["bytes_out"] == 0 and abs(ev["time"] - time.time()) < 10
    assert not col.events(1, state="open", dst=FORBIDDEN)  # never forwarded, so no conntrack entry
    # a sandbox's own deny list, logged by a rule in its chain
    assert not (await run_in(SBX1, GET, OTHER_WEB, str(PORT), "0.5")).startswith("ok")
    denied = await until(lambda: col.events(1, state="denied", dst=OTHER_WEB))
    assert denied and denied[0]["rule"] == "deny", col.events(1)


async def test_each_sandbox_has_its_own_events(col: Collected) -> None:
    out = await run_in(SBX2, GET, WEB, str(PORT), "2")
    assert out.startswith("ok"), out
    assert not (await run_in(SBX2, GET, FORBIDDEN, str(PORT), "0.5")).startswith("ok")
    assert await until(lambda: col.events(2, state="open", dst=WEB))
    assert await until(lambda: col.events(2, state="denied", dst=FORBIDDEN, rule="never4"))
    mine = link_addresses(2)[1]
    assert all(e["src"] == mine for e in col.events(2))
    assert not [e for e in col.events(1) if e["src"] == mine]


async def test_a_forged_source_makes_no_event_anywhere(col: Collected) -> None:
    # sandbox 1 forges sandbox 2's address: the router drops it before any rule that logs (its strict
    # reverse-path check), so nothing lands in the neighbour's log, allowed or denied
    neighbour = link_addresses(2)[1]
    for dst in (FORBIDDEN, WEB):
        assert await run_in(SBX1, SPOOF, neighbour, dst, "4321") == "sent"
    await asyncio.sleep(0.5)
    assert not [e for slot in (1, 2) for e in col.events(slot) if e.get("dport") == 4321]


async def test_udp_allowed_and_a_denied_flood(col: Collected, net: Router) -> None:
    # allowed (UDP needs an allow list naming it): the echoes come back and the flow is one open event
    net.set_policy(1, NetworkPolicy.parse(True, allow_out=[f"{WEB}/32"]))
    try:
        assert await run_in(SBX1, UDP_SEND, WEB, str(UDP_PORT), "20") == "20"
    finally:
        net.set_policy(1, NetworkPolicy.parse(True, deny_out=[f"{OTHER_WEB}/32"]))
    udp = await until(lambda: col.events(1, state="open", proto="udp", dst=WEB, dport=UDP_PORT))
    assert len(udp) == 1
    # denied: 5,000 datagrams; past the rate limit the packets are still dropped, and the log stays small
    t = time.monotonic()
    assert await run_in(SBX1, UDP_SEND, FORBIDDEN, str(UDP_PORT), "5000") == "0"
    took = time.monotonic() - t
    await asyncio.sleep(0.3)
    flood = col.events(1, state="denied", proto="udp", dst=FORBIDDEN)
    assert flood and flood[0]["rule"] == "never4" and flood[0]["dport"] == UDP_PORT
    for rule in ("never4", "too-many-connections"):  # past 1,000 new flows the per-link rate limit drops too
        logged = [e for e in flood if e["rule"] == rule]
        assert len(logged) <= 100 + 50 * (took + 1), (rule, len(logged), took)  # each its own burst + rate
    print(f"flood: {len(flood)} events for 5000 datagrams in {took:.2f} s; stats {col.collector.stats}")
    assert col.collector.stats["lost_nflog"] == 0


async def test_the_nflog_group_is_bound_once(col: Collected, net: Router) -> None:
    with pytest.raises(EventsError, match="bound by another socket"):
        nflog_socket(net.path)


def test_socket_overruns_are_counted_not_raised() -> None:
    import errno

    class Overrun:
        def __init__(self) -> None:
            self.calls = 0

        def recv(self, n: int) -> bytes:
            self.calls += 1
            if self.calls <= 2:
                raise OSError(errno.ENOBUFS, "No buffer space available")
            raise BlockingIOError

    c = EventCollector(lambda slot, ev: None)
    c._read(Overrun(), c._on_conntrack, "lost_conntrack")  # type: ignore[arg-type]
    assert c.stats["lost_conntrack"] == 2


# --- parsing, no network ----------------------------------------------------------------------------


def test_fragments_and_parsing() -> None:
    assert deny_log("never4") == ('ct state new limit rate 50/second burst 100 packets '
                                  'log prefix "acdeny:never4 " group 7')
    assert "meter m1 size 16384 { iifname limit rate" in deny_log("x", meter="m1")
    assert deny_rules("ip daddr 10.0.0.0/8", "n")[1] == "ip daddr 10.0.0.0/8 drop"
    for bad in ('a" drop', "", "x" * 49, "a b"):
        with pytest.raises(ValueError):
            deny_log(bad)
    assert slot_of("10.77.0.6") == 1 and slot_of("10.77.0.5") is None and slot_of("10.78.0.2") is None
    # the last /30 is the resolver's (egress.RESOLVER), no sandbox's: its address belongs to no slot
    assert slot_of("10.77.255.250") == 16382 and slot_of("10.77.255.254") is None
    assert slot_of("2001:db8::1") is None and slot_of("") is None
    v4 = bytes([0x45, 0, 0, 40, 0, 0, 0, 0, 64, 17, 0, 0, 10, 77, 0, 6, 203, 0, 113, 10]) + struct.pack(">HH", 5555, 53)
    assert parse_packet(v4) == {"src": "10.77.0.6", "dst": "203.0.113.10", "proto": "udp", "sport": 5555,
                                "dport": 53}
    v6 = (bytes([0x60, 0, 0, 0, 0, 8, 6, 64]) + bytes(16) + bytes.fromhex("20010db8" + "0" * 23 + "1")
          + struct.pack(">HH", 4444, 443))
    assert parse_packet(v6) == {"src": "::", "dst": "2001:db8::1", "proto": "tcp", "sport": 4444, "dport": 443}
    assert parse_packet(v4[:10]) is None and parse_packet(b"") is None
    assert parse_packet(v4[:20])["dport"] is None  # truncated: no ports
