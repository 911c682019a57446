"""The in-sandbox agent, run for real but un-isolated: one agent subprocess on a socketpair, home = tmp.

Every op of docs/internal-protocol.md is exercised through the server's own AgentChannel.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from agentcell.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)
from agentcell.runtime.protocol import CHUNK, AgentChannel, Frame, encode_frame, line_dicts, read_frame

ROOT = Path(__file__).resolve().parents[1]
BOOT = (
    "import json, socket, sys\n"
    "from agentcell.runtime import agent\n"
    "agent.preload()\n"
    "import gc, threading\n"
    "assert threading.active_count() == 1, 'preload must not leave threads behind (the zygote forks)'\n"
    "gc.freeze()\n"
    "agent.serve(socket.socket(fileno=int(sys.argv[1])), json.loads(sys.argv[2]))\n"
)


class Agent:
    def __init__(self, channel: AgentChannel, proc: subprocess.Popen[bytes], home: Path) -> None:
        self.ch = channel
        self.proc = proc
        self.home = home

    async def start(self, cmd: str, **fields: Any) -> AsyncIterator[Frame]:
        req = {"cmd": "/bin/bash", "args": ["-c", cmd], "envs": {}, "cwd": None, "tag": None,
               "stdin": False, "pty": None, "timeout_ms": 0, **fields}  # fmt: skip
        async for frame in self.ch.stream("proc.start", **req):
            yield frame

    async def sh(self, cmd: str, **fields: Any) -> tuple[bytes, bytes, dict[str, Any]]:
        out, err, end = b"", b"", {}
        async for f in self.start(cmd, **fields):
            event = f.header.get("event")
            if event in ("stdout", "pty"):
                out += f.payload
            elif event == "stderr":
                err += f.payload
            elif event == "end":
                end = f.header
        return out, err, end

    def run_stream(self, code: str, **fields: Any) -> AsyncIterator[dict[str, Any]]:
        req = {"context_id": None, "language": None, "env_vars": None, "timeout_ms": 0, **fields}
        return line_dicts(self.ch.stream("code.run", code.encode(), **req))

    async def run(self, code: str, **fields: Any) -> list[dict[str, Any]]:
        return [line async for line in self.run_stream(code, **fields)]


def _one(lines: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [line for line in lines if line["type"] == kind]
    assert len(found) == 1, lines
    return found[0]


def _main_text(lines: list[dict[str, Any]]) -> str | None:
    for line in lines:
        if line["type"] == "result" and line["is_main_result"]:
            return line.get("text")
    return None


def _stdout(lines: list[dict[str, Any]]) -> str:
    return "".join(line["text"] for line in lines if line["type"] == "stdout")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def agent(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Agent]:
    home = tmp_path_factory.mktemp("home")
    config = {"sandbox_id": "test", "home": str(home),
              "envs": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "USER": "user",
                       "AGENTCELL_DEFAULT": "yes"}}  # fmt: skip
    ours, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ZYGOTE_ONLY_SECRET": "hunter2"}
    proc = subprocess.Popen([sys.executable, "-c", BOOT, str(theirs.fileno()), json.dumps(config)],
                            pass_fds=[theirs.fileno()], env=env)  # fmt: skip
    theirs.close()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    hello = await asyncio.wait_for(read_frame(reader), 60)
    assert hello is not None and hello.header == {"id": 0, "event": "ready"}
    # the claim: env vars of the tenant, after the default context already started (a standby's)
    writer.write(encode_frame({"id": 0, "op": "claim", "envs": {"TENANT": "claimed"}}))
    channel = AgentChannel(reader, writer)
    yield Agent(channel, proc, home)
    await channel.close()
    assert proc.wait(10) == 0  # the agent exits when its socket closes


# -- processes ----------------------------------------------------------------------------------------


async def test_command_output_and_exit(agent: Agent) -> None:
    frames = [f async for f in agent.start("echo out; echo err >&2; exit 3")]
    assert frames[0].header["event"] == "start" and frames[0].header["pid"] > 0
    out, err, end = await agent.sh("echo out; echo err >&2; exit 3")
    assert (out, err) == (b"out\n", b"err\n")
    assert end == {"id": end["id"], "event": "end", "exit_code": 3, "exited": True, "status": "exit status 3"}
    out, _, end = await agent.sh("pwd; echo $HOME $AGENTCELL_DEFAULT $TENANT $EXTRA", envs={"EXTRA": "x"})
    assert out.decode().split() == [str(agent.home), str(agent.home), "yes", "claimed", "x"]
    out, _, _ = await agent.sh("pwd", cwd="/")
    assert out == b"/\n"


async def test_command_signals_and_timeout(agent: Agent) -> None:
    _, _, end = await agent.sh("kill -9 $$")
    assert (end["exit_code"], end["exited"], end["status"]) == (-1, False, "signal: killed")
    t = time.monotonic()
    _, _, end = await agent.sh("sleep 30", timeout_ms=300)
    assert end["status"] == "signal: killed" and time.monotonic() - t < 5

    stream = agent.start("sleep 30", tag="sleeper")
    start = await anext(stream)
    pid = start.header["pid"]
    listed = (await agent.ch.call("proc.list")).header["processes"]
    assert any(p["pid"] == pid and p["tag"] == "sleeper" and p["args"] == ["-c", "sleep 30"] for p in listed)
    await agent.ch.call("proc.signal", tag="sleeper", signal=15)
    ends = [f.header async for f in stream if f.header.get("event") == "end"]
    assert ends[0]["status"] == "signal: terminated"
    with pytest.raises(NotFoundError):
        await agent.ch.call("proc.signal", pid=pid, signal=9)


async def test_command_stdin(agent: Agent) -> None:
    stream = agent.start("cat; echo done", stdin=True)
    pid = (await anext(stream)).header["pid"]
    await agent.ch.call("proc.input", b"hello\n", pid=pid, pty=False)
    assert (await anext(stream)).payload == b"hello\n"
    await agent.ch.call("proc.close_stdin", pid=pid)
    rest = [f async for f in stream]
    assert b"".join(f.payload for f in rest) == b"done\n" and rest[-1].header["exit_code"] == 0
    # Without stdin=true there is no pipe to write to.
    stream = agent.start("sleep 5")
    pid = (await anext(stream)).header["pid"]
    with pytest.raises(InvalidArgumentError):
        await agent.ch.call("proc.input", b"x", pid=pid, pty=False)
    await agent.ch.call("proc.signal", pid=pid, signal=9)
    assert [f async for f in stream][-1].header["status"] == "signal: killed"


async def test_command_connect_and_cancel(agent: Agent) -> None:
    stream = agent.start("for i in 1 2 3 4 5 6; do echo tick $i; sleep 0.1; done", tag="ticker")
    pid = (await anext(stream)).header["pid"]
    await stream.aclose()  # the subscription ends (cancel), the process keeps running
    frames = [f async for f in agent.ch.stream("proc.connect", tag="ticker")]
    assert frames[0].header == {"id": frames[0].header["id"], "event": "start", "pid": pid}
    assert b"tick 6\n" in b"".join(f.payload for f in frames)
    assert frames[-1].header["exit_code"] == 0
    with pytest.raises(NotFoundError):
        await agent.ch.call("proc.connect", pid=pid)
    with pytest.raises(NotFoundError):
        await agent.ch.call("proc.connect", tag="nobody")


async def test_command_pty(agent: Agent) -> None:
    stream = agent.start("stty size; tty; read line; echo got:$line; stty size",
                         pty={"cols": 100, "rows": 30}, envs={"TERM": "xterm"})  # fmt: skip
    pid = (await anext(stream)).header["pid"]
    seen = b""
    while b"/dev/pts/" not in seen:
        f = await anext(stream)
        assert f.header["event"] == "pty"
        seen += f.payload
    assert b"30 100" in seen
    await agent.ch.call("proc.resize", pid=pid, cols=120, rows=40)
    await agent.ch.call("proc.input", b"abc\n", pid=pid, pty=True)
    async for f in stream:
        seen += f.payload
    assert b"got:abc" in seen and b"40 120" in seen
    with pytest.raises(InvalidArgumentError):  # no pty, nothing to resize
        s = agent.start("sleep 1")
        p = (await anext(s)).header["pid"]
        await agent.ch.call("proc.resize", pid=p, cols=1, rows=1)


async def test_command_user_and_errors(agent: Agent) -> None:
    with pytest.raises(PermissionDeniedError, match="no root"):
        await agent.sh("id", user="root")
    with pytest.raises(NotFoundError):
        await agent.ch.call("proc.start", cmd="definitely-not-a-command", args=[], envs={}, cwd=None,
                            tag=None, stdin=False, pty=None, timeout_ms=0)  # fmt: skip
    with pytest.raises(InvalidArgumentError):
        await agent.sh("true", cwd="/does/not/exist")


async def test_command_large_output(agent: Agent) -> None:
    size = 12 << 20  # more than the agent buffers for one subscriber before it pauses the reader
    total = 0
    async for f in agent.start(f"head -c {size} /dev/zero"):
        if f.header.get("event") == "stdout":
            assert len(f.payload) <= 1 << 20
            total += len(f.payload)
            await asyncio.sleep(0)  # a slow-ish consumer
    assert total == size


async def test_orphans_are_reaped(agent: Agent) -> None:
    out, _, end = await agent.sh("sleep 0.2 & echo $!")
    orphan = int(out)
    assert end["exit_code"] == 0
    await asyncio.sleep(0.6)
    # The agent is a subreaper here (pid 1 in a sandbox): the orphan was reaped, not left a zombie.
    assert not Path(f"/proc/{orphan}").exists()


# -- files ------------------------------------------------------------------------------------------


async def test_files_write_read_stat(agent: Agent) -> None:
    entry = (await agent.ch.call("fs.write", b"hello", path="a/b/hello.txt", metadata={"k": "v"})).header[
        "entry"
    ]
    assert entry["path"] == str(agent.home / "a/b/hello.txt")
    assert (entry["name"], entry["type"], entry["size"]) == ("hello.txt", "file", 5)
    assert entry["permissions"].startswith("-rw") and entry["mode"] & 0o600 == 0o600
    assert entry["owner"] in ("root", "user") or entry["owner"].isdigit()
    assert entry["metadata"] in ({"k": "v"}, {})  # {} only where the filesystem has no user xattrs
    frames = [f async for f in agent.ch.stream("fs.read", path=str(agent.home / "a/b/hello.txt"))]
    assert b"".join(f.payload for f in frames) == b"hello" and frames[-1].header["size"] == 5

    big = os.urandom(3 * (1 << 20) + 7)
    await agent.ch.call("fs.write", big, path="big.bin", metadata=None)
    frames = [f async for f in agent.ch.stream("fs.read", path="big.bin")]
    data = [f for f in frames if f.header.get("event") == "data"]
    assert len(data) == -(-len(big) // CHUNK) and all(len(f.payload) <= CHUNK for f in data)
    assert b"".join(f.payload for f in data) == big

    os.symlink("a/b/hello.txt", agent.home / "link")
    link = (await agent.ch.call("fs.stat", path="link")).header["entry"]
    # as envd: the target's type, marked as a link, with the absolute target
    assert link["type"] == "file" and link["is_symlink"] and link["symlink_target"] == str(agent.home / "a/b/hello.txt")
    with pytest.raises(NotFoundError):
        await agent.ch.call("fs.stat", path="nope")
    with pytest.raises(NotFoundError):
        await agent.ch.call("fs.read", path="nope")
    with pytest.raises(InvalidArgumentError):
        await agent.ch.call("fs.read", path="a")


async def test_files_list_mkdir_move_remove(agent: Agent) -> None:
    made = (await agent.ch.call("fs.mkdir", path="tree/x/y")).header["entry"]
    assert made["type"] == "dir" and made["name"] == "y"
    with pytest.raises(AlreadyExistsError):
        await agent.ch.call("fs.mkdir", path="tree/x")
    await agent.ch.call("fs.write", b"1", path="tree/top.txt", metadata=None)
    await agent.ch.call("fs.write", b"2", path="tree/x/y/deep.txt", metadata=None)
    one = (await agent.ch.call("fs.list", path="tree", depth=1)).header["entries"]
    assert sorted(e["name"] for e in one) == ["top.txt", "x"]
    three = (await agent.ch.call("fs.list", path="tree", depth=3)).header["entries"]
    assert {e["path"].removeprefix(str(agent.home)) for e in three} == {
        "/tree/top.txt", "/tree/x", "/tree/x/y", "/tree/x/y/deep.txt"}  # fmt: skip
    with pytest.raises(InvalidArgumentError):
        await agent.ch.call("fs.list", path="tree/top.txt", depth=1)
    with pytest.raises(NotFoundError):
        await agent.ch.call("fs.list", path="missing", depth=1)

    moved = (await agent.ch.call("fs.move", source="tree/top.txt", destination="tree2/top.txt")).header[
        "entry"
    ]
    assert (
        moved["path"] == str(agent.home / "tree2/top.txt")
        and (agent.home / "tree2/top.txt").read_bytes() == b"1"
    )
    with pytest.raises(NotFoundError):
        await agent.ch.call("fs.move", source="tree/top.txt", destination="x")
    await agent.ch.call("fs.remove", path="tree")
    assert not (agent.home / "tree").exists()
    await agent.ch.call("fs.remove", path="tree")  # as envd: what is not there is removed already


# -- code -------------------------------------------------------------------------------------------


async def test_code_results_and_state(agent: Agent) -> None:
    lines = await agent.run("x = 41")
    assert lines[0]["type"] == "number_of_executions"
    count = lines[0]["execution_count"]
    lines = await agent.run("x + 1")
    assert lines[0] == {"type": "number_of_executions", "execution_count": count + 1}
    assert _one(lines, "result") == {"type": "result", "text": "42", "extra": {}, "is_main_result": True}
    assert _main_text(await agent.run("'alive'")) == "alive"

    lines = await agent.run(
        "import sys, os\nprint('out')\nprint('err', file=sys.stderr)\nos.system('echo fd')\nNone"
    )
    assert _stdout(lines) == "out\nfd\n" and _one(lines, "stderr")["text"] == "err\n"
    assert _one(lines, "stdout" if False else "stderr")["timestamp"].endswith("+00:00")

    lines = await agent.run("def f():\n    return 1 / 0\nf()")
    err = _one(lines, "error")
    assert (err["name"], err["value"]) == ("ZeroDivisionError", "division by zero")
    assert (
        isinstance(err["traceback"], str) and "1 / 0" in err["traceback"] and "\x1b[" not in err["traceback"]
    )
    assert _one(await agent.run("1 +"), "error")["name"] == "SyntaxError"


async def test_code_rich_results(agent: Agent) -> None:
    lines = await agent.run(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.title('t')\nplt.show()"
    )
    png = _one(lines, "result")
    assert png["is_main_result"] is False and base64.b64decode(png["png"]).startswith(b"\x89PNG")
    lines = await agent.run("import matplotlib.pyplot as plt\nplt.figure(); plt.plot([3, 1]); None")
    assert base64.b64decode(_one(lines, "result")["png"]).startswith(b"\x89PNG")  # inline flush at cell end

    lines = await agent.run("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    df = _one(lines, "result")
    assert df["is_main_result"] and "<table" in df["html"] and "a" in df["text"]
    lines = await agent.run(
        "from IPython.display import display, Markdown, HTML, Latex, JSON, SVG\n"
        "display(Markdown('**m**')); display(HTML('<b>h</b>')); display(Latex('$x$'))\n"
        "display(JSON({'k': 1}))\n"
        "display({'application/x-custom': 'c', 'text/plain': 'p'}, raw=True)"
    )
    results = [line for line in lines if line["type"] == "result"]
    assert [r.get("markdown") for r in results][0] == "**m**"
    assert (
        results[1]["html"] == "<b>h</b>" and results[2]["latex"] == "$x$" and results[3]["json"] == {"k": 1}
    )
    assert results[4]["extra"] == {"application/x-custom": "c"} and results[4]["text"] == "p"


async def test_code_heavy_output_is_complete(agent: Agent) -> None:
    lines = await agent.run("import sys\nfor i in range(200000):\n    print(i)\nsys.stdout.write('end')")
    assert _stdout(lines) == "".join(f"{i}\n" for i in range(200000)) + "end"


async def test_code_streams_output_as_it_happens(agent: Agent) -> None:
    code = "import time\nprint('first')\ntime.sleep(0.7)\nprint('second')"
    start = time.monotonic()
    arrivals = []
    async for line in agent.run_stream(code):
        if line["type"] == "stdout":
            arrivals.append((line["text"], time.monotonic() - start))
    assert [a[0] for a in arrivals] == ["first\n", "second\n"]
    assert arrivals[0][1] < 0.5 <= arrivals[1][1]


async def test_main_result_and_output_after_it_both_arrive(agent: Agent) -> None:
    # The kernel keeps the main result back to send it with the run's end: whatever the cell's
    # post-run hooks write in between comes too.
    await agent.run("def _after(result):\n    print('after')\nget_ipython().events.register('post_run_cell', _after)")
    lines = await agent.run("40 + 2")
    assert _main_text(lines) == "42" and _stdout(lines) == "after\n"
    await agent.run("get_ipython().events.unregister('post_run_cell', _after)")
    lines = await agent.run("7")
    assert _main_text(lines) == "7" and _stdout(lines) == ""


async def test_code_contexts(agent: Agent) -> None:
    (agent.home / "work").mkdir()
    ctx = (await agent.ch.call("code.context_create", language="python3", cwd="work")).header["context"]
    assert ctx["language"] == "python" and ctx["cwd"] == str(agent.home / "work")
    listed = (await agent.ch.call("code.context_list")).header["contexts"]
    assert len(listed) >= 2 and ctx in listed  # the default context is listed too

    await agent.run("y = 'default'")
    await agent.run("y = 'other'", context_id=ctx["id"])
    assert _main_text(await agent.run("y")) == "default"
    assert _main_text(await agent.run("import os; os.getcwd()", context_id=ctx["id"])) == str(agent.home / "work")
    await agent.run("only_here = 1", context_id=ctx["id"])
    assert _one(await agent.run("only_here"), "error")["name"] == "NameError"  # state is separate

    await agent.ch.call("code.context_restart", context_id=ctx["id"])
    assert _one(await agent.run("y", context_id=ctx["id"]), "error")["name"] == "NameError"
    lines = await agent.run("y", context_id=ctx["id"])
    assert lines[0]["execution_count"] == 2  # fresh shell after the restart
    await agent.ch.call("code.context_delete", context_id=ctx["id"])
    with pytest.raises(NotFoundError):
        await agent.run("1", context_id=ctx["id"])
    with pytest.raises(NotFoundError):
        await agent.ch.call("code.context_delete", context_id=ctx["id"])
    with pytest.raises(InvalidArgumentError, match="not supported"):
        await agent.ch.call("code.context_create", language="cobol", cwd=None)
    with pytest.raises(InvalidArgumentError, match="not supported"):
        await agent.run("1", language="cobol")


async def test_code_env_vars_for_one_run(agent: Agent) -> None:
    code = "import os; (os.environ.get('RUN_ONLY'), os.environ.get('AGENTCELL_DEFAULT'), os.environ.get('TENANT'))"
    assert _main_text(await agent.run(code, env_vars={"RUN_ONLY": "1"})) == "('1', 'yes', 'claimed')"
    assert _main_text(await agent.run(code)) == "(None, 'yes', 'claimed')"


async def test_code_timeout_interrupts(agent: Agent) -> None:
    await agent.run("kept = 7")
    t = time.monotonic()
    lines = await agent.run("import time\nwhile True:\n    time.sleep(0.01)", timeout_ms=300)
    err = _one(lines, "error")
    assert err["name"] == "KeyboardInterrupt" and time.monotonic() - t < 2
    assert "time.sleep" in err["traceback"] and "agentcell" not in err["traceback"]  # only the user's frames
    assert _main_text(await agent.run("kept")) == "7"  # interrupted, not restarted

    # A cancelled run (the client went away) is interrupted too.
    stream = agent.run_stream("import time\ntime.sleep(30)")
    await anext(stream)
    await stream.aclose()
    t = time.monotonic()
    assert _main_text(await agent.run("kept + 1")) == "8" and time.monotonic() - t < 2


async def test_code_stubborn_run_is_killed(agent: Agent) -> None:
    ctx = (await agent.ch.call("code.context_create", language=None, cwd=None)).header["context"]
    code = "import time\nwhile True:\n    try:\n        time.sleep(1)\n    except KeyboardInterrupt:\n        pass"
    lines = await agent.run(code, context_id=ctx["id"], timeout_ms=100)
    assert _one(lines, "error")["name"] == "UnexpectedEndOfExecution"
    assert _main_text(await agent.run("1 + 1", context_id=ctx["id"])) == "2"
    await agent.ch.call("code.context_delete", context_id=ctx["id"])


async def test_code_context_death_recovers(agent: Agent) -> None:
    lines = await agent.run("print('bye', flush=True)\nimport os; os._exit(3)")
    assert _stdout(lines) == "bye\n"
    err = _one(lines, "error")
    assert err["name"] == "UnexpectedEndOfExecution" and "exit status 3" in err["value"]
    assert _main_text(await agent.run("41 + 1")) == "42"
    lines = await agent.run("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert "segmentation fault" in _one(lines, "error")["value"]
    assert _main_text(await agent.run("'back'")) == "back"


async def test_code_runtime_environment(agent: Agent) -> None:
    assert _main_text(await agent.run("import asyncio\nawait asyncio.sleep(0.01)\n'awaited'")) == "awaited"
    lines = await agent.run("import subprocess; subprocess.run(['echo', 'sub']).returncode")
    assert _stdout(lines) == "sub\n" and _main_text(lines) == "0"
    # Nothing of the zygote's own environment is visible, not even through /proc.
    code = "import os; ('ZYGOTE_ONLY_SECRET' in os.environ, b'hunter2' in open('/proc/self/environ', 'rb').read())"
    assert _main_text(await agent.run(code)) == "(False, False)"
    assert _main_text(await agent.run("import threading; threading.active_count()")) == "1"
    backend = _main_text(await agent.run("import matplotlib; matplotlib.get_backend()"))
    assert backend in ("inline", "module://matplotlib_inline.backend_inline")


async def test_code_run_round_trip_is_fast(agent: Agent) -> None:
    await agent.run("1")
    times = []
    for _ in range(50):
        t = time.perf_counter()
        await agent.run("1")
        times.append(time.perf_counter() - t)
    times.sort()
    median = times[len(times) // 2] * 1000
    print(f"\ntrivial code.run round trip: median {median:.2f} ms, best {times[0] * 1000:.2f} ms")
    assert median < 5


async def test_ping_and_unknown_op(agent: Agent) -> None:
    await agent.ch.call("ping")
    with pytest.raises(Exception, match="unknown op"):
        await agent.ch.call("no.such.op")
