"""A policy's `files` rules (agentcell/policy/linux/file_rules.py), for real: mounts applied by this
test process (host root) in a running sandbox of the session's server, then attacked from inside,
as the sandbox's user and as its root, through the shell, Python and the SDK's files API.

Each test first checks that what it will refuse works without the rule (so it can fail), and leaves
the sandbox without rules."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from agentcell import Sandbox
from agentcell.policy.linux import file_rules
from agentcell.policy.linux.file_rules import Applied, FileRulesError
from tests.conftest import GVISOR
from tests.helpers import sh, wait_until
from tests.oci_images import musl_root, root_image
from tests.servers import ServerProcess

pytestmark = pytest.mark.skipif(GVISOR or os.geteuid() != 0, reason="linux backend, as root")

# Tries one operation after another on a directory and prints {operation: "ok" | errno name}.
OPS = r"""
import errno, json, os, sys
base = sys.argv[1]
def t(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
r = {}
r["read"] = t(lambda: open(f"{base}/a").read())
r["list"] = t(lambda: os.listdir(base))
r["stat"] = t(lambda: os.stat(f"{base}/a"))
r["write"] = t(lambda: open(f"{base}/a", "a").write("x"))
r["create"] = t(lambda: open(f"{base}/new", "x").close())
r["truncate"] = t(lambda: os.truncate(f"{base}/a", 0))
r["chmod"] = t(lambda: os.chmod(f"{base}/a", 0o777))
r["chown"] = t(lambda: os.chown(f"{base}/a", os.getuid(), os.getgid()))
r["utime"] = t(lambda: os.utime(f"{base}/a"))
r["mkdir"] = t(lambda: os.mkdir(f"{base}/d"))
r["symlink"] = t(lambda: os.symlink("/tmp", f"{base}/l"))
r["link"] = t(lambda: os.link(f"{base}/a", f"{base}/a2"))
r["rename"] = t(lambda: os.rename(f"{base}/c", f"{base}/b"))
r["rmdir"] = t(lambda: os.rmdir(f"{base}/sub"))
r["unlink"] = t(lambda: os.unlink(f"{base}/a"))
print(json.dumps(r))
"""
WRITES = ("write", "create", "truncate", "chmod", "chown", "utime", "mkdir", "symlink", "link", "rename", "rmdir",
          "unlink")
REFUSED = {"EROFS", "EACCES", "EPERM"}


@dataclass(frozen=True)
class Rule:
    path: str
    access: str


def init_pid(sandbox_id: str) -> int:
    """The host pid of the sandbox's init: pid 1 of its pid namespace whose hostname is the id."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                nspid = next(line for line in f if line.startswith("NSpid:")).split()[1:]
            if len(nspid) > 1 and nspid[-1] == "1":
                with open(f"/proc/{name}/root/etc/hostname") as f:
                    if f.read().strip() == sandbox_id:
                        return int(name)
        except (OSError, StopIteration):
            continue
    raise AssertionError(f"no init process for {sandbox_id}")


class Rules:
    """The rules in force in one sandbox, as the server would keep them."""

    def __init__(self, sbx: Sandbox) -> None:
        self.pid = init_pid(sbx.sandbox_id)
        self.applied: Applied | None = None

    def set(self, *rules: tuple[str, str]) -> Applied:
        self.applied = file_rules.apply(self.pid, [Rule(p, a) for p, a in rules], self.applied)
        return self.applied

    def clear(self) -> None:
        if self.applied is not None:
            file_rules.clear(self.pid, self.applied)
            self.applied = None


@pytest.fixture(scope="module")
def sbx(server_url: str) -> Iterator[Sandbox]:
    s = Sandbox.create(api_url=server_url, timeout=900)
    s.files.write("/tmp/ops.py", OPS)
    yield s
    s.kill()


@pytest.fixture
def rules(sbx: Sandbox) -> Iterator[Rules]:
    r = Rules(sbx)
    mounts = sh(sbx, "cat /proc/self/mountinfo")[1].count("\n")
    yield r
    r.clear()
    assert sh(sbx, "cat /proc/self/mountinfo")[1].count("\n") == mounts  # every rule mount is gone


def ops(sbx: Sandbox, path: str, user: str | None = None) -> dict[str, str]:
    code, out, err = sh(sbx, f"python3 /tmp/ops.py {path}", user=user)
    assert code == 0, err
    return json.loads(out)


def fresh_dir(sbx: Sandbox, path: str) -> None:
    """`path` with files `a`, `c` and an empty directory `sub`, owned by the user."""
    assert sh(sbx, f"sudo rm -rf {path}; mkdir -p {path}/sub && echo data > {path}/a && touch {path}/c")[0] == 0


@pytest.mark.parametrize("user", ["user", "root"])
def test_read_rule_refuses_every_change_and_allows_reading(sbx: Sandbox, rules: Rules, user: str) -> None:
    fresh_dir(sbx, "/home/user/repo")
    assert set(ops(sbx, "/home/user/repo", user).values()) == {"ok"}  # without the rule: all allowed
    fresh_dir(sbx, "/home/user/repo")
    rules.set(("/home/user/repo", "read"))
    got = ops(sbx, "/home/user/repo", user)
    assert {op: got[op] for op in ("read", "list", "stat")} == {"read": "ok", "list": "ok", "stat": "ok"}
    assert {op: got[op] for op in WRITES if got[op] not in REFUSED} == {}, got
    assert sh(sbx, "cat /home/user/repo/a")[1] == "data\n"


@pytest.mark.parametrize("user", ["user", "root"])
def test_none_rule_refuses_listing_and_reading(sbx: Sandbox, rules: Rules, user: str) -> None:
    fresh_dir(sbx, "/home/user/.ssh")
    assert sh(sbx, "echo k > /home/user/token")[0] == 0
    assert ops(sbx, "/home/user/.ssh", user)["read"] == "ok"
    fresh_dir(sbx, "/home/user/.ssh")
    rules.set(("/home/user/.ssh", "none"), ("/home/user/token", "none"))
    got = ops(sbx, "/home/user/.ssh", user)
    assert set(got.values()) <= REFUSED, got
    code, _, err = sh(sbx, "cat /home/user/token; ls /home/user/.ssh; cd /home/user/.ssh", user=user)
    assert code != 0 and err.count("Permission denied") == 3, err
    # the cover is host root's: the sandbox's root can neither read it nor make it its own
    code, _, err = sh(sbx, "chmod 777 /home/user/.ssh || chown root /home/user/token || echo x >> /home/user/token",
                      user="root")
    assert code != 0
    assert sh(sbx, "stat -c '%a %U' /home/user/.ssh /home/user/token")[1] == "0 nobody\n0 nobody\n"


def test_write_under_read_and_none_parents(sbx: Sandbox, rules: Rules) -> None:
    fresh_dir(sbx, "/home/user/repo")
    assert sh(sbx, "mkdir -p /home/user/repo/out /home/user/secret/drop && echo s > /home/user/secret/key")[0] == 0
    rules.set(("/home/user/repo", "read"), ("/home/user/repo/out", "write"),
              ("/home/user/secret", "none"), ("/home/user/secret/drop", "write"))
    assert sh(sbx, "echo r > /home/user/repo/out/r && cat /home/user/repo/out/r")[1] == "r\n"
    assert sh(sbx, "echo d > /home/user/secret/drop/d && cat /home/user/secret/drop/d")[1] == "d\n"
    assert "Read-only" in sh(sbx, "echo x > /home/user/repo/x")[2]
    code, _, err = sh(sbx, "ls /home/user/secret")
    assert code != 0 and "Permission denied" in err
    # with a rule inside, the cover can be searched (mode 0111) but holds only the way to that rule
    code, _, err = sh(sbx, "cat /home/user/secret/key")
    assert code != 0 and "No such file" in err
    # moving a file out of the writable place into the read-only one, or back, crosses mounts
    code, _, err = sh(sbx, "mv /home/user/repo/out/r /home/user/repo/r")
    assert code != 0
    assert sh(sbx, "ls /home/user/repo")[1].split() == ["a", "c", "out", "sub"]


def test_files_api_obeys_the_rules(sbx: Sandbox, rules: Rules) -> None:
    fresh_dir(sbx, "/home/user/repo")
    assert sh(sbx, "mkdir -p /home/user/repo/out /home/user/vault && echo v > /home/user/vault/v")[0] == 0
    sbx.files.write("/home/user/repo/api", "before")  # without the rule: allowed
    rules.set(("/home/user/repo", "read"), ("/home/user/repo/out", "write"), ("/home/user/vault", "none"))
    assert sbx.files.read("/home/user/repo/a") == "data\n"
    with pytest.raises(Exception, match="(?i)read-only|permission"):
        sbx.files.write("/home/user/repo/api", "after")
    with pytest.raises(Exception, match="(?i)read-only|permission"):
        sbx.files.remove("/home/user/repo/a")
    with pytest.raises(Exception, match="(?i)permission|denied|not found"):
        sbx.files.read("/home/user/vault/v")
    with pytest.raises(Exception, match="(?i)permission|denied"):
        sbx.files.list("/home/user/vault")
    with pytest.raises(Exception, match="(?i)read-only|permission"):
        sbx.files.write("/home/user/repo/api", "as root", user="root")
    sbx.files.write("/home/user/repo/out/api", "ok")
    assert sbx.files.read("/home/user/repo/out/api") == "ok"
    assert sbx.files.read("/home/user/repo/api") == "before"


BYPASS = r"""
import errno, json, os, subprocess
def t(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
r = {}
os.symlink("/home/user/repo/a", "/tmp/via-link") if not os.path.lexists("/tmp/via-link") else None
r["symlink"] = t(lambda: open("/tmp/via-link", "a").write("x"))
r["dotdot"] = t(lambda: open("/home/user/repo/out/../a", "a").write("x"))
r["dotdot_create"] = t(lambda: open("/tmp/../home/user/repo/new", "x").close())
r["proc_root"] = t(lambda: open("/proc/self/root/home/user/repo/a", "a").write("x"))
r["proc_cwd"] = t(lambda: (os.chdir("/home/user/repo"), open("/proc/self/cwd/a", "a").write("x")))
os.chdir("/")
r["hardlink_out"] = t(lambda: os.link("/home/user/repo/a", "/tmp/hard"))
r["hardlink_in_home"] = t(lambda: os.link("/home/user/repo/a", "/home/user/hard"))
r["rename_out"] = t(lambda: os.rename("/home/user/repo/a", "/home/user/moved"))
r["rename_dir"] = t(lambda: os.rename("/home/user/repo", "/home/user/repo2"))
r["rmtree_dir"] = t(lambda: os.rmdir("/home/user/repo"))
r["hidden_read"] = t(lambda: open("/proc/self/root/home/user/vault/v").read())
r["hidden_fd_dir"] = t(lambda: os.listdir("/proc/self/root/home/user/vault"))
r["hidden_dotdot"] = t(lambda: open("/home/user/vault/../vault/v").read())
for name, argv in {"umount": ["umount", "/home/user/repo"], "umount_lazy": ["umount", "-l", "/home/user/vault"],
                   "remount": ["mount", "-o", "remount,rw", "/home/user/repo"],
                   "bind": ["mount", "--bind", "/tmp", "/home/user/repo"],
                   "unshare": ["unshare", "-m", "true"], "nsenter": ["nsenter", "-t", "1", "-m", "true"]}.items():
    p = subprocess.run(argv, capture_output=True, text=True)
    r[name] = "ok" if p.returncode == 0 else "refused"
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
r["umount2_syscall"] = "ok" if libc.umount2(b"/home/user/repo", 2) == 0 else errno.errorcode[ctypes.get_errno()]
r["mount_syscall"] = "ok" if libc.mount(b"none", b"/home/user/repo", None, 4096 | 32, None) == 0 else \
    errno.errorcode[ctypes.get_errno()]
r["open_tree_syscall"] = "ok" if libc.syscall(428, -100, b"/home/user/repo", 1) >= 0 else \
    errno.errorcode[ctypes.get_errno()]
print(json.dumps(r))
"""


@pytest.mark.parametrize("user", ["user", "root"])
def test_bypass_attempts_fail(sbx: Sandbox, rules: Rules, user: str) -> None:
    fresh_dir(sbx, "/home/user/repo")
    assert sh(sbx, "sudo rm -rf /home/user/vault /tmp/via-link /tmp/hard /home/user/hard; mkdir -p /home/user/repo/out "
                   "/home/user/vault && echo v > /home/user/vault/v")[0] == 0
    sbx.files.write("/tmp/bypass.py", BYPASS)
    rules.set(("/home/user/repo", "read"), ("/home/user/repo/out", "write"), ("/home/user/vault", "none"))
    code, out, err = sh(sbx, "python3 /tmp/bypass.py", user=user)
    assert code == 0, err
    got = json.loads(out)
    print(user, got)
    # a hard link made inside the same writable mount would be a new name for the read-only inode:
    # the kernel refuses links across mounts (EXDEV), and the rule's mount is another one
    allowed = {k: v for k, v in got.items() if v == "ok"}
    assert allowed == {}, got
    assert sh(sbx, "cat /home/user/repo/a")[1] == "data\n"


def test_moving_an_ancestor_keeps_the_tree_protected(sbx: Sandbox, rules: Rules) -> None:
    fresh_dir(sbx, "/home/user/proj/repo")
    rules.set(("/home/user/proj/repo", "read"))
    # the mount point itself cannot move (EBUSY); an ancestor can, and the mount goes with it
    assert sh(sbx, "mv /home/user/proj/repo /home/user/proj/r2")[0] != 0
    assert sh(sbx, "mv /home/user/proj /home/user/moved")[0] == 0
    assert "Read-only" in sh(sbx, "echo x > /home/user/moved/repo/a")[2]
    assert sh(sbx, "cat /home/user/moved/repo/a")[1] == "data\n"
    rules.clear()  # the rule follows the directory that was at the path, so clear() finds it there
    assert sh(sbx, "echo x >> /home/user/moved/repo/a && rm -rf /home/user/moved")[0] == 0


# A long-running process that holds a file open for writing from the start, then on each request
# (/tmp/hold/go-N) tries: the old fd, a new open for writing, a read. Answers in /tmp/hold/res-N.
HOLDER = r"""
import errno, json, os, time
old = open("/home/user/area/work/held", "a")
def t(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
n = 0
while n < 10:
    if os.path.exists(f"/tmp/hold/go-{n}"):
        r = {"old_fd": t(lambda: (old.write("o"), old.flush())),
             "new_open": t(lambda: open("/home/user/area/work/held", "a").write("n")),
             "read": t(lambda: open("/home/user/area/work/held").read())}
        with open(f"/tmp/hold/res-{n}.tmp", "w") as f:
            json.dump(r, f)
        os.rename(f"/tmp/hold/res-{n}.tmp", f"/tmp/hold/res-{n}")
        n += 1
    time.sleep(0.01)
"""


def test_updates_reach_running_processes(sbx: Sandbox, rules: Rules) -> None:
    assert sh(sbx, "rm -rf /tmp/hold /home/user/area; mkdir -p /tmp/hold /home/user/area/work && echo h > "
                   "/home/user/area/work/held")[0] == 0
    sbx.files.write("/tmp/holder.py", HOLDER)
    proc = sbx.commands.run("python3 /tmp/holder.py", background=True)
    steps = iter(range(10))

    def ask() -> dict[str, str]:
        n = next(steps)
        sh(sbx, f"touch /tmp/hold/go-{n}")
        return json.loads(wait_until("the holder's answer", lambda: sh(sbx, f"cat /tmp/hold/res-{n}")[1]))

    try:
        assert ask() == {"old_fd": "ok", "new_open": "ok", "read": "ok"}
        rules.set(("/home/user/area/work", "read"))  # tighten
        # the caveat: a file opened for writing before the rule keeps that access until closed
        assert ask() == {"old_fd": "ok", "new_open": "EROFS", "read": "ok"}
        rules.set(("/home/user/area/work", "none"))
        assert ask() == {"old_fd": "ok", "new_open": "EACCES", "read": "EACCES"}
        rules.set(("/home/user/area", "read"), ("/home/user/area/work", "write"))  # loosen, restructured
        assert ask() == {"old_fd": "ok", "new_open": "ok", "read": "ok"}
        assert sh(sbx, "touch /home/user/area/x")[0] != 0
        rules.set(("/home/user/area/work", "none"))  # inside a rule that goes away: placed beneath it first
        assert ask() == {"old_fd": "ok", "new_open": "EACCES", "read": "EACCES"}
        assert sh(sbx, "touch /home/user/area/x && rm /home/user/area/x")[0] == 0
        rules.set()
        assert ask() == {"old_fd": "ok", "new_open": "ok", "read": "ok"}
        assert sh(sbx, "touch /home/user/area/x && rm /home/user/area/x")[0] == 0
    finally:
        proc.kill()


def test_a_cwd_inside_the_area_keeps_its_access_until_it_moves(sbx: Sandbox, rules: Rules) -> None:
    """The documented limit: a working directory (like an open directory) taken before a tightening
    update reaches the files beneath it through the mount it was taken on."""
    fresh_dir(sbx, "/home/user/repo")
    sbx.files.write("/tmp/cwd.py", "import os, sys, time\nos.chdir('/home/user/repo')\n"
                    "while not os.path.exists('/tmp/cwd-go'): time.sleep(0.01)\n"
                    "for p in ('rel', '/home/user/repo/abs'):\n"
                    "    try:\n        open(p, 'w').close(); print(p, 'ok')\n"
                    "    except OSError as e: print(p, e.strerror)\n")
    sh(sbx, "rm -f /tmp/cwd-go")
    proc = sbx.commands.run("python3 /tmp/cwd.py", background=True)
    time.sleep(0.5)
    rules.set(("/home/user/repo", "read"))
    sh(sbx, "touch /tmp/cwd-go")
    result = proc.wait()
    assert result.stdout == "rel ok\n/home/user/repo/abs Read-only file system\n"


def test_the_agent_survives_a_rule_on_its_home(server_url: str) -> None:
    s = Sandbox.create(api_url=server_url, timeout=120)
    try:
        r = Rules(s)
        r.set(("/home/user", "read"))
        assert sh(s, "true")[0] == 0
        r.set()
        assert sh(s, "true")[0] == 0
    finally:
        s.kill()


def test_a_code_context_started_before_the_rules_obeys_them(server_url: str) -> None:
    s = Sandbox.create(api_url=server_url, timeout=120)
    try:
        Rules(s).set(("/home/user", "read"))
        e = s.run_code("try:\n    open('rel.txt', 'w').close(); print('written')\n"
                       "except OSError as e: print(e.strerror)")
        assert e.logs.stdout == ["Read-only file system\n"]
    finally:
        s.kill()


def test_an_update_that_fails_leaves_the_old_rules(sbx: Sandbox, rules: Rules) -> None:
    fresh_dir(sbx, "/home/user/repo")
    assert sh(sbx, "rm -rf /home/user/t; mkdir -p /home/user/t && ln -s /home/user/t /home/user/lnk")[0] == 0
    before = rules.set(("/home/user/repo", "read"))
    with pytest.raises(FileRulesError) as e:  # a symlink in a rule's path: refused, not followed
        rules.set(("/home/user/repo", "none"), ("/home/user/lnk/x", "none"))
    assert e.value.index == 1 and "symlink" in e.value.message
    assert rules.applied is before
    assert "Read-only" in sh(sbx, "echo x > /home/user/repo/y")[2]
    assert sh(sbx, "cat /home/user/repo/a")[1] == "data\n"
    sh(sbx, "rm -f /home/user/lnk")


def test_missing_paths_are_created_and_covered(sbx: Sandbox, rules: Rules) -> None:
    sh(sbx, "sudo rm -rf /home/user/.aws /home/user/ro")
    applied = rules.set(("/home/user/.aws", "none"), ("/home/user/ro/deep", "read"), ("/nonexistent/x", "none"))
    assert applied.absent == ("/nonexistent/x",)  # on the template's read-only root: nobody can create it
    code, _, err = sh(sbx, "echo k > /home/user/.aws/credentials")
    assert code != 0 and "Permission denied" in err
    assert "Read-only" in sh(sbx, "touch /home/user/ro/deep/f")[2]
    assert sh(sbx, "stat -c %U /home/user/ro /home/user/ro/deep")[1] == "user\nuser\n"


@pytest.mark.parametrize(("rule", "message"), [
    (Rule("home/user", "read"), "absolute"),
    (Rule("/home/user/../etc", "read"), "normalised"),
    (Rule("/home/user/", "read"), "normalised"),
    (Rule("/", "read"), "top-level"),
    (Rule("/proc/1", "none"), "/proc"),
    (Rule("/dev", "read"), "/dev"),
    (Rule("/sys/kernel", "none"), "/sys"),
    (Rule("/opt/agentcell/bin", "read"), "/opt/agentcell"),
    (Rule("/opt", "none"), "hide /opt/agentcell"),
    (Rule("/home/user", "all"), "access"),
])
def test_rules_are_validated(rule: Rule, message: str) -> None:
    with pytest.raises(FileRulesError, match=message) as e:
        file_rules.validate([Rule("/tmp", "read"), rule])
    assert e.value.index == 1 and e.value.part == "policy.files[1]"


def test_a_process_outside_any_sandbox_is_refused() -> None:
    with pytest.raises(FileRulesError, match="not in a sandbox"):
        file_rules.apply(os.getpid(), [Rule("/tmp", "read")])


def test_rule_count_and_duplicates() -> None:
    with pytest.raises(FileRulesError, match="at most 64"):
        file_rules.validate([Rule(f"/tmp/{i}", "read") for i in range(65)])
    with pytest.raises(FileRulesError, match=r"policy.files\[0\]"):
        file_rules.validate([Rule("/tmp/a", "read"), Rule("/tmp/a", "none")])


def test_write_where_the_sandbox_cannot_write_is_refused(sbx: Sandbox, rules: Rules) -> None:
    for path in ("/home", "/home/other"):  # the template's read-only root
        with pytest.raises(FileRulesError, match="read-only") as e:
            rules.set(("/tmp", "read"), (path, "write"))
        assert e.value.index == 1
    rules.set(("/usr", "read"), ("/usr/local", "write"))  # an overlay: the sandbox's root writes there
    assert sh(sbx, "touch /usr/local/x && rm /usr/local/x", user="root")[0] == 0
    assert sh(sbx, "touch /usr/x", user="root")[0] != 0


def test_apply_is_cheap(sbx: Sandbox, rules: Rules) -> None:
    sh(sbx, "mkdir -p /home/user/repo/out /home/user/.ssh")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        rules.set(("/home/user/repo", "read"), ("/home/user/repo/out", "write"), ("/home/user/.ssh", "none"))
        times.append((time.perf_counter() - t0) * 1000)
        rules.clear()
    t0 = time.perf_counter()
    rules.set(("/home/user/repo", "read"), ("/home/user/repo/out", "write"), ("/home/user/.ssh", "none"))
    rules.set(("/home/user/repo", "read"), ("/home/user/repo/out", "read"), ("/home/user/.ssh", "none"))
    update = (time.perf_counter() - t0) * 1000
    print(f"apply of 3 rules: {' '.join(f'{t:.2f}' for t in times)} ms; apply + update: {update:.2f} ms")
    assert min(times) < 10


def test_a_dead_sandbox_is_cleared_quietly(server_url: str) -> None:
    s = Sandbox.create(api_url=server_url, timeout=60)
    r = Rules(s)
    r.set(("/home/user", "read"))
    s.kill()
    wait_until("the sandbox's end", lambda: not os.path.exists(f"/proc/{r.pid}/ns/mnt") or None, timeout=10)
    r.clear()
    assert r.applied is None
    with pytest.raises(OSError) as e:
        file_rules.apply(r.pid, [Rule("/home/user", "read")])
    assert e.value.errno in (errno.ENOENT, errno.ESRCH)


@pytest.fixture(scope="module")
def image_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with a musl + busybox image template: its sandboxes' root is one overlay."""
    tmp = tmp_path_factory.mktemp("images")
    root_image(tmp / "layout", "musl", root=musl_root(tmp / "musl"))
    done = subprocess.run([sys.executable, "-m", "agentcell", "template", "import", f"oci:{tmp / 'layout'}:musl",
                           "--name", "musl", "--store", str(tmp / "state" / "templates")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    with ServerProcess(tmp / "server.log", "--state-dir", str(tmp / "state"), "--egress-uplink", "none") as srv:
        yield srv


def test_rules_in_an_image_sandbox(image_server: ServerProcess) -> None:
    s = Sandbox.create(template="musl", api_url=image_server.url, timeout=120)
    r = Rules(s)
    try:
        assert sh(s, "mkdir -p /srv/app/out /home/user/repo && echo a > /srv/app/a && echo s > /etc/secret "
                     "&& chmod 644 /etc/secret", user="root")[0] == 0
        assert sh(s, "echo x >> /srv/app/a", user="root")[0] == 0
        r.set(("/srv/app", "read"), ("/srv/app/out", "write"), ("/etc/secret", "none"), ("/usr/lib", "read"))
        for user in ("user", "root"):
            code, _, err = sh(s, "echo x >> /srv/app/a || rm /srv/app/a || touch /usr/lib/x || cat /etc/secret",
                              user=user)
            assert code != 0, err
            assert sh(s, "cat /srv/app/a", user=user)[1] == "a\nx\n"
        assert sh(s, "echo o > /srv/app/out/o && cat /srv/app/out/o", user="root")[1] == "o\n"
        assert "Permission denied" in sh(s, "cat /etc/secret", user="root")[2]
        # the image root is writable for the sandbox's root: 'write' rules are possible anywhere in it
        r.set(("/srv", "read"), ("/srv/new", "write"))
        assert sh(s, "touch /srv/new/f && ! touch /srv/f", user="root")[0] == 0
        r.clear()
        assert sh(s, "touch /srv/f && echo y >> /srv/app/a && cat /etc/secret", user="root")[1] == "s\n"
    finally:
        r.clear()
        s.kill()


def test_a_kernel_refusal_midway_leaves_the_old_rules(sbx: Sandbox, rules: Rules,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel refusing one of the attaches (injected: EINVAL from move_mount) after others were
    made: the previous rules stay in force, and the next update and clear() still end clean."""
    from agentcell.policy.linux import mount_api

    fresh_dir(sbx, "/home/user/repo")
    sh(sbx, "mkdir -p /home/user/other /home/user/zzz")
    rules.set(("/home/user/repo", "read"))
    real = mount_api.attach

    zzz = os.stat(f"/proc/{rules.pid}/root/home/user/zzz").st_ino

    def refuse(when: str) -> None:
        def attach(tree_fd: int, target_fd: int, beneath: bool = False) -> None:
            if beneath if when == "swap" else os.fstat(target_fd).st_ino == zzz:
                raise OSError(errno.EINVAL, "injected")
            real(tree_fd, target_fd, beneath)
        monkeypatch.setattr(mount_api, "attach", attach)

    def still_old() -> None:
        assert "Read-only" in sh(sbx, "echo x > /home/user/repo/y")[2]
        assert sh(sbx, "cat /home/user/repo/a")[1] == "data\n"
        assert sh(sbx, "touch /home/user/other/f /home/user/zzz/f")[0] == 0

    refuse("swap")  # the new rule on other/ is attached first, then repo's swap fails
    with pytest.raises(FileRulesError, match="previous rules stay"):
        rules.set(("/home/user/other", "read"), ("/home/user/repo", "none"))
    still_old()
    refuse("new")  # repo's swap is made (beneath the old one), then the new rule on zzz/ fails
    with pytest.raises(FileRulesError, match="previous rules stay"):
        rules.set(("/home/user/repo", "none"), ("/home/user/zzz", "read"))
    still_old()
    monkeypatch.setattr(mount_api, "attach", real)
    rules.set(("/home/user/repo", "none"))
    assert "Permission denied" in sh(sbx, "cat /home/user/repo/a")[2]
    assert sh(sbx, "touch /home/user/zzz/g")[0] == 0


def test_a_rename_while_rules_are_applied_is_refused(sbx: Sandbox, rules: Rules,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox swapping the directory at a rule's path between our look and our mount (made to
    happen here, from the host, right after the plan): no copy of the old directory goes over the new
    one (the old one would stay writable under its new name); the update fails, nothing changes."""
    fresh_dir(sbx, "/home/user/repo")
    sh(sbx, "rm -rf /home/user/repo_real")
    root_fd = os.open(f"/proc/{rules.pid}/root", os.O_PATH)
    real_plan = file_rules._plan

    def plan_then_swap(*args: object):  # type: ignore[no-untyped-def]
        planned = real_plan(*args)  # type: ignore[arg-type]
        os.rename("home/user/repo", "home/user/repo_real", src_dir_fd=root_fd, dst_dir_fd=root_fd)
        os.mkdir("home/user/repo", dir_fd=root_fd)
        owner = os.stat("home/user/repo_real", dir_fd=root_fd)
        os.chown("home/user/repo", owner.st_uid, owner.st_gid, dir_fd=root_fd)
        return planned

    monkeypatch.setattr(file_rules, "_plan", plan_then_swap)
    try:
        with pytest.raises(FileRulesError, match="changed while the rules were applied") as e:
            rules.set(("/home/user/repo", "read"))
    finally:
        os.close(root_fd)
    assert e.value.index == 0 and rules.applied is None
    assert sh(sbx, "touch /home/user/repo/x /home/user/repo_real/x && rm -rf /home/user/repo_real")[0] == 0
