"""E2B behaviours the official SDKs' own suites check, through the unchanged e2b packages and ours.

A sandbox killed while a request is in flight: the server cuts the response's connection, as E2B's
proxy does, and the SDKs (theirs after a health probe, ours too) raise "killed / end of life".
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from e2b import AsyncSandbox as E2BAsyncSandbox
from e2b import Sandbox as E2BSandbox
from e2b import TimeoutException as E2BTimeout
from e2b_code_interpreter import AsyncSandbox as CodeAsyncSandbox
from e2b_code_interpreter import Sandbox as CodeSandbox

from agentcell import AsyncSandbox, Sandbox
from agentcell.errors import SandboxNotRunningException


def _kill_later(kill, delay: float = 1.0) -> threading.Thread:  # type: ignore[no-untyped-def]
    t = threading.Thread(target=lambda: (time.sleep(delay), kill()), daemon=True)
    t.start()
    return t


def test_e2b_command_wait_raises_killed(e2b_env: str) -> None:
    sbx = E2BSandbox.create()
    cmd = sbx.commands.run("sleep 60", background=True)
    sbx.kill()
    with pytest.raises(E2BTimeout) as info:
        cmd.wait()
    assert "sandbox was killed or reached its end of life" in str(info.value)


def test_e2b_command_killed_mid_stream(e2b_env: str) -> None:
    sbx = E2BSandbox.create()
    _kill_later(sbx.kill)
    started = time.monotonic()
    with pytest.raises(E2BTimeout) as info:
        sbx.commands.run("sleep 60")
    assert "end of life" in str(info.value)
    assert time.monotonic() - started < 15


def test_e2b_code_interpreter_run_code_killed(e2b_env: str) -> None:
    sbx = CodeSandbox.create()
    _kill_later(sbx.kill)
    with pytest.raises(E2BTimeout) as info:
        sbx.run_code("import time; time.sleep(300)", timeout=300)
    assert "sandbox was killed while the request was in progress" in str(info.value)


async def test_e2b_async_killed_mid_request(e2b_env: str) -> None:
    code = await CodeAsyncSandbox.create()
    run = asyncio.ensure_future(code.run_code("import time; time.sleep(300)", timeout=300))
    await asyncio.sleep(1)
    await code.kill()
    with pytest.raises(E2BTimeout, match="killed while the request was in progress"):
        await run

    sbx = await E2BAsyncSandbox.create()
    cmd = await sbx.commands.run("sleep 60", background=True)
    await sbx.kill()
    with pytest.raises(E2BTimeout, match="end of life"):
        await cmd.wait()


def test_agentcell_sdk_killed_mid_request(server_url: str) -> None:
    sbx = Sandbox.create(api_url=server_url)
    _kill_later(sbx.kill)
    with pytest.raises(SandboxNotRunningException, match="end of life"):
        sbx.run_code("import time; time.sleep(300)", timeout=300)

    sbx = Sandbox.create(api_url=server_url)
    _kill_later(sbx.kill)
    with pytest.raises(SandboxNotRunningException, match="end of life"):
        sbx.commands.run("sleep 60")


async def test_agentcell_async_sdk_killed_mid_request(server_url: str) -> None:
    sbx = await AsyncSandbox.create(api_url=server_url)
    run = asyncio.ensure_future(sbx.run_code("import time; time.sleep(300)", timeout=300))
    await asyncio.sleep(1)
    await sbx.kill()
    with pytest.raises(SandboxNotRunningException, match="end of life"):
        await run

    sbx = await AsyncSandbox.create(api_url=server_url)
    cmd = await sbx.commands.run("sleep 60", background=True)
    await sbx.kill()
    with pytest.raises(SandboxNotRunningException, match="end of life"):
        await cmd.wait()


def test_run_code_error_still_ends_normally(server_url: str) -> None:
    """Cutting connections is for a dead sandbox only: a crashing context still ends its stream."""
    with Sandbox.create(api_url=server_url) as sbx:
        ex = sbx.run_code("import os; os._exit(3)")
        assert ex.error is not None
        assert sbx.run_code("1 + 1").text == "2"
