"""A sandbox's policy end to end (issue 28), through the server and our SDK, with real sandboxes, real
programs and the attacks the issue names: exec rules (every way a program starts), file rules, ask
(allow, deny, timeout, remember, flood, a held process killed, the API responsive), updates at run
time, and the behaviour record. The mechanisms' own suites: test_exec_hold.py, test_exec_guard.py,
test_file_rules.py, test_policy_runtime.py, test_network_ask.py; the API's refusals: test_policy_api.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from agentcell import Sandbox
from agentcell.errors import SandboxException
from tests.conftest import GVISOR
from tests.helpers import sh, wait_until

pytestmark = pytest.mark.skipif(GVISOR, reason="exec and file rules: the linux backend (gvisor: test_policy_api)")

DENIED = 126  # bash: an exec refused ("Operation not permitted") or not executable
KILLED = (137, -1)  # the exec guard's SIGKILL: the shell's status, or the command's own (E2B: -1)


@pytest.fixture
def make(server_url: str) -> Iterator:  # type: ignore[type-arg]
    made: list[Sandbox] = []

    def create(policy: dict, **kw: object) -> Sandbox:  # type: ignore[type-arg]
        sbx = Sandbox.create(api_url=server_url, timeout=180, policy=policy, **kw)  # type: ignore[arg-type]
        made.append(sbx)
        return sbx

    yield create
    for sbx in made:
        sbx.kill()


def refused(code: int, err: str) -> bool:
    return code == DENIED and "not permitted" in err


# -- exec ---------------------------------------------------------------------------------------------


def test_an_allow_list_runs_what_it_names_and_nothing_else(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "deny", "allow": ["python3", "git", "cat"]}})
    assert sh(sbx, "python3 -c 'print(6 * 7)'")[1] == "42\n"
    assert sh(sbx, "git --version")[0] == 0
    code, out, err = sh(sbx, "ls /")
    assert refused(code, err), (code, out, err)
    assert "ls" in err  # the shell names what it could not run
    code, _, err = sh(sbx, "python3 -c 'import subprocess; subprocess.run([\"id\"])'")
    assert code == 1 and "PermissionError" in err
    # the shell itself (E2B's commands run through bash) and its builtins
    assert sh(sbx, "echo ok; echo x > /tmp/f && read v < /tmp/f && echo $v")[1] == "ok\nx\n"


def test_every_way_around_an_allow_list_is_refused(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "deny", "allow": ["python3", "cat", "cp", "ln", "chmod"]}})
    attempts = {
        # the loader runs any file: killed before the program's first instruction
        "loader": "/lib64/ld-linux-x86-64.so.2 /bin/ls /",
        # a copy of an allowed program is a new file
        "copy": "cp /bin/cat /tmp/cat2 && /tmp/cat2 /etc/hostname",
        # a copy named like an allowed program
        "renamed": "cp /bin/ls /tmp/python3 && /tmp/python3 /",
        # a symlink named like an allowed program pointing at a denied one
        "symlink": "ln -sf /bin/ls /tmp/cat && /tmp/cat /",
        # a hard link (an overlay copies the file up: a new file)
        "hardlink": "ln /usr/bin/ls /usr/local/bin/ls2 2>/dev/null; ln /bin/ls /tmp/ls2 2>/dev/null; "
                    "{ /usr/local/bin/ls2 / || /tmp/ls2 /; }",
        # a script whose interpreter is denied
        "script": 'printf "#!/usr/bin/perl\\nprint 1;\\n" > /tmp/s.pl && chmod +x /tmp/s.pl && /tmp/s.pl && echo ran',
        # an anonymous file (memfd)
        "memfd": "python3 -c \"import os; fd = os.memfd_create('x'); os.write(fd, open('/bin/ls','rb').read()); "
                 "os.execv(f'/proc/self/fd/{fd}', ['ls', '/'])\"",
        "fexecve": "python3 -c \"import os; fd = os.memfd_create('x'); os.write(fd, open('/bin/ls','rb').read()); "
                   "os.execve(fd, ['ls', '/'], {})\"",
        # via another interpreter's exec
        "python-exec": "python3 -c \"import os; os.execv('/bin/ls', ['ls', '/'])\"",
        "sh-c": "python3 -c \"import subprocess, sys; sys.exit(subprocess.run(['sh', '-c', 'ls /']).returncode)\"",
    }
    for user in ("user", "root"):
        for name, cmd in attempts.items():
            code, out, err = sh(sbx, cmd, user=user)
            assert code != 0 and "usr" not in out and "ran" not in out, (user, name, code, out, err)
    # an allowed interpreter runs a script (its interpreter is what is judged)
    assert sh(sbx, "printf '#!/usr/bin/python3\\nprint(\"py script\")\\n' > /tmp/p.py && chmod +x /tmp/p.py && "
                   "/tmp/p.py")[1] == "py script\n"


def test_a_deny_list_under_default_allow(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "allow", "deny": ["ls", "/usr/bin/id"]}})
    assert refused(*_code_err(sh(sbx, "ls /")))
    assert refused(*_code_err(sh(sbx, "id")))
    assert sh(sbx, "cat /etc/hostname")[0] == 0
    # the loader as a program, to run a denied one: killed
    code, out, _ = sh(sbx, "/lib64/ld-linux-x86-64.so.2 /bin/ls /")
    assert code in KILLED and "usr" not in out
    # and the files API or a write cannot lift it: a denied program stays denied where it is
    assert refused(*_code_err(sh(sbx, "/usr/bin/ls /", user="root")))


def _code_err(r: tuple[int, str, str]) -> tuple[int, str]:
    return r[0], r[2]


def test_exec_rules_change_at_run_time_for_running_processes(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "deny", "allow": ["python3"]}})
    code = ("import subprocess, time\n"
            "def run():\n"
            "    try:\n        return subprocess.run(['ls', '/'], capture_output=True).returncode\n"
            "    except PermissionError:\n        return -13\n")
    ctx = sbx.create_code_context()
    sbx.run_code(code, context=ctx)
    assert sbx.run_code("run()", context=ctx).text == "-13"
    sbx.set_policy({"exec": {"default": "deny", "allow": ["python3", "ls"]}})
    assert sbx.run_code("run()", context=ctx).text == "0"  # the same process, now allowed
    sbx.set_policy({"exec": {"default": "deny", "allow": ["python3"]}})
    assert sbx.run_code("run()", context=ctx).text == "-13"
    sbx.set_policy({})
    assert sbx.run_code("run()", context=ctx).text == "0"
    assert sbx.get_policy()["exec"]["default"] == "allow"


# -- ask ----------------------------------------------------------------------------------------------


def _run_in_background(sbx: Sandbox, cmd: str) -> dict:  # type: ignore[type-arg]
    out: dict = {}  # type: ignore[type-arg]

    def go() -> None:
        out["result"] = sh(sbx, cmd, timeout=90)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    out["thread"] = t
    return out


def _pending(sbx: Sandbox, n: int = 1) -> list[dict]:  # type: ignore[type-arg]
    return wait_until("an approval request", lambda: (lambda p: p if len(p) >= n else None)(sbx.approvals.list()),
                      timeout=20)


def test_ask_allow_deny_remember_and_timeout(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "ask", "allow": ["python3"]}, "ask_timeout_s": 3})
    # allowed once: it runs; asked again next time
    job = _run_in_background(sbx, "ls /")
    req = _pending(sbx)[0]
    assert req["kind"] == "exec" and req["path"].endswith("/ls") and req["argv"][:2] == ["ls", "/"], req
    assert any("bash" in (p.get("comm") or "") for p in req["tree"]), req["tree"]
    t0 = time.monotonic()
    sbx.approvals.allow(req["id"])
    job["thread"].join(30)
    assert job["result"][0] == 0 and "usr" in job["result"][1]
    assert time.monotonic() - t0 < 5
    # denied
    job = _run_in_background(sbx, "id")
    req = _pending(sbx)[0]
    sbx.approvals.deny(req["id"])
    job["thread"].join(30)
    assert job["result"][0] == DENIED, job["result"]
    # remembered: the second run is not asked about
    job = _run_in_background(sbx, "uname")
    sbx.approvals.allow(_pending(sbx)[0]["id"], remember=True)
    job["thread"].join(30)
    assert job["result"][0] == 0
    assert sh(sbx, "uname")[0] == 0 and sbx.approvals.list() == []
    # unanswered: denied after ask_timeout_s
    t0 = time.monotonic()
    code, _, err = sh(sbx, "hostname", timeout=30)
    assert code == DENIED and 2.5 < time.monotonic() - t0 < 15, (code, err)
    decided = sbx.approvals.list(include_decided=True)
    assert [a["state"] for a in decided if a["path"].endswith("hostname")] == ["expired"]
    kinds = [e["kind"] for e in sbx.events(kinds="approval.")]
    assert kinds.count("approval.request") == 4 and kinds.count("approval.decision") == 4


def test_a_held_exec_can_be_killed_and_the_api_stays_responsive(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "ask"}, "ask_timeout_s": 60})
    job = _run_in_background(sbx, "sleep 1")
    req = _pending(sbx)[0]
    # the sandbox answers while an exec waits: files, code, another command's builtins
    t0 = time.monotonic()
    sbx.files.write("/tmp/x", "y")
    assert sbx.files.read("/tmp/x") == "y"
    assert sbx.run_code("1 + 1").text == "2"
    assert sh(sbx, "echo builtin")[1] == "builtin\n"
    assert time.monotonic() - t0 < 10
    # the held process can be killed: its command ends
    pid = req["pid"]
    assert sbx.commands.kill(pid) or True
    job["thread"].join(30)
    assert not job["thread"].is_alive()
    wait_until("the request to go", lambda: sbx.approvals.list() == [], timeout=20)


def test_a_flood_of_requests_is_bounded(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "ask"}, "ask_timeout_s": 20})
    sbx.commands.run("for i in {1..60}; do (/bin/true &) ; done", timeout=60, background=True)
    time.sleep(5)
    assert len(sbx.approvals.list()) <= 16
    assert sbx.run_code("2 + 2").text == "4"


def test_on_approval_callback(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "ask", "allow": ["python3"]}})
    seen: list[str] = []

    def decide(req: dict) -> bool:  # type: ignore[type-arg]
        seen.append(req["path"])
        return req["path"].endswith("/date")

    watcher = sbx.approvals.on_approval(decide)
    try:
        assert sh(sbx, "date +%Y")[0] == 0
        assert sh(sbx, "id")[0] == DENIED
    finally:
        watcher.stop()
    assert any(p.endswith("/date") for p in seen) and any(p.endswith("/id") for p in seen)


# -- files, processes, syscalls together ---------------------------------------------------------------


def test_the_readme_example(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "ask", "allow": ["python3", "git"]},
                "files": [{"path": "/home/user/repo", "access": "read"},
                          {"path": "/home/user/repo/out", "access": "write"},
                          {"path": "/home/user/.ssh", "access": "none"}],
                "syscalls": "strict", "processes": {"max": 64}, "ask_timeout_s": 2})
    assert sh(sbx, "cd /home/user/repo/out && git init -q . && echo inited")[1] == "inited\n"
    code, _, err = sh(sbx, "echo x > /home/user/repo/f")
    assert code != 0 and "Read-only" in err
    assert sh(sbx, "echo x > /home/user/repo/out/f && cat /home/user/repo/out/f")[0] != 0  # cat: asked, expires
    assert sh(sbx, "python3 -c 'print(open(\"/home/user/repo/out/f\").read())'")[1] == "x\n\n"
    with pytest.raises(SandboxException):  # the files API obeys the same rules
        sbx.files.write("/home/user/repo/g", "no")
    with pytest.raises(SandboxException):
        sbx.files.list("/home/user/.ssh")
    r = sbx.run_code("import socket\ntry:\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)\n"
                     "    print('ping socket')\nexcept OSError as e:\n    print(e.errno)")
    assert r.logs.stdout == ["1\n"]  # strict: EPERM
    got = sbx.get_policy()
    assert got["processes"] == {"max": 64} and got["syscalls"] == "strict"


def test_the_policy_is_in_the_record(make, server_url: str) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "deny", "allow": ["python3"]}})
    sh(sbx, "/lib64/ld-linux-x86-64.so.2 /bin/true")
    sbx.set_policy({"exec": {"default": "allow"}})
    wait_until("the kill's event", lambda: [e for e in sbx.events(kinds="deny.exec")], timeout=20)
    created = next(iter(sbx.events(kinds="sandbox.created")))
    assert created["policy"]["exec"]["default"] == "deny"
    assert [e["policy"]["exec"]["default"] for e in sbx.events(kinds="policy.set")] == ["allow"]
    with httpx.Client(base_url=server_url) as http:
        r = http.get(f"/sandboxes/{sbx.sandbox_id}/approvals")
        assert r.status_code == 200


def test_sudo_when_allowed(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "deny", "allow": ["sudo", "id"]}})
    assert sh(sbx, "sudo id -u")[1] == "0\n"
    code, _, err = sh(sbx, "sudo ls /")
    assert code != 0 and "not permitted" in err
    sbx2 = make({"exec": {"default": "deny", "allow": ["id"]}})
    assert sh(sbx2, "sudo id -u")[0] != 0


def test_an_approval_binds_the_file_not_the_path(make) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "ask", "allow": ["cp", "mv"]}, "ask_timeout_s": 3})
    assert sh(sbx, "cp /bin/true /tmp/tool && cp /bin/ls /tmp/other")[0] == 0
    job = _run_in_background(sbx, "/tmp/tool")
    sbx.approvals.allow(_pending(sbx)[0]["id"], remember=True)
    job["thread"].join(30)
    assert job["result"][0] == 0 and sh(sbx, "/tmp/tool")[0] == 0  # remembered
    # the path now names another file: that file is asked about, and denied when nobody answers
    assert sh(sbx, "mv /tmp/other /tmp/tool")[0] == 0
    code, out, _ = sh(sbx, "/tmp/tool /", timeout=30)
    assert code == DENIED and "usr" not in out
    assert [a["state"] for a in sbx.approvals.list(include_decided=True)][-1] == "expired"


def test_the_policy_survives_a_pause(make, server_url: str) -> None:  # type: ignore[no-untyped-def]
    sbx = make({"exec": {"default": "deny", "allow": ["cat"]},
                "files": [{"path": "/home/user/ro", "access": "read"}]})
    sbx.pause()
    again = Sandbox.connect(sbx.sandbox_id, api_url=server_url)
    assert refused(*_code_err(sh(again, "ls /")))
    assert sh(again, "echo x > /home/user/ro/f")[0] != 0
    assert again.get_policy()["exec"]["default"] == "deny"


def test_the_async_sdk(server_url: str) -> None:
    import asyncio

    from agentcell import AsyncSandbox

    async def main() -> None:
        sbx = await AsyncSandbox.create(api_url=server_url, policy={"exec": {"default": "ask", "allow": ["python3"]}})
        try:
            decided: list[str] = []

            async def decide(req: dict) -> bool:  # type: ignore[type-arg]
                decided.append(req["path"])
                return req["path"].endswith("/uname")

            watcher = sbx.approvals.on_approval(decide, remember=True)
            r = await sbx.commands.run("uname")
            assert r.exit_code == 0 and decided and decided[-1].endswith("/uname")
            assert (await sbx.get_policy())["exec"]["default"] == "ask"
            got = await sbx.set_policy({"exec": {"default": "deny", "allow": ["python3"]}})
            assert got["exec"]["default"] == "deny"
            assert [a["state"] for a in await sbx.approvals.list(include_decided=True)] == ["allowed"]
            watcher.cancel()
        finally:
            await sbx.kill()

    asyncio.run(main())
