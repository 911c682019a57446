"""`agentcell doctor`, run for real: as root (this process) and as an ordinary user made for the test,
its text and --json outputs parsed, its exit code checked against its verdict."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.ordinary_user import OrdinaryUser, ordinary_user, user_venv, user_without_subids  # noqa: F401

STATUSES = {"ok", "warn", "missing"}
NAMES = {"privilege", "user namespaces", "newuidmap + subordinate ids", "cgroups", "seccomp", "Landlock", "nftables",
         "user-mode networking", "libbpf + BTF", "exec rules", "kernel audit", "node", "R", "runsc (gvisor)", "microvm", "/dev/kvm", "state dir", "disk for the runtime store"}
LINE = re.compile(r"^\[(ok  |warn|MISS)\] (?P<name>[^:]+): (?P<detail>.*?)(?: -> fix: (?P<fix>.+))?$")


def _check_json(out: str, returncode: int) -> dict:
    report = json.loads(out)
    assert set(report) == {"mode", "can_run", "checks", "guarantees"}
    assert {c["name"] for c in report["checks"]} == NAMES
    for c in report["checks"]:
        assert c["status"] in STATUSES and c["detail"]
        if c["status"] == "missing":
            assert c["fix"], c  # every missing thing comes with its fix
    assert returncode == (0 if report["can_run"] else 1)
    return report


def _parse_text(out: str) -> tuple[str, dict[str, re.Match[str]], str]:
    lines = out.strip().splitlines()
    assert lines[0].startswith("mode: ")
    checks = {m["name"]: m for m in map(LINE.match, lines) if m}
    return lines[0], checks, lines[-1]


@pytest.mark.skipif(os.geteuid() != 0, reason="the root half needs root")
def test_doctor_as_root() -> None:
    done = subprocess.run([sys.executable, "-m", "agentcell", "doctor", "--json"], capture_output=True, text=True,
                          timeout=60)
    report = _check_json(done.stdout, done.returncode)
    assert report["mode"] == "root" and report["guarantees"] == []
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["privilege"]["status"] == "ok"
    # this machine (CI's too) runs the full server: what root needs is there
    assert report["can_run"], report
    text = subprocess.run([sys.executable, "-m", "agentcell", "doctor"], capture_output=True, text=True, timeout=60)
    mode, checks, verdict = _parse_text(text.stdout)
    assert mode.startswith("mode: root") and set(checks) == NAMES
    assert verdict == "verdict: a server can run here (root)" and text.returncode == 0


def test_doctor_as_ordinary_user_reports_rootless(ordinary_user: OrdinaryUser) -> None:  # noqa: F811
    done = ordinary_user.run([ordinary_user.python, "-m", "agentcell", "doctor", "--json"])
    report = _check_json(done.stdout, done.returncode)
    assert report["mode"] == "rootless"
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["privilege"]["status"] == "warn"
    assert by_name["newuidmap + subordinate ids"]["status"] == "ok", by_name["newuidmap + subordinate ids"]
    assert ordinary_user.home in by_name["state dir"]["detail"]
    # the reduced guarantees: the same table as docs/rootless.md, and some do not hold
    areas = {g["area"]: g["holds"] for g in report["guarantees"]}
    assert areas["sandboxes from each other"] is True and areas["sandboxes from the user's files"] is True
    assert areas["CPU limit"] is False and areas["memory limit"] is None
    # user-mode networking: slirp4netns and a /dev/net/tun others may open (this machine's is root's alone)
    usermode_net, network = by_name["user-mode networking"], next(g for g in report["guarantees"]
                                                                  if g["area"] == "network")
    tun = os.stat("/dev/net/tun") if os.path.exists("/dev/net/tun") else None
    if shutil.which("slirp4netns") and tun is not None and tun.st_mode & 0o006 == 0o006:
        assert usermode_net["status"] == "ok" and "slirp4netns" in network["text"], usermode_net
    else:
        assert usermode_net["status"] == "warn" and usermode_net["fix"], usermode_net
        assert "loopback only" in network["text"]
    if shutil.which("slirp4netns") and tun is not None and tun.st_mode & 0o006 != 0o006:
        assert "/dev/net/tun" in usermode_net["detail"] and "chmod 0666 /dev/net/tun" in usermode_net["fix"]
    assert report["can_run"] and done.returncode == 0
    text = ordinary_user.run([ordinary_user.python, "-m", "agentcell", "doctor"])
    mode, checks, verdict = _parse_text(text.stdout)
    assert mode.startswith("mode: rootless") and set(checks) == NAMES
    assert "rootless mode's guarantees" in text.stdout and "[does not hold] CPU limit" in text.stdout
    assert verdict == "verdict: a server can run here (rootless)"


def test_doctor_without_subordinate_ids_says_no_and_how(user_without_subids: OrdinaryUser) -> None:  # noqa: F811
    done = user_without_subids.run([user_without_subids.python, "-m", "agentcell", "doctor"])
    mode, checks, verdict = _parse_text(done.stdout)
    line = checks["newuidmap + subordinate ids"]
    assert line.group(1) == "MISS" and "usermod --add-subuids" in line["fix"] and user_without_subids.name in line["fix"]
    assert done.returncode == 1 and verdict.startswith("verdict: a server cannot run here (rootless)")
    # and `serve` refuses the same way, in one line
    serve = user_without_subids.run([user_without_subids.python, "-m", "agentcell", "serve", "--port", "1"], timeout=60)
    assert serve.returncode != 0
    assert "subordinate ids" in serve.stderr and "Traceback" not in serve.stderr
