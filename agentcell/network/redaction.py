"""Secret values taken out of what comes back to a sandbox (docs/network.md, "Secrets").

A host a secret is for may echo it (a debugging endpoint, an error message that quotes the request).
The proxy reads every answer to a sandbox that has secrets as HTTP (inspection.py), after its transfer
coding is undone (chunks joined), and replaces every secret's value by its placeholder wherever it shows
up in the status line's headers, the body and the trailers, in any of these forms:

- as it is;
- Base64 (standard and URL-safe alphabets, padded or not), at any of the three alignments a value can
  have inside a longer Base64 text: the part of the encoding that depends on the value alone is found;
- hexadecimal (lower and upper case);
- percent-encoded (every reserved byte, and the form-encoding variant with `+` for spaces);
- inside a JSON string (its escapes of quotes, backslashes, slashes and control characters).

A body with a `Content-Encoding` of gzip or deflate is decoded first (the sandbox then gets it
decoded, without that header); requests from such a sandbox offer no other encoding (`Accept-Encoding`
is narrowed to gzip, deflate, identity), and an answer in another one is refused (502), never passed
unread. Whatever else a host may do to a value (encrypt it, split it across fields, a custom encoding)
cannot be caught: a secret is only as safe as the hosts it is given to.

Because values and placeholders differ in length, a redacted body changes length: the proxy frames
every answer it rewrites afresh (chunked to HTTP/1.1 clients, to the connection's end for HTTP/1.0)
and drops the `Content-Length` it no longer matches, so the sandbox always gets well-formed HTTP.
"""

from __future__ import annotations

import base64
import json
import urllib.parse
import zlib

DECODABLE = ("gzip", "x-gzip", "deflate")


def forms(value: bytes, placeholder: bytes) -> list[tuple[bytes, bytes]]:
    """(form of `value`, what replaces it) for every form the redactor looks for (see the module
    docstring), longest first. An encoded form is replaced by the placeholder in the same encoding,
    so that a Base64 or hex text stays one (it decodes to the placeholder, give or take the two
    bytes a value shares with its neighbours in a Base64 group)."""
    found = {value: placeholder, value.hex().encode(): placeholder.hex().encode(),
             value.hex().upper().encode(): placeholder.hex().upper().encode()}
    stand_in = placeholder[: len(placeholder) // 3 * 3]
    for offset in range(3):  # where the value starts in a 3-byte group of the surrounding text
        start = (3 - offset) % 3
        whole = value[start:][: (len(value) - start) // 3 * 3]
        if len(whole) >= 6:
            core, other = base64.b64encode(whole), base64.b64encode(stand_in)
            found[core] = other
            found[core.translate(_URL_SAFE)] = other.translate(_URL_SAFE)
    text = value.decode("utf-8", "replace")
    for form in (urllib.parse.quote(text, safe=""), urllib.parse.quote_plus(text, safe=""), json.dumps(text)[1:-1],
                 json.dumps(text, ensure_ascii=False)[1:-1]):
        found.setdefault(form.encode(), placeholder)  # (a placeholder needs no escaping in any of these)
    return sorted(((f, r) for f, r in found.items() if len(f) >= 8), key=lambda p: len(p[0]), reverse=True)


_URL_SAFE = bytes.maketrans(b"+/", b"-_")


class Redactor:
    """Replaces every form of each value by the value's placeholder, in a stream cut anywhere."""

    def __init__(self, pairs: list[tuple[bytes, bytes]]) -> None:
        self.pairs = [pair for value, placeholder in pairs for pair in forms(value, placeholder)]
        self.keep = max((len(f) for f, _ in self.pairs), default=1) - 1
        self.tail = b""

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def text(self, data: bytes) -> bytes:
        """`data` redacted as a whole (a header value)."""
        for form, placeholder in self.pairs:
            if form in data:
                data = data.replace(form, placeholder)
        return data

    def feed(self, data: bytes, final: bool = False) -> bytes:
        buf = self.text(self.tail + data)
        if final or self.keep <= 0:
            self.tail = b""
            return buf
        # a value may start in the last `keep` bytes: hold them back for the next piece
        self.tail, out = buf[-self.keep:], buf[:-self.keep]
        return out


class BodyDecoder:
    """A gzip or deflate body undone as it arrives, at most `chunk` bytes of output a step (a small
    compressed body may expand a lot: the output is handed on piece by piece)."""

    def __init__(self, coding: str, chunk: int = 64 << 10) -> None:
        self.coding = coding
        self.chunk = chunk
        self.raw_deflate = False
        self.d = zlib.decompressobj(16 + zlib.MAX_WBITS if coding in ("gzip", "x-gzip") else zlib.MAX_WBITS)
        self.started = False

    def feed(self, data: bytes) -> list[bytes]:
        out = []
        try:
            piece = self.d.decompress(data, self.chunk)
        except zlib.error:
            if self.coding != "deflate" or self.started or self.raw_deflate:
                raise
            # "deflate" is meant to be zlib-wrapped, but some servers send it raw
            self.raw_deflate = True
            self.d = zlib.decompressobj(-zlib.MAX_WBITS)
            piece = self.d.decompress(data, self.chunk)
        self.started = True
        out.append(piece)
        while self.d.unconsumed_tail:
            out.append(self.d.decompress(self.d.unconsumed_tail, self.chunk))
        return [p for p in out if p]

    def end(self) -> bytes:
        return self.d.flush()
