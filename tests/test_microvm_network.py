"""MicroVM sandboxes' network, end to end: a microvm server (QEMU under TCG, one standby) whose egress
uplink leads into the tests' "internet" (tests/egress_internet.py: documentation and forbidden
addresses in a namespace with no route anywhere else), real guests probing it from inside.

Each VM's NIC is a TAP device on the linux backend's egress router (network/router.py: connect_tap),
so the same policy, resolver, never-list and secrets hold; these tests check that they do for guests,
which have a kernel (and a root) of their own.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Iterator

import pytest

from agentcell import Sandbox
from tests import egress_internet
from tests.conftest import ServerProcess
from tests.egress_internet import FORBIDDEN, INTERNET_LOG, OTHER, WEB, ask, internet_server, probed

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/net/tun"), reason="needs /dev/net/tun")


@pytest.fixture(scope="module")
def vm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # a microvm server's start boots its template (and may build a root image): minutes under a busy TCG
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(egress_internet, "ServerProcess", functools.partial(ServerProcess, start_timeout=600))
        with internet_server(tmp_path_factory, "--backend", "microvm", "--accel", "tcg", "--standbys", "1") as server:
            yield server


@pytest.fixture
def make(vm_server: ServerProcess) -> Iterator:
    made: list[Sandbox] = []

    def create(**kwargs: object) -> Sandbox:
        sbx = Sandbox.create(api_url=vm_server.url, timeout=600, request_timeout=300, **kwargs)  # type: ignore[arg-type]
        made.append(sbx)
        return probed(sbx)

    yield create
    for sbx in made:
        sbx.kill()


def test_internet_on_and_off(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make()
    assert ask(sbx, f"tcp('{WEB}')") == "ok"
    assert ask(sbx, "tcp('allowed.test')") == "ok"  # the router's resolver, from the guest's resolv.conf
    assert ask(sbx, "get('http://other.test/')").startswith(f"hello from {OTHER} host=other.test")
    assert ask(sbx, "my_address()").startswith("10.77.")  # its link's sandbox side, set at its identity
    off = make(allow_internet_access=False)
    assert ask(off, f"tcp('{WEB}')") != "ok"
    t = time.monotonic()
    ask(off, "1")
    round_trip = time.monotonic() - t  # a run_code under TCG on a busy host: seconds, sometimes
    t = time.monotonic()
    assert ask(off, "names('allowed.test')") == "noname"  # refused at once, not a timeout (>= 4 s here)
    assert time.monotonic() - t < round_trip + 2.0
    assert off.get_info().allow_internet_access is False


def test_allow_and_deny_rules_and_updates(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make(network={"allow_out": ["allowed.test"]})
    assert ask(sbx, f"tcp('{WEB}')") != "ok"  # a raw IP not answered for an allowed name
    assert ask(sbx, "names('allowed.test')") == f"['{WEB}']"
    assert ask(sbx, "tcp('allowed.test')") == "ok"
    assert ask(sbx, "names('other.test')") == "noname"
    assert ask(sbx, f"tcp('{OTHER}')") != "ok"
    assert ask(sbx, f"http_as('{WEB}', 'denied.test')") == "HTTP/1.1 403 Forbidden"  # Host checked by the proxy
    sbx.update_network({"deny_out": [f"{WEB}/32"]})
    assert ask(sbx, f"tcp('{WEB}')") != "ok"
    assert ask(sbx, f"tcp('{OTHER}')") == "ok"
    sbx.update_network({"allow_internet_access": False})
    assert ask(sbx, f"tcp('{OTHER}')") != "ok"


def test_the_never_list_holds_for_a_guest(make, vm_server: ServerProcess) -> None:  # type: ignore[no-untyped-def]
    sbx = make()
    for addr in FORBIDDEN:  # private, link-local (metadata), CGNAT: each one answers in the internet
        assert ask(sbx, f"tcp('{addr}')") != "ok", addr
    assert ask(sbx, "tcp('10.77.255.254', 22)") != "ok"  # the router itself: DNS only
    default = "[f[2] for f in map(str.split, open('/proc/net/route').readlines()[1:]) if f[1] == '00000000']"
    gateway = socket.inet_ntoa(bytes.fromhex(eval(ask(sbx, default))[0])[::-1])
    assert gateway.startswith("10.77.")  # its link's router side
    for port in (22, 53, 80):
        assert ask(sbx, f"tcp('{gateway}', {port})") != "ok", port
    # the host: the server's own port on each of the host's addresses
    host_addrs = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    for addr in host_addrs | {"127.0.0.1"}:
        assert ask(sbx, f"tcp('{addr}', {vm_server.port})") != "ok", addr


def test_other_sandboxes_are_unreachable(make) -> None:  # type: ignore[no-untyped-def]
    a, b = make(), make()
    addr_a, addr_b = ask(a, "my_address()"), ask(b, "my_address()")
    assert addr_a != addr_b  # clones of one template, each with its own link's address
    # the NIC's MAC by SIOCGIFHWADDR (a sandbox has no /sys)
    mac = ("__import__('fcntl').ioctl(__import__('socket').socket(2, 2), 0x8927, b'eth0'.ljust(40, b'\\0'))"
           "[18:24].hex(':')")
    assert ask(a, mac) != ask(b, mac)
    listen = ("import socket, threading\nlistener = socket.create_server(('0.0.0.0', 8000))\n"
              "threading.Thread(target=lambda: [listener.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()")
    assert b.run_code(listen).error is None
    connect = "connected('{}')"
    for sbx in (a, b):
        assert sbx.run_code(CONNECTED).error is None
    assert ask(b, connect.format(addr_b)) == "ok"  # b serves on its own address
    assert ask(a, connect.format(addr_b)) != "ok"  # a cannot reach it


CONNECTED = '''
def connected(host, port=8000):
    try:
        socket.create_connection((host, port), timeout=2).close()
        return "ok"
    except OSError as e:
        return type(e).__name__
'''
ALIAS = r'''
import fcntl, socket, struct
s = socket.socket()
ifr = struct.pack("16sH2s4s8s", b"eth0:1", socket.AF_INET, b"\0\0", socket.inet_aton("%s"), b"\0" * 8)
try:
    fcntl.ioctl(s, 0x8916, ifr)  # SIOCSIFADDR
    print("taken")
except OSError as e:
    print(type(e).__name__)
'''


def test_a_guest_root_cannot_take_another_address(make) -> None:  # type: ignore[no-untyped-def]
    """Its root (sudo: the guest kernel's root) cannot put another address on eth0, by netlink or by
    ioctl; past a guest kernel exploit, the router forwards only what carries the link's address."""
    a, b = make(), make()
    addr_b = ask(b, "my_address()")
    a.files.write("/tmp/alias.py", ALIAS % addr_b)
    r = a.commands.run("sudo python3 /tmp/alias.py; sudo ip addr add 203.0.113.99/32 dev eth0; true")
    assert r.stdout.strip() == "PermissionError", r
    assert "Cannot open netlink socket" in r.stderr
    assert ask(a, "my_address()") != addr_b
    assert ask(a, f"tcp('{WEB}')") == "ok"


def test_secrets_are_substituted_by_the_host_and_never_reach_the_guest(make) -> None:  # type: ignore[no-untyped-def]
    value = "sk-live-" + os.urandom(12).hex()
    sbx = make(secrets={"API_KEY": {"value": value, "hosts": ["secret.test"]}})
    placeholder = ask(sbx, "__import__('os').environ['API_KEY']")
    assert placeholder and value not in placeholder
    auth = "'Bearer ' + __import__('os').environ['API_KEY']"
    got = ask(sbx, f"get_with('https://secret.test/v1/vm', {auth})")  # the guest trusts the proxy's CA
    assert got.split("|", 1)[0] == f"Bearer {placeholder}", got  # what the guest sent, echoed: the placeholder
    assert f"Bearer {value}".encode() in INTERNET_LOG.read_bytes()  # what the internet got: the value
    # to a host the secret is not for, the placeholder goes as it is
    other = ask(sbx, f"get_with('https://other.test/v1/vm', {auth})")
    assert value not in other
    found = sbx.commands.run(f"grep -rl {value} /etc /tmp /home /run 2>/dev/null; true").stdout
    assert found.strip() == ""


def test_a_fork_takes_its_own_link_and_keeps_its_policy(make) -> None:  # type: ignore[no-untyped-def]
    parent = make(network={"deny_out": [f"{OTHER}/32"]})
    forks = parent.fork(count=1, request_timeout=600)
    child = forks[0]
    assert isinstance(child, Sandbox), child
    try:
        assert ask(child, "my_address()") != ask(parent, "my_address()")  # a clone of its memory, its own address
        assert ask(child, f"tcp('{WEB}')") == "ok"
        assert ask(child, f"tcp('{OTHER}')") != "ok"  # its parent's policy, on its own link
        assert ask(parent, f"tcp('{WEB}')") == "ok"
    finally:
        child.kill()
