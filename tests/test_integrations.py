"""docs/integrations.md's snippets, run: LangChain, Deep Agents (langchain-e2b), smolagents, the OpenAI Agents
SDK (a function tool, and agentcell's MCP server) and E2B's `e2b-mcp-server`, each against a real server
under an API key, with a fake model where one is needed, in the frameworks' own venvs (scripts/integrations-venv makes them;
the frameworks pin e2b, mcp and openai versions of their own). A snippet runs as a subprocess
(tests/integrations/run_snippet.py) and says what its agent did; the test then looks in the sandbox with
agentcell's SDK. Every Python process of a run refuses, and writes down, any connection or name lookup off
loopback (tests/integrations/netguard): no framework may reach a model API, a hub or its telemetry.

Without the venvs the module is skipped, unless AGENTCELL_REQUIRE_INTEGRATIONS is set (scripts/test), when
it fails instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentcell import Sandbox
from tests.conftest import BACKEND_ARGS
from tests.helpers import wait_until
from tests.servers import ServerProcess

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "integrations" / "run_snippet.py"
NETGUARD = REPO / "tests" / "integrations" / "netguard"
EXAMPLES = REPO / "examples" / "integrations"
AGENTS_PYTHON = REPO / ".venv-integrations" / "agents" / "bin" / "python"
E2B_MCP_PYTHON = REPO / ".venv-integrations" / "e2b-mcp-server" / "bin" / "python"
# The server's key, as an operator would set it: every framework must carry it (E2B's SDKs check its shape).
API_KEY = "e2b_" + "5eed" * 10


def _venvs() -> None:
    missing = [str(p.relative_to(REPO)) for p in (AGENTS_PYTHON, E2B_MCP_PYTHON) if not p.exists()]
    if not missing:
        return
    message = f"the integrations' venvs are missing ({', '.join(missing)}): run scripts/integrations-venv"
    if os.environ.get("AGENTCELL_REQUIRE_INTEGRATIONS"):
        pytest.fail(message + " (AGENTCELL_REQUIRE_INTEGRATIONS is set)")
    pytest.skip(message)


Run = Callable[..., dict[str, Any]]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """This module's own server, under an API key (the session's takes any), no uplink (conftest.py)."""
    _venvs()
    log = Path(tempfile.mkdtemp(prefix="agentcell-integrations-")) / "server.log"
    with ServerProcess(log, *BACKEND_ARGS, "--egress-uplink", "none", "--api-key", API_KEY) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def run(server_url: str) -> Iterator[Run]:
    """run(snippet, *args, guarded=[]) -> what it printed; fails on any refused connection unless its
    host is in `guarded` (then it must be refused: the guard's own check)."""
    workdir = Path(tempfile.mkdtemp(prefix="agentcell-integrations-"))
    # `agentcell` on the PATH, as the MCP snippet starts it: this checkout's, with this Python
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    (bin_dir / "agentcell").write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m agentcell "$@"\n')
    (bin_dir / "agentcell").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AGENTCELL_", "OPENAI_", "LANGCHAIN_", "LANGSMITH_",
                                                                     "HF_", "VIRTUAL_ENV", "PYTHON"))}
    env.update({
        # the e2b SDKs (both planes on one URL), agentcell's SDK and `agentcell mcp`
        "E2B_API_URL": server_url, "E2B_SANDBOX_URL": server_url, "E2B_API_KEY": API_KEY,
        "AGENTCELL_URL": server_url, "AGENTCELL_API_KEY": API_KEY,
        # no model API, no tracing or telemetry: a client that is built anyway points at a closed port
        "OPENAI_API_KEY": "dummy", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_AGENTS_DISABLE_TRACING": "1",
        "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false", "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "ANTHROPIC_API_KEY": "dummy",
        "PYTHONPATH": str(NETGUARD), "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
    })

    def run_snippet(*args: str, guarded: tuple[str, ...] = ()) -> dict[str, Any]:
        guard_log = workdir / f"netguard-{args[0]}-{os.urandom(4).hex()}.log"
        proc = subprocess.run([str(AGENTS_PYTHON), str(HARNESS), *args], cwd=workdir, capture_output=True,
                              text=True, timeout=120, env={**env, "AGENTCELL_NET_GUARD": str(guard_log)})
        refused = guard_log.read_text() if guard_log.exists() else ""
        for host in guarded:
            assert repr(host) in refused, f"the guard saw no attempt to reach {host}: {refused!r}"
            refused = "".join(line for line in refused.splitlines(True) if repr(host) not in line)
        assert not refused, f"{args[0]} tried to leave the machine:\n{refused}"
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"{args[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                               f"{proc.stderr[-6000:]}"
        return json.loads(lines[-1].removeprefix("RESULT "))

    yield run_snippet


@pytest.fixture
def sandboxes(server_url: str) -> Iterator[list[str]]:
    """Sandbox ids a test is to kill at its end, whatever happened."""
    ids: list[str] = []
    yield ids
    for sid in ids:
        Sandbox.kill(sid, api_url=server_url, api_key=API_KEY)


def _sandbox(server_url: str, sandbox_id: str) -> Sandbox:
    return Sandbox.connect(sandbox_id, api_url=server_url, api_key=API_KEY)


def _running(server_url: str) -> set[str]:
    return {s.sandbox_id for s in Sandbox.list(api_url=server_url, api_key=API_KEY)}


def test_langchain_agent_runs_python_in_the_sandbox(run: Run, server_url: str, sandboxes: list[str]) -> None:
    out = run("langchain_agent")
    sandboxes.append(out["sandbox_id"])
    assert out["tool_results"] == ["42\n"]
    assert out["answer"] == "The sandbox said: 42\n"
    assert _sandbox(server_url, out["sandbox_id"]).files.read("/home/user/langchain.txt") == "42"


def test_langchain_e2b_backend_operations(run: Run, server_url: str, sandboxes: list[str]) -> None:
    out = run("langchain_e2b_backend")
    sandboxes.append(out["sandbox_id"])
    todo = "/home/user/notes/todo.txt"
    assert out["execute"] == {"output": "42\n", "exit_code": 0, "truncated": False}
    assert out["read"]["error"] is None and out["read"]["file_data"]["content"].startswith("buy oat milk\nwrite tests")
    assert out["ls"] == {"error": None, "entries": [{"path": todo, "is_dir": False}]}
    assert out["grep"] == {"error": None, "matches": [{"path": todo, "line": 1, "text": "buy oat milk"}]}
    assert [m["path"] for m in out["glob"]["matches"]] == ["todo.txt"]
    # written, then edited in place: the sandbox has the edit
    assert _sandbox(server_url, out["sandbox_id"]).files.read(todo) == "buy oat milk\nwrite tests\n"


def test_deep_agent_writes_and_runs_a_file_in_the_sandbox(run: Run, server_url: str, sandboxes: list[str]) -> None:
    out = run("deepagents_e2b")
    sid = out["sandbox_id"]
    sandboxes.append(sid)
    wrote, ran = out["tool_results"]
    assert "/home/user/hello.py" in wrote
    # it printed 42, as the sandbox's user, on the sandbox's host (its name is its id)
    assert ran.startswith(f"42\nran as user on {sid}\n") and "exit code 0" in ran
    assert _sandbox(server_url, sid).files.read("/home/user/hello.py") == "print(6*7)\n"


def test_smolagents_code_action_runs_in_the_sandbox(run: Run, server_url: str, sandboxes: list[str]) -> None:
    out = run("smolagents_e2b")
    sandboxes.append(out["sandbox_id"])
    assert out["answer"] == 42  # final_answer(6*7), computed in the sandbox and sent back
    assert any("42" in o for o in out["tool_results"])
    assert _sandbox(server_url, out["sandbox_id"]).files.read("/home/user/smolagents.txt") == "42"


def test_openai_agents_function_tool_runs_python_in_the_sandbox(run: Run, server_url: str,
                                                                 sandboxes: list[str]) -> None:
    out = run("openai_agents_tool")
    sandboxes.append(out["sandbox_id"])
    assert out["tool_results"] == ["42\n"]
    assert out["answer"] == "The sandbox said: 42\n"
    assert _sandbox(server_url, out["sandbox_id"]).files.read("/home/user/openai_agents.txt") == "42"


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_openai_agents_with_agentcell_mcp(run: Run, server_url: str, transport: str) -> None:
    out = run("openai_agents_mcp", transport)
    sid = out["sandbox_id"]
    created, wrote, computed, listed = out["tool_results"]
    assert f'"sandbox_id": "{sid}"' in created and "/home/user/question.txt" in wrote
    assert computed == "42\n"  # run_code read the file write_file wrote: one sandbox across the tools
    assert "6*7" in listed and "user" in listed
    assert out["answer"] == "The sandbox said: 42\n"
    # the sandbox was the MCP session's: gone with it
    wait_until("the MCP session's sandbox is killed", lambda: sid not in _running(server_url), timeout=15)


def test_e2b_mcp_server_through_the_shim(run: Run, server_url: str, sandboxes: list[str]) -> None:
    before = _running(server_url)
    out = run("e2b_mcp_server", str(E2B_MCP_PYTHON), "shim")
    new = _running(server_url) - before
    sandboxes.extend(new)
    assert out["tools"] == ["run_code"] and not out["is_error"]
    assert json.loads(out["tool_results"][0]) == {"stdout": ["42\n"], "stderr": []}
    # e2b-mcp-server makes a sandbox per call and leaves it to its timeout: it is there, with the file
    assert len(new) == 1
    assert _sandbox(server_url, new.pop()).files.read("/home/user/e2b_mcp_server.txt") == "42"


def test_e2b_mcp_server_without_the_shim_tries_e2b_cloud(run: Run, server_url: str) -> None:
    """Why the shim: its e2b 1.x SDK ignores E2B_API_URL and goes to E2B's cloud (which the guard refuses,
    as it would any framework's attempt to leave: this is the guard's own test too)."""
    before = _running(server_url)
    out = run("e2b_mcp_server", str(E2B_MCP_PYTHON), "unshimmed", guarded=("api.e2b.app",))
    assert out["is_error"] and "network guard refused" in out["tool_results"][0]
    assert _running(server_url) == before


def test_the_docs_show_the_snippets_as_they_are_tested() -> None:
    """docs/integrations.md shows each example file whole, in a ```python block: the files are the source."""
    doc = (REPO / "docs" / "integrations.md").read_text()
    blocks = [b.split("\n", 1)[1] for b in doc.split("```python")[1:]]
    blocks = [b.split("```", 1)[0] for b in blocks]
    for path in sorted(EXAMPLES.glob("*.py")):
        assert path.read_text() in blocks, (f"docs/integrations.md does not show {path.name} as it is: "
                                            "paste the file whole into its ```python block")
