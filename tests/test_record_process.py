"""The behaviour record's collectors in a process of their own (record/linux/process.py): a
real server, its real child, real sandboxes. The child reads the kernel, not the server; it runs at a
lower priority; it dies with the server, restoring the kernel's audit rules; killed, it is started
again and the records say what went missing."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from agentcell import Sandbox
from agentcell.record.linux import audit_netlink as an
from agentcell.record.linux.process import NICE, processes_of
from tests.helpers import wait_for_events, wait_until
from tests.servers import ServerProcess

pytestmark = pytest.mark.skipif(os.environ.get("AGENTCELL_TEST_BACKEND", "linux") != "linux",
                                reason="the linux backend's collectors")


def _alive(pid: int) -> bool:
    """Running (an exited child of a dead server is a zombie until whoever inherited it reaps it: an
    embedded server earlier in the test session makes this test process a subreaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _rule_keys() -> set[str]:
    ctl = an.AuditSocket()
    try:
        return {an.rule_key(r) for r in ctl.rules()}
    finally:
        ctl.close()


def _events(sbx: Sandbox, pred: Any, within: float = 10) -> list[dict[str, Any]]:
    return wait_for_events(sbx.events, pred, timeout=within, interval=0.1)


def test_the_kernel_is_read_by_a_child_that_dies_with_the_server(tmp_path: Path) -> None:
    before = _rule_keys()
    srv = ServerProcess(tmp_path / "server.log", "--standbys", "1")
    try:
        srv.wait_ready(300)
        (child,) = wait_until("a record process beside the server", lambda: processes_of(srv.pid), timeout=30)
        assert os.getpriority(os.PRIO_PROCESS, child) == NICE
        ctl = an.AuditSocket()
        try:  # the kernel's records go to a record process, never to a server
            daemon = ctl.status().pid
        finally:
            ctl.close()
        with open(f"/proc/{daemon}/cmdline", "rb") as f:
            assert b"agentcell.record.linux.process" in f.read()
        ours = _rule_keys() - before
        assert ours, "the server's collectors added no audit rule"
        with Sandbox.create(api_url=srv.url, timeout=60) as sbx:
            sbx.run_code("import os; os.system('echo hi > /tmp/through-the-child')")
            evs = _events(sbx, lambda evs: any(e["kind"] == "file.write" and e.get("path") == "/tmp/through-the-child"
                                               for e in evs) and any(e["kind"] == "process.exec" for e in evs))
            execs = [e for e in evs if e["kind"] == "process.exec"]
            assert any(e.get("argv", [None])[0] == "sh" for e in execs), execs
        srv.proc.kill()  # SIGKILL: no close of the server's; the child goes by PR_SET_PDEATHSIG
        srv.proc.wait(10)
        wait_until("the record process to die with its server", lambda: not _alive(child), timeout=15)
        assert not (ours & _rule_keys()), "the dead server's audit rules stayed"
    finally:
        srv.stop()


def test_a_killed_record_process_is_started_again_and_the_records_say_so(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "server.log", "--standbys", "1")
    try:
        srv.wait_ready(300)
        (child,) = wait_until("a record process beside the server", lambda: processes_of(srv.pid), timeout=30)
        with Sandbox.create(api_url=srv.url, timeout=120) as old:
            old.commands.run("true")
            os.kill(child, signal.SIGKILL)
            (again,) = wait_until("the record process to start again",
                                  lambda: [p for p in processes_of(srv.pid) if p != child], timeout=30)
            assert "the behaviour record's process is gone" in srv.log()
            # the sandbox that lived through it: a note of the gap, then its events again
            _events(old, lambda evs: any(e["kind"] == "record.dropped" and "started again" in e.get("reason", "")
                                         for e in evs))
            old.commands.run("echo after > /tmp/after-the-restart")
            _events(old, lambda evs: any(e["kind"] == "file.write" and e.get("path") == "/tmp/after-the-restart"
                                         for e in evs))
            with Sandbox.create(api_url=srv.url, timeout=60) as new:  # and one created after it
                new.commands.run("/bin/true")
                _events(new, lambda evs: any(e["kind"] == "process.exec" and e.get("path") == "/bin/true"
                                             for e in evs))
        assert srv.proc.poll() is None
    finally:
        srv.stop()
    wait_until("the record process to end with its server's stop", lambda: not _alive(again), timeout=15)
