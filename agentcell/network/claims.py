"""Which host name a sandbox's outgoing connection claims, read from its first bytes.

A building block of issue 7 (docs/network.md): the egress proxy will hold a new connection to a
pinned address until its first bytes name a host (the TLS ClientHello's server_name, or the Host
header of an HTTP/1.x request). It then checks that name against the names the address was pinned
for, and only then splices the connection through. This module is the reading: `claimed_host()`
over the bytes received so far says
- *more*: not enough bytes yet;
- *none*: the protocol names no host (e.g. a ClientHello without SNI, or something else entirely);
- *the name*.

A parser here reads attacker-made bytes, so every length is checked against what is there, and
nothing is read past MAX_PEEK.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PEEK = 16 << 10  # bytes a connection may send before naming its host; past it, it names none
_HTTP_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"PATCH ", b"OPTIONS ", b"CONNECT ", b"TRACE ")


@dataclass(frozen=True)
class Claim:
    kind: str  # "tls", "http" or "none"
    host: str | None  # lower-case, no port, no trailing dot; None for "none"


MORE = None  # claimed_host() when it needs more bytes


def claimed_host(data: bytes) -> Claim | None:
    """The host `data` (a connection's first bytes) claims, or MORE when it cannot tell yet."""
    if not data:
        return MORE
    if data[0] == 0x16:  # TLS handshake record
        return _tls(data)
    if any(m.startswith(data[: len(m)]) for m in _HTTP_METHODS):
        return _http(data)
    return Claim("none", None)


def _tls(data: bytes) -> Claim | None:
    # record: type(1) version(2) length(2); the ClientHello may span records, but a first record
    # of up to 16 KiB holds it in practice (browsers, OpenSSL, Go); a longer one is read whole.
    if len(data) < 5:
        return MORE
    record_len = int.from_bytes(data[3:5], "big")
    if record_len > MAX_PEEK:
        return Claim("none", None)
    if len(data) < 5 + record_len:
        return MORE if len(data) < MAX_PEEK else Claim("none", None)
    hello = data[5 : 5 + record_len]
    if len(hello) < 4 or hello[0] != 0x01:  # handshake type client_hello
        return Claim("none", None)
    body_len = int.from_bytes(hello[1:4], "big")
    body = hello[4 : 4 + body_len]
    if len(body) != body_len:
        return Claim("none", None)  # split over records: no name from us (refused by the caller)
    name = _sni(body)
    return Claim("tls", name) if name else Claim("none", None)


def _sni(body: bytes) -> str | None:
    pos = 2 + 32  # client_version, random
    pos = _skip(body, pos, 1)  # session_id
    pos = _skip(body, pos, 2)  # cipher_suites
    pos = _skip(body, pos, 1)  # compression_methods
    if pos is None or pos + 2 > len(body):
        return None
    end = pos + 2 + int.from_bytes(body[pos : pos + 2], "big")
    if end > len(body):
        return None
    pos += 2
    names = []
    while pos + 4 <= end:
        ext_type = int.from_bytes(body[pos : pos + 2], "big")
        ext_len = int.from_bytes(body[pos + 2 : pos + 4], "big")
        ext = body[pos + 4 : pos + 4 + ext_len]
        if len(ext) != ext_len:
            return None
        if ext_type == 0:  # server_name
            names.append(_server_name(ext))
        pos += 4 + ext_len
    if len(names) != 1 or names[0] is None:  # none, or a duplicate extension: no single claim
        return None
    return names[0]


def _server_name(ext: bytes) -> str | None:
    if len(ext) < 2 or int.from_bytes(ext[:2], "big") != len(ext) - 2:
        return None
    pos, found = 2, []
    while pos + 3 <= len(ext):
        kind, n = ext[pos], int.from_bytes(ext[pos + 1 : pos + 3], "big")
        value = ext[pos + 3 : pos + 3 + n]
        if len(value) != n:
            return None
        if kind == 0:  # host_name
            found.append(value)
        pos += 3 + n
    if len(found) != 1:
        return None
    return _clean(found[0])


def _skip(body: bytes, pos: int | None, width: int) -> int | None:
    if pos is None or pos + width > len(body):
        return None
    end = pos + width + int.from_bytes(body[pos : pos + width], "big")
    return end if end <= len(body) else None


def _http(data: bytes) -> Claim | None:
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return MORE if len(data) < MAX_PEEK else Claim("none", None)
    lines = data[:head_end].split(b"\r\n")
    hosts = [line.split(b":", 1)[1] for line in lines[1:] if line[:5].lower() == b"host:"]
    if len(hosts) != 1:  # none, or two Host headers (a smuggling classic): no single claim
        return Claim("none", None)
    value = hosts[0].strip()
    if value.startswith(b"["):  # [v6]:port
        value = value[1 : value.find(b"]")] if b"]" in value else b""
    elif value.count(b":") == 1:
        value = value.split(b":", 1)[0]
    name = _clean(value)
    return Claim("http", name) if name else Claim("none", None)


def _clean(raw: bytes) -> str | None:
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    text = text.strip().rstrip(".").lower()
    if not text or len(text) > 253 or any(c.isspace() or c in "/\\@#?" for c in text):
        return None
    return text
