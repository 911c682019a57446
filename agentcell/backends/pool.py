"""A pool of standbys: sandboxes prepared before any request, handed out by take().

A standby is a sandbox with everything done that does not depend on its tenant (see
backends/linux/sandbox_init.py): a create then only claims one. The pool keeps `size` of them ready
and refills off the request path (REFILL_DELAY after a take), at most `parallel` preparations at a
time; in a burst the first `size` creates are served at once and the rest wait, in order, for the
preparations they started.

A backend whose standbys are prepared at a low priority (linux: the lowest CPU weight, so that they yield
to sandboxes serving someone) gives a second preparation, `prepare_now`, for the creates that wait: one
each, at most `parallel` at a time besides the standbys' own. A create never waits on a preparation that
busy sandboxes can starve (measured before: two tenants' busy loops kept every waiting create from its
sandbox for 10 s, and the create failed).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger("agentcell.pool")
# A take's refill starts this much later: the fork and the first steps of a preparation would
# otherwise compete with the create's answer and its first run (measured: create -> first result
# 12.3 -> 9.5 ms). A create that has to wait starts its preparation at once.
REFILL_DELAY = 0.1


class StandbyPool(Generic[T]):
    def __init__(self, prepare: Callable[[], Awaitable[T]], discard: Callable[[T], Awaitable[None]],
                 usable: Callable[[T], bool], size: int, parallel: int,
                 prepare_now: Callable[[], Awaitable[T]] | None = None) -> None:
        if size < 0 or parallel < 1:
            raise ValueError("a pool needs size >= 0 and parallel >= 1")
        self._prepare = prepare
        self._prepare_now = prepare_now
        self._discard = discard
        self._usable = usable
        self.size = size
        self.parallel = parallel
        self._ready: collections.deque[T] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[T]] = collections.deque()
        self._tasks: set[asyncio.Task[None]] = set()  # preparations and discards under way
        self._preparing = 0  # all preparations under way, those for waiting creates included
        self._hurrying = 0  # those by prepare_now, for waiting creates
        self._closed = False
        self._failing = False  # the last preparation failed: refill only for waiting creates

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def preparing(self) -> int:
        return self._preparing

    def fill(self) -> None:
        """Start preparing standbys until `size` are ready or under way."""
        self._failing = False
        self._refill()

    async def take(self) -> T:
        """A ready standby (waiting for one if none is), or the error its preparation raised."""
        while self._ready:
            item = self._ready.popleft()
            if self._usable(item):
                asyncio.get_running_loop().call_later(REFILL_DELAY, self._refill)
                return item
            self._spawn(self._discard(item))  # it died while it waited
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._refill()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._deliver(fut.result())  # handed to us just as we were cancelled: not lost
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        while self._ready:
            with contextlib.suppress(Exception):
                await self._discard(self._ready.popleft())
        for fut in self._waiters:
            if not fut.done():
                fut.cancel()

    def _waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    def _wanted(self) -> int:
        goal = self._waiting() if self._failing else self.size + self._waiting()
        return goal - len(self._ready) - self._preparing

    def _refill(self) -> None:
        if self._closed:
            return
        if self._prepare_now is not None:  # each waiting create: a preparation of its own, not a standby's
            for _ in range(min(self._waiting() - len(self._ready) - self._hurrying, self.parallel - self._hurrying)):
                self._start(self._prepare_now, hurry=True)
        for _ in range(min(self._wanted(), self.parallel - self._preparing)):
            self._start(self._prepare, hurry=False)

    def _start(self, prepare: Callable[[], Awaitable[T]], hurry: bool) -> None:
        self._preparing += 1
        self._hurrying += hurry
        self._spawn(self._prepare_one(prepare)).add_done_callback(lambda _task: self._prepared(hurry))

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _prepared(self, hurry: bool) -> None:
        self._preparing -= 1
        self._hurrying -= hurry
        self._refill()  # now that this one is out of the count

    async def _prepare_one(self, prepare: Callable[[], Awaitable[T]]) -> None:
        try:
            item = await prepare()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the oldest waiting create gets it; the pool goes on
            self._failing = True
            waiter = next((f for f in self._waiters if not f.done()), None)
            if waiter is not None:
                waiter.set_exception(e)
            else:
                log.warning("preparing a standby failed: %s", e)
            return
        self._failing = False
        self._deliver(item)

    def _deliver(self, item: T) -> None:
        """To the oldest waiting create, else onto the ready queue."""
        if self._closed:
            self._spawn(self._discard(item))
            return
        waiter = next((f for f in self._waiters if not f.done()), None)
        if waiter is not None:
            waiter.set_result(item)
        else:
            self._ready.append(item)
