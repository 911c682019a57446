"""What a server changes on the host (docs/host-changes.md) is undone when it stops: a real server
(the defaults: host sysctls raised, the behaviour record's collectors with kernel audit; no uplink, so
nothing leaves the machine) is started and stopped, and the host compared before, during and after.

Other servers may run on this host meanwhile (they hold the same host-wide settings: the last holder
restores them, backends/linux/host_settings.py), so what this server did is told apart by its pid
(its cgroups, its holds) and its uid range (its audit rules, its uid lock)."""

from __future__ import annotations

import glob
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agentcell.backends.linux import host_settings, uids
from agentcell.record.linux import audit_netlink as an
from agentcell.record.linux.audit_events import AUDIT_KEY, audit_setting
from tests.servers import SERVE, ServerProcess

REPO = Path(__file__).resolve().parent.parent
SYSCTLS = ("fs.file-max", "kernel.pid_max", "kernel.pty.max")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the server needs root")


def _sysctl(name: str) -> str:
    return Path("/proc/sys", name.replace(".", "/")).read_text().strip()


def _holder_pids(key: str) -> set[int]:
    return {int(h["pid"]) for h in host_settings.holders(key).values()}


def _audit_rule_keys(first: int) -> list[str]:
    ctl = an.AuditSocket()
    try:
        return [k for k in (an.rule_key(r) for r in ctl.rules()) if k.startswith(f"agentcell:{first}-")]
    finally:
        ctl.close()


def _state(pid: int, first: int) -> dict[str, Any]:
    status = audit_setting().read()
    return {
        "sysctls": {n: _sysctl(n) for n in SYSCTLS},
        "sysctl_holders": {n: _holder_pids(n) for n in SYSCTLS},
        "audit": {k: status[k] for k in ("enabled", "failure", "backlog_limit", "backlog_wait_time")},
        "audit_holders": _holder_pids(AUDIT_KEY),
        "audit_rules": _audit_rule_keys(first),
        "cgroups": sorted(glob.glob(f"/sys/fs/cgroup/*/agentcell/{pid}-*") + glob.glob(f"/sys/fs/cgroup/unified/agentcell/{pid}-*")),
        "uid_lock_held": _uid_lock_held(first),
        "nft_tables": [t for t in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout.splitlines()
                       if str(pid) in t],
        "mounts": [m for m in Path("/proc/mounts").read_text().splitlines() if f"/{pid}-" in m or f"-{pid}/" in m],
    }


def _uid_lock_held(first: int) -> bool:
    import fcntl

    for path in glob.glob(os.path.join(uids.LOCK_DIR, f"{first}-*")):
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


def test_a_stopped_server_leaves_the_host_as_it_found_it(tmp_path: Path) -> None:
    first = 1_600_000_000 + (os.getpid() % 1000) * 4096  # our own uid range: our audit rules are told apart
    before = _state(-1, first)
    srv = ServerProcess(tmp_path / "server.log", "--state-dir", str(tmp_path / "state"), "--egress-uplink", "none",
                        "--uid-base", str(first), "--max-sandboxes", "8", "--standbys", "1", command=SERVE,
                        uds=str(tmp_path / "s.sock"), env={"PYTHONPATH": str(REPO)}, ready_status=200,
                        start_timeout=300)
    try:
        srv.wait_ready()
        with srv.http_client() as c:
            sbx = c.post("/sandboxes", json={"templateID": "code-interpreter-v1", "timeout": 60})
            assert sbx.status_code == 201, sbx.text
            during = _state(srv.pid, first)
    finally:
        srv.stop(60, or_kill=False)  # its own shutdown undoes its changes: a SIGKILL would not tell
    after = _state(srv.pid, first)

    # it did change the host while it ran ...
    assert during["cgroups"] and during["uid_lock_held"], (during, srv.log()[-2000:])
    for name in SYSCTLS:  # held even when high enough already (another server's raise stays)
        assert srv.pid in during["sysctl_holders"][name], (name, during)
    # ... and nothing of it is left
    assert after["cgroups"] == [] and not after["uid_lock_held"], after
    assert after["audit_rules"] == [] and after["nft_tables"] == [] and after["mounts"] == [], after
    assert srv.pid not in after["audit_holders"]
    for name in SYSCTLS:
        assert srv.pid not in after["sysctl_holders"][name], (name, after)
        if not after["sysctl_holders"][name] and not before["sysctl_holders"][name]:
            assert after["sysctls"][name] == before["sysctls"][name], (name, before, after)  # restored
    if not after["audit_holders"] and not before["audit_holders"]:
        assert after["audit"] == before["audit"], (before, after)
