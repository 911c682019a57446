"""The `agentcell` command end to end: a real server (`agentcell serve`, no uplink, its own state dir)
and the CLI run as a user runs it, a subprocess (`python -m agentcell.cli`), asserting on its stdout,
stderr and exit code; `shell` on a real pseudo-terminal.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import ServerProcess, free_port

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "agentcell.cli"]


@contextlib.contextmanager
def _serve(*args: str) -> Iterator[ServerProcess]:
    """`agentcell serve --egress-uplink none` on a free loopback port, with a state dir of its own."""
    tmp = tempfile.mkdtemp(prefix="agentcell-cli-test-")
    try:
        with ServerProcess(Path(tmp, "server.log"), "--egress-uplink", "none", "--state-dir", str(Path(tmp, "state")),
                           "--standbys", "1", *args, command=[*CLI, "serve"], start_timeout=180,
                           stop_timeout=30) as srv:
            yield srv
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with _serve() as s:
        yield s


def _env(url: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTCELL_URL", "AGENTCELL_API_KEY", "E2B_API_KEY")}
    if url:
        env["AGENTCELL_URL"] = url
    env["AGENTCELL_EGRESS_UPLINK"] = "none"  # an embedded server (run --rm) routes nothing out either
    return {**env, **extra}


def cli(url: str | None, *args: str, input: bytes | None = None, timeout: float = 90,
        **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*CLI, *args], cwd=REPO, env=_env(url, **env), input=input, capture_output=True,
                          timeout=timeout)


def ok(url: str, *args: str, input: bytes | None = None) -> str:
    r = cli(url, *args, input=input)
    assert r.returncode == 0, (args, r.returncode, r.stderr.decode())
    return r.stdout.decode()


def one_line_error(r: subprocess.CompletedProcess[bytes], code: int = 1) -> str:
    """The run failed with `code`, saying so in one `agentcell: error:` line (and at most a hint)."""
    err = r.stderr.decode()
    lines = err.splitlines()
    assert r.returncode == code, (r.returncode, err)
    assert "Traceback" not in err, err
    assert lines and lines[0].startswith("agentcell: error: "), err
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("hint: ")), err
    return lines[0]


@pytest.fixture
def sid(server: ServerProcess) -> Iterator[str]:
    sandbox_id = ok(server.url, "create", "--timeout", "600").strip()
    yield sandbox_id
    cli(server.url, "kill", sandbox_id)


# --- create, info, ls -----------------------------------------------------------------------------


def test_create_prints_the_id_and_applies_its_options(server: ServerProcess) -> None:
    out = ok(server.url, "create", "--timeout", "120", "--env", "GREETING=hello there", "--metadata", "team=cli",
             "--limit", "memory=256M", "--limit", "pids=128", "--no-internet")
    sandbox_id = out.strip()
    assert "\n" not in sandbox_id and sandbox_id.isalnum()
    info = json.loads(ok(server.url, "info", sandbox_id, "--json"))
    assert info["sandbox_id"] == sandbox_id and info["state"] == "running"
    assert info["metadata"] == {"team": "cli"} and info["allow_internet_access"] is False
    assert info["limits"]["memoryMB"] == 256 and info["limits"]["pids"] == 128
    assert ok(server.url, "exec", sandbox_id, "--", "sh", "-c", "echo $GREETING") == "hello there\n"
    # the sandbox outlives the command that created it
    assert sandbox_id in ok(server.url, "ls", "-q")
    created = json.loads(ok(server.url, "create", "--json", "--timeout", "60", "--metadata", "team=other"))
    assert created["state"] == "running" and created["metadata"] == {"team": "other"}
    listed = json.loads(ok(server.url, "ls", "--json", "--metadata", "team=cli"))
    assert [s["sandbox_id"] for s in listed] == [sandbox_id]
    ok(server.url, "kill", sandbox_id, created["sandbox_id"])
    assert sandbox_id not in ok(server.url, "ls", "--all", "-q")


def test_create_with_a_policy(server: ServerProcess, tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"exec": {"default": "deny", "allow": ["cat"]}}))
    sandbox_id = ok(server.url, "create", "--timeout", "60", "--policy", f"@{policy}").strip()
    try:
        r = cli(server.url, "exec", sandbox_id, "--", "ls", "/")
        assert r.returncode != 0 and "not permitted" in r.stderr.decode(), r
        assert ok(server.url, "exec", sandbox_id, "--", "cat", "/etc/hostname").strip()
    finally:
        ok(server.url, "kill", sandbox_id)
    line = one_line_error(cli(server.url, "create", "--policy", '{"exce": {}}'))
    assert "policy.exce" in line
    assert "not JSON" in one_line_error(cli(server.url, "create", "--policy", "{nope"))


def test_text_outputs_escape_what_a_client_chose(server: ServerProcess) -> None:
    sandbox_id = ok(server.url, "create", "--timeout", "60", "--metadata", "note=\x1b]0;owned\x07\x1b[2J").strip()
    try:
        out = ok(server.url, "ls")
        assert "\x1b" not in out and "\\x1b]0;owned\\x07\\x1b[2J" in out
        assert "\x1b" not in ok(server.url, "info", sandbox_id)
        assert json.loads(ok(server.url, "ls", "--json"))  # JSON stays JSON (its encoder escapes)
    finally:
        ok(server.url, "kill", sandbox_id)


def test_bad_options_are_usage_errors(server: ServerProcess) -> None:
    for args in (["create", "--limit", "memory=lots"], ["create", "--env", "NOEQUALS"], ["kill"],
                 ["cp", "a", "b"], ["run", "onlycode"], ["completion", "tcsh"]):
        r = cli(server.url, *args)
        assert r.returncode == 2, (args, r.stderr)
        assert b"Traceback" not in r.stderr


# --- exec -----------------------------------------------------------------------------------------


def test_exec_exit_codes_streams_and_options(server: ServerProcess, sid: str) -> None:
    r = cli(server.url, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, b"out\n", b"err\n")
    assert ok(server.url, "exec", sid, "--", "true") == ""
    assert ok(server.url, "exec", "--user", "root", sid, "--", "whoami") == "root\n"
    assert ok(server.url, "exec", sid, "--", "whoami") == "user\n"
    assert ok(server.url, "exec", "--cwd", "/tmp", sid, "--", "pwd") == "/tmp\n"
    assert ok(server.url, "exec", "-e", "A=1 2", sid, "--", "sh", "-c", 'echo "$A"') == "1 2\n"
    # the words are the command's own: no second round of shell parsing
    assert ok(server.url, "exec", sid, "--", "echo", "$HOME", "a b", "*") == "$HOME a b *\n"
    assert ok(server.url, "exec", "-i", sid, "--", "wc", "-c", input=b"x" * 100_000).strip() == "100000"
    assert cli(server.url, "exec", sid, "--", "sh", "-c", "kill -9 $$").returncode == 137
    assert cli(server.url, "exec", sid, "--", "sh", "-c", "kill $$").returncode == 143
    r = cli(server.url, "exec", "--timeout", "1", sid, "--", "sleep", "30")
    assert "--timeout 1 s" in one_line_error(r, 124)


def test_exec_passes_bytes_through_and_json_collects_them(server: ServerProcess, sid: str) -> None:
    # not UTF-8: passed through byte for byte (it was decoded, each bad byte turned into U+FFFD)
    r = cli(server.url, "exec", sid, "--", "sh", "-c", r"printf '\377\376\000\303('; printf '\200\n' >&2")
    assert (r.returncode, r.stdout, r.stderr) == (0, b"\xff\xfe\x00\xc3(", b"\x80\n")
    blob = ok(server.url, "exec", sid, "--", "sh", "-c", "head -c 300000 /dev/urandom | tee /tmp/rnd | sha256sum")
    raw = cli(server.url, "exec", sid, "--", "cat", "/tmp/rnd")
    assert __import__("hashlib").sha256(raw.stdout).hexdigest() == blob.split()[0]
    r = cli(server.url, "exec", "--json", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert r.returncode == 3 and r.stderr == b""
    assert json.loads(r.stdout) == {"exit_code": 3, "stdout": "out\n", "stderr": "err\n"}
    assert json.loads(ok(server.url, "exec", "--json", sid, "--", "true")) == {"exit_code": 0, "stdout": "",
                                                                              "stderr": ""}
    r = cli(server.url, "exec", "--json", sid, "--", "sh", "-c", "kill -9 $$")
    assert r.returncode == 137 and json.loads(r.stdout)["exit_code"] == 137
    r = cli(server.url, "exec", "--json", "--timeout", "1", sid, "--", "sleep", "30")
    assert "--timeout 1 s" in one_line_error(r, 124)
    assert json.loads(r.stdout)["error"]["exit_code"] == 124


def test_json_errors_are_an_object_on_stdout_and_the_line_on_stderr(server: ServerProcess) -> None:
    for args in (["info", "nosuchsandbox", "--json"], ["resume", "--json", "nosuchsandbox"],
                 ["exec", "--json", "nosuchsandbox", "--", "true"], ["snapshot", "create", "--json", "nosuchsandbox"]):
        r = cli(server.url, *args)
        line = one_line_error(r)
        error = json.loads(r.stdout)["error"]
        assert error["exit_code"] == 1 and error["message"] in line and "ls --all" in error["hint"], (args, error)
    # no --json, no JSON
    assert cli(server.url, "info", "nosuchsandbox").stdout == b""
    down = f"http://127.0.0.1:{free_port()}"
    r = cli(down, "ls", "--json")
    assert "cannot reach" in one_line_error(r) and "cannot reach" in json.loads(r.stdout)["error"]["message"]


def test_exec_output_arrives_as_it_is_written(server: ServerProcess, sid: str) -> None:
    proc = subprocess.Popen([*CLI, "exec", sid, "--", "sh", "-c", "echo first; sleep 3; echo second >&2; echo third"],
                            cwd=REPO, env=_env(server.url), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        t0 = time.monotonic()
        assert proc.stdout.readline() == b"first\n"
        first = time.monotonic()
        assert proc.poll() is None, "the first line came only when the command had ended"
        assert proc.stdout.readline() == b"third\n"
        assert time.monotonic() - first >= 2.5, "the later lines did not wait for the sleep"
        assert first - t0 < 10
        assert proc.wait(30) == 0
        assert proc.stderr is not None and proc.stderr.read() == b"second\n"
    finally:
        proc.kill()
        proc.wait()


# --- run ------------------------------------------------------------------------------------------


def test_run_keeps_state_and_an_error_exits_1_with_the_traceback(server: ServerProcess, sid: str) -> None:
    assert ok(server.url, "run", sid, "x = 41\nprint('side', flush=True)") == "side\n"
    assert ok(server.url, "run", sid, "x + 1") == "42\n"
    assert ok(server.url, "run", sid, "-", input=b"print(x * 2)\n") == "82\n"
    r = cli(server.url, "run", sid, "import sys; print('to stderr', file=sys.stderr); 1/0")
    assert r.returncode == 1 and b"to stderr" in r.stderr
    assert b"ZeroDivisionError" in r.stderr and b"Traceback" in r.stderr  # the code's own traceback
    assert r.stdout == b""
    got = json.loads(ok(server.url, "run", sid, "--json", "print('p'); x"))
    assert got["results"][0]["text"] == "41" and got["stdout"] == ["p\n"] and got["error"] is None
    r = cli(server.url, "run", sid, "--json", "raise ValueError('bad')")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["name"] == "ValueError"
    assert ok(server.url, "run", "-L", "bash", sid, "echo $((2 + 3))").strip() == "5"
    assert ok(server.url, "run", "--language", "javascript", sid, "const y = 20; y + 1").strip() == "21"
    r = cli(server.url, "run", "--timeout", "1", sid, "import time; time.sleep(20)")
    assert "--timeout 1 s" in one_line_error(r, 124)


def test_run_rm_uses_a_fresh_sandbox_on_an_embedded_server() -> None:
    r = cli(None, "run", "--rm", "import os; print(6 * 7)", timeout=180)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == b"42\n"


# --- cp -------------------------------------------------------------------------------------------


def test_cp_files_directories_and_std_streams(server: ServerProcess, sid: str, tmp_path: Path) -> None:
    blob = os.urandom(300_000) + bytes(range(256))
    tree = tmp_path / "tree"
    (tree / "sub" / "deeper").mkdir(parents=True)
    (tree / "a.txt").write_text("alpha\n")
    (tree / "sub" / "blob.bin").write_bytes(blob)
    (tree / "sub" / "deeper" / "empty").write_bytes(b"")
    (tree / "link").symlink_to("a.txt")
    r = cli(server.url, "cp", str(tree), f"{sid}:/home/user/")
    assert r.returncode == 0, r.stderr
    assert b"skipped symlink" in r.stderr
    listing = ok(server.url, "exec", sid, "--", "sh", "-c", "cd /home/user/tree && find . -type f | sort")
    assert listing.split() == ["./a.txt", "./sub/blob.bin", "./sub/deeper/empty"]
    assert ok(server.url, "exec", sid, "--", "sha256sum", "/home/user/tree/sub/blob.bin").split()[0] == \
        __import__("hashlib").sha256(blob).hexdigest()
    # a file to a new name, and into a directory
    ok(server.url, "cp", str(tree / "a.txt"), f"{sid}:/tmp/renamed.txt")
    ok(server.url, "cp", str(tree / "a.txt"), f"{sid}:/tmp")
    assert ok(server.url, "exec", sid, "--", "cat", "/tmp/renamed.txt", "/tmp/a.txt") == "alpha\nalpha\n"
    # back out: a directory, into an existing local one, modes kept
    ok(server.url, "exec", sid, "--", "sh", "-c", "printf '#!/bin/sh\\n' > /home/user/tree/run.sh; "
       "chmod 755 /home/user/tree/run.sh")
    out = tmp_path / "out"
    out.mkdir()
    ok(server.url, "cp", f"{sid}:/home/user/tree", str(out))
    assert (out / "tree" / "sub" / "blob.bin").read_bytes() == blob
    assert (out / "tree" / "a.txt").read_text() == "alpha\n"
    assert (out / "tree" / "sub" / "deeper" / "empty").read_bytes() == b""
    assert (out / "tree" / "run.sh").stat().st_mode & 0o777 == 0o755
    # a file to a local name
    ok(server.url, "cp", f"{sid}:/home/user/tree/sub/blob.bin", str(tmp_path / "copy.bin"))
    assert (tmp_path / "copy.bin").read_bytes() == blob
    # stdin in, stdout out, binary intact
    ok(server.url, "cp", "-", f"{sid}:/tmp/from-stdin.bin", input=blob)
    r = cli(server.url, "cp", f"{sid}:/tmp/from-stdin.bin", "-")
    assert r.returncode == 0 and r.stdout == blob
    # what is not there: one line each
    assert "/nope" in one_line_error(cli(server.url, "cp", f"{sid}:/nope", str(tmp_path)))
    assert "no such file" in one_line_error(cli(server.url, "cp", str(tmp_path / "nope"), f"{sid}:/tmp/"))
    assert cli(server.url, "cp", f"{sid}:/home/user/tree", "-").returncode == 2


def test_cp_upload_keeps_modes_and_json_says_what_it_copied(server: ServerProcess, sid: str, tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    (tool / "bin").mkdir(parents=True)
    script = tool / "bin" / "hello.sh"
    script.write_text("#!/bin/sh\necho hello from the script\n")
    script.chmod(0o755)
    (tool / "private.txt").write_text("mine\n")
    (tool / "private.txt").chmod(0o600)
    (tool / "plain.txt").write_text("plain\n")
    (tool / "plain.txt").chmod(0o644)
    got = json.loads(ok(server.url, "cp", "--json", str(tool), f"{sid}:/home/user/"))
    assert got == {"source": str(tool), "destination": "/home/user/tool", "files": 3, "directories": 2,
                   "bytes": sum(p.stat().st_size for p in (script, tool / "private.txt", tool / "plain.txt")),
                   "skipped": []}
    assert ok(server.url, "exec", sid, "--", "/home/user/tool/bin/hello.sh") == "hello from the script\n"
    modes = ok(server.url, "exec", sid, "--", "sh", "-c", "cd /home/user/tool && stat -c '%a %n' bin/hello.sh "
               "private.txt plain.txt")
    assert modes.split("\n")[:3] == ["755 bin/hello.sh", "600 private.txt", "644 plain.txt"]
    # one file, to a new name: its mode too
    ok(server.url, "cp", str(script), f"{sid}:/tmp/run-me")
    assert ok(server.url, "exec", sid, "--", "/tmp/run-me") == "hello from the script\n"
    # a download's --json, and --json with stdout as the file is refused
    back = json.loads(ok(server.url, "cp", "--json", f"{sid}:/home/user/tool", str(tmp_path / "back")))
    assert (back["files"], back["directories"], back["destination"]) == (3, 2, str(tmp_path / "back"))
    assert (tmp_path / "back" / "bin" / "hello.sh").stat().st_mode & 0o777 == 0o755
    assert cli(server.url, "cp", "--json", f"{sid}:/tmp/run-me", "-").returncode == 2


# --- shell ----------------------------------------------------------------------------------------


def test_shell_is_a_real_terminal(server: ServerProcess, sid: str) -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI, on the pty's terminal end
        try:
            os.chdir(REPO)
            os.execve(sys.executable, [*CLI, "shell", sid], _env(server.url, TERM="xterm"))
        finally:
            os._exit(127)
    seen = b""

    def until(token: bytes, within: float = 30) -> None:
        nonlocal seen
        deadline = time.monotonic() + within
        while token not in seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {token!r} in {seen[-500:]!r}"
            if select.select([fd], [], [], left)[0]:
                try:
                    seen += os.read(fd, 4096)
                except OSError:
                    break
        assert token in seen, seen[-500:]

    try:
        until(b"$ ")
        os.write(fd, b"echo $((6*7))\r")
        until(b"\r42\r\n")
        os.write(fd, b"tty\r")
        until(b"/dev/pts/")
        # the window follows this terminal's: the kernel sends the CLI SIGWINCH
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 37, 101, 0, 0))
        time.sleep(0.5)
        os.write(fd, b"stty size\r")
        until(b"37 101")
        os.write(fd, b"exit 7\r")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 7
    finally:
        os.close(fd)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def test_shell_reads_a_piped_stdin(server: ServerProcess, sid: str) -> None:
    r = cli(server.url, "shell", sid, input=b"echo $((6*7))\nexit 3\n")
    assert r.returncode == 3 and b"42" in r.stdout
    r = cli(server.url, "shell", sid, input=b"echo done\n")  # the end of stdin ends the shell
    assert r.returncode == 0 and b"done" in r.stdout


# --- pause, resume, snapshots ---------------------------------------------------------------------


def test_pause_and_resume_keep_the_state(server: ServerProcess, sid: str) -> None:
    ok(server.url, "run", sid, "kept = 'still here'")
    assert ok(server.url, "pause", sid) == f"paused {sid}\n"
    assert sid not in ok(server.url, "ls", "-q")  # ls: running ones
    assert sid in ok(server.url, "ls", "--all", "-q")
    assert [s["state"] for s in json.loads(ok(server.url, "ls", "--state", "paused", "--json"))
            if s["sandbox_id"] == sid] == ["paused"]
    assert "is paused" in one_line_error(cli(server.url, "exec", sid, "--", "true"))
    assert ok(server.url, "resume", sid) == f"resumed {sid}\n"
    assert ok(server.url, "run", sid, "kept") == "still here\n"
    assert "not paused" in one_line_error(cli(server.url, "resume", sid))
    # --json: what was done, as objects
    assert json.loads(ok(server.url, "pause", "--json", sid)) == {"paused": [sid], "already_paused": []}
    assert json.loads(ok(server.url, "pause", "--json", sid)) == {"paused": [], "already_paused": [sid]}
    resumed = json.loads(ok(server.url, "resume", "--json", "--timeout", "500", sid))
    assert resumed["sandbox_id"] == sid and resumed["state"] == "running" and resumed["end_at"]
    assert ok(server.url, "run", sid, "kept") == "still here\n"


def test_snapshot_create_ls_rm(server: ServerProcess, sid: str) -> None:
    ok(server.url, "exec", sid, "--", "sh", "-c", "echo from-the-snapshot > /home/user/marker")
    snap = ok(server.url, "snapshot", "create", sid, "--name", "cli-test").strip()
    assert snap == "cli-test:default"
    listed = json.loads(ok(server.url, "snapshot", "ls", "--json", "--sandbox", sid))
    assert [s["snapshot_id"] for s in listed] == [snap] and listed[0]["mode"] in ("filesystem", "full")
    assert snap in ok(server.url, "snapshot", "ls")
    child = ok(server.url, "create", "--template", snap, "--timeout", "60").strip()
    try:
        assert ok(server.url, "exec", child, "--", "cat", "/home/user/marker") == "from-the-snapshot\n"
    finally:
        ok(server.url, "kill", child)
    again = json.loads(ok(server.url, "snapshot", "create", "--json", sid, "--name", "cli-test-2"))
    assert again["snapshot_id"] == "cli-test-2:default"
    assert ok(server.url, "snapshot", "rm", snap) == f"deleted {snap}\n"
    assert snap in one_line_error(cli(server.url, "snapshot", "rm", snap))
    r = cli(server.url, "snapshot", "rm", "--json", again["snapshot_id"], snap)
    assert snap in one_line_error(r)  # exit 1: one was not found; the JSON says which
    assert json.loads(r.stdout) == {"deleted": [again["snapshot_id"]], "not_found": [snap]}
    assert snap not in ok(server.url, "snapshot", "ls", "--json")


# --- the record -----------------------------------------------------------------------------------


def test_events_logs_and_report(server: ServerProcess, sid: str) -> None:
    ok(server.url, "exec", sid, "--", "sh", "-c", "echo recorded > /home/user/r.txt")
    events = [json.loads(x) for x in ok(server.url, "events", sid, "--kind", "api.call").splitlines()]
    assert events and all(e["kind"] == "api.call" for e in events)
    assert any(e.get("action") == "process.Start" for e in events)
    text = ok(server.url, "logs", sid)
    assert "sandbox.created" in text and "api.call" in text and "\x1b" not in text
    rep = json.loads(ok(server.url, "report", sid, "--json"))
    assert rep["sandbox_id"] == sid
    assert sid in ok(server.url, "report", sid)
    # --follow: the new event as it happens, and the end when the sandbox goes
    proc = subprocess.Popen([*CLI, "logs", sid, "--follow", "--kind", "sandbox."], cwd=REPO, env=_env(server.url),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert b"sandbox.created" in proc.stdout.readline()
        ok(server.url, "kill", sid)
        rest = proc.stdout.read()
        assert b"sandbox.killed" in rest
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


# --- errors: one line, no traceback ---------------------------------------------------------------


def test_server_down_is_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for args in (["ls"], ["create"], ["exec", "someid", "--", "true"], ["kill", "someid"], ["report", "someid"]):
        line = one_line_error(cli(url, *args))
        assert f"cannot reach the agentcell server at {url} (connection refused)" in line, line
    r = cli(url, "--debug", "ls")
    assert r.returncode == 1 and b"Traceback" in r.stderr and b"ServerUnreachableException" in r.stderr
    assert b"Traceback" in cli(url, "ls", AGENTCELL_DEBUG="1").stderr


def test_a_server_that_does_not_answer_is_one_line() -> None:
    with socket.socket() as silent:  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        for args in (["ls"], ["info", "someid"]):
            line = one_line_error(cli(url, *args, "--request-timeout", "1"))
            assert f"the agentcell server at {url} did not answer in time" in line, line
        assert time.monotonic() - t0 < 20


def test_no_server_configured_is_one_line_with_the_hint() -> None:
    for args in (["ls"], ["create"], ["exec", "someid", "--", "true"], ["kill", "--all"], ["snapshot", "ls"]):
        line = one_line_error(r := cli(None, *args))
        assert "needs a running agentcell server" in line
        assert "agentcell serve" in r.stderr.decode() and "AGENTCELL_URL" in r.stderr.decode()


def test_unknown_id_is_one_line(server: ServerProcess) -> None:
    for args in (["exec", "nosuchsandbox", "--", "true"], ["run", "nosuchsandbox", "1"], ["shell", "nosuchsandbox"],
                 ["cp", "nosuchsandbox:/x", "/tmp/"], ["info", "nosuchsandbox"], ["pause", "nosuchsandbox"],
                 ["resume", "nosuchsandbox"], ["kill", "nosuchsandbox"], ["events", "nosuchsandbox"],
                 ["logs", "nosuchsandbox"], ["report", "nosuchsandbox"], ["snapshot", "create", "nosuchsandbox"]):
        line = one_line_error(cli(server.url, *args))
        assert "nosuchsandbox" in line and "not found" in line, (args, line)


def test_wrong_key_is_one_line() -> None:
    with _serve("--api-key", "right-key") as keyed:
        for key in ("wrong-key", None):
            extra = {"AGENTCELL_API_KEY": key} if key else {}
            for args in (["ls"], ["create"], ["exec", "someid", "--", "true"], ["events", "someid"]):
                line = one_line_error(cli(keyed.url, *args, **extra))
                assert "the server refused the API key" in line, (args, line)
        assert ok(keyed.url, "ls", "--api-key", "right-key") == ""


def test_sandbox_gone_mid_stream_is_one_line(server: ServerProcess) -> None:
    for args in (["exec", "{sid}", "--", "sh", "-c", "echo started; sleep 60"],
                 ["run", "{sid}", "import time; print('started', flush=True); time.sleep(60)"]):
        victim = ok(server.url, "create", "--timeout", "120").strip()
        proc = subprocess.Popen([*CLI, *(a.format(sid=victim) for a in args)], cwd=REPO, env=_env(server.url),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
            ok(server.url, "kill", victim)
            stdout, stderr = proc.communicate(timeout=30)
        finally:
            proc.kill()
        line = one_line_error(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
        assert f"sandbox {victim} is gone" in line, line


# --- completion -----------------------------------------------------------------------------------


def test_completion_scripts_and_completions(server: ServerProcess, sid: str) -> None:
    for shell in ("bash", "zsh", "fish"):
        script = ok(server.url, "completion", shell)
        assert "_AGENTCELL_COMPLETE" in script, shell
    bash = ok(server.url, "completion", "bash")
    assert "complete " in bash and "_agentcell_completion" in bash
    # what the script asks the command for: subcommands, and the server's sandbox ids
    words = cli(server.url, _AGENTCELL_COMPLETE="bash_complete", COMP_WORDS="agentcell sn", COMP_CWORD="1")
    assert b"plain,snapshot" in words.stdout, words
    ids = cli(server.url, _AGENTCELL_COMPLETE="bash_complete", COMP_WORDS=f"agentcell exec {sid[:4]}", COMP_CWORD="2")
    assert f"plain,{sid}".encode() in ids.stdout, ids


def test_kill_all(server: ServerProcess) -> None:
    made = [ok(server.url, "create", "--timeout", "60").strip() for _ in range(2)]
    ok(server.url, "pause", made[1])
    out = ok(server.url, "kill", "--all")
    assert all(f"killed {m}" in out for m in made)
    assert ok(server.url, "ls", "--all", "-q") == ""
    made = [ok(server.url, "create", "--timeout", "60").strip() for _ in range(2)]
    ok(server.url, "pause", made[0])
    killed = json.loads(ok(server.url, "kill", "--all", "--json"))
    assert sorted(killed["killed"]) == sorted(made) and killed["not_found"] == []
    assert json.loads(ok(server.url, "kill", "--all", "--json")) == {"killed": [], "not_found": []}
    r = cli(server.url, "kill", "--json", "nosuchsandbox")
    assert "not found" in one_line_error(r)
    assert json.loads(r.stdout) == {"killed": [], "not_found": ["nosuchsandbox"]}
