"""network/redaction.py: every form of a secret's value comes out of an answer, however it is cut."""

from __future__ import annotations

import base64
import gzip
import json
import os
import random
import urllib.parse
import zlib

from agentcell.network.redaction import BodyDecoder, Redactor


def _b64(text: bytes) -> bytes:
    return base64.b64decode(text + b"=" * (-len(text) % 4))


def _b64url(text: bytes) -> bytes:
    return base64.urlsafe_b64decode(text + b"=" * (-len(text) % 4))


def _stream(redactor: Redactor, data: bytes, rng: random.Random) -> bytes:
    out, i = b"", 0
    while i < len(data):
        n = rng.randint(1, 40)
        out += redactor.feed(data[i:i + n])
        i += n
    return out + redactor.feed(b"", final=True)


def test_every_form_of_a_value_is_taken_out_wherever_it_is_cut() -> None:
    rng = random.Random(3)
    for _ in range(30):
        value = os.urandom(rng.randint(8, 40)).hex()[: rng.randint(8, 60)].encode() + b"/+=?&\"\\ "[: rng.randint(0, 8)]
        placeholder = b"agentcell-secret-k-" + os.urandom(16).hex().encode()
        for prefix in (b"", b"x", b"xy"):  # every alignment inside a longer Base64 text
            carriers = [value, value.hex().encode(), value.hex().upper().encode(),
                        base64.b64encode(prefix + value + b"tail"), base64.urlsafe_b64encode(prefix + value + b"t"),
                        base64.b64encode(prefix + value).rstrip(b"="),
                        urllib.parse.quote(value.decode(), safe="").encode(),
                        urllib.parse.quote_plus(value.decode(), safe="").encode(),
                        json.dumps({"k": value.decode()}).encode()]
            for carrier in carriers:
                text = b"before " + carrier + b" after"
                out = _stream(Redactor([(value, placeholder)]), text, rng)
                # the form the value had there is gone, the placeholder (in that form) in its place
                assert value not in out and carrier not in out, (value, carrier, out)
                readable = [out, out.replace(b"before ", b"").replace(b" after", b"")]
                for undo in (_b64, _b64url, lambda b: bytes.fromhex(b.decode())):
                    try:
                        readable.append(undo(readable[1]))
                    except ValueError:
                        pass
                assert any(placeholder[:48] in r for r in readable), (carrier, out)


def test_text_without_a_value_passes_unchanged() -> None:
    redactor = Redactor([(b"sk-0123456789abcdef", b"agentcell-secret-k-0")])
    data = os.urandom(1 << 16)
    assert _stream(redactor, data, random.Random(1)) == data


def test_gzip_and_deflate_bodies_are_read() -> None:
    payload = os.urandom(2000).hex().encode() * 50
    for coding, packed in (("gzip", gzip.compress(payload)), ("deflate", zlib.compress(payload)),
                           ("deflate", zlib.compress(payload, wbits=-15))):
        decoder = BodyDecoder(coding, chunk=1000)
        out = b"".join(b"".join(decoder.feed(packed[i:i + 333])) for i in range(0, len(packed), 333)) + decoder.end()
        assert out == payload, coding
