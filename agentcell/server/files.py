"""envd's plain HTTP endpoints: GET /health, GET /files (download), POST /files (upload).

The root router has already checked the access token or the URL signature (auth.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentcell.errors import SandboxError
from agentcell.server import api_events, auth
from agentcell.server.errors import HTTPError, from_sandbox_error, json_error
from agentcell.server.streams import HTTP_PIECE, LiveStream, client_gone, current_sandbox, first_batch
from agentcell.server.uploads import MultipartStream, boundary_of, capped, gunzipped, too_large


def _user(request: Request) -> str:
    """Who reads or writes: the `username` query parameter (signed URLs) or the SDK's Basic
    authorization; `user` or the sandbox's `root` (runtime/filesystem.py FileSystem.acting_as)."""
    try:
        return auth.run_as(request.query_params.get("username") or auth.basic_user(request.headers.get("authorization")))
    except auth.MalformedAuthorization as e:
        raise HTTPError(400, str(e)) from None
    except ValueError as e:
        raise HTTPError(401, str(e)) from None


def _required_path(request: Request) -> str:
    path = request.query_params.get("path")
    if not path:
        raise HTTPError(400, "the 'path' query parameter is required")
    return path


async def health(request: Request) -> Response:
    return Response(status_code=204)


async def download(request: Request) -> Response:
    path = _required_path(request)
    user = _user(request)
    api_events.note(path=path, user=user)
    gone = asyncio.ensure_future(client_gone(request.receive))
    batches = current_sandbox.get().channel.batches("fs.read", until=gone, path=path, user=user)
    # Wait for the first frame so that not_found / a directory become proper HTTP errors.
    first = await first_batch(batches, gone)
    gzip_ok = "gzip" in request.headers.get("accept-encoding", "").lower()

    async def body() -> AsyncIterator[bytes]:
        compressor = zlib.compressobj(6, zlib.DEFLATED, 31) if gzip_ok else None
        try:
            batch = first
            while batch is not None:
                for frame in batch:
                    if frame.header.get("event") == "data" and frame.payload:
                        data = compressor.compress(frame.payload) if compressor else frame.payload
                        for i in range(0, len(data), HTTP_PIECE):
                            yield data[i:i + HTTP_PIECE]
                try:
                    batch = await anext(batches)
                except StopAsyncIteration:
                    batch = None
            if compressor:
                yield compressor.flush()
        finally:
            await batches.aclose()

    headers = {"Content-Disposition": f'attachment; filename="{path.rsplit("/", 1)[-1]}"'}
    if gzip_ok:
        headers["Content-Encoding"] = "gzip"
    return LiveStream(body(), gone, media_type="application/octet-stream", headers=headers)


def _metadata(request: Request) -> dict[str, str] | None:
    meta: dict[str, str] = {}
    for key, value in request.headers.items():
        if key.startswith("x-metadata-"):
            name = key[len("x-metadata-") :]
            if not name or not all(33 <= ord(c) < 127 for c in name) or not all(32 <= ord(c) < 127 for c in value):
                raise HTTPError(400, f"invalid metadata header {key!r}: keys and values must be printable ASCII")
            meta[name] = value
    return meta or None


async def _write(path: str, chunks: AsyncIterator[bytes], metadata: dict[str, str] | None,
                 user: str = "user") -> dict[str, Any]:
    try:
        header = (await current_sandbox.get().channel.upload("fs.write", chunks, path=path, metadata=metadata,
                                                             user=user)).header
    except SandboxError as e:
        raise from_sandbox_error(e) from None
    entry: Any = header.get("entry") or {}
    info: dict[str, Any] = {"path": entry.get("path", path), "name": entry.get("name", path.rsplit("/", 1)[-1]), "type": "file"}
    if entry.get("metadata"):
        info["metadata"] = entry["metadata"]
    return info


@dataclass
class _SandboxSlots:
    sem: asyncio.Semaphore
    users: int = 0


class UploadSlots:
    """Bounds uploads in progress, server-wide and per sandbox; a request over the bound waits (its
    body is not read meanwhile, so a waiting upload costs the server nothing but the connection)."""

    def __init__(self, total: int, per_sandbox: int) -> None:
        self._total = asyncio.Semaphore(total)
        self._per_sandbox = per_sandbox
        self._sandboxes: dict[str, _SandboxSlots] = {}

    @contextlib.asynccontextmanager
    async def take(self, sandbox_id: str) -> AsyncIterator[None]:
        slots = self._sandboxes.setdefault(sandbox_id, _SandboxSlots(asyncio.Semaphore(self._per_sandbox)))
        slots.users += 1
        try:
            async with slots.sem, self._total:
                yield
        finally:
            slots.users -= 1
            if slots.users == 0:  # nobody uploads to it: forget it, so the dict does not grow
                del self._sandboxes[sandbox_id]


def upload_handler(max_bytes: int, slots: UploadSlots):  # type: ignore[no-untyped-def]
    async def upload(request: Request) -> Response:
        try:
            return await _upload(request)
        except HTTPError as e:
            # The rest of the body may be unread: the connection cannot carry another request.
            response = json_error(e.status, e.message)
            response.headers["Connection"] = "close"
            return response

    async def _upload(request: Request) -> Response:
        query_path = request.query_params.get("path")
        user = _user(request)
        metadata = _metadata(request)
        content_type = request.headers.get("content-type", "")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > max_bytes:
            raise too_large(max_bytes)
        async with slots.take(current_sandbox.get().sandbox_id):
            body = capped(request.stream(), max_bytes)
            if content_type.startswith("multipart/form-data"):
                results = []
                async for part in MultipartStream(body, boundary_of(content_type)).parts():
                    # The path query parameter names the destination of a single-file upload; there
                    # (as envd) a `file` field without a filename is the content too.
                    single = bool(query_path) and not results
                    if part.filename is None and not (single and part.name == "file"):
                        continue  # a plain form field, not a file
                    dest = query_path if single else part.filename
                    if not dest:
                        raise HTTPError(400, "each file part needs a filename (the destination path)")
                    results.append(await _write(dest, part.data(), metadata, user))
                if not results:
                    raise HTTPError(400, "the multipart body has no file parts")
                api_events.note(paths=[str(r.get("path")) for r in results][:100], files=len(results), user=user)
                return JSONResponse(results)
            if not query_path:
                raise HTTPError(400, "the 'path' query parameter is required for an octet-stream upload")
            encoding = request.headers.get("content-encoding", "identity").lower()
            if encoding == "gzip":
                body = gunzipped(body, max_bytes)
            elif encoding not in ("", "identity"):
                raise HTTPError(400, f"unsupported Content-Encoding {encoding!r}; use gzip or none")
            api_events.note(path=query_path, user=user)
            return JSONResponse([await _write(query_path, body, metadata, user)])

    return upload
