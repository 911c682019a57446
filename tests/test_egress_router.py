"""The egress router (network/router.py) against an "internet" this test builds.

Everything lives in network namespaces created here: a router, two stand-ins for sandbox namespaces,
and an "internet" namespace on documentation ranges that also answers on private, CGNAT, link-local
and metadata addresses. The router's only route leads to that namespace, so nothing can leave the
machine; and since the route would carry those forbidden addresses too, a refusal proves the rules
work, not a missing route. The host's own links, addresses, routes and ruleset must be unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from agentcell.network.policy import NetworkPolicy, PolicyError
from agentcell.network.router import RESOLVER, Router, link_addresses
from tests.egress_world import router_world


def Policy(internet: bool, allow: list[str] | None = None, deny: list[str] | None = None) -> NetworkPolicy:
    return NetworkPolicy.parse(internet, allow or (), deny or ())

TAG = f"actest{os.getpid() % 100000}"
INET, SBX1, SBX2 = f"{TAG}-inet", f"{TAG}-s1", f"{TAG}-s2"
WEB, OTHER_WEB = "203.0.113.10", "198.51.100.20"
FORBIDDEN = ("10.1.2.3", "169.254.169.254", "192.168.7.7", "100.64.1.1", "172.16.5.5")
PORT = 8080

REACH = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
    print("ok" if s.recv(12).startswith(b"HTTP/1.") else "junk")
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print(type(e).__name__)
"""


def reach(ns: str, ip: str, port: int = PORT, timeout: float = 0.5) -> str:
    r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", REACH, ip, str(port), str(timeout)],
                       capture_output=True, text=True, check=False)
    return r.stdout.strip() or r.stderr.strip()


@pytest.fixture(scope="module")
def net() -> Iterator[Router]:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    with router_world(TAG, (WEB, OTHER_WEB, *FORBIDDEN)) as world:
        world.spawn(INET, "-m", "http.server", str(PORT), "--bind", "0.0.0.0")
        world.spawn(SBX2, "-m", "http.server", str(PORT), "--bind", "0.0.0.0")
        deadline = time.monotonic() + 10
        while reach(INET, WEB) != "ok" and time.monotonic() < deadline:
            time.sleep(0.1)
        yield world.router


def test_a_new_link_is_closed(net: Router) -> None:
    net.set_policy(1, Policy(internet=False))
    assert reach(SBX1, WEB) != "ok"


def test_internet_reaches_public_addresses_only(net: Router) -> None:
    net.set_policy(1, Policy(internet=True))
    assert reach(SBX1, WEB) == "ok"
    assert reach(SBX1, OTHER_WEB) == "ok"
    for addr in FORBIDDEN:
        assert reach(SBX1, addr) != "ok", addr
    ours, _ = link_addresses(1)
    assert reach(SBX1, ours) != "ok"  # the router itself
    _, neighbour = link_addresses(2)
    net.set_policy(2, Policy(internet=True))
    assert reach(SBX1, neighbour) != "ok"  # another sandbox, though both have internet
    assert reach(SBX2, WEB) == "ok"


def test_deny_and_allow_lists(net: Router) -> None:
    net.set_policy(1, Policy(internet=True, deny=[f"{WEB}/32"]))
    assert reach(SBX1, WEB) != "ok"
    assert reach(SBX1, OTHER_WEB) == "ok"
    net.set_policy(1, Policy(internet=True, allow=[OTHER_WEB]))
    assert reach(SBX1, OTHER_WEB) == "ok"
    assert reach(SBX1, WEB) != "ok"  # an allow list closes everything else
    net.set_policy(1, Policy(internet=True, allow=["10.0.0.0/8"]))
    assert reach(SBX1, "10.1.2.3") != "ok"  # the never-list comes first


def test_a_policy_change_holds_for_the_next_connection(net: Router) -> None:
    net.set_policy(1, Policy(internet=True))
    assert reach(SBX1, WEB) == "ok"
    t = time.monotonic()
    net.set_policy(1, Policy(internet=False))
    took = time.monotonic() - t
    assert reach(SBX1, WEB) != "ok"
    assert took < 0.1, f"set_policy took {took * 1000:.0f} ms"
    net.disconnect(2)
    assert reach(SBX2, WEB) != "ok"


def test_a_tunneled_link_never_forwards_tcp_even_with_no_proxy_listening(net: Router) -> None:
    """network.egressProxy fails closed at the router: its TCP goes to the proxy's socket or nowhere
    (no proxy process runs in this world: tproxy finds no socket, and the forward chain drops it)."""
    for policy in (Policy(internet=True), Policy(internet=True, allow=[WEB])):
        net.set_policy(1, policy)
        assert reach(SBX1, WEB) == "ok"
        net.set_policy(1, policy, tunnel=True)
        assert reach(SBX1, WEB) == "TimeoutError", policy
    net.set_policy(1, Policy(internet=True))
    assert reach(SBX1, WEB) == "ok"  # the tunnel gone: direct again


def test_deny_all_with_an_allow_list_is_e2bs_idiom(net: Router) -> None:
    net.set_policy(1, Policy(internet=True, allow=[OTHER_WEB], deny=["0.0.0.0/0"]))
    assert reach(SBX1, OTHER_WEB) == "ok"
    assert reach(SBX1, WEB) != "ok"
    net.set_policy(1, Policy(internet=True, allow=["198.51.100.0/24"], deny=[f"{OTHER_WEB}/32"]))
    assert reach(SBX1, OTHER_WEB) != "ok"  # a narrower deny wins over an allow
    net.set_policy(1, Policy(internet=True, deny=["0.0.0.0/0"]))
    assert reach(SBX1, WEB) != "ok" and reach(SBX1, OTHER_WEB) != "ok"


def test_pins_open_one_address_for_a_while(net: Router) -> None:
    net.set_policy(1, Policy(internet=True, allow=["allowed.example"]))
    assert reach(SBX1, WEB) != "ok"  # a domain-only allow list: no raw IP
    net.nft(Router.pin_commands(1, [(WEB, 2)]))
    assert reach(SBX1, WEB) == "ok"
    assert reach(SBX1, OTHER_WEB) != "ok"
    net.nft(Router.pin_commands(1, [(WEB, 1)]))  # re-pinning sets the new timeout
    time.sleep(1.6)
    assert reach(SBX1, WEB) != "ok"


def test_spoofed_sources_and_the_router_itself(net: Router) -> None:
    net.set_policy(1, Policy(internet=True))
    ours, _ = link_addresses(1)
    _, neighbour = link_addresses(2)
    # sandbox 1 (root in its own namespace) takes its neighbour's address: the router drops it
    subprocess.run(["ip", "-n", SBX1, "addr", "add", f"{neighbour}/32", "dev", "eth0"], check=True)
    try:
        r = subprocess.run(["ip", "netns", "exec", SBX1, sys.executable, "-c",
                            "import socket,sys\ns=socket.socket()\ns.bind((sys.argv[1],0))\ns.settimeout(0.5)\n"
                            "try:\n s.connect((sys.argv[2],8080)); print('ok')\nexcept OSError as e: print(type(e).__name__)",
                            neighbour, WEB], capture_output=True, text=True, check=False)
        assert r.stdout.strip() != "ok"
    finally:
        subprocess.run(["ip", "-n", SBX1, "addr", "del", f"{neighbour}/32", "dev", "eth0"], check=True)
    assert reach(SBX1, WEB) == "ok"
    for port in (22, 53, 8080):
        assert reach(SBX1, RESOLVER, port) != "ok"


def test_bad_rules_are_refused() -> None:
    for bad in ("exa mple.com", "http://example.com", "1.2.3.4/40", "*", "999.1.1.1"):
        with pytest.raises(PolicyError):
            Policy(internet=True, allow=[bad])


def test_the_operator_can_open_a_private_range_and_nothing_of_its_own() -> None:
    import ipaddress

    from agentcell.network.router import EgressError, NeverList

    never = NeverList(["10.5.0.0/16", "fd00:ec2::/32"])
    assert ipaddress.ip_address("10.5.1.1") not in never
    assert ipaddress.ip_address("10.6.1.1") in never and ipaddress.ip_address("169.254.169.254") in never
    assert ipaddress.ip_address("::ffff:10.6.1.1") in never  # v4-mapped is checked as v4
    assert ipaddress.ip_address("fd00:ec2::254") not in never and ipaddress.ip_address("fd01::1") in never
    for ours in ("10.77.3.0/24", "100.127.0.0/24", "10.0.0.0/8"):
        with pytest.raises(EgressError, match="own links"):
            NeverList([ours])


FLOOD = """
import socket, sys, time
socks = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(); s.setblocking(False); s.connect_ex((sys.argv[1], 9)); socks.append(s)
time.sleep(0.4)
print(len(socks))
"""


def test_one_sandbox_cannot_fill_the_connection_table(net: Router) -> None:
    from agentcell.network.router import MAX_CONNECTIONS

    net.set_policy(1, Policy(internet=True))
    net.set_policy(2, Policy(internet=True))
    inet = ["ip", "netns", "exec", INET, "nft"]
    subprocess.run([*inet, "add table inet hole"], check=True)  # SYNs to port 9 vanish: connections stay open
    subprocess.run([*inet, "add chain inet hole in { type filter hook input priority 0; }"], check=True)
    subprocess.run([*inet, "add rule inet hole in tcp dport 9 tcp flags syn counter drop"], check=True)
    try:
        r = subprocess.run(["ip", "netns", "exec", SBX1, sys.executable, "-c", FLOOD, WEB, str(MAX_CONNECTIONS + 300)],
                           capture_output=True, text=True, check=True)
        assert r.stdout.strip() == str(MAX_CONNECTIONS + 300)
        counted = subprocess.run([*inet, "list chain inet hole in"], capture_output=True, text=True).stdout
        arrived = int(counted.split("packets ")[1].split()[0])
        assert MAX_CONNECTIONS - 50 <= arrived <= MAX_CONNECTIONS + 5, arrived  # the rest stopped at the router
        assert reach(SBX2, WEB) == "ok"  # the neighbour has its own budget
    finally:
        subprocess.run([*inet, "delete table inet hole"], check=False)
