"""A small HTTP + WebSocket server that tests/test_ports.py runs inside a sandbox (stdlib only).

python port_server.py PORT [HOST]. Routes: /echo (method, path, headers and body as JSON), /big?n=
(n bytes, Content-Length), /chunked?n= (chunked), /close (close-delimited body), /malformed (not
HTTP), /slow (writes until the client goes, then creates /tmp/slow-closed), /sink?delay= (reads the
body late; its size and hash), /ws (WebSocket echo).
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

PATTERN = bytes(range(256)) * 256  # 64 KiB
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        n = int(parse_qs(url.query).get("n", ["0"])[0])
        if url.path == "/echo":
            body = self._body()
            info = {"method": self.command, "path": self.path, "headers": [[k.lower(), v] for k, v in self.headers.items()],
                    "body": body.decode("latin-1")}
            self._send(200, json.dumps(info).encode())
        elif url.path == "/sink":  # reads the body only after `delay` s, then in small pieces
            time.sleep(float(parse_qs(url.query).get("delay", ["0"])[0]))
            digest, size, left = hashlib.sha256(), 0, int(self.headers.get("content-length") or 0)
            while left:
                piece = self.rfile.read(min(left, 65536))
                digest.update(piece)
                size += len(piece)
                left -= len(piece)
            self._send(200, json.dumps({"size": size, "sha256": digest.hexdigest()}).encode())
        elif url.path == "/big":
            self.send_response(200)
            self.send_header("content-type", "application/octet-stream")
            self.send_header("content-length", str(n))
            self.end_headers()
            self._stream(n)
        elif url.path == "/chunked":
            self.send_response(200)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            left = n
            while left:
                piece = PATTERN[: min(left, len(PATTERN))]
                self.wfile.write(b"%x\r\n%b\r\n" % (len(piece), piece))
                left -= len(piece)
            self.wfile.write(b"0\r\n\r\n")
        elif url.path == "/close":
            self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\nuntil the end")
            self.close_connection = True
        elif url.path == "/malformed":
            self.wfile.write(b"THIS IS NOT HTTP\r\n\r\n")
            self.close_connection = True
        elif url.path == "/slow":
            self.send_response(200)
            self.send_header("content-type", "text/plain")
            self.end_headers()
            try:
                while True:
                    self.wfile.write(PATTERN[:1024])
                    self.wfile.flush()
                    time.sleep(0.02)
            except OSError:
                open("/tmp/slow-closed", "w").close()
                self.close_connection = True
        elif url.path == "/ws":
            self._websocket()
        else:
            self._send(404, b'{"error": "no such path"}')

    def _stream(self, n: int) -> None:
        left = n
        while left:
            piece = PATTERN[: min(left, len(PATTERN))]
            self.wfile.write(piece)
            left -= len(piece)

    def _websocket(self) -> None:
        key = self.headers["sec-websocket-key"]
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("upgrade", "websocket")
        self.send_header("connection", "Upgrade")
        self.send_header("sec-websocket-accept", accept)
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        while True:
            frame = read_frame(self.rfile)
            if frame is None:
                return
            opcode, payload = frame
            if opcode == 8:  # close: answer it and end
                self.wfile.write(encode_frame(8, payload[:2]))
                return
            if opcode == 9:  # ping
                self.wfile.write(encode_frame(10, payload))
            elif opcode in (1, 2):
                self.wfile.write(encode_frame(opcode, payload))
            self.wfile.flush()


def read_frame(f) -> tuple[int, bytes] | None:  # type: ignore[no-untyped-def]
    head = f.read(2)
    if len(head) < 2:
        return None
    opcode, length = head[0] & 0x0F, head[1] & 0x7F
    if length == 126:
        length = struct.unpack(">H", f.read(2))[0]
    elif length == 127:
        length = struct.unpack(">Q", f.read(8))[0]
    mask = f.read(4) if head[1] & 0x80 else b"\0\0\0\0"
    data = f.read(length)
    return opcode, bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def encode_frame(opcode: int, payload: bytes) -> bytes:
    n = len(payload)
    head = bytes([0x80 | opcode])
    if n < 126:
        head += bytes([n])
    elif n < 1 << 16:
        head += bytes([126]) + struct.pack(">H", n)
    else:
        head += bytes([127]) + struct.pack(">Q", n)
    return head + payload


if __name__ == "__main__":
    host = sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"
    ThreadingHTTPServer.address_family = __import__("socket").AF_INET6 if ":" in host else __import__("socket").AF_INET
    ThreadingHTTPServer((host, int(sys.argv[1])), Handler).serve_forever()
