"""Each sandbox's metrics over time, for `GET /sandboxes/{id}/metrics?start=&end=` (E2B's API).

The manager samples every sandbox every SAMPLE_INTERVAL_S (E2B's collection interval) and a metrics
request adds a fresh sample, so a range that ends now is never empty. A sandbox keeps its last
HISTORY samples (one hour) in one flat array of doubles: ~29 KiB at most per sandbox, nothing
per-sample in Python objects, gone with the sandbox.
"""

from __future__ import annotations

import math
from array import array
from datetime import UTC, datetime
from typing import Any

from agentcell.backends.base import SandboxStats

SAMPLE_INTERVAL_S = 5.0
HISTORY = 720  # samples kept per sandbox: an hour at 5 s
MIN_GAP_S = 1.0  # a request's fresh sample replaces none closer than this to the last one
_FIELDS = 5  # time, cpu %, memory used, page cache, disk used


class MetricsHistory:
    """A ring of a sandbox's samples, oldest first; CPU % is taken between consecutive samples."""

    def __init__(self, started: float, capacity: int = HISTORY) -> None:
        self._data = array("d")
        self._head = 0  # index (in samples) of the oldest once the ring is full
        self._capacity = capacity
        self._cpu_prev = (started, 0.0)  # (time, cumulative CPU seconds) of the previous sample

    def __len__(self) -> int:
        return len(self._data) // _FIELDS

    def last_time(self) -> float | None:
        n = len(self)
        if not n:
            return None
        return self._data[((self._head + n - 1) % self._capacity) * _FIELDS]

    def add(self, now: float, stats: SandboxStats, cpus: float) -> None:
        prev_t, prev_cpu = self._cpu_prev
        self._cpu_prev = (now, stats.cpu_seconds)
        wall = max(now - prev_t, 1e-3)
        pct = max(0.0, min(100.0, (stats.cpu_seconds - prev_cpu) / wall / max(cpus, 0.01) * 100))
        row = (now, round(pct, 2), float(stats.memory_bytes), float(stats.cache_bytes), float(stats.disk_bytes))
        if len(self) < self._capacity:
            self._data.extend(row)
            return
        i = self._head * _FIELDS
        self._data[i:i + _FIELDS] = array("d", row)
        self._head = (self._head + 1) % self._capacity

    def last(self, n: int) -> array:
        """The newest `n` samples as one flat array (_FIELDS doubles each), oldest first: the console's
        sparklines take columns of it by slicing (`flat[1::5]`: CPU %), with no scan of the ring."""
        count = len(self)
        k = min(n, count)
        if count < self._capacity:  # not yet wrapped: the samples are in order
            return self._data[(count - k) * _FIELDS:count * _FIELDS]
        start = (self._head + count - k) % self._capacity
        end = start + k
        if end <= self._capacity:
            return self._data[start * _FIELDS:end * _FIELDS]
        return self._data[start * _FIELDS:] + self._data[:(end - self._capacity) * _FIELDS]

    def between(self, start: float, end: float) -> list[tuple[float, ...]]:
        n, out = len(self), []
        for k in range(n):
            i = ((self._head + k) % self._capacity) * _FIELDS
            if start <= self._data[i] <= end:
                out.append(tuple(self._data[i:i + _FIELDS]))
        return out


def sample_due(history: MetricsHistory, now: float, gap: float) -> bool:
    last = history.last_time()
    return last is None or now - last >= gap


def metric_json(row: tuple[float, ...], cpu_count: float, mem_total: int, disk_total: int) -> dict[str, Any]:
    """One sample in E2B's SandboxMetric shape."""
    t, pct, mem, cache, disk = row
    return {
        "timestamp": datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z"),
        "timestampUnix": int(t),
        "cpuCount": max(1, math.ceil(cpu_count)),
        "cpuUsedPct": pct,
        "memUsed": int(mem),
        "memTotal": mem_total,
        "memCache": int(cache),
        "diskUsed": int(disk),
        "diskTotal": disk_total,
    }
