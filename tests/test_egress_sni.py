"""network/claims.py on real first bytes: ClientHellos made by OpenSSL (Python's ssl), HTTP requests,
and mutations of both (the parser reads attacker-made bytes: it must answer, never raise)."""

from __future__ import annotations

import random
import ssl

from agentcell.network.claims import MAX_PEEK, MORE, Claim, claimed_host


def client_hello(server_hostname: str | None) -> bytes:
    ctx = ssl.create_default_context()
    if server_hostname is None:
        ctx.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def test_tls_server_name() -> None:
    hello = client_hello("API.Example.com")
    assert claimed_host(hello) == Claim("tls", "api.example.com")
    for cut in (1, 4, 5, 100, len(hello) - 1):  # a ClientHello that arrives in pieces
        assert claimed_host(hello[:cut]) is MORE
    assert claimed_host(hello + b"more bytes after it") == Claim("tls", "api.example.com")


def test_tls_without_a_name_claims_none() -> None:
    assert claimed_host(client_hello(None)) == Claim("none", None)
    assert claimed_host(client_hello("203.0.113.10")) == Claim("none", None)  # no SNI for an IP literal


def test_http_host() -> None:
    req = b"GET /x HTTP/1.1\r\nUser-Agent: t\r\nHost: Example.COM:8080\r\n\r\n"
    assert claimed_host(req) == Claim("http", "example.com")
    assert claimed_host(req[:20]) is MORE
    assert claimed_host(b"POST / HTTP/1.1\r\nhost: [2001:db8::1]:80\r\n\r\n") == Claim("http", "2001:db8::1")
    assert claimed_host(b"GE") is MORE


def test_ambiguous_or_absent_names_claim_none() -> None:
    two = b"GET / HTTP/1.1\r\nHost: allowed.example\r\nHost: evil.example\r\n\r\n"
    assert claimed_host(two) == Claim("none", None)
    assert claimed_host(b"GET / HTTP/1.0\r\n\r\n") == Claim("none", None)
    assert claimed_host(b"GET / HTTP/1.1\r\nHost: a/b@evil\r\n\r\n") == Claim("none", None)
    assert claimed_host(b"SSH-2.0-OpenSSH_9.2\r\n") == Claim("none", None)
    assert claimed_host(b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_PEEK) == Claim("none", None)  # never ends


def test_mutated_inputs_never_raise() -> None:
    rng = random.Random(7)
    seeds = [client_hello("mutate.example"), b"GET / HTTP/1.1\r\nHost: mutate.example\r\n\r\n"]
    for _ in range(20000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            i = rng.randrange(len(data))
            if op < 0.5:
                data[i] = rng.randrange(256)
            elif op < 0.8:
                del data[i : i + rng.randint(1, 16)]
            else:
                data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            if not data:
                data = bytearray(b"\x16")
        claim = claimed_host(bytes(data))
        assert claim is MORE or claim.kind in ("tls", "http", "none")
        if claim is not MORE and claim.host is not None:
            assert claim.host == claim.host.lower() and len(claim.host) <= 253


def _split(hello: bytes, *cuts: int) -> bytes:
    """The same handshake message in several TLS records, cut at `cuts` (bytes into the message)."""
    body, out, start = hello[5:], b"", 0
    for end in (*cuts, len(hello) - 5):
        out += hello[:3] + (end - start).to_bytes(2, "big") + body[start:end]
        start = end
    return out


def test_a_client_hello_split_over_records_is_read_whole() -> None:
    hello = client_hello("denied.example")
    for cuts in ((1,), (40,), (3, 4), (100, 101, 300)):
        split = _split(hello, *cuts)
        assert claimed_host(split) == Claim("tls", "denied.example"), cuts
        assert claimed_host(split[:-1]) is MORE
    # an alert between the pieces, a record of another type: not a hello, no name
    parts = _split(hello, 40)
    alert = b"\x15\x03\x03\x00\x02\x01\x00"
    assert claimed_host(parts[: 5 + 40] + alert + parts[5 + 40:]) == Claim("none", None)


def test_any_method_in_any_case_is_read_as_http() -> None:
    for method in (b"PROPFIND", b"get", b"M-SEARCH", b"X"):
        assert claimed_host(method + b" / HTTP/1.1\r\nHost: denied.example\r\n\r\n") == Claim("http", "denied.example")
    # what parsers disagree on names nothing (refused where a name rule exists)
    for bad in (b"GET / HTTP/1.1\nHost: denied.example\n\n", b"GET /\tHTTP/1.1\r\nHost: denied.example\r\n\r\n",
                b"GET http://other.example/ HTTP/1.1\r\nHost: denied.example\r\n\r\n",
                b"GET / HTTP/1.1\r\nHost: denied.example\r\nHost: denied.example\r\n\r\n",
                b"GET / HTTP/1.1\r\nHost: user@denied.example\r\n\r\n", b"NOTHTTP\x00 / x\r\n\r\n"):
        assert claimed_host(bad) == Claim("none", None), bad
    assert claimed_host(b"GET http://Denied.Example:80/x HTTP/1.0\r\n\r\n") == Claim("http", "denied.example")
