"""envd's plain HTTP endpoints: GET /health, GET /files (download), POST /files (upload).

The root router has already checked the access token or the URL signature (auth.py).
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentcell.errors import SandboxError
from agentcell.runtime.protocol import Frame
from agentcell.server.errors import HTTPError, from_sandbox_error
from agentcell.server.streams import agent_call, current_sandbox


def _check_user(request: Request) -> None:
    user = request.query_params.get("username")
    if user in (None, "", "user"):
        return
    if user == "root":
        raise HTTPError(401, "running as root is not supported: files are owned by the sandbox user 'user'")
    raise HTTPError(401, f"unknown user '{user}': the only user is 'user'")


def _required_path(request: Request) -> str:
    path = request.query_params.get("path")
    if not path:
        raise HTTPError(400, "the 'path' query parameter is required")
    return path


async def health(request: Request) -> Response:
    return Response(status_code=204)


async def download(request: Request) -> Response:
    path = _required_path(request)
    _check_user(request)
    stream = current_sandbox.get().channel.stream("fs.read", path=path)
    # Wait for the first frame so that not_found / a directory become proper HTTP errors.
    try:
        first: Frame | None = await anext(stream)
    except StopAsyncIteration:
        first = None
    except SandboxError as e:
        raise from_sandbox_error(e) from None
    gzip_ok = "gzip" in request.headers.get("accept-encoding", "").lower()

    async def body() -> AsyncIterator[bytes]:
        compressor = zlib.compressobj(6, zlib.DEFLATED, 31) if gzip_ok else None
        try:
            frame = first
            while frame is not None:
                if frame.header.get("event") == "data" and frame.payload:
                    yield compressor.compress(frame.payload) if compressor else frame.payload
                try:
                    frame = await anext(stream)
                except StopAsyncIteration:
                    frame = None
            if compressor:
                yield compressor.flush()
        finally:
            await stream.aclose()

    headers = {"Content-Disposition": f'attachment; filename="{path.rsplit("/", 1)[-1]}"'}
    if gzip_ok:
        headers["Content-Encoding"] = "gzip"
    return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)


def _metadata(request: Request) -> dict[str, str] | None:
    meta: dict[str, str] = {}
    for key, value in request.headers.items():
        if key.startswith("x-metadata-"):
            name = key[len("x-metadata-") :]
            if not name or not all(33 <= ord(c) < 127 for c in name) or not all(32 <= ord(c) < 127 for c in value):
                raise HTTPError(400, f"invalid metadata header {key!r}: keys and values must be printable ASCII")
            meta[name] = value
    return meta or None


async def _bounded_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise HTTPError(413, f"the upload is larger than the server's limit of {limit >> 20} MiB")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"the upload is larger than the server's limit of {limit >> 20} MiB")
        chunks.append(chunk)
    return b"".join(chunks)


def _gunzip(data: bytes, limit: int) -> bytes:
    d = zlib.decompressobj(47)  # gzip or zlib header
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as e:
        raise HTTPError(400, f"the body is not valid gzip: {e}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise HTTPError(413, f"the decompressed upload is larger than the server's limit of {limit >> 20} MiB")
    return out


async def _write(path: str, data: bytes, metadata: dict[str, str] | None) -> dict[str, Any]:
    try:
        header = await agent_call("fs.write", data, path=path, metadata=metadata)
    except SandboxError as e:
        raise from_sandbox_error(e) from None
    entry: Any = header.get("entry") or {}
    info: dict[str, Any] = {"path": entry.get("path", path), "name": entry.get("name", path.rsplit("/", 1)[-1]), "type": "file"}
    if entry.get("metadata"):
        info["metadata"] = entry["metadata"]
    return info


def upload_handler(max_bytes: int):  # type: ignore[no-untyped-def]
    async def upload(request: Request) -> Response:
        query_path = request.query_params.get("path")
        _check_user(request)
        metadata = _metadata(request)
        content_type = request.headers.get("content-type", "")
        raw = await _bounded_body(request, max_bytes)
        if content_type.startswith("multipart/form-data"):
            request._body = raw  # request.form() re-reads the (already bounded) body
            try:
                form = await request.form(max_files=1000, max_fields=1000)
            except Exception as e:
                raise HTTPError(400, f"invalid multipart body: {e}") from None
            try:
                parts = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
                if not parts:
                    raise HTTPError(400, "the multipart body has no file parts")
                results = []
                for part in parts:
                    dest = query_path if (query_path and len(parts) == 1) else part.filename
                    if not dest:
                        raise HTTPError(400, "each file part needs a filename (the destination path)")
                    results.append(await _write(dest, await part.read(), metadata))
            finally:
                await form.close()
            return JSONResponse(results)
        if not query_path:
            raise HTTPError(400, "the 'path' query parameter is required for an octet-stream upload")
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding == "gzip":
            raw = _gunzip(raw, max_bytes)
        elif encoding not in ("", "identity"):
            raise HTTPError(400, f"unsupported Content-Encoding {encoding!r}; use gzip or none")
        return JSONResponse([await _write(query_path, raw, metadata)])

    return upload
