"""A count of things held at once, in all and per key: how the egress's shared services (resolver,
proxy) keep one sandbox from taking what its neighbours need."""

from __future__ import annotations

from collections.abc import Hashable


class KeyedQuota:
    """At most `total` held at once, and at most `per_key` of them under one key."""

    def __init__(self, total: int, per_key: int) -> None:
        self.total = total
        self.per_key = per_key
        self.used = 0
        self._by_key: dict[Hashable, int] = {}

    def take(self, key: Hashable) -> bool:
        """Hold one more under `key`, if both limits allow; False (nothing held) if not."""
        held = self._by_key.get(key, 0)
        if self.used >= self.total or held >= self.per_key:
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
