"""The clock of sandbox deadlines (timeouts, paused retention, hibernation): the host's wall clock, but
not its steps.

A timeout is a duration: a sandbox created with 300 s lives 300 s of real time. Measured on the plain
wall clock, one step of the host's clock (an operator's `date -s`, NTP's first sync after a boot, a VM
resumed after hours) would kill every sandbox at once (a step forward) or let all of them live on for
the length of the step (backward). This clock counts real time from the monotonic clock and follows
the wall clock only while the two agree within STEP_S: it takes NTP's slewing and small corrections,
and ignores a step, which it logs once. The times the API shows (startedAt, endAt) are this clock's:
after a step they stay on the time line the sandbox started on, so that endAt - now is still what is left.
"""

from __future__ import annotations

import logging
import threading
import time

STEP_S = 2.0  # a jump of the wall clock against real time larger than this is a step, not a correction

log = logging.getLogger("agentcell.server")


class SteadyClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wall, self._mono = time.time(), time.monotonic()
        self._stepped = 0.0  # the step last seen (wall - steady), 0 while they agree

    def now(self) -> float:
        """Seconds since the epoch: the wall clock's, less any step it took since this clock started."""
        with self._lock:
            wall, mono = time.time(), time.monotonic()
            steady = self._wall + (mono - self._mono)
            drift = wall - steady
            if abs(drift) <= STEP_S:
                self._wall, self._mono, self._stepped = wall, mono, 0.0
                return wall
            if abs(drift - self._stepped) > STEP_S:
                self._stepped = drift
                log.warning("the host's clock stepped by %+.0f s: sandbox timeouts keep counting real time "
                            "(their endAt stays on the time line they started on)", drift)
            return steady


STEADY = SteadyClock()
