"""Which host name a sandbox's outgoing connection claims, read from its first bytes.

The egress proxy holds a new intercepted connection until its first bytes name a host (the TLS
ClientHello's server_name, or the Host of an HTTP/1.x request), checks that name against the
sandbox's policy, and only then lets the connection on (docs/network.md). `claimed_host()` over the
bytes received so far says
- *more*: not enough bytes yet;
- *none*: the bytes name no single host: no SNI, two of them, no Host or two, something that is
  neither TLS nor HTTP/1.x. Where the sandbox has name rules, a connection that names none is
  refused: what the proxy cannot read, it does not pass;
- *the name*.

What it reads as an attacker would send it: a ClientHello split over several TLS records (legal, and
a classic way past SNI filters) is put back together; any request method that is an HTTP token, in
any case, is read as HTTP. This is only the connection's *first* claim: every request that follows on
it is read again by the proxy (inspection.py) and must name the same host.

A parser here reads attacker-made bytes, so every length is checked against what is there, and
nothing is read past MAX_PEEK.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_PEEK = 16 << 10  # bytes a connection may send before naming its host; past it, it names none
_HANDSHAKE, _CLIENT_HELLO = 0x16, 0x01
_TOKEN = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 tchar: every method is one
_VERSION = re.compile(rb"^HTTP/\d\.\d$")
_REQUEST_START = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}( |$)")


@dataclass(frozen=True)
class Claim:
    kind: str  # "tls", "http" or "none"
    host: str | None  # lower-case, no port, no trailing dot; None for "none"


MORE = None  # claimed_host() when it needs more bytes
NONE = Claim("none", None)


def claimed_host(data: bytes) -> Claim | None:
    """The host `data` (a connection's first bytes) claims, or MORE when it cannot tell yet."""
    if not data:
        return MORE
    if data[0] == _HANDSHAKE:
        return _tls(data)
    if _REQUEST_START.match(data[:33]) or (len(data) < 33 and _TOKEN.match(data)):
        return _http(data)
    return NONE


def client_hello(data: bytes) -> bytes | None:
    """The ClientHello message's body from the TLS records at the start of `data`, put together from
    as many handshake records as it spans; b"" when more bytes are needed, None when these are not one."""
    message = b""
    pos = 0
    while True:
        if len(data) < pos + 5:
            return b"" if len(data) < MAX_PEEK else None
        if data[pos] != _HANDSHAKE or data[pos + 1] != 0x03:
            return None  # an alert, application data, SSLv2 ... before the hello is whole
        length = int.from_bytes(data[pos + 3 : pos + 5], "big")
        if length == 0 or length > 1 << 14:
            return None
        fragment = data[pos + 5 : pos + 5 + length]
        if len(fragment) < length:
            return b"" if len(data) < MAX_PEEK else None
        message += fragment
        pos += 5 + length
        if len(message) >= 4:
            if message[0] != _CLIENT_HELLO:
                return None
            needed = 4 + int.from_bytes(message[1:4], "big")
            if needed > MAX_PEEK:
                return None
            if len(message) >= needed:
                return message[4:needed]
        if pos >= MAX_PEEK:
            return None


def _tls(data: bytes) -> Claim | None:
    body = client_hello(data)
    if body == b"":
        return MORE
    if body is None:
        return NONE
    name = _sni(body)
    return Claim("tls", name) if name else NONE


def _sni(body: bytes) -> str | None:
    pos: int | None = 2 + 32  # client_version, random
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
    return clean_host(found[0])


def _skip(body: bytes, pos: int | None, width: int) -> int | None:
    if pos is None or pos + width > len(body):
        return None
    end = pos + width + int.from_bytes(body[pos : pos + width], "big")
    return end if end <= len(body) else None


def _http(data: bytes) -> Claim | None:
    line_end = data.find(b"\r\n")
    if line_end < 0:  # the request line is not whole yet (a bare LF ends nothing here: not ours to read)
        return NONE if b"\n" in data or len(data) >= MAX_PEEK else MORE
    parts = data[:line_end].split(b" ")
    if len(parts) != 3 or not _TOKEN.match(parts[0]) or not _VERSION.match(parts[2]):
        return NONE  # (a protocol that merely starts like a word, SSH's banner say, is told at once)
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return MORE if len(data) < MAX_PEEK and b"\n\n" not in data else NONE
    lines = data[:head_end].split(b"\r\n")
    hosts = [line.split(b":", 1)[1] for line in lines[1:] if line[:5].lower() == b"host:"]
    if any(b"\n" in line or b"\r" in line for line in lines) or len(hosts) > 1:
        return NONE  # a bare LF or CR, or two Host headers: parsers disagree on these (smuggling)
    named = {h for h in (authority_host(hosts[0].strip()) if hosts else None, _absolute_host(parts[1])) if h}
    if len(named) != 1:  # none, or a Host and an absolute target that differ
        return NONE
    return Claim("http", named.pop())


def _absolute_host(target: bytes) -> str | None:
    lower = target.lower()
    if not lower.startswith((b"http://", b"https://")):
        return None
    return authority_host(target.split(b"/", 3)[2])


def authority_host(value: bytes) -> str | None:
    """The host of an authority (`name[:port]`, `[v6]:port`), cleaned; None if it is not one."""
    if b"@" in value:
        return None  # userinfo: not in a Host, and a way to make two parsers see two hosts
    if value.startswith(b"["):  # [v6]:port
        value = value[1 : value.find(b"]")] if b"]" in value else b""
    elif value.count(b":") == 1:
        value, _, port = value.partition(b":")
        if port and not port.isdigit():
            return None
    return clean_host(value)


def clean_host(raw: bytes) -> str | None:
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    text = text.strip().rstrip(".").lower()
    if not text or len(text) > 253 or any(c.isspace() or c in "/\\@#?%" or ord(c) < 0x21 for c in text):
        return None
    return text
