"""The console's ASGI app, mounted at /ui by the server's router (and the gateway's): the pages'
static files, their security headers, sign-in, and the API they call (docs/console.md).

Every API call is authenticated by the session cookie (or, for scripts and a gateway asking its
cells, an `X-API-KEY` header: no ambient credential, so no CSRF check); a cookie-authenticated call
that is not GET/HEAD must carry the session's CSRF token, and an Origin, when sent, must be this
server's own (the terminal's WebSocket must send it). A viewer session reads only.
"""

from __future__ import annotations

import json
import math
import mimetypes
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import orjson
from starlette.requests import cookie_parser
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response

from agentcell.console import detail, files, health, overview
from agentcell.console.code_cell import CodeCells, parse_cell
from agentcell.console.passthrough import PREFIX as PASS_PREFIX
from agentcell.console.passthrough import passthrough
from agentcell.console.responses import PAGE_CSP, error, framable, with_headers
from agentcell.console.sessions import COOKIE, Session, SessionStore, SignInThrottle, csrf_ok, role_of
from agentcell.console.upstream import Upstream, UpstreamError
from agentcell.server import hosts
from agentcell.server.asgi import header
from agentcell.server.banner import version
from agentcell.server.http_protocol import UPGRADE_EXTENSION

STATIC = Path(__file__).parent / "static"
BUILD_HINT = "the console's pages are not built in this checkout: run `bash scripts/build-console`"
_SANDBOX_API = re.compile(r"^/ui/api/sandboxes/([a-z0-9]{1,64})/(detail|files|file|code|code/history|terminal)$")
_ASSET = re.compile(r"^/ui/assets/((?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_][A-Za-z0-9_.-]*)$")
SIGN_IN_LIMIT = 4096  # bytes of a sign-in body
CODE_LIMIT = 1 << 20  # bytes of a code cell's body
_SAFE = ("GET", "HEAD")


def mounted(path: str) -> bool:
    """Whether the console serves this path (the router sends it here before its own checks)."""
    return path == "/ui" or path.startswith("/ui/")


def same_origin(scope: dict[str, Any], origin: str) -> bool:
    """Whether an Origin header names the scheme, host and port this request came to."""
    return hosts.same_origin(origin, header(scope, b"host") or "", scope.get("scheme", "http"))


async def _body(receive: Any, limit: int) -> bytes:
    out = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise UpstreamError(400, "the client left")
        out += message.get("body", b"")
        if len(out) > limit:
            raise UpstreamError(413, f"the body is larger than {limit} bytes")
        if not message.get("more_body", False):
            return bytes(out)


class ServerView:
    """What only the server itself knows (its records, its health), for `agentcell serve`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def overview(self, outer: dict[str, Any]) -> dict[str, Any]:
        tenancy = self.app.tenancy
        caller = tenancy.caller(outer) if tenancy is not None else None
        visible = (lambda r: tenancy.sees(caller, r.owner)) if tenancy is not None else None
        return overview.server_overview(self.app.manager, visible)

    async def health(self, outer: dict[str, Any]) -> dict[str, Any]:
        return await health.server_health(self.app)

    async def detail(self, upstream: Upstream, outer: dict[str, Any], sandbox_id: str) -> dict[str, Any]:
        return await detail.server_detail(upstream, self.app.manager, outer, sandbox_id)


class GatewayView:
    """The same, asked of the cells (their consoles, with the cell key), for `agentcell gateway`."""

    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway

    async def overview(self, outer: dict[str, Any]) -> dict[str, Any]:
        g = self.gateway
        return await overview.merged_overview(g.client, g.cells.routable(), g.cells.headers())

    async def health(self, outer: dict[str, Any]) -> dict[str, Any]:
        return await health.gateway_health(self.gateway)

    async def detail(self, upstream: Upstream, outer: dict[str, Any], sandbox_id: str) -> dict[str, Any]:
        return await detail.gateway_detail(self.gateway, sandbox_id)


class ConsoleApp:
    def __init__(self, upstream: Upstream, view: ServerView | GatewayView, viewer_key: str | None = None,
                 static_dir: Path = STATIC) -> None:
        self.upstream = upstream
        self.view = view
        self.api_key = upstream.api_key
        self.viewer_key = viewer_key
        self.static_dir = static_dir
        self.sessions = SessionStore()
        self.throttle = SignInThrottle()  # wrong keys per client address
        self.cells = CodeCells(upstream)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        if path.startswith(PASS_PREFIX + "/"):
            send = framable(send)
        elif (m := _ASSET.match(path)) is not None:
            await self._asset(m.group(1), scope, receive, with_headers(send, PAGE_CSP, cache=True))
            return
        else:
            send = with_headers(send, PAGE_CSP)
        if path in ("/ui", "/ui/"):
            await self._index(scope, receive, send)
            return
        if not path.startswith("/ui/api/"):
            await error(404, f"no route for {scope['method']} {path}")(scope, receive, send)
            return
        try:
            await self._api(scope, receive, send)
        except UpstreamError as e:
            await error(e.status, e.message)(scope, receive, send)

    # --- the pages --------------------------------------------------------------------------------

    async def _index(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        index = self.static_dir / "index.html"
        if scope["method"] not in _SAFE:
            await error(405, "the console's page is read with GET")(scope, receive, send)
        elif not index.is_file():
            await PlainTextResponse(BUILD_HINT, status_code=503)(scope, receive, send)
        else:
            await FileResponse(index, media_type="text/html; charset=utf-8")(scope, receive, send)

    async def _asset(self, name: str, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assets = (self.static_dir / "assets").resolve()
        target = (assets / name).resolve()
        if scope["method"] not in _SAFE or not target.is_relative_to(assets) or not target.is_file():
            await error(404, f"no asset {name}")(scope, receive, send)
            return
        media = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        await FileResponse(target, media_type=media,
                           headers={"cache-control": "public, max-age=31536000, immutable"})(scope, receive, send)

    # --- the API ----------------------------------------------------------------------------------

    def _cookie(self, scope: dict[str, Any]) -> str | None:
        raw = header(scope, b"cookie")
        return cookie_parser(raw).get(COOKIE) if raw else None

    def _caller(self, scope: dict[str, Any]) -> tuple[Session | None, bool]:
        """(the session, whether it came by cookie); an X-API-KEY makes a one-call session."""
        session = self.sessions.get(self._cookie(scope))
        if session is not None:
            return session, True
        key = header(scope, b"x-api-key")
        if key is not None and (role := role_of(key, self.api_key, self.viewer_key)) is not None:
            return Session(role), False
        return None, False

    def _session_body(self, session: Session) -> dict[str, Any]:
        return {"role": session.role, "csrf": session.csrf, "server": {"kind": self.upstream.kind, "version": version()}}

    async def _session(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        method = scope["method"]
        if method == "GET":
            session = self.sessions.get(self._cookie(scope))
            if session is None:
                await error(401, "not signed in", keyRequired=self.api_key is not None)(scope, receive, send)
            else:
                await JSONResponse(self._session_body(session))(scope, receive, send)
        elif method == "POST":
            origin = header(scope, b"origin")
            if origin is not None and not same_origin(scope, origin):
                await error(403, f"sign-in from the page at {origin!r} is refused: not this server's origin")(
                    scope, receive, send)
                return
            try:
                given = json.loads(await _body(receive, SIGN_IN_LIMIT) or b"{}")
            except ValueError:
                given = None
            key = given.get("apiKey") if isinstance(given, dict) else None
            if not isinstance(key, str):
                await error(400, 'send {"apiKey": "..."}')(scope, receive, send)
                return
            address = (scope.get("client") or ("?",))[0]
            if (wait := self.throttle.wait_s(address)) > 0:
                await error(429, f"too many wrong keys from {address}: try again in {math.ceil(wait)} s")(
                    scope, receive, send)
                return
            role = role_of(key, self.api_key, self.viewer_key)
            if role is None:
                self.throttle.failed(address)
                await error(401, "wrong key: sign in with the server's API key (or the console's viewer key)")(
                    scope, receive, send)
                return
            self.sessions.forget(self._cookie(scope))  # a new id at each sign-in (no session fixation)
            session_id, session = self.sessions.create(role)
            response = JSONResponse(self._session_body(session))
            response.set_cookie(COOKIE, session_id, path="/ui", httponly=True, samesite="strict",
                                secure=scope.get("scheme") == "https")
            await response(scope, receive, send)
        elif method == "DELETE":
            self.sessions.forget(self._cookie(scope))
            response = Response(status_code=204)
            response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict",
                                   secure=scope.get("scheme") == "https")
            await response(scope, receive, send)
        else:
            await error(405, f"{method} /ui/api/session: use GET, POST or DELETE")(scope, receive, send)

    async def _api(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/ui/api/session":
            await self._session(scope, receive, send)
            return
        session, by_cookie = self._caller(scope)
        if session is None:
            await error(401, "not signed in", keyRequired=self.api_key is not None)(scope, receive, send)
            return
        origin = header(scope, b"origin")
        upgrade = UPGRADE_EXTENSION in (scope.get("extensions") or {})
        if origin is not None and not same_origin(scope, origin):
            await error(403, f"requests from the page at {origin!r} are refused: not this server's origin")(
                scope, receive, send)
            return
        if by_cookie and upgrade and origin is None:
            await error(403, "a WebSocket with the console's cookie must send this server's Origin")(scope, receive, send)
            return
        if by_cookie and method not in _SAFE and not csrf_ok(session, header(scope, b"x-csrf-token")):
            await error(403, "missing or wrong X-CSRF-Token (GET /ui/api/session gives it)")(scope, receive, send)
            return
        if path.startswith(PASS_PREFIX + "/"):
            await passthrough(self.upstream, session, scope, receive, send)
            return
        if path == "/ui/api/overview" and method in _SAFE:  # (orjson: 1,000 sandboxes' sparklines, ~370 KiB)
            body = orjson.dumps(await self.view.overview(scope))
            await Response(body, media_type="application/json")(scope, receive, send)
            return
        if path == "/ui/api/health" and method in _SAFE:
            await JSONResponse(await self.view.health(scope))(scope, receive, send)
            return
        m = _SANDBOX_API.match(path)
        if m is None:
            await error(404, f"no route for {method} {path}")(scope, receive, send)
            return
        await self._sandbox_api(m.group(1), m.group(2), session, scope, receive, send)

    async def _sandbox_api(self, sandbox_id: str, what: str, session: Session, scope: dict[str, Any],
                           receive: Any, send: Any) -> None:
        method = scope["method"]
        q = {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
        writes = {("file", "POST"), ("code", "POST"), ("terminal", "GET")}
        if (what, method) in writes and not session.admin:
            doing = {"file": "upload files", "code": "run code", "terminal": "open a terminal"}[what]
            await error(403, f"read-only session: a viewer cannot {doing}")(scope, receive, send)
            return
        if what == "detail" and method in _SAFE:
            await JSONResponse(await self.view.detail(self.upstream, scope, sandbox_id))(scope, receive, send)
        elif what == "files" and method in _SAFE:
            listing = await files.list_dir(self.upstream, scope, sandbox_id, q.get("path") or "/home/user")
            await JSONResponse(listing)(scope, receive, send)
        elif what == "file" and method in _SAFE:
            await files.download(self.upstream, scope, sandbox_id, _required(q, "path"), receive, send)
        elif what == "file" and method == "POST":
            await files.upload(self.upstream, scope, sandbox_id, _required(q, "path"), receive, send)
        elif what == "code" and method == "POST":
            code, language = parse_cell(await _body(receive, CODE_LIMIT))
            await self.cells.run(scope, receive, send, sandbox_id, code, language)
        elif what == "code/history" and method in _SAFE:
            await JSONResponse({"cells": self.cells.cells(sandbox_id)})(scope, receive, send)
        elif what == "terminal" and method == "GET":
            if UPGRADE_EXTENSION not in (scope.get("extensions") or {}):
                await error(400, "the terminal is a WebSocket: connect with an Upgrade request")(scope, receive, send)
                return
            # imported at the first terminal: it brings the SDK's PTY messages and wsproto (~55 ms a server start)
            from agentcell.console.terminal import MAX_COLS, MAX_ROWS, Terminal, size_param
            from agentcell.sdk.models import PtySize

            size = PtySize(rows=size_param(q.get("rows"), 24, MAX_ROWS), cols=size_param(q.get("cols"), 80, MAX_COLS))
            token = await self.upstream.access_token(scope, sandbox_id)
            await Terminal(self.upstream, scope, sandbox_id, token).serve(receive, send, size)
        else:
            await error(405, f"{method} is not served on {scope['path']}")(scope, receive, send)


def _required(q: dict[str, str], name: str) -> str:
    value = q.get(name)
    if not value:
        raise UpstreamError(400, f"the '{name}' query parameter is required")
    return value
