"""E2B's `network.egressProxy`, end to end: real sandboxes, a real server whose uplink leads into the
tests' internet (tests/egress_internet.py), and real SOCKS5 proxies in that internet
(tests/socks_services.py) in front of a target that only the proxies may reach (a firewall in the
internet's namespace drops everything else to it), through the official e2b SDK and agentcell's.

What is asserted is what happened: the proxy's log (greetings, credentials, CONNECTs), the address the
target saw, the internet's request log, and what the sandbox got.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentcell import Sandbox
from agentcell.network.ca import EgressCA
from tests.conftest import ServerProcess
from tests.egress_internet import DENIED_IP, INET, INTERNET_LOG, OTHER, WEB, ask, internet_server, probed
from tests.egress_world import netns_service
from tests.helpers import e2b_pointed_at

HERE = Path(__file__).resolve().parent
PROXY, NOT_SOCKS, DEAD, TARGET = "192.0.2.80", "192.0.2.81", "192.0.2.82", "192.0.2.90"
OPEN_PROXY = f"{PROXY}:1080"  # no credentials
AUTH_PROXY = f"{PROXY}:1081"  # tenant / AUTH_PASSWORD
TLS_PROXY = f"{PROXY}:1443"  # TLS with a certificate for proxy.test from the test CA, no credentials
NAMED_PROXY = "allowed.test:1080"  # a name (allowed.test is WEB in the internet's zone)
RANGE_PROXY = "10.1.2.3"  # a private address (FORBIDDEN), in the range the operator opened for proxies
AUTH_PASSWORD = "pw-correct-horse-battery"
SOCKS_LOG = Path(f"/tmp/agentcell-test-socks-{os.getpid()}.log")

GET = r'''
import socket
def fetch(host, port, path="/", timeout=4.0):
    try:
        s = socket.create_connection((host, port), timeout=timeout)
        s.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: " + host.encode() + b"\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        s.close()
        return data.split(b"\r\n\r\n", 1)[-1].decode().strip() if data else "closed"
    except OSError as e:
        return type(e).__name__
'''


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    # 10.1.2.0/24 (FORBIDDEN's 10.1.2.3): where the operator lets proxies be, and only proxies
    with internet_server(tmp_path_factory, "--egress-proxy-range", RANGE_PROXY.rsplit(".", 1)[0] + ".0/24") as server:
        tmp = tmp_path_factory.mktemp("socks")
        ca = EgressCA.load_or_create(str(tmp / "ca"))
        (tmp / "proxy.pem").write_bytes(ca.issue("proxy.test"))
        other_ca = EgressCA.load_or_create(str(tmp / "other-ca"))
        for address in (PROXY, NOT_SOCKS, DEAD, TARGET):
            subprocess.run(["ip", "-n", INET, "addr", "add", f"{address}/32", "dev", "lo"], check=True)
        # the target answers the proxies' addresses only: whatever reaches it came through one
        firewall = (f"table inet socks_test {{\n chain input {{\n type filter hook input priority 0; policy accept;\n"
                    f"ip daddr {TARGET} ip saddr != {{ {PROXY}, {WEB}, {RANGE_PROXY} }} drop\n }}\n}}\n")
        subprocess.run(["ip", "netns", "exec", INET, "nft", "-f", "-"], input=firewall, text=True, check=True)
        SOCKS_LOG.unlink(missing_ok=True)
        config = {"proxies": [{"listen": OPEN_PROXY}, {"listen": AUTH_PROXY, "auth": ["tenant", AUTH_PASSWORD]},
                              {"listen": TLS_PROXY, "tls": str(tmp / "proxy.pem")}, {"listen": f"{WEB}:1080"},
                              {"listen": f"{RANGE_PROXY}:1080"}],
                  "target": TARGET, "log": str(SOCKS_LOG)}
        with netns_service(INET, HERE / "socks_services.py", json.dumps(config)):
            yield {"server": server, "ca": ca.cert_pem.decode(), "other_ca": other_ca.cert_pem.decode()}
    SOCKS_LOG.unlink(missing_ok=True)


@pytest.fixture
def inet_server(world: dict[str, object]) -> ServerProcess:
    return world["server"]  # type: ignore[return-value]


@pytest.fixture
def make(inet_server: ServerProcess) -> Iterator:
    made: list[Sandbox] = []

    def create(**kwargs: object) -> Sandbox:
        sbx = Sandbox.create(api_url=inet_server.url, timeout=300, **kwargs)  # type: ignore[arg-type]
        made.append(sbx)
        probed(sbx)
        assert sbx.run_code(GET).error is None
        return sbx

    yield create
    for sbx in made:
        sbx.kill()


def log_mark() -> int:
    return SOCKS_LOG.stat().st_size if SOCKS_LOG.exists() else 0


def log_since(mark: int) -> list[str]:
    with SOCKS_LOG.open("rb") as f:
        f.seek(mark)
        return f.read().decode().splitlines()


def test_every_tcp_connection_goes_through_the_proxy(inet_server: ServerProcess) -> None:
    """Through the official e2b SDK: the target, which only the proxy may reach, answers, and says it
    saw the proxy's address; plain HTTP to a public host goes through the proxy too; names still
    resolve (DNS is not tunneled); without a proxy the target is out of reach."""
    import e2b_code_interpreter as e2b

    with e2b_pointed_at(inet_server.url):
        sbx = e2b.Sandbox.create(network={"egress_proxy": {"address": OPEN_PROXY}}, timeout=120)
        plain = e2b.Sandbox.create(timeout=120)
        try:
            assert sbx.run_code(GET).error is None and plain.run_code(GET).error is None
            mark = log_mark()
            assert ask(sbx, f"fetch('{TARGET}', 9000, '/a')") == f"target saw {PROXY} port=9000 path=/a"  # type: ignore[arg-type]
            assert ask(sbx, "fetch('allowed.test', 80)").startswith(f"hello from {WEB} host=allowed.test")  # type: ignore[arg-type]
            seen = log_since(mark)
            assert f"connect {OPEN_PROXY} {TARGET}:9000" in seen
            assert f"connect {OPEN_PROXY} {WEB}:80" in seen  # by address: what the sandbox's resolver answered
            assert ask(plain, f"fetch('{TARGET}', 9000)") in ("TimeoutError", "timeout")  # type: ignore[arg-type]
            info = sbx.get_info()
            assert info.network is not None and info.network["egress_proxy"] == {"address": OPEN_PROXY}
            assert "egress_proxy" not in (plain.get_info().network or {})
        finally:
            sbx.kill()
            plain.kill()


def test_credentials_work_wrong_ones_fail_closed_and_the_password_is_never_shown(make, inet_server: ServerProcess) -> None:  # type: ignore[no-untyped-def]
    sbx = make(network={"egress_proxy": {"address": AUTH_PROXY, "username": "tenant", "password": AUTH_PASSWORD}})
    mark = log_mark()
    assert ask(sbx, f"fetch('{TARGET}', 9001)") == f"target saw {PROXY} port=9001 path=/"
    assert f"auth-ok {AUTH_PROXY} tenant" in log_since(mark)
    raw = httpx.get(f"{inet_server.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": "e2b_test_key"}).text
    assert AUTH_PASSWORD not in raw
    assert json.loads(raw)["network"]["egressProxy"] == {"address": AUTH_PROXY, "username": "tenant"}
    assert AUTH_PASSWORD not in subprocess.run(["cat", str(inet_server.log_path)], capture_output=True, text=True).stdout

    wrong = make(network={"egress_proxy": {"address": AUTH_PROXY, "username": "tenant", "password": "not-it"}})
    mark = log_mark()
    assert ask(wrong, f"fetch('{TARGET}', 9001)") in ("closed", "ConnectionResetError")
    assert ask(wrong, "fetch('allowed.test', 80)") in ("closed", "ConnectionResetError")  # never direct
    seen = log_since(mark)
    assert f"auth-failed {AUTH_PROXY} tenant" in seen and not any(line.startswith("connect") for line in seen)

    anonymous = make(network={"egress_proxy": {"address": AUTH_PROXY}})  # offers no credentials: refused
    assert ask(anonymous, f"fetch('{TARGET}', 9001)") in ("closed", "ConnectionResetError")


def test_a_dead_proxy_or_one_that_is_not_socks5_fails_closed(make) -> None:  # type: ignore[no-untyped-def]
    for address in (f"{DEAD}:1080", f"{NOT_SOCKS}:853"):
        sbx = make(network={"egress_proxy": {"address": address}})
        marker = uuid.uuid4().hex
        assert ask(sbx, f"fetch('{OTHER}', 80, '/{marker}')") in ("closed", "ConnectionResetError"), address
        # nothing went out directly
        assert not INTERNET_LOG.exists() or marker not in INTERNET_LOG.read_text(errors="replace"), address
        # and the sandbox's record says why
        deadline = time.monotonic() + 5
        while not (refused := [e for e in sbx.events("net.deny") if e.get("rule") == "egress-proxy"]) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert refused and refused[-1]["dst"] == OTHER and refused[-1]["via"] == address, address
        assert ("could not be reached" if address.startswith(DEAD) else "does not speak SOCKS5") in refused[-1]["error"]


def test_deny_rules_refuse_before_the_proxy(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make(network={"deny_out": [DENIED_IP], "egress_proxy": {"address": OPEN_PROXY}})
    mark = log_mark()
    assert ask(sbx, f"fetch('{DENIED_IP}', 80)") in ("TimeoutError", "timeout")
    assert ask(sbx, f"fetch('{OTHER}', 80)").startswith(f"hello from {OTHER}")
    seen = log_since(mark)
    assert f"connect {OPEN_PROXY} {OTHER}:80" in seen and not any(DENIED_IP in line for line in seen)

    # an allow list of names: only those, read by the proxy (HTTP Host), then tunneled
    only = make(network={"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"],
                         "egress_proxy": {"address": OPEN_PROXY}})
    mark = log_mark()
    assert ask(only, "fetch('allowed.test', 80)").startswith(f"hello from {WEB} host=allowed.test")
    assert ask(only, f"fetch('{OTHER}', 80)") in ("TimeoutError", "timeout")
    assert ask(only, f"fetch('{TARGET}', 9000)") in ("TimeoutError", "timeout")
    seen = log_since(mark)
    assert f"connect {OPEN_PROXY} {WEB}:80" in seen
    assert not any(OTHER in line or TARGET in line for line in seen)


def test_update_network_sets_replaces_and_removes_the_proxy(inet_server: ServerProcess) -> None:
    import e2b_code_interpreter as e2b

    with e2b_pointed_at(inet_server.url):
        sbx = e2b.Sandbox.create(timeout=120)
        try:
            assert sbx.run_code(GET).error is None
            assert ask(sbx, f"fetch('{TARGET}', 9000)") in ("TimeoutError", "timeout")  # type: ignore[arg-type]
            sbx.update_network({"egress_proxy": {"address": OPEN_PROXY}})
            mark = log_mark()
            assert ask(sbx, f"fetch('{TARGET}', 9000)") == f"target saw {PROXY} port=9000 path=/"  # type: ignore[arg-type]
            assert f"connect {OPEN_PROXY} {TARGET}:9000" in log_since(mark)
            sbx.update_network({"egress_proxy": {"address": AUTH_PROXY, "username": "tenant",
                                                 "password": AUTH_PASSWORD}})
            mark = log_mark()
            assert ask(sbx, f"fetch('{TARGET}', 9000)") == f"target saw {PROXY} port=9000 path=/"  # type: ignore[arg-type]
            assert f"connect {AUTH_PROXY} {TARGET}:9000" in log_since(mark)
            assert sbx.get_info().network["egress_proxy"] == {"address": AUTH_PROXY, "username": "tenant"}  # type: ignore[index]
            sbx.update_network({})  # the update replaces everything: no proxy any more
            mark = log_mark()
            assert ask(sbx, f"fetch('{TARGET}', 9000)") in ("TimeoutError", "timeout")  # type: ignore[arg-type]
            assert ask(sbx, "fetch('allowed.test', 80)").startswith(f"hello from {WEB}")  # type: ignore[arg-type]
            assert log_since(mark) == []
            assert "egress_proxy" not in (sbx.get_info().network or {})
        finally:
            sbx.kill()


def test_secrets_are_substituted_host_side_before_the_tunnel(make) -> None:  # type: ignore[no-untyped-def]
    value = "sk-live-" + os.urandom(12).hex()
    sbx = make(secrets={"API_KEY": {"value": value, "hosts": ["secret.test"]}},
               network={"egress_proxy": {"address": OPEN_PROXY}})
    placeholder = ask(sbx, "__import__('os').environ['API_KEY']")
    mark = log_mark()
    got = ask(sbx, "get_with('https://secret.test/v1/tunneled', 'Bearer ' + __import__('os').environ['API_KEY'])")
    assert got.split("|", 1)[0] == f"Bearer {placeholder}", got  # the sandbox never sees the value ...
    assert f"Bearer {value}".encode() in INTERNET_LOG.read_bytes()  # ... the host got it ...
    assert f"connect {OPEN_PROXY} {WEB}:443" in log_since(mark)  # ... through the tunnel


def test_tls_to_the_proxy(make, world: dict[str, object]) -> None:  # type: ignore[no-untyped-def]
    tls = {"server_name": "proxy.test", "ca_cert": world["ca"]}
    sbx = make(network={"egress_proxy": {"address": TLS_PROXY, "tls": tls}})
    mark = log_mark()
    assert ask(sbx, f"fetch('{TARGET}', 9000)") == f"target saw {PROXY} port=9000 path=/"
    assert f"connect {TLS_PROXY} {TARGET}:9000" in log_since(mark)
    assert sbx.get_info().network["egressProxy"] == {  # type: ignore[union-attr]
        "address": TLS_PROXY, "tls": {"enabled": True, "serverName": "proxy.test"}}  # never the CA
    # TLS in TLS: HTTPS to a host, read by the egress proxy (a secret for it), inside the TLS tunnel
    value = "sk-live-" + os.urandom(12).hex()
    inner = make(secrets={"API_KEY": {"value": value, "hosts": ["secret.test"]}},
                 network={"egress_proxy": {"address": TLS_PROXY, "tls": tls}})
    mark = log_mark()
    got = ask(inner, "get_with('https://secret.test/tls-in-tls', __import__('os').environ['API_KEY'])")
    assert got.split("|", 1)[1].startswith("GET /tls-in-tls HTTP/1.1"), got
    assert f"connect {TLS_PROXY} {WEB}:443" in log_since(mark)
    assert value.encode() in INTERNET_LOG.read_bytes()
    # a certificate the given CA did not sign, or a name it is not for: fail closed
    for bad in ({"server_name": "proxy.test", "ca_cert": world["other_ca"]}, {"server_name": "other.test", "ca_cert": world["ca"]}):
        wrong = make(network={"egress_proxy": {"address": TLS_PROXY, "tls": bad}})
        mark = log_mark()
        assert ask(wrong, f"fetch('{TARGET}', 9000)") in ("closed", "ConnectionResetError")
        assert not any(line.startswith("connect") for line in log_since(mark))


def test_where_a_proxy_may_be(inet_server: ServerProcess) -> None:
    """The operator's ceiling: never the never-list (private, loopback, link-local, metadata), by
    address or by name; a name resolved at create and again at each dial."""
    import e2b_code_interpreter as e2b
    from e2b.exceptions import SandboxException

    with e2b_pointed_at(inet_server.url):
        for address in ("10.1.3.3:1080", "127.0.0.1:1080", "169.254.169.254:80", "192.168.7.7:1080",
                        "meta.test:1080", "nowhere.test:1080"):  # (rebind.test is 10.1.2.3: opened here)
            with pytest.raises(SandboxException, match="egressProxy"):
                e2b.Sandbox.create(network={"egress_proxy": {"address": address}}, timeout=60)
        sbx = e2b.Sandbox.create(network={"egress_proxy": {"address": NAMED_PROXY}}, timeout=120)
        try:
            assert sbx.run_code(GET).error is None
            mark = log_mark()
            assert ask(sbx, f"fetch('{TARGET}', 9000)") == f"target saw {WEB} port=9000 path=/"  # type: ignore[arg-type]
            assert f"connect {WEB}:1080 {TARGET}:9000" in log_since(mark)
            with pytest.raises(SandboxException, match="egressProxy"):
                sbx.update_network({"egress_proxy": {"address": "10.1.3.3:1080"}})
        finally:
            sbx.kill()


def test_the_operator_opens_a_private_range_for_proxies_only(make) -> None:  # type: ignore[no-untyped-def]
    """`--egress-proxy-range 10.1.2.0/24`: a proxy there works; sandboxes still cannot reach it directly."""
    sbx = make(network={"egress_proxy": {"address": f"{RANGE_PROXY}:1080"}})
    mark = log_mark()
    assert ask(sbx, f"fetch('{TARGET}', 9000)") == f"target saw {RANGE_PROXY} port=9000 path=/"
    assert f"connect {RANGE_PROXY}:1080 {TARGET}:9000" in log_since(mark)
    plain = make()
    assert ask(plain, f"fetch('{RANGE_PROXY}', 1080)") in ("TimeoutError", "timeout")
    # and a tunneled sandbox cannot reach it by tunneling to it either: the never-list comes first
    assert ask(sbx, f"fetch('{RANGE_PROXY}', 80)") in ("TimeoutError", "timeout")


def test_malformed_proxies_are_refused(inet_server: ServerProcess) -> None:
    for proxy, why in (({"address": "no-port"}, "host:port"), ({"address": "[2001:db8::1]:1080"}, "IPv6"),
                       ({"address": OPEN_PROXY, "password": "x"}, "username"),
                       ({"address": OPEN_PROXY, "tls": {"caCert": "not a certificate"}}, "caCert"),
                       ({"address": OPEN_PROXY, "protocol": "socks5"}, "unknown field"),
                       ("proxy:1080", "object")):
        r = httpx.post(f"{inet_server.url}/sandboxes", json={"templateID": "base", "network": {"egressProxy": proxy}},
                       headers={"X-API-KEY": "e2b_test_key"})
        assert r.status_code == 400 and why in r.json()["message"], (proxy, r.text)


def test_a_server_without_egress_refuses_a_proxy(server_url: str) -> None:
    """The session's server (no uplink; AGENTCELL_TEST_BACKEND=gvisor: the gvisor backend, which has no
    egress): nothing to tunnel, a 400 that says so, at create and at update."""
    r = httpx.post(f"{server_url}/sandboxes", json={"templateID": "base", "network": {"egressProxy": {
        "address": OPEN_PROXY}}}, headers={"X-API-KEY": "e2b_test_key"})
    assert r.status_code == 400 and "egressProxy" in r.json()["message"] and "no internet" in r.json()["message"]
    sbx = Sandbox.create(api_url=server_url, timeout=60)
    try:
        r = httpx.put(f"{server_url}/sandboxes/{sbx.sandbox_id}/network", json={"egressProxy": {"address": OPEN_PROXY}},
                      headers={"X-API-KEY": "e2b_test_key"})
        assert r.status_code == 400 and "egressProxy" in r.json()["message"]
    finally:
        sbx.kill()


def test_added_latency(make) -> None:  # type: ignore[no-untyped-def]
    """What the tunnel costs a new connection (printed; bounded loosely: it is one more local hop)."""
    direct = make()
    tunneled = make(network={"egress_proxy": {"address": OPEN_PROXY}})
    code = ("import time\nt = time.perf_counter()\nfor _ in range(50): r = fetch('allowed.test', 80)\n"
            "print(round((time.perf_counter() - t) / 50 * 1000, 2), r[:5])")
    for sbx in (direct, tunneled):
        ask(sbx, "fetch('allowed.test', 80)")  # warm
    times = {}
    for name, sbx in (("direct", direct), ("tunneled", tunneled)):
        ex = sbx.run_code(code)
        assert ex.error is None, ex.error
        ms, head = "".join(ex.logs.stdout).split()
        assert head.startswith("hello"), head
        times[name] = float(ms)
    print(f"\nper connection (connect + GET + close): {times}")
    assert times["tunneled"] < times["direct"] + 50
    bulk = ("import socket, time\nt = time.perf_counter()\n"
            "s = socket.create_connection(('allowed.test', 80), timeout=30)\n"
            "s.sendall(b'GET /big/50000000 HTTP/1.1\\r\\nHost: allowed.test\\r\\nConnection: close\\r\\n\\r\\n')\n"
            "n = 0\nwhile chunk := s.recv(1 << 20): n += len(chunk)\n"
            "print(round(n / (time.perf_counter() - t) / 1e6, 1))")
    rates = {}
    for name, sbx in (("direct", direct), ("tunneled", tunneled)):
        ex = sbx.run_code(bulk)
        assert ex.error is None, ex.error
        rates[name] = float("".join(ex.logs.stdout))
    print(f"50 MB over one connection, MB/s: {rates}")
    assert rates["tunneled"] > 1
