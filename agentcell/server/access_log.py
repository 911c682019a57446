"""The access log (logger `agentcell.access`), one line per request when its response has ended, with
the sandbox's id and port on data-plane lines, and the count of responses (/metrics). It replaces
uvicorn's access log, which knows nothing of sandboxes. The server's and the gateway's (each with its
own counter: by plane, by route).

A line: client, method, path (never the query string: a signed /files URL carries its signature there),
HTTP version, status (none when the connection ended before a response), duration_ms, bytes (of the
response body), sandbox_id and port for a data-plane request, sandbox_id for a control-plane call on
one sandbox, and what the app noted while serving (`note`: the gateway's route and cell, the sandbox a
create made or a signed URL named). While the request is served, every log line made for it carries
its sandbox's id (logs.sandbox_context), and an incident (a 500) is counted by its exception's type.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Protocol

from agentcell.logs import Serving, fields, sandbox_context
from agentcell.server import routing
from agentcell.server.errors import incident_counter

log = logging.getLogger("agentcell.access")
_CONTROL_SANDBOX = re.compile(r"^/(?:v2/)?sandboxes/([a-z0-9]{1,64})(?:/|$)")
_COUNTED = "_agentcell_counted"  # set on an exception once it is counted (an incident, then re-raised)


class Counts(Protocol):
    """Who counts what the access log sees (server/prometheus.py ServerMetrics, gateway/metrics.py)."""

    def responded(self, scope: dict[str, Any], port: int | None, status: int | None,
                  noted: dict[str, Any]) -> None: ...

    def error(self, exc: BaseException) -> None: ...


def note(sandbox_id: str | None = None, **values: Any) -> None:
    """For the request being served, what the app learnt: the sandbox it turned out to concern (on its
    access line and every line logged for it from now on), and fields for its access line."""
    serving = sandbox_context.get()
    if serving is None or not serving.active:
        return
    if sandbox_id is not None:
        serving.sandbox_id = sandbox_id
    serving.noted.update(values)


class AccessLog:
    """ASGI middleware around the server's or the gateway's app (HTTP scopes only)."""

    def __init__(self, app: Any, metrics: Counts) -> None:
        self.app = app
        self.metrics = metrics

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
            self.metrics.responded(scope, port, status, serving.noted)
            if log.isEnabledFor(logging.INFO):
                client = scope.get("client")
                peer = f"{client[0]}:{client[1]}" if client and client[0] else "-"
                method, path = scope.get("method"), scope.get("path")
                log.info('%s "%s %s HTTP/%s" %s', peer, method, path, scope.get("http_version"),
                         status if status is not None else "-", extra=fields(
                             serving.sandbox_id, port=port, **serving.noted,
                             duration_ms=round((time.monotonic() - started) * 1000, 1), bytes=sent, client=peer, method=method, path=path, status=status,
                             text_hidden=("client", "method", "path", "status")))
