"""Rootless mode's pieces that need no second user: its sandbox id ranges (within the ids a user
namespace maps, disjoint between servers of one user) and its guarantees table (docs/rootless.md is
the same list `agentcell doctor` prints)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agentcell import rootless
from agentcell.backends.linux import uids

DOC = Path(__file__).resolve().parents[1] / "docs" / "rootless.md"


def test_two_rootless_servers_of_one_user_get_disjoint_ranges_within_the_map(tmp_path: Path) -> None:
    uid_map = tmp_path / "uid_map"
    uid_map.write_text("         0       1001          1\n         1     100000      65535\n")
    end = uids.mapped_ids_end(str(uid_map))
    assert end == 65533  # below the overflow id 65534
    opts = {"lock_dir": str(tmp_path / "locks"), "account_files": (), "start": rootless.FIRST_SANDBOX_ID,
            "end": end, "align": 1024}
    first = uids.reserve(26, None, **opts)  # a small server (8 sandboxes)
    second = uids.reserve(2016, None, **opts)  # the embedded server's default size
    try:
        assert first.base == rootless.FIRST_SANDBOX_ID
        assert second.base > first.last and second.last <= end
        with pytest.raises(uids.UidRangeError, match="fewer sandboxes"):
            uids.reserve(60_000, None, **opts)
    finally:
        first.release()
        second.release()


def test_a_map_with_a_hole_ends_before_it(tmp_path: Path) -> None:
    uid_map = tmp_path / "uid_map"
    uid_map.write_text("0 1001 1\n1 100000 999\n2000 300000 10\n")
    assert uids.mapped_ids_end(str(uid_map)) == 999


def test_the_docs_table_is_the_doctors_list() -> None:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| (?P<area>[^|]+) \| (?P<holds>holds|weaker|does not hold) \| (?P<text>.+) \|$", line)
        if m:
            rows[m["area"].strip()] = (m["holds"], m["text"].strip())
    words = {True: "holds", None: "weaker", False: "does not hold"}
    listed = {g.area: (words[g.holds], g.text) for g in rootless.guarantees()}
    assert rows == listed
