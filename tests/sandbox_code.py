"""Code that tests, and benchmarks/egress_hardening.py, run inside sandboxes, as source text.

HELLO: `hello(sni)`, a real TLS ClientHello naming `sni` (the first bytes a TLS client sends), and
`split_hello(sni)`, the same in two TLS records. FLOOD adds `flood(seconds)`: 24 threads opening
connections to 203.0.113.10:443 that send a ClientHello naming a new host each (a certificate to mint,
a handshake to do, for a proxy that terminates TLS) and read the first answer; it returns how many
connections it tried.
"""

HELLO = r'''
import socket, ssl, threading, time
_CTX = ssl.create_default_context()  # (made once: loading the trust store takes tens of ms)
def hello(sni):
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = _CTX.wrap_bio(incoming, outgoing, server_hostname=sni)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()
def split_hello(sni, at=40):
    """The ClientHello for `sni` in two TLS records (legal; SNI filters that read one record miss it)."""
    rec = hello(sni)
    body = rec[5:]
    return (rec[:3] + len(body[:at]).to_bytes(2, "big") + body[:at]
            + rec[:3] + len(body[at:]).to_bytes(2, "big") + body[at:])
'''

FLOOD = HELLO + r'''
def flood(seconds, threads=24):
    end, tried = time.monotonic() + seconds, []
    def one():
        while time.monotonic() < end:
            try:
                tried.append(1)
                data = hello(f"h{len(tried)}-{threading.get_ident()}.flood.test")  # a new name: a new certificate
                s = socket.create_connection(("203.0.113.10", 443), timeout=2)
                s.sendall(data)
                s.recv(4096)
                s.close()
            except OSError:
                time.sleep(0.01)
    ts = [threading.Thread(target=one) for _ in range(threads)]
    for t in ts: t.start()
    for t in ts: t.join()
    return len(tried)
'''
