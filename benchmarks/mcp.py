"""What MCP costs on top of the SDK (issue 29): one `run_code("print(1)")`, from the call to its result,

* through our SDK directly (AsyncSandbox.run_code, over TCP to the server);
* as an MCP tool call over stdio (`agentcell mcp` spawned by the official client);
* as an MCP tool call over streamable HTTP: /mcp of `agentcell serve` (the endpoint calls the server back
  over loopback), and the standalone `agentcell mcp --http`.

Interleaved (the machine's load hits each alike), one sandbox each, p50 / p90 in ms over --runs calls.

    .venv/bin/python benchmarks/mcp.py [--runs 50]           # root
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

# this file's directory first on the path would make it the `mcp` package: the repository instead
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import httpx2  # noqa: E402
from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

from agentcell import AsyncSandbox  # noqa: E402
from tests.servers import REPO, ServerProcess, free_port  # noqa: E402

KEY = "bench-" + os.urandom(6).hex()
CODE = "print(1)"


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


@asynccontextmanager
async def mcp_stdio(url: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=sys.executable, args=["-m", "agentcell", "mcp", "--api-url", url],
                                   env={**os.environ, "AGENTCELL_API_KEY": KEY}, cwd=str(REPO))
    async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
        await s.initialize()
        yield s


@asynccontextmanager
async def mcp_http(url: str) -> AsyncIterator[ClientSession]:
    async with httpx2.AsyncClient(headers={"X-API-KEY": KEY}, timeout=60) as http, \
            streamable_http_client(url, http_client=http) as (r, w), ClientSession(r, w) as s:
        await s.initialize()
        yield s


async def tool_runner(s: ClientSession) -> Callable[[], Awaitable[None]]:
    made = await s.call_tool("create_sandbox", {})
    sid = made.structured_content["sandbox_id"]  # type: ignore[index]

    async def run() -> None:
        result = await s.call_tool("run_code", {"sandbox_id": sid, "code": CODE})
        assert not result.is_error and result.content[0].text.strip() == "1", result  # type: ignore[union-attr]
    return run


def standalone(server_url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentcell", "mcp", "--http", "--port", str(port),
                             "--api-url", server_url], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("agentcell mcp --http did not start")


async def measure(server: ServerProcess, runs: int) -> dict[str, list[float]]:
    helper, helper_url = standalone(server.url)
    try:
        async with AsyncExitStack() as stack:
            sbx = await AsyncSandbox.create(api_url=server.url, api_key=KEY)
            stack.push_async_callback(sbx.kill)

            async def sdk() -> None:
                ex = await sbx.run_code(CODE)
                assert "".join(ex.logs.stdout).strip() == "1"

            paths: dict[str, Callable[[], Awaitable[None]]] = {"SDK run_code (TCP)": sdk}
            paths["MCP stdio"] = await tool_runner(await stack.enter_async_context(mcp_stdio(server.url)))
            paths["MCP HTTP (/mcp of serve)"] = await tool_runner(
                await stack.enter_async_context(mcp_http(server.url + "/mcp")))
            paths["MCP HTTP (agentcell mcp --http)"] = await tool_runner(
                await stack.enter_async_context(mcp_http(helper_url)))
            for run in paths.values():  # warm: the first call of each pays for imports and connections
                await run()
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(runs):
                for name, run in paths.items():
                    t0 = time.perf_counter()
                    await run()
                    times[name].append((time.perf_counter() - t0) * 1000)
            return times
    finally:
        helper.terminate()
        helper.wait(timeout=15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    log = Path(tempfile.gettempdir()) / f"agentcell-bench-mcp-{os.getpid()}.log"
    with ServerProcess(log, "--egress-uplink", "none", env={"AGENTCELL_SERVER_API_KEY": KEY}) as server:
        times = asyncio.run(measure(server, args.runs))
    base = statistics.median(times["SDK run_code (TCP)"])
    print(f"run_code({CODE!r}): call -> result, ms, {args.runs} calls each (interleaved):")
    for name, got in times.items():
        p50 = statistics.median(got)
        print(f"  {name:34s} p50 {p50:6.2f}  p90 {_pct(got, 0.9):6.2f}  (+{p50 - base:.2f} over the SDK)")


if __name__ == "__main__":
    main()
