"""Sandboxes' internet, end to end: a real server whose egress uplink leads into an "internet" this
module builds, real sandboxes, real probes from inside them, through both SDKs.

The internet is one network namespace (tests/internet_services.py) with web, DNS, DoT, UDP echo and
QUIC-port services on documentation addresses, and the same services on forbidden addresses (private,
CGNAT, link-local, metadata). It has no route anywhere else, and the server's router has no route but
into it: nothing can leave this machine, and a refusal proves a rule, not a missing route. The host's
links, addresses, routes and ruleset must be unchanged afterwards.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest

from agentcell import Sandbox
from agentcell.errors import InvalidArgumentException
from tests.conftest import ServerProcess
from tests.egress_internet import (  # noqa: F401 (the names other test modules import from here too)
    ADDRESSES,
    DENIED_IP,
    ECHO,
    FORBIDDEN,
    FOREIGN_DNS,
    HERE,
    INET,
    INTERNET_LOG,
    MIRROR,
    OTHER,
    PROBES,
    TAG,
    UPSTREAM_DNS,
    WEB,
    WEB6,
    WILD,
    ask,
    internet_server,
    probed,
)
from tests.helpers import e2b_pointed_at


@pytest.fixture(scope="module")
def egress_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with internet_server(tmp_path_factory, "--egress-allow-range", "172.16.9.0/24") as server:
        yield server


@pytest.fixture
def make(egress_server: ServerProcess) -> Iterator:
    made: list[Sandbox] = []

    def create(**kwargs: object) -> Sandbox:
        sbx = Sandbox.create(api_url=egress_server.url, timeout=300, **kwargs)  # type: ignore[arg-type]
        made.append(sbx)
        return probed(sbx)

    yield create
    for sbx in made:
        sbx.kill()


def test_by_default_the_public_internet_and_nothing_else(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make()
    assert ask(sbx, f"tcp('{WEB}')") == "ok"
    assert ask(sbx, "tcp('allowed.test')") == "ok"  # through the router's resolver
    assert ask(sbx, "get('http://other.test/')").startswith(f"hello from {OTHER} host=other.test")
    for addr in FORBIDDEN:
        assert ask(sbx, f"tcp('{addr}')") != "ok", addr
    assert ask(sbx, f"tcp('{MIRROR}')") == "ok"  # the one private range the operator opened
    assert ask(sbx, "names('rebind.test')") == "noname"  # its only record is private: dropped
    assert ask(sbx, "names('meta.test')") == "noname"
    assert ask(sbx, "names('flip.test')") == "['203.0.113.13']"  # an answer that later turns private
    assert ask(sbx, "names('flip.test')") == "noname"
    assert ask(sbx, "tcp('10.77.255.254', 22)") != "ok"
    info = sbx.get_info()
    assert info.allow_internet_access is True and info.network is not None
    assert info.network["allowOut"] == [] and info.network["denyOut"] == []


def test_ipv6_goes_nowhere(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make(network={"allow_out": ["2001:db8::/32", "::/0"]})
    code = (f"import socket\ntry:\n    socket.create_connection(('{WEB6}', 80), timeout=1); print('ok')\n"
            "except OSError as e: print(type(e).__name__)")
    ex = sbx.run_code(code)
    assert "".join(ex.logs.stdout).strip() != "ok"
    addrs = sbx.commands.run("cat /proc/net/if_inet6; ip -6 route 2>/dev/null; true").stdout
    assert "2001" not in addrs and "default" not in addrs  # no IPv6 address or route but loopback's


def test_no_internet_when_asked(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make(allow_internet_access=False)
    assert ask(sbx, f"tcp('{WEB}')") != "ok"
    t = time.monotonic()
    assert ask(sbx, "names('allowed.test')") == "noname"  # refused at once, not a timeout
    assert time.monotonic() - t < 1.5
    assert sbx.get_info().allow_internet_access is False


def test_foreign_resolvers_dot_and_quic_are_closed(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make()
    assert ask(sbx, f"dns_udp('{FOREIGN_DNS}')") != "ok"
    assert ask(sbx, f"dns_udp('{UPSTREAM_DNS}')") != "ok"  # even the one the resolver itself uses
    assert ask(sbx, f"tcp('{FOREIGN_DNS}', 53)") != "ok"
    assert ask(sbx, f"tcp('{FOREIGN_DNS}', 853)") != "ok"  # DNS over TLS
    assert ask(sbx, f"udp('{ECHO}', 443)") != "ok"  # QUIC
    assert ask(sbx, f"udp('{ECHO}', 7)") != "ok"  # UDP only to what an allow list names
    assert ask(sbx, "dns_udp('10.77.255.254')") == "ok"  # ours answers


def test_a_domain_allow_list(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make(network={"allow_out": ["allowed.test", "*.wild.test"]})
    assert ask(sbx, f"tcp('{WEB}')") != "ok"  # a raw IP, not (yet) answered for an allowed name
    assert ask(sbx, "names('allowed.test')") == f"['{WEB}']"
    assert ask(sbx, "tcp('allowed.test')") == "ok"
    assert ask(sbx, "tcp('api.wild.test')") == "ok"
    assert ask(sbx, "names('other.test')") == "noname"  # never forwarded upstream
    assert ask(sbx, f"tcp('{OTHER}')") != "ok"
    assert ask(sbx, "names('wild.test')") == "noname"  # a wildcard is not its apex
    assert ask(sbx, f"tls_as('{FOREIGN_DNS}', 'dns.test')") != "answered"  # DoH to an IP: a raw IP, dropped
    # a redirect from an allowed host to a denied one goes nowhere
    assert "other.test" not in ask(sbx, "get('http://allowed.test/redirect?to=http://other.test/')").split(
        "hello")[-1]
    assert "URLError" in ask(sbx, "get('http://allowed.test/redirect?to=http://other.test/')")


def test_the_host_a_connection_names_must_be_allowed(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make(network={"allow_out": ["allowed.test", "other.test"]})
    assert ask(sbx, "names('allowed.test')") == f"['{WEB}']"
    assert ask(sbx, "names('other.test')") == f"['{OTHER}']"
    assert ask(sbx, f"http_as('{WEB}', 'allowed.test')") == "HTTP/1.1 200 OK"
    assert ask(sbx, f"http_as('{WEB}', 'denied.test')") == "HTTP/1.1 403 Forbidden"  # Host not allowed
    assert ask(sbx, f"http_as('{WEB}', 'other.test')") == "HTTP/1.1 403 Forbidden"  # allowed, not this address's
    assert ask(sbx, f"tls_as('{WEB}', 'allowed.test')") == "answered"
    assert ask(sbx, f"tls_as('{WEB}', 'denied.test')") == "closed"  # SNI not allowed
    assert ask(sbx, f"tls_as('{WEB}', 'other.test')") == "closed"  # SNI of another pinned name
    assert ask(sbx, f"tls_as('{WEB}', None)") == "closed"  # no SNI: nothing to check against
    assert ask(sbx, f"http_as('{DENIED_IP}', 'allowed.test', timeout=1)") == "TimeoutError"  # unpinned: dropped
    # an open internet with a deny list of names: the names are checked, addresses stay open
    open_ = make(network={"deny_out": ["denied.test"]})
    assert ask(open_, f"http_as('{DENIED_IP}', 'denied.test')") == "HTTP/1.1 403 Forbidden"
    assert ask(open_, f"tls_as('{DENIED_IP}', 'denied.test')") == "closed"
    assert ask(open_, f"http_as('{DENIED_IP}', 'anything.test')") == "HTTP/1.1 200 OK"
    assert ask(open_, f"tls_as('{WEB}', None)") == "closed"  # names no host: a name rule cannot be checked
    # an address allowed as such (a CIDR) takes any name but a denied one
    mixed = make(network={"allow_out": ["203.0.113.0/24", "allowed.test"], "deny_out": ["denied.test"]})
    assert ask(mixed, f"http_as('{WEB}', 'anything.test')") == "HTTP/1.1 200 OK"
    assert ask(mixed, f"http_as('{WEB}', 'denied.test')") == "HTTP/1.1 403 Forbidden"
    # no domain rules: nothing is intercepted
    plain = make()
    assert ask(plain, f"http_as('{WEB}', 'denied.test')") == "HTTP/1.1 200 OK"


def test_big_answers_over_edns_and_tcp(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make(network={"allow_out": ["big.test", "huge.test"]})
    got = eval(ask(sbx, "names('big.test')"))
    assert len(got) == 60  # ~1 KB: one datagram, as resolv.conf turns EDNS0 on
    query = "__import__('dns.message').message.make_query('huge.test', 'A')"
    udp = ask(sbx, f"int(__import__('dns.query').query.udp({query}, '10.77.255.254', timeout=3).flags)")
    assert int(udp) & 0x0200  # TC: too big for a datagram: truncated, so the client asks over TCP
    tcp = ask(sbx, f"len(__import__('dns.query').query.tcp({query}, '10.77.255.254', timeout=3).answer[0])")
    assert tcp == "100"  # the resolver asked its upstream over TCP too


def test_deny_lists_and_e2bs_allow_idiom(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make(network={"deny_out": ["denied.test", f"{OTHER}/32"]})
    assert ask(sbx, "names('denied.test')") == "noname"
    assert ask(sbx, f"tcp('{OTHER}')") != "ok"
    assert ask(sbx, "tcp('allowed.test')") == "ok"
    only = make(network={"allow_out": [OTHER], "deny_out": ["0.0.0.0/0"]})
    assert ask(only, f"tcp('{OTHER}')") == "ok"
    assert ask(only, f"tcp('{WEB}')") != "ok"
    assert ask(only, "names('allowed.test')") == "noname"  # no domain allowed: no name resolves
    udp_ok = make(allow_internet_access=False, network={"allow_out": [f"{ECHO}/32"]})  # as deny ALL_TRAFFIC
    assert ask(udp_ok, f"udp('{ECHO}', 7)") == "ok"
    assert ask(udp_ok, f"udp('{ECHO}', 443)") != "ok"  # QUIC stays closed
    assert ask(udp_ok, f"tcp('{WEB}')") != "ok"


def test_update_network_takes_effect_for_new_connections(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make()
    assert ask(sbx, f"tcp('{WEB}')") == "ok"
    t = time.monotonic()
    sbx.update_network({"deny_out": [f"{WEB}/32"]})
    took = time.monotonic() - t
    assert took < 0.1, f"update_network took {took * 1000:.0f} ms"
    assert ask(sbx, f"tcp('{WEB}')") != "ok"
    assert ask(sbx, f"tcp('{OTHER}')") == "ok"
    assert sbx.get_info().network["denyOut"] == [f"{WEB}/32"]  # type: ignore[index]
    sbx.update_network({"allow_out": ["allowed.test"]})
    assert ask(sbx, "tcp('allowed.test')") == "ok"
    assert ask(sbx, f"tcp('{OTHER}')") != "ok"
    sbx.update_network({"allow_internet_access": False})
    assert ask(sbx, "tcp('allowed.test')") != "ok"
    sbx.update_network({})  # allow_internet_access left out: the sandbox's own (on at create)
    assert ask(sbx, f"tcp('{OTHER}')") == "ok"


def test_neighbours_and_the_host_are_unreachable(make, egress_server: ServerProcess) -> None:  # type: ignore[no-untyped-def]
    a, b = make(), make()
    a.commands.run("python3 -m http.server 9000 --bind 0.0.0.0", background=True)
    addr = ask(a, "my_address()")
    assert addr.startswith("10.77.")
    deadline = time.monotonic() + 5
    while ask(a, "tcp('127.0.0.1', 9000)") != "ok" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ask(b, f"tcp('{addr}', 9000)") != "ok"
    assert ask(b, f"tcp('127.0.0.1', {egress_server.port})") != "ok"  # its own loopback, not the host's
    assert ask(b, "tcp('192.0.2.2', 22)") != "ok"  # the host's own address


def test_bad_rules_get_clear_errors(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentException, match="not a CIDR"):
        make(network={"allow_out": ["exa mple.test"]})
    with pytest.raises(InvalidArgumentException, match="egressProxy"):
        make(network={"egress_proxy": {"address": "proxy.test:1080"}})
    sbx = make()
    with pytest.raises(InvalidArgumentException, match="not a CIDR"):
        sbx.update_network({"deny_out": ["http://x.test/"]})
    assert ask(sbx, f"tcp('{WEB}')") == "ok"  # a refused update changed nothing


def test_the_official_e2b_sdk(egress_server: ServerProcess) -> None:
    import e2b

    with e2b_pointed_at(egress_server.url):
        sbx = e2b.Sandbox.create(network={"allow_out": ["allowed.test"], "deny_out": [e2b.ALL_TRAFFIC]})
        try:
            code = "import socket; s=socket.create_connection(('allowed.test', 80), timeout=2); print('ok')"
            assert sbx.commands.run(f'python3 -c "{code}"').stdout.strip() == "ok"
            with pytest.raises(e2b.CommandExitException):
                sbx.commands.run(f"python3 -c \"import socket; socket.create_connection(('{OTHER}', 80), timeout=1)\"")
            info = sbx.get_info()
            assert info.network is not None and info.network.get("allow_out") == ["allowed.test"]
            sbx.update_network({"allow_out": [OTHER], "deny_out": [e2b.ALL_TRAFFIC]})
            code2 = f"import socket; socket.create_connection(('{OTHER}', 80), timeout=2); print('ok')"
            assert sbx.commands.run(f'python3 -c "{code2}"').stdout.strip() == "ok"
        finally:
            sbx.kill()
        off = e2b.Sandbox.create(allow_internet_access=False)
        try:
            code3 = f"import socket; socket.create_connection(('{WEB}', 80), timeout=1)"
            with pytest.raises(e2b.CommandExitException):
                off.commands.run(f'python3 -c "{code3}"')
        finally:
            off.kill()


def test_connection_events(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make(network={"allow_out": ["allowed.test"]})
    assert ask(sbx, "len(get('http://allowed.test/big/20000'))") == "20000"
    assert ask(sbx, f"tcp('{OTHER}', 8080)") != "ok"
    assert ask(sbx, "names('other.test')") == "noname"
    assert ask(sbx, "tcp('10.1.2.3')") != "ok"
    deadline = time.monotonic() + 30  # a closed connection's event waits for the router's TIME_WAIT (10 s)
    while True:
        events = list(sbx.events())
        closed = [e for e in events if e.get("state") == "closed" and e.get("dst") == WEB]
        if closed or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    opened = [e for e in events if e.get("state") == "open" and e.get("dst") == WEB]
    assert opened and opened[0]["domain"] == "allowed.test" and opened[0]["dport"] == 80
    assert closed and closed[0]["bytes_in"] >= 20000 and 0 < closed[0]["bytes_out"] < 2000
    assert any(e.get("verdict") == "denied" and e.get("dst") == OTHER and e.get("rule") == "policy" for e in events)
    assert ask(sbx, f"http_as('{WEB}', 'other.test')") == "HTTP/1.1 403 Forbidden"
    assert any(e.get("domain") == "other.test" and e.get("rule") == "domain" for e in sbx.events())
    assert any(e.get("proto") == "dns" and e.get("domain") == "other.test" and e["verdict"] == "denied"
               for e in events)
    assert any(e.get("dst") == "10.1.2.3" and e.get("rule") == "never4" for e in events)
    # the report flags the reach for a private address, citing the refused attempt
    flags = {f["flag"]: f["events"] for f in sbx.report()["flags"]}
    never = [e["seq"] for e in events if e.get("dst") == "10.1.2.3" and e["kind"] == "net.deny"]
    assert never and set(never) & set(flags["host-or-lan"])
    other = make()
    assert [e for e in other.events() if e["kind"].startswith(("net.", "dns."))] == []  # its events are its own


async def test_following_events_with_the_async_sdk(egress_server: ServerProcess) -> None:
    import asyncio

    from agentcell import AsyncSandbox

    sbx = await AsyncSandbox.create(api_url=egress_server.url, timeout=120)
    got: list[dict] = []

    async def follow() -> None:
        async for event in sbx.events(follow=True):
            got.append(event)

    task = asyncio.create_task(follow())
    try:
        await sbx.run_code(PROBES)
        await sbx.run_code(f"tcp('{WEB}', 8080)")
        deadline = time.monotonic() + 10
        while not any(e.get("dport") == 8080 for e in got) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert any(e.get("dport") == 8080 and e.get("state") == "open" for e in got)
    finally:
        await sbx.kill()
    await asyncio.wait_for(task, 5)  # the stream ends with the sandbox


def test_secrets_never_enter_the_sandbox(make, egress_server: ServerProcess) -> None:  # type: ignore[no-untyped-def]
    value = "sk-live-" + os.urandom(12).hex()
    sbx = make(secrets={"API_KEY": {"value": value, "hosts": ["secret.test"]}})
    placeholder = ask(sbx, "__import__('os').environ['API_KEY']")
    assert placeholder.startswith("agentcell-secret-api_key-") and value not in placeholder
    got = ask(sbx, "get_with('https://secret.test/v1/models', 'Bearer ' + __import__('os').environ['API_KEY'])")
    echoed_auth, echoed_head = got.split("|", 1)
    assert echoed_head.startswith("GET /v1/models HTTP/1.1"), got  # through the proxy, TLS to the real host
    assert f"Bearer {value}".encode() in INTERNET_LOG.read_bytes()  # the host got the value ...
    assert value not in got and echoed_auth == f"Bearer {placeholder}"  # ... the sandbox never sees it
    certifi = ("import certifi, ssl, urllib.request, os; ctx = ssl.create_default_context(cafile=certifi.where()); "
               "print(urllib.request.urlopen('https://secret.test/', context=ctx, timeout=3).status)")
    assert sbx.commands.run(f'python3 -c "{certifi}"').stdout.strip() == "200"  # certifi's own bundle
    for lib in ("httpx",):  # a certifi-based client trusts the egress CA too (SSL_CERT_FILE; requests: REQUESTS_CA_BUNDLE)
        code = (f"import {lib}, os; r = {lib}.get('https://secret.test/x', headers={{'Authorization': "
                "os.environ['API_KEY']}, timeout=3); print(r.status_code, r.headers['X-Echo-Auth'])")
        r = sbx.commands.run(f'python3 -c "{code}"')
        assert r.stdout.strip() == f"200 {placeholder}", (lib, r.stdout, r.stderr)
    # nowhere in the sandbox: environments, files, memory of its processes
    # (the scanner holds the value in two halves only, so its own memory cannot match)
    half = len(value) // 2
    scan = (f"h1, h2 = {value[:half]!r}.encode(), {value[half:]!r}.encode(); import glob; hits = []; seen = 0\n"
            "def has(data):\n"
            "    i = data.find(h1)\n"
            "    while i >= 0:\n"
            "        if data[i + len(h1):i + len(h1) + len(h2)] == h2: return True\n"
            "        i = data.find(h1, i + 1)\n"
            "    return False\n"
            "for p in glob.glob('/proc/[0-9]*'):\n"
            "    for f in ('environ', 'cmdline'):\n"
            "        try:\n"
            "            hits += [p + '/' + f] if has(open(p + '/' + f, 'rb').read()) else []\n"
            "        except OSError: pass\n"
            "    try:\n"
            "        maps = open(p + '/maps').read().splitlines(); mem = open(p + '/mem', 'rb', 0); seen += 1\n"
            "        for line in maps:\n"
            "            a, b = (int(x, 16) for x in line.split()[0].split('-'))\n"
            "            if 'r' not in line.split()[1] or b - a > 1 << 28: continue\n"
            "            try:\n"
            "                mem.seek(a); hits += [p + ' mem'] if has(mem.read(b - a)) else []\n"
            "            except (OSError, ValueError, OverflowError): pass\n"
            "    except OSError: pass\n"
            "print(hits, seen > 0)")
    ex = sbx.run_code(scan)
    assert ex.error is None and "".join(ex.logs.stdout).strip() == "[] True", (ex.error, ex.logs.stdout)
    r = sbx.commands.run(f"grep -rl {value} /home /tmp /etc 2>/dev/null; echo done")
    assert r.stdout.strip() == "done"
    # the placeholder to any other host, over HTTP or HTTPS: refused, reported, never sent
    before = INTERNET_LOG.read_bytes()
    for url in ("http://other.test/", "https://other.test/"):
        other = ask(sbx, f"get_with('{url}', 'Bearer ' + __import__('os').environ['API_KEY'])")
        assert "403" in other, (url, other)
    assert placeholder.encode() not in INTERNET_LOG.read_bytes()[len(before):]
    # the secret's host's address, naming another host (a CDN would route it there): refused
    fronted = ("import os, socket, ssl; ctx = ssl.create_default_context(); "
               "s = ctx.wrap_socket(socket.create_connection(('secret.test', 443), timeout=3), "
               "server_hostname='secret.test'); "
               "s.sendall(b'GET / HTTP/1.1\\r\\nHost: other.test\\r\\nAuthorization: ' + os.environ['API_KEY'].encode()"
               " + b'\\r\\n\\r\\n'); print(s.recv(100).split(b'\\r\\n')[0].decode())")
    assert sbx.commands.run(f'python3 -c "{fronted}"').stdout.strip() == "HTTP/1.1 421 Misdirected Request"
    assert value.encode() not in INTERNET_LOG.read_bytes()[len(before):]
    # HTTPS to that host without the placeholder goes through (read, re-encrypted, verified upstream)
    fine = ask(sbx, "get_with('https://other.test/ok', 'none')")
    assert fine.startswith("none|GET /ok HTTP/1.1"), fine
    events = list(sbx.events())
    assert any(e.get("rule") == "secret" and e.get("secrets") == ["API_KEY"] for e in events)
    assert any(e.get("rule") == "secret-elsewhere" and e.get("secret") == "API_KEY" for e in events)
    # the report's signatures: the secret used (named, info) and sent where it may not go
    sigs = {s["signature"]: s for s in sbx.report()["signatures"]}
    cited = {e["seq"]: e for e in events}
    assert sigs["secrets-used"]["severity"] == "info" and sigs["secrets-used"]["why"].endswith(": API_KEY")
    assert all(cited[q]["secrets"] == ["API_KEY"] for q in sigs["secrets-used"]["events"])
    assert sigs["secret-misuse"]["severity"] == "high" and "denied-egress" in sigs
    page = sbx.report(format="html")
    assert "Secrets used" in page and "API_KEY" in page and value not in page
    # no API response carries the value
    info = httpx.get(f"{egress_server.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": "x"}).text
    assert value not in info and "secret.test" in info
    assert value not in "".join(str(e) for e in events)


def test_secrets_are_checked(make) -> None:  # type: ignore[no-untyped-def]
    for bad, why in (({"1X": {"value": "12345678", "hosts": ["a.test"]}}, "environment variable name"),
                     ({"X": {"value": "", "hosts": ["a.test"]}}, "8 to"),
                     ({"X": {"value": "short", "hosts": ["a.test"]}}, "8 to"),
                     ({"X": {"value": "abcdefgh\nb", "hosts": ["a.test"]}}, "CR, LF"),
                     ({"X": {"value": "12345678", "hosts": ["https://a.test/"]}}, "not a host name")):
        with pytest.raises(InvalidArgumentException, match=why):
            make(secrets=bad)


# --- E2B's own network tests (packages/python-sdk/tests/sync/sandbox_sync/test_network.py and
# test_internet_access.py in e2b-dev/E2B), ported: the official SDK unchanged, curl in the sandbox, and
# this module's internet in place of 1.1.1.1 / 8.8.8.8 / connectivitycheck.gstatic.com.

@pytest.fixture
def e2b_factory(egress_server: ServerProcess) -> Iterator:
    import e2b

    made: list[e2b.Sandbox] = []

    def factory(**kwargs: object) -> e2b.Sandbox:
        sbx = e2b.Sandbox.create(**kwargs)  # type: ignore[arg-type]
        made.append(sbx)
        return sbx

    with e2b_pointed_at(egress_server.url):
        try:
            yield factory
        finally:
            for sbx in made:
                sbx.kill()


def _curl_ok(sbx, ip: str) -> bool:  # type: ignore[no-untyped-def]
    import e2b

    try:
        r = sbx.commands.run(f"curl -s -o /dev/null -w '%{{http_code}}' --connect-timeout 2 --max-time 4 http://{ip}/")
    except e2b.CommandExitException:
        return False
    return r.exit_code == 0 and r.stdout.strip() == "200"


def test_e2b_allow_specific_ip_with_deny_all(e2b_factory) -> None:  # type: ignore[no-untyped-def]
    from e2b import SandboxNetworkOpts

    sbx = e2b_factory(network=SandboxNetworkOpts(deny_out=lambda ctx: [ctx.all_traffic], allow_out=[WEB]))
    assert _curl_ok(sbx, WEB) and not _curl_ok(sbx, OTHER)


def test_e2b_deny_specific_ip_and_deny_all(e2b_factory) -> None:  # type: ignore[no-untyped-def]
    from e2b import SandboxNetworkOpts

    sbx = e2b_factory(network=SandboxNetworkOpts(deny_out=[OTHER]))
    assert not _curl_ok(sbx, OTHER) and _curl_ok(sbx, WEB)
    none = e2b_factory(network=SandboxNetworkOpts(deny_out=lambda ctx: [ctx.all_traffic]))
    assert not _curl_ok(none, WEB) and not _curl_ok(none, OTHER)


def test_e2b_allow_takes_precedence_over_deny_all(e2b_factory) -> None:  # type: ignore[no-untyped-def]
    from e2b import SandboxNetworkOpts

    sbx = e2b_factory(network=SandboxNetworkOpts(deny_out=lambda ctx: [ctx.all_traffic], allow_out=[WEB, OTHER]))
    assert _curl_ok(sbx, WEB) and _curl_ok(sbx, OTHER)


def test_e2b_update_network_applies_and_clears(e2b_factory) -> None:  # type: ignore[no-untyped-def]
    from e2b import SandboxNetworkOpts

    sbx = e2b_factory()
    assert _curl_ok(sbx, OTHER)
    sbx.update_network({"deny_out": [OTHER]})
    assert not _curl_ok(sbx, OTHER) and _curl_ok(sbx, WEB)
    only = e2b_factory(network=SandboxNetworkOpts(deny_out=lambda ctx: [ctx.all_traffic], allow_out=[WEB]))
    assert not _curl_ok(only, OTHER)
    only.update_network({})  # an empty update clears allow_out / deny_out entirely
    assert _curl_ok(only, WEB) and _curl_ok(only, OTHER)


def test_e2b_internet_access_enabled_disabled_default(e2b_factory) -> None:  # type: ignore[no-untyped-def]
    assert _curl_ok(e2b_factory(allow_internet_access=True), WEB)
    assert not _curl_ok(e2b_factory(allow_internet_access=False), WEB)
    assert _curl_ok(e2b_factory(), WEB)  # the SDK's default (True) and the server's default (on)


def test_e2b_firewall_transform_injects_headers(e2b_factory) -> None:  # type: ignore[no-untyped-def]
    import json as _json

    from e2b import SandboxNetworkOpts

    network: SandboxNetworkOpts = {"rules": {"secret.test": [{"transform": {"headers": {"X-Test-Token": "e2b-123"}}}]}}
    sbx = e2b_factory(network=network)
    r = sbx.commands.run("curl -sS --max-time 10 -H 'X-Test-Token: from-the-sandbox' https://secret.test/headers")
    head = r.stdout
    assert "x-test-token: e2b-123" in head.lower() and "from-the-sandbox" not in head  # set, not added
    info = sbx.get_info()
    assert info.network is not None and "secret.test" in _json.dumps(info.network.get("rules", {}))
    sbx.update_network({"rules": {}})
    # now straight to the host, whose certificate is the test CA's (not the sandbox's trust): -k
    assert "e2b-123" not in sbx.commands.run("curl -sSk --max-time 10 https://secret.test/headers").stdout


def test_secrets_in_bodies_are_opt_in(make) -> None:  # type: ignore[no-untyped-def]
    body_value, head_value = "body-" + os.urandom(8).hex(), "head-" + os.urandom(8).hex()
    sbx = make(secrets={"IN_BODY": {"value": body_value, "hosts": ["secret.test"], "bodies": True},
                        "HEAD_ONLY": {"value": head_value, "hosts": ["secret.test"]},
                        "ELSEWHERE": {"value": "x-" + os.urandom(8).hex(), "hosts": ["other.test"]}})
    post = ("import json, os, urllib.request\n"
            "def post(data):\n"
            "    req = urllib.request.Request('https://secret.test/v1', data=data.encode(), method='POST',"
            " headers={'Content-Type': 'application/json'})\n"
            "    try:\n"
            "        return urllib.request.urlopen(req, timeout=3).read().decode()\n"
            "    except Exception as e:\n"
            "        return type(e).__name__ + ': ' + str(e)\n")
    assert sbx.run_code(post).error is None
    before = len(INTERNET_LOG.read_bytes())
    out = ask(sbx, "post(json.dumps({'key': os.environ['IN_BODY'], 'other': os.environ['HEAD_ONLY']}))")
    sent = INTERNET_LOG.read_bytes()[before:]
    assert body_value.encode() in sent  # substituted in the body (opted in), Content-Length fixed
    assert head_value.encode() not in sent  # not opted in: the placeholder went as is
    assert body_value not in out and "IN_BODY".lower() in out  # the echo came back with the placeholder
    refused = ask(sbx, "post(json.dumps({'k': os.environ['ELSEWHERE']}))")
    assert "403" in refused  # another host's placeholder in a body: refused
