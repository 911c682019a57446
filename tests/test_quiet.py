"""record/quiet.py: the record's background work waits while the server serves requests, never
longer than MAX_WAIT_S."""

from __future__ import annotations

import time

from agentcell.record import quiet


def test_work_waits_while_requests_are_served_and_never_past_its_bound() -> None:
    due = time.monotonic()
    quiet.touch()
    wait = quiet.wait_s(due)
    assert 0 < wait <= quiet.QUIET_S
    time.sleep(quiet.QUIET_S)
    assert quiet.wait_s(due) == 0.0  # quiet again: run now
    quiet.touch()
    assert quiet.wait_s(time.monotonic() - quiet.MAX_WAIT_S) == 0.0  # waited its bound: run even while busy


async def test_put_off_calls_the_work_again_once_quiet() -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    ran: list[float] = []
    due = time.monotonic()
    quiet.touch()
    handle = quiet.put_off(loop, due, ran.append)
    assert handle is not None and not ran
    await asyncio.sleep(quiet.QUIET_S * 3)
    assert ran == [due]  # called again with the time it came due
    assert quiet.put_off(loop, due, ran.append) is None  # quiet now: run at once


def test_a_young_request_in_flight_holds_work_back_an_old_one_does_not() -> None:
    due = time.monotonic()
    first = quiet.begin()
    time.sleep(quiet.QUIET_S * 2)  # no message for a while, but a request just started is in flight
    assert quiet.QUIET_S < quiet.wait_s(due) <= quiet.YOUNG_S
    second = quiet.begin()
    quiet.end(second)  # the youngest ends: the older one in flight is what counts now
    time.sleep(quiet.QUIET_S * 2)
    assert 0 < quiet.wait_s(due) < quiet.YOUNG_S - quiet.QUIET_S
    time.sleep(quiet.YOUNG_S)  # a long stream, old now: work runs beside it
    assert quiet.wait_s(time.monotonic()) == 0.0
    quiet.end(first)
    time.sleep(quiet.QUIET_S)
    assert quiet.wait_s(time.monotonic()) == 0.0
    busy = quiet.begin()
    try:
        assert quiet.wait_s(time.monotonic() - quiet.MAX_WAIT_S) == 0.0  # never past the bound
    finally:
        quiet.end(busy)
