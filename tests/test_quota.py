"""network/quota.py: a shared budget that keeps every key's reserve (per sandbox first, in all second)."""

from __future__ import annotations

from agentcell.network.quota import KeyedQuota


def test_a_quota_keeps_a_reserve_for_every_key() -> None:
    quota = KeyedQuota(total=10, per_key=4, reserve=2)
    for key, n in (("a", 4), ("b", 4), ("e", 2)):  # the shared total is taken
        assert all(quota.take(key) for _ in range(n))
    assert not quota.take("a")  # its own limit
    assert not quota.take("e")  # the total, and e holds its reserve already
    for key in ("c", "d"):  # whoever holds less than the reserve still gets it
        assert [quota.take(key) for _ in range(3)] == [True, True, False]
    assert quota.used == 14  # past the total by at most reserve x keys
    quota.give("a")
    assert not quota.take("c")  # still over the total: back to the reserve rule
    for _ in range(4):
        quota.give("c") if quota.held("c") else quota.give("d")
    assert quota.used == 9 and not quota.take("b") and quota.take("e")  # b at its own limit; e in the shared part
