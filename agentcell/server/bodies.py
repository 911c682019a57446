"""JSON request bodies: the content type, a size cap per endpoint, and a server-wide memory budget.

A JSON body is read whole before it is parsed, so the server holds it in memory. Three bounds:
- the Content-Type must be application/json, so a cross-site HTML form or no-preflight `fetch`
  (text/plain, x-www-form-urlencoded, multipart) cannot drive a JSON endpoint (415);
- each endpoint has a cap (1 MiB, 8 MiB for /execute), checked against Content-Length before reading
  and counted while reading; past it the answer is 413 and the rest is never read;
- all requests together hold at most `max_body_memory_mb` of bodies being read and parsed. A request
  reserves its Content-Length (or its cap, when chunked) before reading a byte and waits while the
  budget is spent; until then its bytes stay in the kernel (uvicorn stops reading a connection whose
  buffered body is not consumed). A request that waits too long gets 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from agentcell.server.asgi import declared_length, has_body, header
from agentcell.server.errors import HTTPError

JSON_LIMIT = 1 << 20  # control plane, /contexts
EXECUTE_LIMIT = 8 << 20  # /execute: code can be big
BUDGET_KEY = "agentcell.body_budget"  # scope key under which the root app hands the budget down


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


class BodyBudget:
    """Bytes of request bodies that may be in memory at once, across all requests."""

    def __init__(self, total: int, wait_timeout: float) -> None:
        if total < EXECUTE_LIMIT:
            raise ValueError(f"the body memory budget must be at least {_size(EXECUTE_LIMIT)} (the /execute cap)")
        self.total = total
        self.wait_timeout = wait_timeout
        self.used = 0
        self._freed = asyncio.Condition()

    async def acquire(self, n: int) -> int:
        """Wait until `n` bytes (at most the whole budget) are free and take them; returns what was
        taken, for release(). 503 after `wait_timeout`."""
        n = min(n, self.total)
        if self.used + n <= self.total:  # free now: no waiting (asyncio.wait_for would make a task)
            self.used += n
            return n
        async with self._freed:
            try:
                await asyncio.wait_for(self._freed.wait_for(lambda: self.used + n <= self.total), self.wait_timeout)
            except TimeoutError:
                raise HTTPError(503, "the server is busy receiving other requests; retry shortly") from None
            self.used += n
        return n

    async def release(self, n: int) -> None:
        async with self._freed:
            self.used -= n
            self._freed.notify_all()

    @contextlib.asynccontextmanager
    async def reserve(self, n: int) -> AsyncIterator[None]:
        taken = await self.acquire(n)
        try:
            yield
        finally:
            await self.release(taken)


def json_content_type_refusal(scope: dict[str, Any]) -> str | None:
    """Why a request with a body is not JSON (415), or None. Bodyless requests need no Content-Type."""
    if not has_body(scope):
        return None
    given = header(scope, b"content-type")
    media = (given or "").split(";", 1)[0].strip().lower()
    if media == "application/json":
        return None
    return (f"this endpoint takes a JSON body with Content-Type: application/json, not "
            f"{given!r}" if given else "this endpoint takes a JSON body: send Content-Type: application/json")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"the request body is larger than this endpoint's limit of {_size(limit)}")


async def _read_capped(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int = JSON_LIMIT) -> Any:
    """The parsed JSON body, or None when it is empty. 413 past `limit`, 400 when not JSON."""
    declared = declared_length(request.scope)
    if declared is not None and declared > limit:
        raise _too_large(limit)
    if not has_body(request.scope):
        return None
    budget: BodyBudget | None = request.scope.get(BUDGET_KEY)
    reservation = budget.reserve(declared if declared is not None else limit) if budget else contextlib.nullcontext()
    async with reservation:
        raw = await _read_capped(request, limit)
        if not raw.strip():
            return None
        try:
            return json.loads(raw, parse_constant=_reject_constant)
        except ValueError as e:
            raise HTTPError(400, f"the request body is not valid JSON: {e}") from None
