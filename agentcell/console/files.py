"""The file browser's API: list a directory, download a file, upload one (the raw body).

Each is the sandbox's own envd call, made through the server's router with the sandbox's access
token (filesystem.Filesystem/ListDir, GET /files, POST /files as octet-stream), as the SDK makes
it; the bytes stream both ways and the server's upload limit applies.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote, urlencode

from starlette.responses import JSONResponse

from agentcell.console.responses import error
from agentcell.console.upstream import ENVD, Upstream, UpstreamError, error_message

_TYPES = {"FILE_TYPE_FILE": "file", "FILE_TYPE_DIRECTORY": "dir", "FILE_TYPE_SYMLINK": "symlink"}
_AS_USER = [(b"authorization", b"Basic dXNlcjo=")]  # base64("user:"): as the sandbox's user, as the SDKs


def _query(**params: str) -> bytes:
    return urlencode(params).encode()


async def list_dir(upstream: Upstream, outer: dict[str, Any], sandbox_id: str, path: str) -> dict[str, Any]:
    scope = await upstream.sandbox_scope(outer, sandbox_id, ENVD, "POST", "/filesystem.Filesystem/ListDir",
                                         headers=[(b"content-type", b"application/json"),
                                                  (b"connect-protocol-version", b"1"), *_AS_USER])
    reply = await upstream.request(scope, json.dumps({"path": path, "depth": 1}).encode())
    if reply.status != 200:
        raise UpstreamError(reply.status if reply.status < 500 else 502, error_message(reply.body, reply.status))
    entries = []
    for e in (reply.json() or {}).get("entries", []):
        entries.append({"name": e.get("name"), "path": e.get("path"), "type": _TYPES.get(e.get("type"), "file"),
                        "size": int(e.get("size") or 0), "modified": e.get("modifiedTime")})
    entries.sort(key=lambda e: (e["type"] != "dir", str(e["name"])))
    return {"path": path, "entries": entries}


async def download(upstream: Upstream, outer: dict[str, Any], sandbox_id: str, path: str,
                   receive: Any, send: Any) -> None:
    scope = await upstream.sandbox_scope(outer, sandbox_id, ENVD, "GET", "/files",
                                         _query(path=path, username="user"), _AS_USER)
    stream = await upstream.stream(scope)
    try:
        if stream.status != 200:
            body = await stream.read(64 << 10)
            await error(stream.status, error_message(body, stream.status))(outer, receive, send)
            return
        name = path.rstrip("/").rsplit("/", 1)[-1] or "download"
        headers = [(b"content-type", b"application/octet-stream"),
                   (b"content-disposition", f"attachment; filename*=UTF-8''{quote(name)}".encode())]
        if (length := stream.header(b"content-length")) is not None:
            headers.append((b"content-length", length.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for chunk in stream.chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await stream.close()


async def upload(upstream: Upstream, outer: dict[str, Any], sandbox_id: str, path: str,
                 receive: Any, send: Any) -> None:
    headers = [(b"content-type", b"application/octet-stream"), *_AS_USER]
    length = next((v for k, v in outer.get("headers", []) if k.lower() == b"content-length"), None)
    headers.append((b"content-length", length) if length is not None else (b"transfer-encoding", b"chunked"))
    scope = await upstream.sandbox_scope(outer, sandbox_id, ENVD, "POST", "/files",
                                         _query(path=path, username="user"), headers)
    size = 0

    async def counted() -> dict[str, Any]:
        nonlocal size
        message = await receive()
        size += len(message.get("body", b""))
        return message

    answer: dict[str, Any] = {}
    body = bytearray()

    async def held(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        else:
            if len(body) < 64 << 10:
                body.extend(message.get("body", b""))

    await upstream.router(scope, counted, held)
    status = int(answer.get("status", 502))
    if status != 200:
        await error(status, error_message(bytes(body), status))(outer, receive, send)
        return
    await JSONResponse({"path": path, "size": size})(outer, receive, send)
