"""When the server last served a request, so that the behaviour record's background work (issue 10)
waits for a quiet moment instead of sitting on a request's round trip. On a 2-core host the record's
reading, parsing and storing of a build's ~800 events takes ~20 ms of the event loop; run when they
come due, slices of it landed on the next requests (a create right after a build +9 %, `true` +8 %),
and run between requests they cost them nothing.

The server touches it at each request and each response message; a collector asks `wait_s` before a
slice of work and, if told to, runs it that much later. Work never waits longer than MAX_WAIT_S (the
kernel's queues and the record's latency stay bounded), so a stream of requests only delays it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

QUIET_S = 0.002  # the loop is serving requests while their messages come closer together than this
MAX_WAIT_S = 0.25  # work is never put off longer than this since it came due

_last = 0.0


def touch() -> None:
    """A request or a response message was handled just now."""
    global _last
    _last = time.monotonic()


def wait_s(due: float) -> float:
    """How much longer work due since `due` (time.monotonic()) should wait: 0.0 to run it now."""
    now = time.monotonic()
    busy_for = QUIET_S - (now - _last)
    if busy_for <= 0 or now - due >= MAX_WAIT_S:
        return 0.0
    return busy_for


def put_off(loop: asyncio.AbstractEventLoop, due: float, callback: Callable[..., Any],
            *args: Any) -> asyncio.TimerHandle | None:
    """While the server is serving requests, `callback(*args, due)` called again once it may run, and
    its handle; None when the work may run now."""
    wait = wait_s(due)
    return loop.call_later(wait, callback, *args, due) if wait else None
