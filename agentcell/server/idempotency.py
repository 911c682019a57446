"""`Idempotency-Key` on `POST /v2/sandboxes` (E2B's API): a create retried with the same key, after a
lost answer or a timeout, gets the sandbox the first one made instead of a second sandbox.

A key is remembered for KEY_TTL_S with the request's digest and the answer; the same key with another
body is a 409. Two creates with one key at once: the second waits for the first's answer. At most
MAX_KEYS are kept (the oldest go first), so the memory a client can fill is bounded (~1 KiB each).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agentcell.server.errors import HTTPError

KEY_TTL_S = 3600.0
MAX_KEYS = 10_000
_KEY = re.compile(r"[a-z0-9-]{1,255}")


@dataclass
class _Entry:
    digest: str
    expires: float
    answer: asyncio.Future[dict[str, Any]]


def parse_key(raw: str | None) -> str | None:
    if raw is None:
        return None
    if not _KEY.fullmatch(raw):
        raise HTTPError(400, "Idempotency-Key must be 1-255 characters of lowercase letters, digits and hyphens")
    return raw


def digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class IdempotentCreates:
    def __init__(self, ttl: float = KEY_TTL_S, max_keys: int = MAX_KEYS) -> None:
        self._ttl = ttl
        self._max = max_keys
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    async def run(self, key: str, body: dict[str, Any],
                  create: Callable[[], Awaitable[dict[str, Any]]]) -> tuple[dict[str, Any], bool]:
        """The create's answer and whether it is a replay. A failed create forgets its key (a retry
        with it creates), so only answers are remembered, never errors."""
        now = time.monotonic()
        self._expire(now)
        d = digest(body)
        entry = self._entries.get(key)
        if entry is not None:
            if entry.digest != d:
                raise HTTPError(409, "this Idempotency-Key was used for a different create request; "
                                     "use a new key for a new sandbox")
            return dict(await asyncio.shield(entry.answer)), True
        entry = _Entry(d, now + self._ttl, asyncio.get_running_loop().create_future())
        self._entries[key] = entry
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
        try:
            answer = await create()
        except BaseException as e:
            if self._entries.get(key) is entry:
                del self._entries[key]
            entry.answer.set_exception(e if isinstance(e, Exception) else HTTPError(503, "the create was cancelled"))
            entry.answer.exception()  # retrieved: waiters re-raise it; nobody waiting is fine too
            raise
        entry.answer.set_result(answer)
        return answer, False

    def _expire(self, now: float) -> None:
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires > now:
                break
            del self._entries[key]
