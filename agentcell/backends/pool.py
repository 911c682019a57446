"""A pool of standbys: sandboxes prepared before any request, handed out by take().

A standby is a sandbox with everything done that does not depend on its tenant (see
backends/linux/sandbox_init.py): a create then only claims one. The pool keeps `size` of them ready
and refills off the request path (REFILL_DELAY after a take), at most `parallel` preparations at a
time; in a burst the first `size` creates are served at once and the rest wait, in order, for the
preparations they started.
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
                 usable: Callable[[T], bool], size: int, parallel: int) -> None:
        if size < 0 or parallel < 1:
            raise ValueError("a pool needs size >= 0 and parallel >= 1")
        self._prepare = prepare
        self._discard = discard
        self._usable = usable
        self.size = size
        self.parallel = parallel
        self._ready: collections.deque[T] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[T]] = collections.deque()
        self._tasks: set[asyncio.Task[None]] = set()  # preparations and discards under way
        self._preparing = 0
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

    def _wanted(self) -> int:
        waiting = sum(1 for f in self._waiters if not f.done())
        goal = waiting if self._failing else self.size + waiting
        return goal - len(self._ready) - self._preparing

    def _refill(self) -> None:
        if self._closed:
            return
        for _ in range(min(self._wanted(), self.parallel - self._preparing)):
            self._preparing += 1
            self._spawn(self._prepare_one()).add_done_callback(self._prepared)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _prepared(self, _task: asyncio.Future[None]) -> None:
        self._preparing -= 1
        self._refill()  # now that this one is out of the count

    async def _prepare_one(self) -> None:
        try:
            item = await self._prepare()
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
