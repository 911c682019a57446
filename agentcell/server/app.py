"""The root ASGI app: the control plane and every sandbox's data plane on one port.

A request with an `E2b-Sandbox-Id` header, or a Host of the form `{port}-{sandboxid}.{anything}`, goes
to that sandbox's data plane for the port (49983 envd, 49999 code interpreter); anything else is the
control plane. This mirrors E2B's own proxy, so `E2B_SANDBOX_URL` pointing here just works.
"""

from __future__ import annotations

import hmac
import logging
import re
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentcell.backends import get_backend
from agentcell.backends.base import Backend
from agentcell.server import files, interpreter
from agentcell.server.config import ServerConfig
from agentcell.server.config import check as check_config
from agentcell.server.control import ControlPlane
from agentcell.server.envd import filesystem_app, process_app
from agentcell.server.errors import HTTPError, json_error, sandbox_not_found
from agentcell.server.registry import SandboxManager
from agentcell.server.streams import current_sandbox

log = logging.getLogger("agentcell.server")

ENVD_PORT = 49983
INTERPRETER_PORT = 49999
_HOST_RE = re.compile(r"^(\d+)-([a-z0-9]+)\.")
_SANDBOX_ID_RE = re.compile(r"^[a-z0-9]{1,64}$")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPError)
    return json_error(exc.status, exc.message)


async def _starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code in (204, 304):
        return Response(status_code=exc.status_code)
    message = exc.detail if exc.status_code != 404 else f"no route for {request.method} {request.url.path}"
    return json_error(exc.status_code, str(message))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return json_error(500, f"internal server error: {type(exc).__name__}: {exc}")


_HANDLERS: dict[Any, Any] = {
    HTTPError: _http_error,
    StarletteHTTPException: _starlette_error,
    Exception: _internal_error,
}


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _route_target(scope: dict[str, Any]) -> tuple[str, int] | None:
    """(sandbox id, port) if this request is for a sandbox's data plane."""
    sandbox_id = _header(scope, b"e2b-sandbox-id")
    if sandbox_id is not None:
        raw_port = _header(scope, b"e2b-sandbox-port") or str(ENVD_PORT)
        try:
            port = int(raw_port)
        except ValueError:
            port = -1
        return sandbox_id.strip(), port
    host = _header(scope, b"host") or ""
    m = _HOST_RE.match(host)
    if m:
        return m.group(2), int(m.group(1))
    return None


class AgentcellApp:
    def __init__(self, config: ServerConfig, backend: Backend | None = None) -> None:
        check_config(config)
        self.config = config
        self.backend = backend or get_backend(config.backend, uid_base=config.uid_base,
                                              max_sandboxes=config.max_sandboxes)
        self.manager = SandboxManager(self.backend, config.max_sandboxes)
        self.control = self._control_app()
        self.envd_http = Starlette(
            routes=[
                Route("/health", files.health, methods=["GET"]),
                Route("/files", files.download, methods=["GET"]),
                Route("/files", files.upload_handler(config.max_upload_mb << 20, files.UploadSlots(
                    config.max_uploads, config.max_uploads_per_sandbox)), methods=["POST"]),
            ],
            exception_handlers=_HANDLERS,
        )
        self.process = process_app()
        self.filesystem = filesystem_app()
        self.interpreter = Starlette(routes=interpreter.routes(), exception_handlers=_HANDLERS)

    def _control_app(self) -> Starlette:
        plane = ControlPlane(self.config, self.manager)
        app = Starlette(routes=plane.routes(), exception_handlers=_HANDLERS)
        api_key = self.config.api_key
        if api_key is None:
            return app

        async def with_auth(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] != "/health" and _header(scope, b"x-api-key") != api_key:
                await json_error(401, "invalid or missing X-API-KEY")(scope, receive, send)
                return
            await app(scope, receive, send)

        return with_auth  # type: ignore[return-value]

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.backend.start()
                    await self.manager.start()
                except Exception as e:
                    log.exception("startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.manager.close()
                    await self.backend.close()
                except Exception:
                    log.exception("shutdown failed")
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets are not part of the protocol
        target = _route_target(scope)
        if target is None:
            await self.control(scope, receive, send)
            return
        sandbox_id, port = target
        rec = self.manager.get(sandbox_id) if _SANDBOX_ID_RE.match(sandbox_id) else None
        if rec is None:
            await sandbox_not_found(sandbox_id)(scope, receive, send)
            return
        token = current_sandbox.set(rec)
        try:
            if port == ENVD_PORT:
                await self._envd(scope, receive, send)
            elif port == INTERPRETER_PORT:
                await self.interpreter(scope, receive, send)
            else:
                body = {"sandboxId": sandbox_id, "port": port, "code": 502,
                        "message": f"The sandbox is running but port is not open ({port}); agentcell serves 49983 and 49999"}
                await JSONResponse(body, status_code=502)(scope, receive, send)
        finally:
            current_sandbox.reset(token)

    async def _envd(self, scope: Any, receive: Any, send: Any) -> None:
        path: str = scope.get("path", "")
        if path.startswith(("/process.Process/", "/filesystem.Filesystem/")):
            given = _header(scope, b"x-access-token") or ""
            if not hmac.compare_digest(given.encode(), current_sandbox.get().access_token.encode()):
                body = {"code": "unauthenticated", "message": "missing or invalid X-Access-Token"}
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
            app = self.process if path.startswith("/process.") else self.filesystem
            await app(scope, receive, send)
            return
        await self.envd_http(scope, receive, send)


def create_app(config: ServerConfig, backend: Backend | None = None) -> AgentcellApp:
    """The ASGI app for `config` (pass `backend` to use an already-built one)."""
    return AgentcellApp(config, backend)


def serve(config: ServerConfig) -> None:
    """Run the server in the foreground with uvicorn until interrupted."""
    import resource

    import uvicorn

    # Each sandbox holds a socket and a pidfd in the server: a 1024-fd soft limit would cap density.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    uv = uvicorn.Config(
        create_app(config),
        host=config.host,
        port=config.port,
        uds=config.uds,
        log_level=config.log_level,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(uv).run()
