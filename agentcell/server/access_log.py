"""The access log (logger `agentcell.access`), one line per request when its response has ended, with
the sandbox's id and port on data-plane lines, and the count of responses by plane and status class
(/metrics). It replaces uvicorn's access log, which knows nothing of sandboxes.

A line: client, method, path (never the query string: a signed /files URL carries its signature there),
HTTP version, status (none when the connection ended before a response), duration_ms, bytes (of the
response body), and sandbox_id and port for a data-plane request. While the request is served, every
log line made for it carries its sandbox's id (logs.sandbox_context), and an incident (a 500) is
counted by its exception's type.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from agentcell.logs import Serving, fields, sandbox_context
from agentcell.server import routing
from agentcell.server.auth import ENVD_PORT, INTERPRETER_PORT
from agentcell.server.errors import incident_counter
from agentcell.server.prometheus import ServerMetrics

log = logging.getLogger("agentcell.access")
_CONTROL_SANDBOX = re.compile(r"^/sandboxes/([a-z0-9]{1,64})(?:/|$)")
_COUNTED = "_agentcell_counted"  # set on an exception once it is counted (an incident, then re-raised)


def plane_of(port: int | None) -> str:
    if port is None:
        return "control"
    return {ENVD_PORT: "envd", INTERPRETER_PORT: "interpreter"}.get(port, "port")


class AccessLog:
    """ASGI middleware around the server's app (HTTP scopes only)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics
        self._responses: dict[tuple[str, str], Any] = {}  # (plane, class) -> its counter child

    def _count_incident(self, exc: BaseException) -> None:
        if not getattr(exc, _COUNTED, False):
            self.metrics.error(exc)
            try:
                setattr(exc, _COUNTED, True)
            except AttributeError:  # (an exception type with __slots__)
                pass

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        started = time.monotonic()
        try:
            where = routing.target(scope)
        except routing.RoutingError:
            where = None  # refused with 400 by the router
        sandbox_id, port = (where.sandbox_id, where.port) if where is not None else (None, None)
        if where is None and (m := _CONTROL_SANDBOX.match(scope.get("path", ""))):
            sandbox_id = m.group(1)  # a control-plane call on one sandbox
        status: int | None = None
        sent = 0

        async def seen(message: Any) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        serving = Serving(sandbox_id)
        sandbox_token = sandbox_context.set(serving)
        incident_token = incident_counter.set(self._count_incident)
        try:
            await self.app(scope, receive, seen)
        except Exception as e:
            self._count_incident(e)
            if status is None:
                status = 500
            raise
        finally:
            incident_counter.reset(incident_token)
            serving.active = False
            sandbox_context.reset(sandbox_token)
            plane = "metrics" if port is None and scope.get("path") == "/metrics" else plane_of(port)
            status_class = f"{status // 100}xx" if status is not None else "none"
            child = self._responses.get((plane, status_class))
            if child is None:
                child = self._responses[(plane, status_class)] = self.metrics.requests.labels(plane, status_class)
            child.inc()
            if log.isEnabledFor(logging.INFO):
                client = scope.get("client")
                peer = f"{client[0]}:{client[1]}" if client and client[0] else "-"
                method, path = scope.get("method"), scope.get("path")
                log.info('%s "%s %s HTTP/%s" %s', peer, method, path, scope.get("http_version"),
                         status if status is not None else "-", extra=fields(
                             sandbox_id, port=port, duration_ms=round((time.monotonic() - started) * 1000, 1),
                             bytes=sent, client=peer, method=method, path=path, status=status,
                             text_hidden=("client", "method", "path", "status")))
