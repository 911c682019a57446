"""Rootless mode, end to end: an ordinary user (made for the test) starts `agentcell serve` itself; the
server runs in a user namespace of that user's (docs/rootless.md). Sandboxes work (code with state,
commands, files), are apart from each other and from the user's files, and a fork bomb and a memory
hog are contained as far as docs/rootless.md promises (RLIMIT_NPROC per sandbox, RLIMIT_DATA per
process)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentcell.sdk import Sandbox
from tests.ordinary_user import OrdinaryUser, ordinary_user, user_venv  # noqa: F401
from tests.servers import ServerProcess, free_port

pytestmark = pytest.mark.skipif(shutil.which("newuidmap") is None,
                                reason="rootless mode needs newuidmap/newgidmap: apt-get install uidmap")
SECRET = "rootless-secret-of-the-user"
LAUNCHER: dict[str, int] = {}  # the rootless_server fixture's launcher pid (what the user sees as the server)


@pytest.fixture(scope="module")
def rootless_server(ordinary_user: OrdinaryUser) -> Iterator[tuple[str, OrdinaryUser, str]]:  # noqa: F811
    user = ordinary_user
    secret = os.path.join(user.home, "secret.txt")
    with open(secret, "w") as f:
        f.write(SECRET)
    os.chown(secret, user.uid, user.gid)
    os.chmod(secret, 0o644)  # readable by every host user: only the sandbox's own root keeps it out
    # `python -m agentcell.server` (the embedded SDK's test below covers `python -m agentcell serve`)
    with ServerProcess(Path(user.home, "server.log"), "--standbys", "1", "--max-sandboxes", "8", "--egress-uplink",
                       "none", command=[user.python, "-m", "agentcell.server"], host=None, own_state_dir=False,
                       user=user, ready_status=200, start_timeout=180,  # the first start builds its runtime store
                       stop_timeout=30, what="the rootless server") as srv:
        LAUNCHER["pid"] = srv.pid
        yield srv.url, user, srv.log()


def _run(sb: Sandbox, cmd: str) -> str:
    return sb.commands.run(cmd, timeout=60).stdout


def test_server_runs_as_the_user_in_its_namespace(rootless_server: tuple[str, OrdinaryUser, str]) -> None:
    url, user, log = rootless_server
    assert "rootless mode" in log and "NOT PROTECTED" in log  # the log says what it does not protect
    sb = Sandbox.create(api_url=url, timeout=120)
    try:
        # the sandbox's ids are subordinate ids of the user's, distinct from the user's own
        outer_user = int(_run(sb, "cat /proc/self/uid_map").split("\n")[1].split()[1])  # 1000 -> its server-ns id
        assert outer_user >= 10_000
        assert _run(sb, "id -u").strip() == "1000"
        # no uplink in rootless mode: a create asking for the internet gets loopback only (as on any server
        # without an uplink); nothing leaves, not even to a documentation address
        online = Sandbox.create(api_url=url, timeout=60, allow_internet_access=True)
        try:
            interfaces = [line.split(":")[0].strip() for line in _run(online, "cat /proc/net/dev").splitlines()[2:]]
            assert interfaces == ["lo"]
            unreachable = online.run_code("import socket\ns = socket.socket()\ns.settimeout(2)\n"
                                          "try:\n    s.connect(('192.0.2.1', 80))\nexcept OSError as e:\n"
                                          "    print(e.errno)").logs.stdout
            assert unreachable == ["101\n"]  # ENETUNREACH
        finally:
            online.kill()
    finally:
        sb.kill()


def test_code_state_commands_files(rootless_server: tuple[str, OrdinaryUser, str]) -> None:
    url, _, _ = rootless_server
    sb = Sandbox.create(api_url=url, timeout=120)
    try:
        assert sb.run_code("x = 41\nx + 1").text == "42"
        assert sb.run_code("x * 2").text == "82"  # state kept between calls
        r = sb.commands.run("echo hello && id -un", timeout=30)
        assert r.exit_code == 0 and r.stdout == "hello\nuser\n"
        sb.files.write("/home/user/notes.txt", "written by the test")
        assert sb.files.read("/home/user/notes.txt") == "written by the test"
        assert _run(sb, "cat /home/user/notes.txt") == "written by the test"
        assert sb.run_code("open('/home/user/notes.txt').read()").text == "written by the test"
        # what rootless mode does not offer, as docs/rootless.md says: /usr is read-only, even for root ...
        assert "Read-only file system" in sb.commands.run("touch /usr/x 2>&1 || true", timeout=30).stdout
        as_root = sb.commands.run("id -u; pwd; touch /etc/x 2>&1 || true", user="root", timeout=30).stdout
        assert as_root.startswith("0\n/root\n") and "Read-only file system" in as_root
        # ... and a venv in the home is where packages go
        venv = sb.commands.run("python -m venv ~/v && ~/v/bin/python -c 'import sys; print(sys.prefix)'",
                               timeout=120).stdout
        assert venv == "/home/user/v\n"
    finally:
        sb.kill()


def test_sandboxes_are_apart_and_the_users_files_out_of_reach(rootless_server: tuple[str, OrdinaryUser, str]) -> None:
    url, user, _ = rootless_server
    a = Sandbox.create(api_url=url, timeout=120)
    b = Sandbox.create(api_url=url, timeout=120)
    try:
        a.commands.run("sleep 600", background=True)
        _run(a, "echo a-private > /tmp/a-marker; echo a-home > /home/user/a-home")
        assert "sleep 600" in _run(a, "ps -eo args")
        seen_by_b = _run(b, "ps -eo args")
        assert "sleep 600" not in seen_by_b  # its own pid namespace
        assert _run(b, "ls /tmp /home/user; cat /tmp/a-marker /home/user/a-home 2>&1 || true").count("a-private") == 0
        ids_a = _run(a, "cat /proc/self/uid_map").split()
        ids_b = _run(b, "cat /proc/self/uid_map").split()
        assert ids_a != ids_b and not set(ids_a[1::3]) & set(ids_b[1::3])  # no outer id in common
        # the user's home is not in the sandbox's root, whatever its mode on the host
        cat = _run(b, f"cat {user.home}/secret.txt 2>&1; ls /home; true")
        assert SECRET not in cat and "No such file or directory" in cat and cat.split("\n")[1:] == ["user", ""]
        found = _run(b, f"grep -rsl {SECRET} /home /tmp /opt /etc /run /mnt /srv /root /var 2>/dev/null; true")
        assert found == ""
    finally:
        a.kill()
        b.kill()


def test_fork_bomb_and_memory_hog_are_contained(rootless_server: tuple[str, OrdinaryUser, str]) -> None:
    url, _, _ = rootless_server
    bystander = Sandbox.create(api_url=url, timeout=120)
    sb = Sandbox.create(api_url=url, timeout=120, limits={"pids": 64, "memoryMB": 512})
    try:
        forks = sb.run_code(
            "import os, time\n"
            "n, err = 0, None\n"
            "try:\n"
            "    while n < 5000:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(60); os._exit(0)\n"
            "        n += 1\n"
            "except OSError as e:\n"
            "    err = e.errno\n"
            "(n, err)", timeout=60).text
        n, err = eval(forks)  # noqa: S307 - a tuple of two ints printed by the sandbox
        assert err == 11 and n < 64, forks  # EAGAIN: RLIMIT_NPROC of the sandbox's own id (docs/rootless.md)
        # the others and the server still serve
        assert _run(bystander, "echo alive") == "alive\n"
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        # memory: one process cannot take more than memory_mb (RLIMIT_DATA)
        hog = sb.run_code("b = bytearray(2 << 30)", timeout=60)
        assert hog.error is not None and hog.error.name == "MemoryError"
        assert sb.run_code("len(bytearray(64 << 20))", timeout=60).text == str(64 << 20)
    finally:
        sb.kill()
        bystander.kill()


def test_embedded_sdk_of_an_ordinary_user_runs_rootless(rootless_server: tuple[str, OrdinaryUser, str]) -> None:
    """`Sandbox.create()` with no URL, by a user who is not root: the embedded server starts rootless
    (beside the user's other rootless server: the two reserve disjoint ids)."""
    _, user, _ = rootless_server
    script = ("from agentcell.sdk import Sandbox\n"
              "sb = Sandbox.create()\n"
              "print(sb.run_code('6 * 7').text)\n"
              "print(sb.commands.run('cat /proc/self/uid_map').stdout.split()[4])\n"
              "sb.kill()\n")
    done = user.run([user.python, "-c", script], timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    answer, outer = done.stdout.split()
    assert answer == "42" and int(outer) >= 10_000  # the sandbox's user: a subordinate id of this user's


def test_a_second_server_on_the_state_dir_names_the_real_holder(rootless_server: tuple[str, OrdinaryUser, str]) -> None:
    """The server holds its state dir; inside its namespace it is pid 1, but the message names the pid
    the user sees (its launcher, which passes signals on): it said "pid 1"."""
    url, user, _ = rootless_server
    port = free_port()
    done = user.run([user.python, "-m", "agentcell.server", "--port", str(port), "--standbys", "0",
                     "--egress-uplink", "none"], timeout=120)
    assert done.returncode != 0
    assert "is in use by another agentcell server" in done.stderr, done.stderr[-3000:]
    assert f"(a rootless server, pid {LAUNCHER['pid']}, listening on 127.0.0.1:{url.rsplit(':', 1)[1]}" in done.stderr, \
        done.stderr[-3000:]
    assert "pid 1," not in done.stderr
    os.kill(LAUNCHER["pid"], 0)  # the pid named is the server's, alive
