"""The ASGI layer in front of the router: Host/Origin policy and request-body pacing (the gateway
uses the pacing alone: BodyDeadline).

- A request whose Host or Origin the policy refuses gets 403 before anything else (hosts.py).
- A request body must keep coming: the server waits at most `body_timeout` seconds for each next part,
  and in all at most `body_timeout` plus one second per MIN_BODY_RATE bytes received. Only time spent
  waiting for the client counts (not the handler's own work). Past that the answer is 408, or the
  connection is dropped if a response already started. Once the body is complete, receive() is not
  timed: a streaming response waits there for the client to go away.
- A response that starts before the request body was fully read carries `Connection: close`, so
  uvicorn does not read and discard the rest to reuse the connection (a 1 GB body to a 401); the
  protocol drops a bounded part of it before it closes, so that the client can read the answer
  (linger.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agentcell.server.asgi import has_body
from agentcell.server.bodies import BUDGET_KEY, BodyBudget
from agentcell.server.errors import json_error
from agentcell.server.hosts import HostPolicy

ASGIApp = Any
MIN_BODY_RATE = 1024  # bytes/s, on average, that a request body must keep up
# Client streams: the body is interactive input (a user typing into a process), not an upload.
UNPACED_PATHS = frozenset({"/process.Process/StreamInput"})


class PacedExchange:
    """One request/response pair: wraps receive (pacing) and send (close, or drop after a 408)."""

    def __init__(self, scope: dict[str, Any], receive: Any, send: Any, timeout: float) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self.timeout = timeout
        self.paced = scope["path"] not in UNPACED_PATHS
        self.body_pending = has_body(scope)
        self.received = 0
        self.waited = 0.0
        self.response_started = False
        self.answered = False  # we sent the 408 ourselves; the app's own response is dropped

    def _allowance(self) -> float:
        return min(self.timeout, self.timeout + self.received / MIN_BODY_RATE - self.waited)

    async def receive(self) -> dict[str, Any]:
        if not self.body_pending:
            return await self._receive()
        allowance = self._allowance() if self.paced else None
        start = time.monotonic()
        try:
            if allowance is not None and allowance <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(self._receive(), allowance)
        except TimeoutError:
            await self._body_timed_out()
            return {"type": "http.disconnect"}
        self.waited += time.monotonic() - start
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.body_pending = bool(message.get("more_body", False))
        else:
            self.body_pending = False
        return message

    async def _body_timed_out(self) -> None:
        self.body_pending = False
        if self.response_started:
            return  # the response carries Connection: close; the app sees a disconnect and ends it
        self.answered = True
        message = (f"the request body arrived too slowly: the server waits at most {self.timeout:g} s for "
                   f"the next part and needs at least {MIN_BODY_RATE} bytes/s on average")
        response = json_error(408, message)
        response.headers["connection"] = "close"
        await response(self.scope, self._receive, self._send)

    async def send(self, message: dict[str, Any]) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.response_started = True
            if self.body_pending:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await self._send(message)


class EdgeGuard:
    """Wraps the router (see the module doc)."""

    def __init__(self, app: ASGIApp, policy: HostPolicy, body_timeout: float, budget: BodyBudget) -> None:
        self.app = app
        self.policy = policy
        self.body_timeout = body_timeout
        self.budget = budget

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        refusal = self.policy.refusal(scope)
        exchange = PacedExchange(scope, receive, send, self.body_timeout)
        if refusal is not None:
            await json_error(403, refusal)(scope, exchange.receive, exchange.send)
            return
        scope[BUDGET_KEY] = self.budget
        await self.app(scope, exchange.receive, exchange.send)



class BodyDeadline:
    """The body pacing alone (see the module doc) around any ASGI app: the gateway's edge."""

    def __init__(self, app: ASGIApp, body_timeout: float) -> None:
        self.app = app
        self.body_timeout = body_timeout

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        exchange = PacedExchange(scope, receive, send, self.body_timeout)
        await self.app(scope, exchange.receive, exchange.send)
