"""The unchanged official SDKs (e2b, e2b-code-interpreter) against the real server.

Both planes go to one URL: E2B_API_URL and E2B_SANDBOX_URL are the server (the `e2b_env` fixture).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator

import pytest
from e2b import CommandExitException, FileType, NotFoundException, Sandbox, TimeoutException
from e2b_code_interpreter import Sandbox as CodeSandbox


@pytest.fixture(scope="module")
def sbx(e2b_env: str) -> Iterator[Sandbox]:
    s = Sandbox.create(metadata={"suite": "sdk"}, envs={"GREETING": "hello"})
    yield s
    s.kill()


@pytest.fixture(scope="module")
def code(e2b_env: str) -> Iterator[CodeSandbox]:
    s = CodeSandbox.create()
    yield s
    s.kill()


def test_commands(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo $GREETING; echo err >&2")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "hello\n", "err\n")
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo partial; exit 7")
    assert info.value.exit_code == 7 and info.value.stdout == "partial\n"
    assert sbx.commands.run("pwd").stdout == "/home/user\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("echo $X", envs={"X": "y"}).stdout == "y\n"


def test_command_timeout_raises_timeout_and_kills(sbx: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30; echo late", timeout=1)
    # The client's timer starts a moment before the sandbox's, and its next request may reach the
    # sandbox before the news that it left (two connections): the kill comes at the sandbox's own
    # deadline then, a few ms later. Killed it must be, within a fraction of a second.
    deadline = time.monotonic() + 0.5
    while "sleep 30" in (listing := sbx.commands.run("ps -eo args").stdout) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "sleep 30" not in listing


def test_background_commands(sbx: Sandbox) -> None:
    h = sbx.commands.run("sleep 0.3; echo done", background=True)
    assert h.pid > 0
    assert h.wait().stdout == "done\n"
    h = sbx.commands.run("sleep 60", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert h.kill() is True
    with pytest.raises(CommandExitException):
        h.wait()
    assert sbx.commands.kill(999999) is False


def test_files(sbx: Sandbox) -> None:
    info = sbx.files.write("/home/user/dir/a.txt", "alpha")
    assert info.path == "/home/user/dir/a.txt"
    assert sbx.files.read("/home/user/dir/a.txt") == "alpha"
    assert sbx.files.read("dir/a.txt", format="bytes") == b"alpha"
    sbx.files.write_files([{"path": "dir/b.bin", "data": b"\x00\xff"}, {"path": "dir/c.txt", "data": "c"}])
    assert sbx.files.read("dir/b.bin", format="bytes") == b"\x00\xff"
    assert sorted(e.name for e in sbx.files.list("dir")) == ["a.txt", "b.bin", "c.txt"]
    assert sbx.files.exists("dir/a.txt") and not sbx.files.exists("dir/nope")
    entry = sbx.files.get_info("dir/a.txt")
    assert entry.type == FileType.FILE and entry.size == 5 and entry.name == "a.txt"
    assert sbx.files.get_info("dir").type == FileType.DIR
    assert sbx.files.make_dir("dir/sub") is True and sbx.files.make_dir("dir/sub") is False
    moved = sbx.files.rename("dir/a.txt", "dir/sub/z.txt")
    assert moved.path == "/home/user/dir/sub/z.txt" and not sbx.files.exists("dir/a.txt")
    sbx.files.remove("dir/sub")
    sbx.files.remove("dir/never-there")  # as envd: removing what is not there succeeds
    assert not sbx.files.exists("dir/sub/z.txt")
    with pytest.raises(NotFoundException):
        sbx.files.read("dir/missing")
    # files written over the API are visible to commands
    assert sbx.commands.run("cat dir/c.txt").stdout == "c"


def test_info_list_timeout(sbx: Sandbox) -> None:
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id and info.metadata == {"suite": "sdk"}
    before = info.end_at
    sbx.set_timeout(900)
    assert sbx.get_info().end_at > before
    ids = [s.sandbox_id for s in Sandbox.list().next_items()]
    assert sbx.sandbox_id in ids
    found = Sandbox.list(query=__import__("e2b").SandboxQuery(metadata={"suite": "sdk"})).next_items()
    assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
    assert Sandbox.connect(sbx.sandbox_id).commands.run("echo again").stdout == "again\n"
    assert sbx.get_metrics()


def test_pause_and_resume(sbx: Sandbox) -> None:
    sbx.files.write("/tmp/kept", "yes")
    assert sbx.pause() is True
    assert sbx.is_running() is False
    assert Sandbox.connect(sbx.sandbox_id).files.read("/tmp/kept") == "yes"
    assert sbx.is_running() is True
    [fork] = sbx.fork()  # on linux a filesystem fork (test_protocol_gaps.py), on gvisor a full one
    try:
        assert isinstance(fork, Sandbox) and fork.files.read("/tmp/kept") == "yes"
    finally:
        fork.kill()


def test_kill_and_is_running(e2b_env: str) -> None:
    s = Sandbox.create()
    assert s.is_running()
    assert s.kill() is True
    assert s.is_running() is False
    assert Sandbox.kill(s.sandbox_id) is False


def test_run_code_state_and_errors(code: CodeSandbox) -> None:
    code.run_code("x = 41")
    assert code.run_code("x + 1").text == "42"
    ex = code.run_code("print('out'); 1/0")
    assert ex.logs.stdout == ["out\n"]
    assert ex.error is not None and ex.error.name == "ZeroDivisionError"


def test_run_code_matplotlib_png(code: CodeSandbox) -> None:
    ex = code.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
    assert ex.error is None, ex.error
    pngs = [r.png for r in ex.results if r.png]
    assert pngs and base64.b64decode(pngs[0]).startswith(b"\x89PNG")


def test_code_contexts(code: CodeSandbox) -> None:
    ctx = code.create_code_context(cwd="/tmp")
    code.run_code("v = 'ctx'", context=ctx)
    assert code.run_code("v", context=ctx).text == "ctx"
    assert code.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"
    assert code.run_code("'v' in dir()").text == "False"  # the default context does not see it
    assert ctx.id in [c.id for c in code.list_code_contexts()]
    code.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in code.list_code_contexts()]


def test_kill_answers_once_the_process_is_gone(sbx: Sandbox) -> None:
    """envd's SendSignal(SIGKILL) returns after the process is gone: `kill -0` right after must fail."""
    for _ in range(10):
        h = sbx.commands.run("sleep 100", background=True)
        assert sbx.commands.kill(h.pid)
        r = sbx.commands.run(f"kill -0 {h.pid} 2>/dev/null && echo alive || echo gone")
        assert r.stdout.strip() == "gone"
