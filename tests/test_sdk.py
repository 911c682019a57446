"""agentcell's own SDK (agentcell.Sandbox / AsyncSandbox) against a real server and real sandboxes.

Most tests use the session server from conftest (api_url mode); the quick-start test runs the README
verbatim in embedded mode, where the SDK starts its own private server.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from agentcell import (
    AsyncSandbox,
    CommandExitException,
    CommandHandle,
    EntryInfo,
    FileNotFoundException,
    FileType,
    InvalidArgumentException,
    Sandbox,
    SandboxNotFoundException,
    SandboxNotRunningException,
    TimeoutException,
)
from agentcell.cli import main as cli_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sbx(server_url: str) -> Iterator[Sandbox]:
    with Sandbox.create(api_url=server_url, timeout=120) as s:
        yield s


# --- README quick start, embedded mode ---------------------------------------------------------------


def test_readme_quick_start_embedded() -> None:
    # A fresh interpreter: embedded mode must start (and stop) its own server with no URL configured.
    script = '''
import base64
from agentcell import Sandbox

with Sandbox.create() as sbx:                   # no server running: an embedded local one starts itself
    sbx.run_code("x = 41")
    print(sbx.run_code("x + 1").text)           # "42" — state kept between calls
    r = sbx.run_code("import matplotlib.pyplot as plt; plt.plot([1, 3, 2]); plt.show()")
    r.results[0].png                             # the chart, base64 PNG
    sbx.run_code("1/0").error                   # name, value, traceback (no exception in the host)
    sbx.commands.run("echo hi").stdout          # shell command: exit code, stderr, timeout
    sbx.files.write("/home/user/a.csv", "a,b\\n1,2\\n"); sbx.files.read("/home/user/a.csv")

    assert sbx.run_code("x + 1").text == "42"
    assert base64.b64decode(r.results[0].png)[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    assert sbx.run_code("1/0").error.name == "ZeroDivisionError"
    assert sbx.commands.run("echo hi").stdout == "hi\\n"
    assert sbx.files.read("/home/user/a.csv") == "a,b\\n1,2\\n"
    from agentcell.sdk import embedded
    print("SOCKET", embedded._server.socket)
print("DONE")
'''
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTCELL_URL", "E2B_API_URL")}
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "42" and lines[-1] == "DONE"
    socket_path = next(line.split(" ", 1)[1] for line in lines if line.startswith("SOCKET "))
    assert not os.path.exists(os.path.dirname(socket_path)), "the embedded server's private dir outlived the process"


def test_embedded_server_dies_with_its_parent() -> None:
    script = (
        "import os, sys\nfrom agentcell.sdk import embedded\n"
        "embedded.ensure_server()\nprint(embedded._server.proc.pid, flush=True)\nos._exit(0)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "AGENTCELL_URL"}
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    pid = int(p.stdout.split()[0])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:  # dead: gone, or a zombie (a subreaper, e.g. the gvisor backend's tests in this process, reaps late)
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    pytest.fail("the embedded server survived its parent's death")


def test_embedded_server_failure_is_reported() -> None:
    script = (
        "import sys\nfrom agentcell import Sandbox, EmbeddedServerError\n"
        "sys.executable = '/bin/false'  # the server command fails at once\n"
        "try:\n    Sandbox.create()\nexcept EmbeddedServerError as e:\n    print('ERR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "AGENTCELL_URL"}
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.stdout.startswith("ERR the embedded agentcell server exited with code 1"), p.stdout + p.stderr
    assert "AGENTCELL_URL" in p.stdout and "server log" in p.stdout


# --- code interpreter -------------------------------------------------------------------------------


def test_run_code_state_results_and_logs(sbx: Sandbox) -> None:
    sbx.run_code("y = 20")
    ex = sbx.run_code("print('out'); import sys; print('err', file=sys.stderr); y + 1")
    assert ex.text == "21"
    assert ex.logs.stdout == ["out\n"] and ex.logs.stderr == ["err\n"]
    assert ex.error is None and isinstance(ex.execution_count, int)
    assert ex.results[0].is_main_result


def test_run_code_error_does_not_raise(sbx: Sandbox) -> None:
    ex = sbx.run_code("1/0")
    assert ex.error is not None and ex.error.name == "ZeroDivisionError"
    assert "division by zero" in ex.error.value and "ZeroDivisionError" in ex.error.traceback


def test_run_code_callbacks_in_order(sbx: Sandbox) -> None:
    seen: list[str] = []
    results = []
    ex = sbx.run_code(
        "import time\nfor i in range(3):\n    print(i, flush=True); time.sleep(0.05)\n'end'",
        on_stdout=lambda m: seen.append(m.line), on_result=results.append,
    )
    assert "".join(seen) == "0\n1\n2\n"
    assert results and results[0].text == "end"
    assert ex.text == results[0].text


def test_run_code_chart_and_envs(sbx: Sandbox) -> None:
    r = sbx.run_code("import matplotlib.pyplot as plt; plt.plot([1, 3, 2]); plt.show()")
    assert base64.b64decode(r.results[0].png)[:8] == PNG_MAGIC
    assert sbx.run_code("import os; os.environ.get('FOO')", envs={"FOO": "bar"}).text == "bar"


def test_run_code_timeout(sbx: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        sbx.run_code("import time; time.sleep(10)", timeout=0.5)
    assert sbx.run_code("1 + 1").text == "2"  # the run was interrupted; the context still works


def test_code_contexts(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context(cwd="/tmp")
    sbx.run_code("z = 5", context=ctx)
    assert sbx.run_code("z", context=ctx).text == "5"
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"
    assert sbx.run_code("'z' in globals()").text == "False"  # the default context is separate
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    sbx.restart_code_context(ctx)
    assert sbx.run_code("z", context=ctx).error.name == "NameError"
    sbx.remove_code_context(ctx.id)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    with pytest.raises(InvalidArgumentException):
        sbx.run_code("1", context=ctx, language="python")


# --- commands ---------------------------------------------------------------------------------------


def test_commands_run_envs_cwd(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo hi")
    assert (r.stdout, r.stderr, r.exit_code, r.error) == ("hi\n", "", 0, None)
    assert sbx.commands.run("echo $A-$B", envs={"A": "1", "B": "2"}).stdout == "1-2\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("pwd").stdout == "/home/user\n"


def test_commands_nonzero_exit_raises(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo out; echo oops >&2; exit 3")
    assert ei.value.exit_code == 3 and ei.value.stdout == "out\n" and ei.value.stderr == "oops\n"
    assert "oops" in str(ei.value)


def test_commands_streaming_order(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    sbx.commands.run("for i in 1 2 3; do echo $i; echo e$i >&2; sleep 0.05; done",
                     on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "1\n2\n3\n" and "".join(err) == "e1\ne2\ne3\n"


def test_commands_timeout(sbx: Sandbox) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - t0 < 10


def test_background_command_wait_kill_list_stdin(sbx: Sandbox) -> None:
    h = sbx.commands.run("sleep 0.2; echo done", background=True)
    assert isinstance(h, CommandHandle) and h.pid > 0
    assert h.wait().stdout == "done\n"

    h = sbx.commands.run("sleep 60", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert h.kill() is True
    with pytest.raises(CommandExitException):
        h.wait()
    assert sbx.commands.kill(h.pid) is False

    h = sbx.commands.run("read line; echo got $line", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello\n")
    assert h.wait().stdout == "got hello\n"


def test_command_connect(sbx: Sandbox) -> None:
    h = sbx.commands.run("sleep 0.5; echo late", background=True)
    h.disconnect()
    again = sbx.commands.connect(h.pid)
    assert again.wait().stdout == "late\n"


# --- files ------------------------------------------------------------------------------------------


def test_files(sbx: Sandbox) -> None:
    info = sbx.files.write("/home/user/d/a.txt", "hello")
    assert info.path == "/home/user/d/a.txt" and info.name == "a.txt"
    assert sbx.files.read("/home/user/d/a.txt") == "hello"
    sbx.files.write("d/b.bin", b"\x00\x01\xff")  # relative to /home/user
    assert sbx.files.read("/home/user/d/b.bin", format="bytes") == bytearray(b"\x00\x01\xff")
    assert b"".join(sbx.files.read("/home/user/d/a.txt", format="stream")) == b"hello"

    entries = sbx.files.list("/home/user/d")
    assert sorted(e.name for e in entries) == ["a.txt", "b.bin"] and all(isinstance(e, EntryInfo) for e in entries)
    st = sbx.files.get_info("/home/user/d/a.txt")
    assert st.type == FileType.FILE and st.size == 5 and st.permissions.startswith("-")
    assert sbx.files.get_info("/home/user/d").type == FileType.DIR

    assert sbx.files.exists("/home/user/d/a.txt") and not sbx.files.exists("/home/user/nope")
    assert sbx.files.make_dir("/home/user/d/sub") is True
    assert sbx.files.make_dir("/home/user/d/sub") is False
    moved = sbx.files.rename("/home/user/d/a.txt", "/home/user/d/sub/c.txt")
    assert moved.path == "/home/user/d/sub/c.txt" and sbx.files.read("/home/user/d/sub/c.txt") == "hello"
    sbx.files.remove("/home/user/d/sub")
    assert not sbx.files.exists("/home/user/d/sub/c.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/home/user/nope")
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info("/home/user/nope")

    written = sbx.files.write_files([{"path": "/home/user/m/1.txt", "data": "one"},
                                     {"path": "/home/user/m/2.txt", "data": b"two"}])
    assert [w.path for w in written] == ["/home/user/m/1.txt", "/home/user/m/2.txt"]
    assert sbx.commands.run("cat /home/user/m/1.txt /home/user/m/2.txt").stdout == "onetwo"


# --- lifecycle --------------------------------------------------------------------------------------


def test_lifecycle_list_connect_info_timeout_kill(server_url: str) -> None:
    s = Sandbox.create(api_url=server_url, metadata={"suite": "sdk"}, envs={"GREETING": "hey"},
                       limits={"memoryMB": 256, "pids": 64})
    try:
        assert s.commands.run("echo $GREETING").stdout == "hey\n"
        listed = [i for i in Sandbox.list(api_url=server_url) if i.sandbox_id == s.sandbox_id]
        assert listed and listed[0].metadata == {"suite": "sdk"}
        info = s.get_info()
        assert info.sandbox_id == s.sandbox_id and info.memory_mb == 256 and info.state == "running"
        assert Sandbox.get_info(s.sandbox_id, api_url=server_url).sandbox_id == s.sandbox_id

        s.set_timeout(30)
        end = s.get_info().end_at.timestamp()
        assert abs(end - (time.time() + 30)) < 5
        Sandbox.set_timeout(s.sandbox_id, 60, api_url=server_url)
        assert s.get_info().end_at.timestamp() > end + 20

        other = Sandbox.connect(s.sandbox_id, api_url=server_url)
        assert other.run_code("40 + 2").text == "42"
        assert s.is_running()
    finally:
        assert Sandbox.kill(s.sandbox_id, api_url=server_url) is True
    assert s.kill() is False
    assert not s.is_running()
    with pytest.raises(SandboxNotRunningException, match="killed or its timeout passed"):
        s.run_code("1")
    with pytest.raises(SandboxNotRunningException):
        s.commands.run("true")
    with pytest.raises(SandboxNotRunningException):
        s.files.read("/home/user/a")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(s.sandbox_id, api_url=server_url)
    with pytest.raises(SandboxNotFoundException):
        s.get_info()


def test_sandbox_times_out(server_url: str) -> None:
    s = Sandbox.create(api_url=server_url, timeout=1)
    time.sleep(2.5)
    assert not s.is_running()
    with pytest.raises(TimeoutException):  # SandboxNotRunningException is a TimeoutException, as in e2b
        s.commands.run("true")


def test_cli_ls_and_kill(server_url: str) -> None:
    s = Sandbox.create(api_url=server_url)
    runner = CliRunner()
    r = runner.invoke(cli_main, ["ls", "--api-url", server_url])
    assert r.exit_code == 0 and s.sandbox_id in r.output
    r = runner.invoke(cli_main, ["kill", s.sandbox_id, "--api-url", server_url])
    assert r.exit_code == 0 and "killed" in r.output
    r = runner.invoke(cli_main, ["kill", s.sandbox_id, "--api-url", server_url])
    assert r.exit_code == 1


# --- async ------------------------------------------------------------------------------------------


async def test_async_sandbox(server_url: str) -> None:
    async with await AsyncSandbox.create(api_url=server_url) as s:
        await s.run_code("x = 41")
        assert (await s.run_code("x + 1")).text == "42"
        assert (await s.run_code("1/0")).error.name == "ZeroDivisionError"
        seen: list[str] = []

        async def on_out(msg: object) -> None:
            seen.append(str(msg))

        await s.run_code("print('a'); print('b')", on_stdout=on_out)
        assert "".join(seen) == "a\nb\n"

        assert (await s.commands.run("echo hi")).stdout == "hi\n"
        with pytest.raises(CommandExitException) as ei:
            await s.commands.run("exit 7")
        assert ei.value.exit_code == 7
        with pytest.raises(TimeoutException):
            await s.commands.run("sleep 30", timeout=1)
        out: list[str] = []
        h = await s.commands.run("echo 1; sleep 0.1; echo 2", background=True, on_stdout=out.append)
        assert (await h.wait()).stdout == "1\n2\n" and "".join(out) == "1\n2\n"
        h = await s.commands.run("sleep 60", background=True)
        assert await h.kill() is True
        with pytest.raises(CommandExitException):
            await h.wait()

        await s.files.write("/home/user/x.txt", "data")
        assert await s.files.read("/home/user/x.txt") == "data"
        assert [e.name for e in await s.files.list("/home/user") if e.name == "x.txt"] == ["x.txt"]
        assert await s.files.exists("/home/user/x.txt")
        assert (await s.files.get_info("/home/user/x.txt")).size == 4
        assert await s.files.make_dir("/home/user/dd") and not await s.files.make_dir("/home/user/dd")
        await s.files.rename("/home/user/x.txt", "/home/user/dd/y.txt")
        chunks = [c async for c in await s.files.read("/home/user/dd/y.txt", format="stream")]
        assert b"".join(chunks) == b"data"
        await s.files.remove("/home/user/dd")
        assert not await s.files.exists("/home/user/dd")

        ctx = await s.create_code_context()
        await s.run_code("q = 1", context=ctx)
        assert (await s.run_code("q", context=ctx)).text == "1"
        await s.remove_code_context(ctx)

        ids = [i.sandbox_id async for i in AsyncSandbox.list(api_url=server_url)]
        assert s.sandbox_id in ids
        assert (await s.get_info()).sandbox_id == s.sandbox_id
        await s.set_timeout(60)
        other = await AsyncSandbox.connect(s.sandbox_id, api_url=server_url)
        assert (await other.run_code("x")).text == "41"
        assert await s.is_running()
    assert not await s.is_running()
    with pytest.raises(SandboxNotRunningException):
        await s.run_code("1")
    assert await AsyncSandbox.kill(s.sandbox_id, api_url=server_url) is False


async def test_async_concurrent_runs(server_url: str) -> None:
    async with await AsyncSandbox.create(api_url=server_url) as s:
        results = await asyncio.gather(*(s.commands.run(f"echo {i}") for i in range(8)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]
