"""When the server last served a request, so that the behaviour record's background work (issue 10)
waits for a quiet moment instead of sitting on a request's round trip. On a 2-core host the record's
storing of a build's ~800 events takes ~10 ms of the event loop; run when they came due, slices of it
landed on the next requests (a create right after a build +6 to +10 %), and run between requests they
cost them nothing.

The server marks each request's start and end (`begin`, `end`) and each response message (`touch`);
the record's storing (linux/record_process.py) and the event writer ask `wait_s` before a slice of
work and, if told to, run it that much later. (The collectors run in the record's process, where no
request is served: they need no gate.) Work waits
while messages come closer together than QUIET_S, and while a request started less than YOUNG_S ago is
in flight (a create, a `run_code`: its answer is on its way; a long stream, once older, no longer holds
work back). Work never waits longer than MAX_WAIT_S (the kernel's queues and the record's latency stay
bounded), so a stream of requests only delays it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

QUIET_S = 0.002  # the loop is serving requests while their messages come closer together than this
YOUNG_S = 0.05  # a request in flight for less than this holds work back until it ends
MAX_WAIT_S = 0.25  # work is never put off longer than this since it came due

_last = 0.0
_in_flight: dict[int, float] = {}  # request -> its start, in the order they started
_youngest = float("-inf")  # the start of the youngest request in flight (a float: read by the event writer's thread)
_tokens = itertools.count()


def touch() -> None:
    """A request or a response message was handled just now."""
    global _last
    _last = time.monotonic()


def begin() -> int:
    """A request starts; its token for `end`."""
    global _youngest
    token = next(_tokens)
    _in_flight[token] = _youngest = time.monotonic()
    touch()
    return token


def end(token: int) -> None:
    """The request of `token` is done (answered, or its client gone)."""
    global _youngest
    _in_flight.pop(token, None)
    _youngest = next(reversed(_in_flight.values())) if _in_flight else float("-inf")
    touch()


def wait_s(due: float) -> float:
    """How much longer work due since `due` (time.monotonic()) should wait: 0.0 to run it now."""
    now = time.monotonic()
    if now - due >= MAX_WAIT_S:
        return 0.0
    return max(QUIET_S - (now - _last), _youngest + YOUNG_S - now, 0.0)


def put_off(loop: asyncio.AbstractEventLoop, due: float, callback: Callable[..., Any],
            *args: Any) -> asyncio.TimerHandle | None:
    """While the server is serving requests, `callback(*args, due)` called again once it may run, and
    its handle; None when the work may run now."""
    wait = wait_s(due)
    return loop.call_later(min(wait, MAX_WAIT_S - (time.monotonic() - due)), callback, *args, due) if wait else None
