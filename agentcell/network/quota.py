"""A count of things held at once, per key first and in all second: how the egress's shared services
(resolver, proxy) keep one sandbox, or a handful together, from taking what every other sandbox needs.

Each key may hold at most `per_key`. All keys together may hold at most `total`, except that a key
holding fewer than `reserve` may always take one more: however many sandboxes fill the shared part,
a sandbox that holds little still gets its reserve. So the count can pass `total` by at most
`reserve` x the number of keys (keys are sandboxes, bounded by the server's --max-sandboxes).
"""

from __future__ import annotations

from collections.abc import Hashable


class KeyedQuota:
    """At most `per_key` under one key; at most `total` in all, but a key under `reserve` always gets one."""

    def __init__(self, total: int, per_key: int, reserve: int = 0) -> None:
        if not 0 <= reserve <= per_key <= total:
            raise ValueError("need 0 <= reserve <= per_key <= total")
        self.total = total
        self.per_key = per_key
        self.reserve = reserve
        self.used = 0
        self._by_key: dict[Hashable, int] = {}

    def held(self, key: Hashable) -> int:
        return self._by_key.get(key, 0)

    def take(self, key: Hashable) -> bool:
        """Hold one more under `key` if its own limit and the shared total (or its reserve) allow;
        False (nothing held) if not."""
        held = self._by_key.get(key, 0)
        if held >= self.per_key or (self.used >= self.total and held >= self.reserve):
            return False
        self.used += 1
        self._by_key[key] = held + 1
        return True

    def give(self, key: Hashable) -> None:
        """Let go of one held under `key`."""
        self.used -= 1
        left = self._by_key[key] - 1
        if left:
            self._by_key[key] = left
        else:
            del self._by_key[key]
