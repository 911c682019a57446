"""E2B's volume API: `/volumes` on the control plane (the API key; a tenant sees only its own) and the
content API `/volumecontent/{id}/{file,dir,path}` (the volume's own token as `Authorization: Bearer`),
which works without any sandbox. Shapes and statuses as the released SDKs read them (docs/volumes.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentcell.server.bodies import read_json
from agentcell.server.errors import HTTPError, json_error
from agentcell.volumes.content import VolumeFiles, normalise
from agentcell.volumes.store import Volume, VolumeError, VolumeStore

CHUNK = 1 << 20
_DRAIN_MAX = 16 << 20  # of a refused upload's body, read so that every client sees the answer
_QUEUED_CHUNKS = 4  # an upload's batches between the socket and the disk thread (at most 4 x 1 MiB)


def _int(query: Any, name: str, low: int = 0, high: int = (1 << 32) - 2) -> int | None:
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise VolumeError(400, f"'{name}' must be a whole number, not {raw[:40]!r}") from None
    if not low <= value <= high:
        raise VolumeError(400, f"'{name}' must be from {low} to {high}")
    return value


def _bool(query: Any, name: str) -> bool:
    return (query.get(name) or "").lower() == "true"


class VolumeApi:
    """Both halves of the API over one VolumeStore. `caller(scope)` is the tenant a control-plane
    request acts as, `sees(caller, owner)` whether it may see what `owner` made (server/tenancy.py)."""

    def __init__(self, store: VolumeStore, caller: Callable[[Any], str | None],
                 sees: Callable[[str | None, str | None], bool], domain: str | None = None) -> None:
        self.store = store
        self.caller = caller
        self.sees = sees
        self.domain = domain

    # --- /volumes (control plane) --------------------------------------------------------------------

    def routes(self) -> list[Route]:
        return [
            Route("/volumes", self.create, methods=["POST"]),
            Route("/volumes", self.list, methods=["GET"]),
            Route("/volumes/{volume_id}", self.get, methods=["GET"]),
            Route("/volumes/{volume_id}", self.destroy, methods=["DELETE"]),
        ]

    def _json(self, v: Volume, token: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"volumeID": v.volume_id, "name": v.name, "sizeMB": v.size_mb}
        if token:
            out["token"] = v.token
            if self.domain:  # the SDKs then send content calls to https://api.<domain>
                out["domain"] = self.domain
        return out

    def visible(self, request: Request, volume_id: str) -> Volume:
        v = self.store.get(volume_id)
        if v is None or not self.sees(self.caller(request.scope), v.owner):
            raise HTTPError(404, f"volume '{volume_id}' not found")
        return v

    async def create(self, request: Request) -> Response:
        body = await read_json(request, 64 << 10)
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object: {\"name\": ...}")
        try:
            v = await self.store.create(body.get("name"), self.caller(request.scope), body.get("sizeMB"))
        except VolumeError as e:
            raise HTTPError(e.status, e.message) from None
        return JSONResponse(self._json(v), status_code=201)

    async def list(self, request: Request) -> Response:
        caller = self.caller(request.scope)
        return JSONResponse([self._json(v, token=False) for v in self.store.list(caller, self.sees)])

    async def get(self, request: Request) -> Response:
        return JSONResponse(self._json(self.visible(request, request.path_params["volume_id"])))

    async def destroy(self, request: Request) -> Response:
        v = self.visible(request, request.path_params["volume_id"])
        try:
            await self.store.destroy(v.volume_id)
        except VolumeError as e:
            raise HTTPError(e.status, e.message) from None
        return Response(status_code=204)

    # --- /volumecontent (the volume's token) ---------------------------------------------------------

    async def content(self, scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        try:
            response = await self._content(request)
        except VolumeError as e:
            response = json_error(e.status, e.message)
        await response(scope, receive, send)

    async def _content(self, request: Request) -> Response:
        parts = request.url.path.strip("/").split("/")
        if len(parts) != 3 or parts[2] not in ("file", "dir", "path"):
            raise VolumeError(404, f"no route for {request.method} {request.url.path} "
                                   "(/volumecontent/{id}/file, /dir or /path)")
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        volume = self.store.by_token(parts[1], token.strip()) if scheme.lower() == "bearer" else None
        if volume is None:  # an unknown volume and a wrong token look the same
            raise VolumeError(401, "invalid volume token: use the token of Volume.create or Volume.connect "
                                   "(Authorization: Bearer <token>)")
        files = VolumeFiles(self.store.mount_dir(volume))
        q = request.query_params
        path = normalise(q.get("path"))
        method, what = request.method, parts[2]
        if what == "file" and method == "GET":
            return await self._read(files, path)
        if what == "file" and method == "PUT":
            return await self._write(request, files, path)
        if what == "dir" and method == "GET":
            depth = _int(q, "depth", 1, 16) or 1
            return JSONResponse(await asyncio.to_thread(files.list, path, depth))
        if what == "dir" and method == "POST":
            made = await asyncio.to_thread(files.make_dir, path, _int(q, "uid"), _int(q, "gid"),
                                           _int(q, "mode", 0, 0o7777), _bool(q, "force"))
            return JSONResponse(made, status_code=201)
        if what == "path" and method == "GET":
            return JSONResponse(await asyncio.to_thread(files.stat, path))
        if what == "path" and method == "PATCH":
            body = await read_json(request, 64 << 10) or {}
            if not isinstance(body, dict):
                raise VolumeError(400, "the body must be a JSON object: {\"uid\", \"gid\", \"mode\"}")
            fields = {k: _int(body, k, 0, 0o7777 if k == "mode" else (1 << 32) - 2) for k in ("uid", "gid", "mode")}
            return JSONResponse(await asyncio.to_thread(files.update, path, **fields))
        if what == "path" and method == "DELETE":
            await asyncio.to_thread(files.remove, path)
            return Response(status_code=204)
        raise VolumeError(405, f"{method} is not served on /volumecontent/{{id}}/{what}")

    async def _read(self, files: VolumeFiles, path: str) -> Response:
        fd = await asyncio.to_thread(files.open_file, path)
        size = os.fstat(fd).st_size

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while chunk := await asyncio.to_thread(os.read, fd, CHUNK):
                    yield chunk
            finally:
                os.close(fd)

        return StreamingResponse(chunks(), media_type="application/octet-stream",
                                 headers={"content-length": str(size)})

    async def _write(self, request: Request, files: VolumeFiles, path: str) -> Response:
        q = request.query_params
        uid, gid, mode, force = _int(q, "uid"), _int(q, "gid"), _int(q, "mode", 0, 0o7777), _bool(q, "force")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(_QUEUED_CHUNKS)

        def pulled() -> Iterator[bytes]:  # in the disk thread: the body as it arrives
            while (item := asyncio.run_coroutine_threadsafe(queue.get(), loop).result()) is not None:
                if isinstance(item, BaseException):
                    raise item  # the upload broke off: write() removes its temporary file
                yield item

        writer = asyncio.ensure_future(asyncio.to_thread(files.write, path, pulled(), uid, gid, mode, force))
        drained = 0
        batch = bytearray()  # the socket's small chunks, handed to the disk thread a MiB at a time

        async def hand_over() -> None:
            put = asyncio.ensure_future(queue.put(bytes(batch)))
            batch.clear()
            await asyncio.wait([put, writer], return_when=asyncio.FIRST_COMPLETED)
            if not put.done():
                put.cancel()

        try:
            async for chunk in request.stream():
                if writer.done():  # refused (exists, full volume ...): read on (bounded) so the client sees it
                    drained += len(chunk)
                    if drained > _DRAIN_MAX:
                        break
                    continue
                batch += chunk
                if len(batch) >= CHUNK:
                    await hand_over()
            if batch and not writer.done():
                await hand_over()
            if not writer.done():
                await queue.put(None)
        except BaseException as e:
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(ConnectionError(f"the upload broke off: {e!r}"))
            with contextlib.suppress(BaseException):
                await writer
            raise
        entry = await writer
        return JSONResponse(entry, status_code=201)
