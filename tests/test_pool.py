"""The standby pool's bookkeeping (backends/pool.py), with plain coroutines as the preparation.

The pool with real sandboxes is tested in test_standbys.py; here are the orderings that are hard to
provoke there: failures reaching the waiting create, cancellation, the bound on parallel preparations.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from agentcell.backends.pool import StandbyPool


class Preparer:
    def __init__(self, delay: float = 0.01, fail: bool = False) -> None:
        self.delay = delay
        self.fail = fail
        self.running = 0
        self.most_running = 0
        self.made = itertools.count(1)
        self.discarded: list[int] = []

    async def prepare(self) -> int:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(self.delay)
            if self.fail:
                raise RuntimeError("the zygote is broken")
            return next(self.made)
        finally:
            self.running -= 1

    async def discard(self, item: int) -> None:
        self.discarded.append(item)


def pool_of(p: Preparer, size: int, parallel: int = 4, usable=lambda item: True) -> StandbyPool[int]:  # noqa: ANN001
    return StandbyPool(p.prepare, p.discard, usable, size, parallel)


async def test_fills_to_its_size_and_refills_after_a_take() -> None:
    p = Preparer()
    pool = pool_of(p, size=3)
    pool.fill()
    await asyncio.sleep(0.1)
    assert pool.ready == 3
    assert await pool.take() == 1
    await asyncio.sleep(0.05)
    assert pool.ready == 2  # not yet: the refill waits for the create to be answered
    await asyncio.sleep(0.2)
    assert pool.ready == 3  # refilled off the request path
    await pool.close()
    assert sorted(p.discarded) == [2, 3, 4]


async def test_a_burst_beyond_the_pool_gets_one_each_within_the_parallel_bound() -> None:
    p = Preparer(delay=0.02)
    pool = pool_of(p, size=2, parallel=3)
    pool.fill()
    await asyncio.sleep(0.1)
    items = await asyncio.gather(*(pool.take() for _ in range(20)))
    assert sorted(items) == list(range(1, 21))  # nobody got the same standby, nobody got none
    assert p.most_running <= 3
    await pool.close()


async def test_a_failing_preparation_fails_the_waiting_create_and_the_pool_recovers() -> None:
    p = Preparer(fail=True)
    pool = pool_of(p, size=2)
    with pytest.raises(RuntimeError, match="zygote is broken"):
        await asyncio.wait_for(pool.take(), 5)
    await asyncio.sleep(0.1)
    assert p.running == 0  # no retry loop while nobody waits
    p.fail = False
    assert await asyncio.wait_for(pool.take(), 5) >= 1
    await pool.close()


async def test_dead_standbys_are_discarded_not_handed_out() -> None:
    p = Preparer()
    dead = {1, 2}
    pool = pool_of(p, size=3, usable=lambda item: item not in dead)
    pool.fill()
    await asyncio.sleep(0.1)
    assert await pool.take() == 3
    await asyncio.sleep(0.05)
    assert sorted(p.discarded) == [1, 2]
    await pool.close()


async def test_a_cancelled_create_loses_no_standby() -> None:
    p = Preparer(delay=0.05)
    pool = pool_of(p, size=0, parallel=1)
    waiter = asyncio.ensure_future(pool.take())
    await asyncio.sleep(0.01)
    waiter.cancel()
    await asyncio.sleep(0.1)  # the preparation it started finishes with nobody waiting
    assert await asyncio.wait_for(pool.take(), 1) == 1  # ... and the next create gets it
    await pool.close()
    assert p.discarded == []


async def test_a_waiting_create_gets_a_preparation_of_its_own_not_a_starved_standbys() -> None:
    # the standbys' preparation is starved (linux: the lowest CPU weight beside busy sandboxes)
    starved, now = Preparer(delay=30), Preparer(delay=0.02)
    now.made = itertools.count(100)
    pool = StandbyPool(starved.prepare, starved.discard, lambda item: True, 2, 3, prepare_now=now.prepare)
    pool.fill()
    await asyncio.sleep(0.05)
    assert starved.running == 2
    items = await asyncio.wait_for(asyncio.gather(*(pool.take() for _ in range(10))), 5)
    assert sorted(items) == list(range(100, 110))  # each waiting create got one, none waited for a standby
    assert now.most_running <= 3  # within the parallel bound, besides the standbys' own
    assert starved.running == 2  # the standbys' preparations go on, for the pool
    await pool.close()
