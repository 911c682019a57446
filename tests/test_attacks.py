"""Hostile code, for real: every attack must fail, and the server and a neighbour sandbox must not notice.

Each test runs the attack in a fresh sandbox through the public SDK against a real server, then checks
the neighbour (created before the attack) still computes and the server still creates sandboxes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import GVISOR, MICROVM
from helpers import CONNECT_CODE, host_listener, secret_scan_code, sh

from agentcell import Sandbox

# gVisor has no OOM killer of its own: a sandbox past its memory limit is killed whole by the host's
# memory cgroup, not just its greediest process, and a fork in the guest copies far more on write than
# Linux (60 sleeping Python children of the context take ~500 MiB), so the fork loop meets the memory
# limit before RLIMIT_NPROC. There the attacker's sandbox may die; what must hold on every backend is
# that the attack ends, and that neighbours and the server are untouched (the fixture checks both).


def _killed_whole(sbx: Sandbox) -> bool:
    """On gvisor, whether the attack took its own sandbox down (and only it): then it is gone."""
    return GVISOR and not sbx.is_running()


@pytest.fixture
def attacker(server_url: str, neighbour: Sandbox) -> Iterator[Sandbox]:
    sbx = Sandbox.create(
        api_url=server_url, timeout=120, limits={"memoryMB": 256, "pids": 64, "diskMB": 64}
    )
    yield sbx
    sbx.kill()
    # After every attack: the neighbour kept its state and the server still serves.
    assert neighbour.run_code("canary").text == "alive"
    assert sh(neighbour, "echo ok")[1] == "ok\n"
    with Sandbox.create(api_url=server_url) as fresh:
        assert fresh.run_code("6 * 7").text == "42"



def test_cannot_read_host_files(attacker: Sandbox, host_secret: Path) -> None:
    for path in (host_secret, Path("/root") / host_secret.name):
        code, out, _ = sh(attacker, f"cat {path}")
        assert code != 0 and host_secret.read_text() not in out
        if path.parent == Path("/root"):  # the sandbox's /root is its root's (0700): the user may not look
            with pytest.raises(Exception, match="Permission denied"):
                attacker.files.exists(str(path))
            assert sh(attacker, f"test -e {path}", user="root")[0] != 0
        else:
            assert not attacker.files.exists(str(path))
    code, out, _ = sh(attacker, "ls -a /root /tmp 2>&1")
    assert host_secret.name not in out
    assert sh(attacker, "cat /etc/shadow")[0] != 0
    # /home holds only the sandbox user's home; the host's /etc/passwd users are not there.
    assert sh(attacker, "ls /home")[1].split() == ["user"]
    passwd = attacker.files.read("/etc/passwd")
    assert "user:x:1000" in passwd and "systemd" not in passwd


def test_cannot_see_host_processes(attacker: Sandbox) -> None:
    _, out, _ = sh(attacker, "ls /proc | grep -E '^[0-9]+$'")
    pids = [int(p) for p in out.split()]
    assert 1 in pids and len(pids) < 20 and os.getpid() not in pids, pids
    _, out, _ = sh(attacker, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '; ps -eo comm")
    assert "pytest" not in out and "agentcell.server" not in out
    # Sandbox processes are forks of the zygote; their command line must not tell host details.
    assert "--parent" not in out and "/run/agentcell" not in out and "--cgroup" not in out


def test_cannot_reach_host_loopback(attacker: Sandbox) -> None:
    with host_listener() as (port, accepted):
        r = attacker.run_code(CONNECT_CODE.format(port=port))
        assert "connected" not in "".join(r.logs.stdout)
        # Nothing but loopback inside, and no route anywhere. A microvm has its virtual NIC whatever its
        # network (the template's device), down and without an address when the sandbox has none.
        _, out, _ = sh(attacker, "ip -o link 2>/dev/null || cat /proc/net/dev")
        assert "veth" not in out and ("eth" not in out or MICROVM)
        if MICROVM:
            _, out, _ = sh(attacker, "/usr/sbin/ip -o -4 addr show dev eth0; /usr/sbin/ip -o -6 addr show dev eth0; "
                                     "/usr/sbin/ip route; echo done")
            assert out.strip() == "done", out
    assert accepted == []


def test_fork_bomb_is_contained(attacker: Sandbox) -> None:
    # An unbounded fork loop: the pids limit (64) stops it with EAGAIN, well before the host notices.
    try:
        r = attacker.run_code(
            "import os, time\n"
            "kids, err = [], None\n"
            "try:\n"
            "    while len(kids) < 10000:\n"
            "        pid = os.fork()\n"
            "        if pid == 0:\n"
            "            time.sleep(60); os._exit(0)\n"
            "        kids.append(pid)\n"
            "except OSError as e:\n"
            "    err = e.errno\n"
            "for k in kids: os.kill(k, 9)\n"
            "for k in kids: os.waitpid(k, 0)\n"
            "(len(kids), err)"
        )
    except Exception:  # noqa: BLE001 - gvisor: the sandbox died with the request
        assert _killed_whole(attacker)
        return
    if r.error is not None and _killed_whole(attacker):
        return  # gvisor: the loop met the memory limit first and the host killed that sandbox alone
    forked, err = eval(r.text)
    assert err == 11 and 10 <= forked < 64, (forked, err)  # EAGAIN
    # The classic shell bomb, for a few seconds, while the fixture's neighbour keeps working.
    attacker.commands.run("timeout 3 bash -c ':(){ :|:& };:'", background=True)
    time.sleep(4)
    attacker.run_code("import os, signal; os.kill(-1, signal.SIGKILL)")  # the agent (init) is spared
    time.sleep(0.5)
    assert sh(attacker, "echo recovered")[1] == "recovered\n"


def test_memory_hog_is_contained(attacker: Sandbox) -> None:
    try:
        r = attacker.run_code("x = b'1' * (600 * 1024 * 1024); 'survived'")
    except Exception:  # noqa: BLE001 - gvisor: the sandbox died with the request
        assert _killed_whole(attacker)
        return
    assert r.text != "'survived'"
    assert r.error is not None  # MemoryError, or the context was OOM-killed (UnexpectedEndOfExecution)
    if _killed_whole(attacker):
        return
    # The sandbox's agent outlives its code: a new run works (the context restarts).
    assert attacker.run_code("1 + 1").text == "2"


def test_disk_fill_is_contained(attacker: Sandbox) -> None:
    code, _, err = sh(attacker, "dd if=/dev/zero of=/home/user/big bs=1M count=200", timeout=60)
    assert code != 0 and "No space left" in err
    with pytest.raises(Exception, match="(?i)space|full|disk|exhausted|507"):
        attacker.files.write("/home/user/more", b"x" * (8 * 1024 * 1024))
    sh(attacker, "rm -f /home/user/big")
    attacker.files.write("/home/user/small", "fits")
    assert attacker.files.read("/home/user/small") == "fits"


def test_sleep_past_timeout_is_reaped(server_url: str, neighbour: Sandbox) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=2)
    sbx.commands.run("sleep 600", background=True)
    deadline = time.monotonic() + 15
    while sbx.is_running() and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not sbx.is_running()
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_url=server_url)]
    assert neighbour.run_code("canary").text == "alive"


def test_kill_9_agent_does_not_break_out_or_crash(attacker: Sandbox) -> None:
    sh(attacker, "kill -9 1; kill -KILL -1; kill -TERM 1; kill -INT 1")
    # Signals from inside never reach the sandbox's init; the sandbox keeps serving.
    assert sh(attacker, "echo alive")[1] == "alive\n"


def test_cannot_write_outside_home_and_tmp(attacker: Sandbox) -> None:
    for path in ("/usr/evil", "/etc/evil", "/evil", "/usr/bin/python3", "/proc/sys/kernel/hostname"):
        code, _, _ = sh(attacker, f"echo x > {path}")
        assert code != 0, path
        with pytest.raises(Exception):  # noqa: B017 - any typed SDK error; the write must not land
            attacker.files.write(path, "x")
    assert not Path("/usr/evil").exists() and not Path("/evil").exists()
    assert sh(attacker, "echo x > /home/user/ok && echo x > /tmp/ok && echo fine")[1] == "fine\n"


def test_files_api_symlink_and_dotdot_escapes(attacker: Sandbox, host_secret: Path) -> None:
    sh(attacker, f"ln -s /etc/passwd /home/user/pw; ln -s {host_secret} /home/user/secret; ln -s / /home/user/root")
    # Reading through a link sees only the sandbox's own root.
    assert "user:x:1000" in attacker.files.read("/home/user/pw")
    with pytest.raises(Exception):  # noqa: B017
        attacker.files.read("/home/user/secret")
    with pytest.raises(Exception):  # noqa: B017
        attacker.files.write("/home/user/pw", "root::0:0::/root:/bin/bash\n")
    with pytest.raises(Exception):  # noqa: B017
        attacker.files.write("/home/user/root/usr/evil", "x")
    with pytest.raises(Exception):  # noqa: B017
        attacker.files.read("/home/user/../../etc/shadow")
    with pytest.raises(Exception):  # noqa: B017
        attacker.files.write("/home/user/../../usr/evil", "x")
    assert not Path("/usr/evil").exists()
    assert "root::0:0" not in Path("/etc/passwd").read_text()


def test_setuid_binaries_give_no_privilege(attacker: Sandbox) -> None:
    assert "s" in sh(attacker, "stat -c %A /usr/bin/su")[1]  # the setuid bit is there, and useless:
    code, out, _ = sh(attacker, "su -c 'id -u' root </dev/null")
    assert code != 0 and "0" not in out.split()
    assert sh(attacker, "/usr/bin/mount -t tmpfs x /tmp")[0] != 0
    assert sh(attacker, "id -u")[1] == "1000\n"
    assert sh(attacker, "python3 -c 'import os; os.setuid(0)'")[0] != 0


def test_mount_ptrace_and_namespaces_denied(attacker: Sandbox) -> None:
    assert sh(attacker, "mkdir -p /tmp/m && mount -t tmpfs none /tmp/m")[0] != 0
    assert sh(attacker, "unshare -U true")[0] != 0
    assert sh(attacker, "unshare -r id")[0] != 0
    assert sh(attacker, "unshare -n true")[0] != 0
    r = attacker.run_code(
        "import ctypes, os, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    time.sleep(5); os._exit(0)\n"
        "rc = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH\n"
        "err = ctypes.get_errno(); os.kill(pid, 9); os.waitpid(pid, 0)\n"
        "(rc, err)"
    )
    rc, err = eval(r.text)
    assert rc == -1 and err == 1  # EPERM
    assert sh(attacker, "strace -f true 2>&1")[0] != 0


def test_rm_rf_root_only_hurts_the_sandbox(attacker: Sandbox, host_secret: Path) -> None:
    attacker.files.write("/home/user/precious", "data")
    # gvisor: each deletion in the root's memory overlay is a whiteout the sentry makes, minutes for all of /usr
    sh(attacker, "rm -rf --no-preserve-root / 2>/dev/null; true", timeout=600 if GVISOR else 60)
    assert host_secret.exists()
    assert Path("/usr/bin/ls").exists() and Path("/etc/passwd").exists()
    # The sandbox lost only its own writable files; its read-only view of the host is whole.
    assert not attacker.files.exists("/home/user/precious")
    assert sh(attacker, "/usr/bin/ls /usr/bin/ls")[0] == 0


def test_server_environment_never_reaches_a_sandbox(attacker: Sandbox) -> None:
    from conftest import SERVER_ENV_CANARY

    if os.environ.get("AGENTCELL_TEST_SERVER_URL"):
        pytest.skip("an external server was not started with the canary")
    _, out, _ = sh(attacker, "env; cat /proc/1/environ /proc/self/environ; tr '\\0' '\\n' < /proc/1/cmdline")
    assert SERVER_ENV_CANARY not in out
    # Sandboxes are forks of a zygote: scan the code context's whole memory for the secret.
    r = attacker.run_code(secret_scan_code(SERVER_ENV_CANARY.encode(), rb"canary-[0-9a-f]{16}"))
    assert r.text == "(False, True)", r
