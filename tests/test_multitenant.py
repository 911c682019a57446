"""One tenant against another, for real: no sandbox reads, starves or kills a neighbour's.

Each test attacks through the public API of a real server, then checks that a neighbour sandbox
(created before the attack) kept its state and that the server still creates sandboxes.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import REPO, ServerProcess

from agentcell import Sandbox

pytestmark = pytest.mark.skipif(bool(os.environ.get("AGENTCELL_TEST_SERVER_URL")),
                                reason="these tests start, inspect and kill server processes of their own")


@pytest.fixture(scope="module")
def neighbour(server_url: str) -> Iterator[Sandbox]:
    sbx = Sandbox.create(api_url=server_url, timeout=900)
    sbx.run_code("canary = 'alive'")
    yield sbx
    sbx.kill()


def assert_neighbour_and_server_fine(neighbour: Sandbox, server_url: str) -> None:
    assert neighbour.run_code("canary").text == "'alive'"
    assert neighbour.commands.run("echo ok").stdout == "ok\n"
    with Sandbox.create(api_url=server_url) as fresh:
        assert fresh.run_code("6 * 7").text == "42"


def memory_scan_code(needle: bytes) -> str:
    """Code that scans the running process's whole readable memory for `needle`.

    The code carries only the needle's hash and a pattern, so the scan cannot find its own source.
    """
    digest = hashlib.sha256(needle).hexdigest()
    prefix = needle[:7].decode()
    return (
        "import hashlib, re\n"
        f"pattern = re.compile(rb'{prefix}' + rb'[0-9a-f]{{{len(needle) - 7}}}')\n"
        "found, scanned = False, 0\n"
        "with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:\n"
        "    for line in maps:\n"
        "        addr, perms = line.split()[:2]\n"
        "        if 'r' not in perms or '[vvar' in line or '[vsyscall' in line: continue\n"
        "        lo, hi = (int(x, 16) for x in addr.split('-'))\n"
        "        try:\n"
        "            mem.seek(lo); data = mem.read(hi - lo)\n"
        "        except (OSError, ValueError, OverflowError): continue\n"
        "        scanned += len(data)\n"
        f"        found = found or any(hashlib.sha256(m.group()).hexdigest() == {digest!r}"
        " for m in pattern.finditer(data))\n"
        "(found, scanned > 50_000_000)"
    )


def server_children(pid: int, name: str) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if name in line]


# --- 1. nothing of one tenant's request in memory another sandbox inherits ---------------------------


def test_previous_tenants_env_vars_are_not_in_the_next_sandboxs_memory(server_url: str, neighbour: Sandbox) -> None:
    secret = ("sk-" + secrets.token_hex(16)).encode()
    a = Sandbox.create(api_url=server_url, envs={"OPENAI_API_KEY": secret.decode()}, metadata={"tenant": "a"})
    try:
        # The scan finds what is there: A's own context does hold its env var.
        assert a.run_code(memory_scan_code(secret)).text == "(True, True)"
        for _ in range(3):  # B, C, D: the standbys forked after A's request
            with Sandbox.create(api_url=server_url) as b:
                assert b.run_code(memory_scan_code(secret)).text == "(False, True)"
    finally:
        a.kill()
    assert_neighbour_and_server_fine(neighbour, server_url)


# --- 2. no single request (nor a dying zygote) kills other sandboxes ----------------------------------


@pytest.mark.parametrize("envs", [
    {"BIG": "x" * 300_000},                                   # over the size cap
    {f"K{i}": "v" * 100 for i in range(5000)},                 # many small ones, same total
    {"A=B": "1"}, {"A\0B": "1"}, {"": "1"}, {"OK": "a\0b"},    # not an environment at all
])
def test_rejected_create_keeps_live_sandboxes(server_url: str, neighbour: Sandbox, envs: dict[str, str]) -> None:
    r = httpx.post(f"{server_url}/v2/sandboxes", json={"templateID": "base", "envVars": envs}, timeout=60)
    assert r.status_code == 400, r.text
    assert "envVars" in r.json()["message"]
    assert_neighbour_and_server_fine(neighbour, server_url)


def test_sandboxes_survive_their_zygotes_death(server: ServerProcess, server_url: str, neighbour: Sandbox) -> None:
    own = Sandbox.create(api_url=server_url)
    own.run_code("mine = 17")
    zygotes = server_children(server.pid, "agentcell.backends.linux.zygote")
    assert zygotes, "no zygote found under the server"
    for z in zygotes:
        os.kill(z, 9)
    time.sleep(0.5)
    try:
        assert own.run_code("mine + 1").text == "18"
        assert own.commands.run("echo still").stdout == "still\n"
        assert_neighbour_and_server_fine(neighbour, server_url)  # a create starts a new zygote
        assert server_children(server.pid, "agentcell.backends.linux.zygote") != zygotes
        assert own.run_code("mine").text == "17"
    finally:
        own.kill()


# --- 4. two servers on one host never share host uids --------------------------------------------------


def host_uid(sbx: Sandbox) -> int:
    inside, outside, count = sbx.commands.run("cat /proc/self/uid_map").stdout.split()
    assert (inside, count) == ("1000", "1")
    return int(outside)


def test_two_servers_get_disjoint_uid_ranges(server_url: str, tmp_path: Path) -> None:
    other = ServerProcess(tmp_path / "second.log", "--max-sandboxes", "50")
    try:
        other.wait_ready()
        with Sandbox.create(api_url=server_url) as a, Sandbox.create(api_url=other.url) as b:
            ua, ub = host_uid(a), host_uid(b)
            assert ua != ub and ua >= 1 << 20 and ub >= 1 << 20
            # The second server's whole range is disjoint from the first's: a third one asking for an
            # explicit base inside either range is refused, with a message that says why.
            for taken in (ua, ub):
                clash = ServerProcess(tmp_path / f"clash-{taken}.log", "--uid-base", str(taken))
                try:
                    assert clash.proc.wait(timeout=60) != 0
                finally:
                    clash.stop()
                assert "overlaps" in clash.log() and "another agentcell server" in clash.log(), clash.log()[-2000:]
    finally:
        other.stop()


def test_uid_range_refuses_real_users_and_subordinate_ranges(tmp_path: Path) -> None:
    # /etc/passwd holds root (0) and nobody (65534); a range over either is refused. The lock dir
    # is a temporary one, so this test does not touch the host's registry.
    script = (
        "import sys\nfrom agentcell.backends.linux import uids\n"
        f"lock = {str(tmp_path / 'locks')!r}\n"
        "for base in (60000, 500):\n"
        "    try:\n        uids.reserve(10000, base, lock_dir=lock)\n        print('reserved', base)\n"
        "    except uids.UidRangeError as e:\n        print('refused', base, e)\n"
        "r = uids.reserve(100, None, lock_dir=lock); print('auto', r.base)\n"
    )
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = p.stdout.splitlines()
    assert lines[0].startswith("refused 60000") and "/etc/passwd" in lines[0], p.stdout + p.stderr
    assert lines[1].startswith("refused 500") and "1000-" in lines[1], p.stdout
    assert int(lines[2].split()[1]) >= 1 << 20
