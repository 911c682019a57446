"""The tests' "internet": one network namespace with web, HTTPS, DNS, DoT, UDP echo and QUIC-port
services (tests/internet_services.py) on documentation addresses, and the same services on forbidden
ones (private, CGNAT, link-local, metadata), and a real server whose egress uplink leads into it.

It has no route anywhere else, and the server's router has no route but into it: nothing can leave
this machine, and a refusal proves a rule, not a missing route. The host's links, addresses, routes and
ruleset must be unchanged afterwards. `internet_server()` builds both; PROBES is code a sandbox runs to
probe it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from agentcell import Sandbox
from agentcell.network.ca import EgressCA
from tests.egress_world import host_state as _host_state
from tests.egress_world import netns_service
from tests.servers import SERVER, ServerProcess

TAG = f"acegress{os.getpid() % 100000}"
INET = f"{TAG}-inet"
WEB, OTHER, WILD, DENIED_IP = "203.0.113.10", "198.51.100.20", "203.0.113.11", "203.0.113.12"
UPSTREAM_DNS, FOREIGN_DNS, ECHO = "198.51.100.53", "203.0.113.53", "203.0.113.30"
FORBIDDEN = ("10.1.2.3", "169.254.169.254", "192.168.7.7", "100.64.1.1", "172.16.5.5")
WEB6 = "2001:db8::10"
MIRROR = "172.16.9.9"  # private, but in the range the operator opens (--egress-allow-range)
ROGUE = "203.0.113.66"  # its HTTPS certificate is valid for rogue.test only (an attacker's address)
ADDRESSES = (WEB, OTHER, WILD, DENIED_IP, UPSTREAM_DNS, FOREIGN_DNS, ECHO, MIRROR, ROGUE, *FORBIDDEN)
# the names the internet's HTTPS certificate is valid for (from a test CA the server is told to trust)
TLS_NAMES = ("secret.test", "other.test", "allowed.test", "denied.test", "api.wild.test", "plain.test")
HERE = Path(__file__).resolve().parent
INTERNET_LOG = Path(f"/tmp/agentcell-test-internet-{os.getpid()}.log")  # every request head that got out

PROBES = r'''
import socket, struct, time, urllib.request
def tcp(host, port=80, timeout=1.0):
    try:
        s = socket.create_connection((host, port), timeout=timeout)
        s.sendall(b"GET / HTTP/1.0\r\nHost: " + host.encode() + b"\r\n\r\n")
        data = s.recv(200)
        s.close()
        if data.startswith(b"HTTP/1.1 403"):
            return "403"  # the egress proxy refused the Host
        return "ok" if data.startswith(b"HTTP/1.1 200") or data.startswith(b"dot") else repr(data[:40])
    except socket.gaierror:
        return "noname"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return type(e).__name__
def udp(host, port, timeout=1.0):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    try:
        s.sendto(b"ping", (host, port))
        return "ok" if s.recv(100) else "empty"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()
def dns_udp(server, name="allowed.test", timeout=1.0):
    q = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + b"".join(
        bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0\0\1\0\1"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    try:
        s.sendto(q, (server, 53))
        return "ok" if s.recv(512)[:2] == b"\x12\x34" else "junk"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()
def names(host):
    try:
        return sorted({a[4][0] for a in socket.getaddrinfo(host, 80, socket.AF_INET, socket.SOCK_STREAM)})
    except socket.gaierror as e:
        return "noname"
def get(url, timeout=2.0):
    try:
        return urllib.request.urlopen(url, timeout=timeout).read().decode()
    except Exception as e:
        return type(e).__name__ + ": " + str(e)
def http_as(ip, host, port=80, timeout=2.0):
    """An HTTP request to ip that names another Host (virtual hosting, or a lie)."""
    try:
        s = socket.create_connection((ip, port), timeout=timeout)
        s.sendall(b"GET / HTTP/1.1\r\nHost: " + host.encode() + b"\r\nConnection: close\r\n\r\n")
        data = s.recv(200)
        s.close()
        return data.split(b"\r\n")[0].decode() if data else "closed"
    except OSError as e:
        return type(e).__name__
def tls_as(ip, sni, port=443, timeout=2.0):
    """A real ClientHello naming `sni` (or none), sent to ip; what comes back."""
    import ssl
    ctx = ssl.create_default_context()
    if sni is None:
        ctx.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=sni)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    try:
        s = socket.create_connection((ip, port), timeout=timeout)
        s.sendall(outgoing.read())
        data = s.recv(100)
        s.close()
        return "answered" if data else "closed"
    except OSError as e:
        return type(e).__name__
def get_with(url, auth, timeout=3.0):
    req = urllib.request.Request(url, headers={"Authorization": auth})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.headers.get("X-Echo-Auth", "") + "|" + r.read().decode()
    except Exception as e:
        return type(e).__name__ + ": " + str(e)
def my_address():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(("203.0.113.10", 9))
    return s.getsockname()[0]
'''


def ask(sbx: Sandbox, expr: str) -> str:
    ex = sbx.run_code(f"print({expr})")
    assert ex.error is None, ex.error
    return "".join(ex.logs.stdout).strip()


def probed(sbx: Sandbox) -> Sandbox:
    ex = sbx.run_code(PROBES)
    assert ex.error is None, ex.error
    return sbx


def _ns(*args: str) -> None:
    subprocess.run(["ip", "-n", INET, *args], check=True)


@contextlib.contextmanager
def internet_server(tmp_path_factory: pytest.TempPathFactory, *server_args: str,
                    command: Sequence[str] = SERVER, env: Mapping[str, str | None] | None = None,
                    ) -> Iterator[ServerProcess]:
    """The internet, and a server (two standbys) whose uplink leads into it, with `server_args` (run as
    `command`, with `env` over this process's environment)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    before = _host_state()
    server = None
    subprocess.run(["ip", "netns", "add", INET], check=True)
    # the internet's HTTPS has certificates from a test CA the server is told to trust
    tmp = tmp_path_factory.mktemp("egress-internet")
    test_ca = EgressCA.load_or_create(str(tmp / "ca"))
    (tmp / "upstream.pem").write_bytes(test_ca.issue(*TLS_NAMES))
    (tmp / "rogue.pem").write_bytes(test_ca.issue("rogue.test"))
    (tmp / "ca.pem").write_bytes(test_ca.cert_pem)
    INTERNET_LOG.unlink(missing_ok=True)
    try:
        _ns("link", "set", "lo", "up")
        for addr in ADDRESSES:
            _ns("addr", "add", f"{addr}/32", "dev", "lo")
        _ns("addr", "add", f"{WEB6}/128", "dev", "lo")
        with netns_service(INET, HERE / "internet_services.py", *ADDRESSES,
                           env={**os.environ, "INET_TLS_CERT": str(tmp / "upstream.pem"),
                                "INET_TLS_ROGUE": f"{ROGUE}={tmp / 'rogue.pem'}", "INET_LOG": str(INTERNET_LOG)}):
            server = ServerProcess(tmp_path_factory.mktemp("egress") / "server.log", "--egress-uplink",
                                   f"netns:/run/netns/{INET}", "--egress-dns", UPSTREAM_DNS, "--standbys", "2",
                                   "--egress-ca-bundle", str(tmp / "ca.pem"), *server_args, command=command,
                                   env=env)
            with server:
                yield server
    finally:
        subprocess.run(["ip", "netns", "del", INET], check=False)
        if server is not None:
            leftover = [n for n in os.listdir("/run/netns") if n.startswith(f"agentcell-{server.pid}-")]
            assert leftover == [], f"router namespaces left behind: {leftover}"
        assert _host_state() == before, "the host's network changed"
