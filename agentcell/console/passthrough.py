"""`/ui/api/v/{path}`: the server's own control-plane API at `/{path}`, called with the session's key.

Method, query string, body and the answer stream through unchanged, but for two things: a viewer may
only read (GET/HEAD), and the sandboxes' access tokens (`envdAccessToken`, `trafficAccessToken`) are
taken out of JSON answers, so the page (and a viewer) never holds a credential to a sandbox's data
plane: the console's own file, code and terminal APIs are the way in, and they check the role.
"""

from __future__ import annotations

import json
from typing import Any

from agentcell.console.responses import error
from agentcell.console.sessions import Session
from agentcell.console.upstream import Upstream, forwarded_headers

PREFIX = "/ui/api/v"
TOKEN_FIELDS = ("envdAccessToken", "trafficAccessToken")
SCRUB_LIMIT = 1 << 20  # a JSON answer up to this size is read whole to take tokens out (larger ones have none)


def _scrubbed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _scrubbed(v) for k, v in value.items() if k not in TOKEN_FIELDS}
    if isinstance(value, list):
        return [_scrubbed(v) for v in value]
    return value


def _token_scrubber(send: Any) -> Any:
    held: dict[str, Any] | None = None
    body = bytearray()

    async def scrubbing(message: dict[str, Any]) -> None:
        nonlocal held
        if message["type"] == "http.response.start":
            headers = dict((k.lower(), v) for k, v in message.get("headers", []))
            length = headers.get(b"content-length", b"")
            if headers.get(b"content-type", b"").startswith(b"application/json") and length.isdigit() \
                    and int(length) <= SCRUB_LIMIT:
                held = message
                return
            await send(message)
            return
        if held is None:
            await send(message)
            return
        body.extend(message.get("body", b""))
        if message.get("more_body", False):
            return
        try:
            data = json.dumps(_scrubbed(json.loads(body)), separators=(",", ":")).encode()
        except ValueError:
            data = bytes(body)
        headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
        await send({**held, "headers": [*headers, (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data, "more_body": False})

    return scrubbing


async def passthrough(upstream: Upstream, session: Session, scope: dict[str, Any], receive: Any, send: Any) -> None:
    method = scope["method"]
    path = scope["path"][len(PREFIX):] or "/"
    if not session.admin and method not in ("GET", "HEAD"):
        await error(403, f"read-only session: a viewer cannot {method} {path}")(scope, receive, send)
        return
    if path == "/ui" or path.startswith("/ui/"):
        await error(404, f"no route for {method} {path}")(scope, receive, send)
        return
    inner = upstream.control_scope(scope, method, path, scope.get("query_string", b""), forwarded_headers(scope))
    await upstream.router(inner, receive, _token_scrubber(send))
