"""Rootless mode in a delegated cgroup v2 directory (backends/linux/cgroup_delegation.py), end to end.

The test does what systemd's user@.service (Delegate=yes) does: as root it makes a cgroup v2
directory below the cgroup2 mount and gives it (the directory, cgroup.procs, cgroup.subtree_control,
cgroup.threads) to an ordinary user made for the test; then that user's `agentcell serve` starts in it.
Sandboxes get cgroups below the directory; pause and resume freeze them (cgroup.freeze: no controller
needed); kill and stop remove them; a dead server's directory is removed by the next one; `agentcell
doctor` says what the directory offers. The memory, pids and CPU limits by cgroup run only where
the directory offers those controllers (a v2 host); on a hybrid host (this project's machines:
cgroup2 has none of them) they are skipped, saying so.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentcell.backends.linux import cgroup_delegation
from agentcell.sdk import Sandbox
from tests.ordinary_user import OrdinaryUser, ordinary_user, user_venv  # noqa: F401
from tests.servers import ServerProcess

MOUNT = cgroup_delegation.unified_mount()
pytestmark = [
    pytest.mark.skipif(shutil.which("newuidmap") is None, reason="rootless mode needs newuidmap: apt-get install uidmap"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)"),
    pytest.mark.skipif(MOUNT is None, reason="no cgroup2 hierarchy mounted"),
]
TICKER = "while :; do date +%s.%N >> /tmp/ticks; sleep 0.05; done"


@dataclass
class Delegated:
    directory: str  # the delegated cgroup (absolute path)
    rel: str  # its path in the hierarchy, as /proc/PID/cgroup says it
    user: OrdinaryUser


@pytest.fixture(scope="module")
def delegated(ordinary_user: OrdinaryUser) -> Iterator[Delegated]:  # noqa: F811
    assert MOUNT is not None
    point, _ = MOUNT
    if not os.path.exists(f"{point}/cgroup.subtree_control") or not os.access(point, os.W_OK):
        pytest.skip(f"{point} is not writable here")
    name = f"agentcell-test-deleg-{os.getpid()}"
    directory = os.path.join(point, name)
    os.mkdir(directory)
    if not os.path.exists(f"{directory}/cgroup.freeze"):
        os.rmdir(directory)
        pytest.skip("cgroup.freeze needs a kernel >= 5.2")
    # systemd's Delegate=yes: the directory and these three files belong to the user
    for path in (directory, *(f"{directory}/{f}" for f in ("cgroup.procs", "cgroup.subtree_control",
                                                            "cgroup.threads"))):
        os.chown(path, ordinary_user.uid, ordinary_user.gid)
    try:
        yield Delegated(directory, f"/{name}", ordinary_user)
    finally:
        _remove_cgroup_tree(directory)


def _remove_cgroup_tree(top: str) -> None:
    if not os.path.isdir(top):
        return
    with contextlib.suppress(OSError), open(f"{top}/cgroup.kill", "w") as f:
        f.write("1")
    deadline = time.monotonic() + 10
    for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -len(w[0])):
        while True:
            try:
                os.rmdir(dirpath)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _in_cgroup(cgroup_dir: str, user: OrdinaryUser) -> list[str]:
    """A command prefix: what follows runs as the user, started in `cgroup_dir` (as systemd starts a
    unit's processes in its cgroup)."""
    shell = (f'echo $$ > {cgroup_dir}/cgroup.procs && exec setpriv --reuid={user.uid} --regid={user.gid} '
             '--clear-groups -- "$@"')
    return ["sh", "-c", shell, "sh"]



def _start(d: Delegated, tag: str) -> ServerProcess:
    return ServerProcess(
        Path(d.user.home, f"server-{tag}.log"), "--standbys", "1", "--max-sandboxes", "8", "--egress-uplink", "none",
        command=[*_in_cgroup(d.directory, d.user), d.user.python, "-m", "agentcell.server"], host=None,
        own_state_dir=False, base_env=d.user.env(), cwd=d.user.home, ready_status=200,
        start_timeout=180,  # the first start builds the user's runtime store
        stop_timeout=30, what="the rootless server").started()


@pytest.fixture(scope="module")
def server(delegated: Delegated) -> Iterator[ServerProcess]:
    s = _start(delegated, "main")
    try:
        yield s
    finally:
        s.stop()


def _instances(d: Delegated) -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return sorted(e.name for e in os.scandir(f"{d.directory}/agentcell") if e.is_dir())
    return []


def _procs(cgroup_dir: str) -> list[int]:
    with open(f"{cgroup_dir}/cgroup.procs") as f:
        return [int(p) for p in f.read().split()]


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")
    return ""


def _sandbox_cgroup(d: Delegated, marker: str) -> tuple[str, int]:
    """(the sandbox cgroup below the delegated directory holding a process whose command line has
    `marker`, that pid): found from the host, through each cgroup's cgroup.procs."""
    deadline = time.monotonic() + 10
    while True:
        for instance in _instances(d):
            top = f"{d.directory}/agentcell/{instance}"
            for entry in os.scandir(top):
                if entry.is_dir():
                    for pid in _procs(entry.path):
                        if marker in _cmdline(pid):
                            return entry.path, pid
        assert time.monotonic() < deadline, f"no sandbox cgroup below {d.directory} holds {marker!r}"
        time.sleep(0.1)


def test_the_server_runs_in_a_leaf_and_says_what_holds(delegated: Delegated, server: ServerProcess) -> None:
    d = delegated
    log = server.log()
    offered = cgroup_delegation.offered(d.directory)
    assert f"rootless mode: cgroup v2 delegated at {d.directory}: controllers " in log, log[-3000:]
    assert "freezer yes" in log
    missing = [c for c in cgroup_delegation.WANTED if c not in offered]
    if missing:  # the log says which limits stay rlimits
        assert f"missing {','.join(missing)} -> rlimits" in log
        assert "NOT PROTECTED: rootless mode: no " in log
    # v2's rule: the delegated directory holds no process; the server and its launcher are in the leaf
    assert _procs(d.directory) == []
    leaf = _procs(f"{d.directory}/agentcell-server")
    assert server.proc.pid in leaf and len(leaf) >= 3  # the launcher, the server, its zygote
    assert len(_instances(d)) == 1


def test_a_sandboxs_processes_are_in_its_cgroup_and_kill_removes_it(delegated: Delegated, server: ServerProcess) -> None:
    d = delegated
    sb = Sandbox.create(api_url=server.url, timeout=120)
    try:
        sb.commands.run("sleep 7001", background=True)
        cgroup_dir, pid = _sandbox_cgroup(d, "sleep 7001")
        instance = _instances(d)[0]
        with open(f"/proc/{pid}/cgroup") as f:
            own = next(line for line in f.read().splitlines() if line.startswith("0::"))
        assert re.fullmatch(rf"0::{re.escape(d.rel)}/agentcell/{instance}/s\d+-\d+", own), own
        assert cgroup_dir == d.directory + own[3:].removeprefix(d.rel)
        # the whole sandbox is there (its pid 1, the agent, the shell): none of it in the server's leaf
        assert len(_procs(cgroup_dir)) >= 3
        assert not set(_procs(cgroup_dir)) & set(_procs(f"{d.directory}/agentcell-server"))
        # stats: cpu.stat is a core file (no controller needed)
        sb.commands.run("python3 -c 'sum(range(100_000_000))'", timeout=60)  # ~0.6 s of CPU here (30M: 0.19 s on a fast run)
        with open(f"{cgroup_dir}/cpu.stat") as f:
            assert int(f.read().split()[1]) > 200_000  # usage_usec
        assert sb.get_metrics()[-1].cpu_used_pct >= 0
    finally:
        sb.kill()
    assert not os.path.exists(cgroup_dir)  # kill: its processes gone, its cgroup removed
    assert not os.path.exists(f"/proc/{pid}")


def test_pause_and_resume_freeze_the_sandbox(delegated: Delegated, server: ServerProcess) -> None:
    d = delegated
    sb = Sandbox.create(api_url=server.url, timeout=120)
    try:
        sb.run_code("x = 41")
        sb.commands.run(TICKER, background=True)
        time.sleep(0.4)
        cgroup_dir, _ = _sandbox_cgroup(d, "/tmp/ticks")
        assert sb.pause() is True
        assert sb.get_info().state == "paused"
        with open(f"{cgroup_dir}/cgroup.events") as f:
            assert "frozen 1" in f.read()

        def usage() -> int:
            with open(f"{cgroup_dir}/cpu.stat") as f:
                return int(f.read().split()[1])

        before = usage()
        time.sleep(1.5)  # the ticker must not tick, nothing of the sandbox may run
        assert usage() == before
        sb.connect()
        assert sb.get_info().state == "running"
        with open(f"{cgroup_dir}/cgroup.events") as f:
            assert "frozen 0" in f.read()
        assert sb.run_code("x + 1").text == "42"  # its memory kept
        time.sleep(0.3)
        ticks = [float(t) for t in sb.files.read("/tmp/ticks").split()]
        assert max(b - a for a, b in zip(ticks, ticks[1:], strict=False)) >= 1.4
        assert ticks[-1] > ticks[0] + 1.7  # and it ticks again
    finally:
        sb.kill()
    assert not os.path.exists(cgroup_dir)


def test_kill_of_a_paused_sandbox_empties_and_removes_its_cgroup(delegated: Delegated, server: ServerProcess) -> None:
    sb = Sandbox.create(api_url=server.url, timeout=120)
    sb.commands.run("sleep 7002", background=True)
    cgroup_dir, pid = _sandbox_cgroup(delegated, "sleep 7002")
    sb.pause()
    sb.kill()
    assert not os.path.exists(cgroup_dir) and not os.path.exists(f"/proc/{pid}")


def test_snapshot_and_filesystem_pause(server: ServerProcess) -> None:
    """create_snapshot freezes the sandbox while its disk is archived: with the freezer, rootless too."""
    src = Sandbox.create(api_url=server.url, timeout=120)
    try:
        src.files.write("/home/user/notes/a.txt", "from the source")
        snap = src.create_snapshot()
        assert src.run_code("1 + 1").text == "2"  # the source runs on (thawed)
        child = Sandbox.create(snap.snapshot_id, api_url=server.url, timeout=120)
        try:
            assert child.files.read("/home/user/notes/a.txt") == "from the source"
        finally:
            child.kill()
        assert src.pause(mode="filesystem") is True  # its files kept, everything else stopped
        src.connect()
        assert src.files.read("/home/user/notes/a.txt") == "from the source"
    finally:
        src.kill()


def _doctor(d: Delegated, cgroup_dir: str) -> dict:
    proc = subprocess.Popen([*_in_cgroup(cgroup_dir, d.user), d.user.python, "-m", "agentcell", "doctor", "--json"],
                            env=d.user.env(), cwd=d.user.home, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert out, err
    return json.loads(out)


def test_doctor_in_the_delegated_directory_reports_it(delegated: Delegated, server: ServerProcess) -> None:
    d = delegated
    offered = cgroup_delegation.offered(d.directory)
    missing = [c for c in cgroup_delegation.WANTED if c not in offered]
    # in the directory itself (where the user starts a server: only while it enables no controller, v2's
    # rule), and in its leaf (a shell moved there by a server's start)
    with open(f"{d.directory}/cgroup.subtree_control") as f:
        enabled = f.read().split()
    for where in ([] if enabled else [d.directory]) + [f"{d.directory}/agentcell-server"]:
        report = _doctor(d, where)
        check = next(c for c in report["checks"] if c["name"] == "cgroups")
        assert f"cgroup v2 delegated at {d.directory}: controllers " in check["detail"], check
        assert "freezer yes" in check["detail"]
        if missing:
            assert check["status"] == "warn" and f"missing {','.join(missing)}" in check["detail"]
            assert "Delegate=" in check["fix"]
        else:
            assert check["status"] == "ok"
        holds = {g["area"]: g["holds"] for g in report["guarantees"]}
        assert holds["pause, resume, snapshots"] is True
        assert holds["memory limit"] is (True if "memory" in offered else None)
        assert holds["CPU limit"] is ("cpu" in offered)
    # outside it (the user's processes elsewhere: here the root cgroup), none
    outside = _doctor(d, MOUNT[0] if MOUNT else "/")
    check = next(c for c in outside["checks"] if c["name"] == "cgroups")
    assert "no cgroup v2 directory delegated to you" in check["detail"]
    assert {g["area"]: g["holds"] for g in outside["guarantees"]}["pause, resume, snapshots"] is False


def test_stop_removes_the_instance_and_a_dead_servers_cgroups_go_with_the_next(delegated: Delegated,
                                                                               server: ServerProcess) -> None:
    d = delegated
    server.stop()  # SIGTERM: a clean stop
    assert _instances(d) == []
    # a server killed outright leaves its directory (its sandboxes died with its pid namespace) ...
    first = _start(d, "killed")
    sb = Sandbox.create(api_url=first.url, timeout=120)
    sb.commands.run("sleep 7003", background=True)
    _sandbox_cgroup(d, "sleep 7003")
    left = _instances(d)
    assert len(left) == 1
    first.proc.kill()
    first.proc.wait()
    time.sleep(0.5)
    assert _instances(d) == left and not any("sleep 7003" in _cmdline(p) for p in _all_procs(d))
    # ... which the next server removes (nobody holds its lock any more), and keeps its own
    second = _start(d, "next")
    try:
        assert f"removed the cgroups of 1 dead rootless server(s): {left[0]}" in second.log()
        now = _instances(d)
        assert len(now) == 1 and now != left
    finally:
        second.stop()
    assert _instances(d) == []


def _all_procs(d: Delegated) -> list[int]:
    pids = []
    for dirpath, _dirs, _files in os.walk(d.directory):
        with contextlib.suppress(OSError):
            pids += _procs(dirpath)
    return pids


# -- limits by cgroup: only where the directory offers the controllers ------------------------------


def _offer_or_skip(d: Delegated, controller: str) -> None:
    """As systemd delegates a controller: enabled down to the directory (a v2 host); skip where the
    hierarchy has none (a hybrid host's cgroup2 mount)."""
    point = os.path.dirname(d.directory)
    if controller not in cgroup_delegation.offered(d.directory):
        with contextlib.suppress(OSError), open(f"{point}/cgroup.subtree_control", "w") as f:
            f.write(f"+{controller}")
    if controller not in cgroup_delegation.offered(d.directory):
        with open(f"{point}/cgroup.controllers") as f:
            have = f.read().split()
        pytest.skip(f"the cgroup2 hierarchy offers no {controller} controller here (its root has: {have or 'none'}; "
                    "a hybrid host keeps it in cgroup v1)")


@pytest.fixture(scope="module")
def limited_server(delegated: Delegated) -> Iterator[ServerProcess]:
    for c in cgroup_delegation.WANTED:
        _offer_or_skip(delegated, c)
    s = _start(delegated, "limits")
    try:
        assert "controllers memory,pids,cpu, freezer yes" in s.log()
        yield s
    finally:
        s.stop()


def _events(cgroup_dir: str, name: str) -> dict[str, int]:
    with open(f"{cgroup_dir}/{name}") as f:
        return {k: int(v) for k, v in (line.split() for line in f)}


@contextlib.contextmanager
def _limited_sandbox(d: Delegated, server: ServerProcess, limits: dict[str, float],
                     marker: str) -> Iterator[tuple[Sandbox, str]]:
    """A sandbox of `limits` and its cgroup directory (found by a process it runs, `sleep <marker>`)."""
    sb = Sandbox.create(api_url=server.url, timeout=120, limits=limits)
    try:
        sb.commands.run(f"sleep {marker}", background=True)
        yield sb, _sandbox_cgroup(d, f"sleep {marker}")[0]
    finally:
        sb.kill()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_memory_hog_is_oom_killed_by_the_cgroup(delegated: Delegated, limited_server: ServerProcess) -> None:
    with _limited_sandbox(delegated, limited_server, {"memoryMB": 256}, "7004") as (sb, cgroup_dir):
        assert int(_read(f"{cgroup_dir}/memory.max")) == 256 << 20
        # no RLIMIT_DATA with the memory controller: the allocation succeeds, touching it meets memory.max
        hog = sb.commands.run("python3 -c \"b = b'x' * (1 << 30)\"; echo $?", timeout=60)
        assert hog.stdout.strip() == "137", hog  # SIGKILL by the OOM killer, not a MemoryError
        assert _events(cgroup_dir, "memory.events")["oom_kill"] >= 1
        assert sb.run_code("1 + 1").text == "2"  # the sandbox lives on


def test_fork_bomb_stops_at_pids_max(delegated: Delegated, limited_server: ServerProcess) -> None:
    with _limited_sandbox(delegated, limited_server, {"pids": 64}, "7005") as (sb, cgroup_dir):
        assert int(_read(f"{cgroup_dir}/pids.max")) == 64
        forks = sb.run_code(
            "import os, time\nn, err = 0, None\ntry:\n    while n < 5000:\n        if os.fork() == 0:\n"
            "            time.sleep(30); os._exit(0)\n        n += 1\nexcept OSError as e:\n    err = e.errno\n(n, err)",
            timeout=60).text
        n, err = eval(forks)  # noqa: S307 - a tuple of two ints printed by the sandbox
        assert err == 11 and n < 64
        assert _events(cgroup_dir, "pids.events")["max"] >= 1  # the cgroup refused the fork
        assert int(_read(f"{cgroup_dir}/pids.current")) <= 64


def test_cpu_quota_holds(delegated: Delegated, limited_server: ServerProcess) -> None:
    with _limited_sandbox(delegated, limited_server, {"cpuCount": 0.25}, "7006") as (sb, cgroup_dir):
        assert _read(f"{cgroup_dir}/cpu.max").split() == ["25000", "100000"]
        before = _events(cgroup_dir, "cpu.stat")
        t0 = time.monotonic()
        sb.commands.run("timeout 2 sh -c 'while :; do :; done'; true", timeout=60)
        wall = time.monotonic() - t0
        after = _events(cgroup_dir, "cpu.stat")
        used = (after["usage_usec"] - before["usage_usec"]) / 1e6
        assert used < 0.25 * wall * 1.3, (used, wall)
        assert after["nr_throttled"] > before["nr_throttled"]
