"""Small helpers several test files share (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, TypeVar

import httpx

from agentcell import CommandExitException, Sandbox
from agentcell.backends.base import Backend, Limits, SandboxSpec
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox
from agentcell.runtime.protocol import AgentChannel

PROBE = "agentcell.backends.linux.probe:serve"  # the backend tests' stand-in agent
T = TypeVar("T")
B = TypeVar("B", bound=Backend)


def wait_until(what: str, check: Callable[[], T], timeout: float = 15, interval: float = 0.1) -> T:
    """`check()`'s first truthy answer, asked every `interval` seconds; an AssertionError naming `what`
    once `timeout` seconds have passed without one."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def wait_for_events(read: Callable[[], Iterable[dict[str, Any]]], done: Callable[[list[dict[str, Any]]], bool],
                    timeout: float = 10, interval: float = 0.2) -> list[dict[str, Any]]:
    """A sandbox's record, as `read()` gives it, once `done` says it holds what the test waits for (the
    record is written a little after what it records); an AssertionError with its kinds after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        got = list(read())
        if done(got):
            return got
        assert time.monotonic() < deadline, f"the record never showed it: {[e['kind'] for e in got][-20:]}"
        time.sleep(interval)


@contextlib.contextmanager
def e2b_pointed_at(url: str) -> Iterator[str]:
    """The official e2b SDKs' environment pointed at an agentcell server (both planes), restored after."""
    # E2B_VOLUME_API_URL: the volume content API (the SDKs' default is https://api.<domain>)
    values = {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": "e2b_test_key", "E2B_VOLUME_API_URL": url}
    saved = {k: os.environ.get(k) for k in (*values, "E2B_DEBUG")}
    os.environ.update(values)
    os.environ.pop("E2B_DEBUG", None)
    try:
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.asynccontextmanager
async def started(backend: B) -> AsyncIterator[B]:
    """`backend` started, closed on the way out (the backend tests' module fixtures)."""
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


def probe_backend(**options: Any) -> contextlib.AbstractAsyncContextManager[LinuxBackend]:
    """A started LinuxBackend whose sandboxes run the probe agent."""
    return started(LinuxBackend(entry_point=PROBE, **{"max_sandboxes": 1000, **options}))


@contextlib.contextmanager
def host_listener() -> Iterator[tuple[int, list[Any]]]:
    """A TCP listener on the host's loopback for 5 s: (its port, the connections it accepted). A
    sandbox must never reach it."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list[Any] = []

    def accept() -> None:
        listener.settimeout(5)
        try:
            accepted.append(listener.accept()[0])
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    try:
        yield listener.getsockname()[1], accepted
    finally:
        t.join()
        listener.close()


CONNECT_CODE = ("import socket\n"
                "s = socket.socket(); s.settimeout(2)\n"
                "try:\n    s.connect(('127.0.0.1', {port})); print('connected')\n"
                "except OSError as e:\n    print(type(e).__name__)\n")


def create_sandbox(http: httpx.Client, **body: Any) -> dict[str, Any]:
    """POST /v2/sandboxes with `body` (templateID base), asserting 201; the response's JSON."""
    r = http.post("/v2/sandboxes", json={"templateID": "base", **body})
    assert r.status_code == 201, r.text
    return r.json()


def sh(sbx: Sandbox, cmd: str, timeout: float = 60, user: str | None = None) -> tuple[int, str, str]:
    """Run a shell command (as `user`, the sandbox's default if None); return (exit code, stdout,
    stderr) whatever the exit code."""
    try:
        r = sbx.commands.run(cmd, timeout=timeout, user=user)
        return r.exit_code, r.stdout, r.stderr
    except CommandExitException as e:
        return e.exit_code, e.stdout, e.stderr


def memory_scan_code(prelude: str, on_chunk: str, result: str) -> str:
    """Python for a code context that reads its own process's whole readable memory.

    `prelude` sets things up, `on_chunk` runs for each readable mapping with `data` (its bytes) and
    `line` (its /proc/self/maps line), and `result` is the cell's last expression; `scanned` counts the
    bytes read. Callers search for what they look for without spelling it out (a hash, a pattern of
    one-letter classes), so the scan cannot find its own source.
    """
    return (
        f"{prelude}\n"
        "scanned = 0\n"
        "with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:\n"
        "    for line in maps:\n"
        "        addr, perms = line.split()[:2]\n"
        "        if 'r' not in perms or '[vvar' in line or '[vsyscall' in line: continue\n"
        "        lo, hi = (int(x, 16) for x in addr.split('-'))\n"
        "        try:\n"
        "            mem.seek(lo); data = mem.read(hi - lo)\n"
        "        except (OSError, ValueError, OverflowError): continue\n"
        "        scanned += len(data)\n"
        f"        {on_chunk}\n"
        f"{result}"
    )


def secret_scan_code(secret: bytes, pattern: str) -> str:
    """Code whose result is (secret found in memory, more than 50 MB scanned). `pattern` is a bytes
    regex matching the secret's shape; the code carries only the secret's hash."""
    import hashlib

    digest = hashlib.sha256(secret).hexdigest()
    return memory_scan_code(
        f"import hashlib, re\npattern = re.compile({pattern!r})\nfound = False",
        f"found = found or any(hashlib.sha256(m.group()).hexdigest() == {digest!r} for m in pattern.finditer(data))",
        "(found, scanned > 50_000_000)",
    )


class ProbeBox:
    """A sandbox of a probe-agent backend (agentcell.backends.linux.probe), driven by exec calls."""

    def __init__(self, sandbox: LinuxSandbox, channel: AgentChannel) -> None:
        self.sandbox = sandbox
        self.channel = channel

    @classmethod
    async def create(cls, backend: LinuxBackend, prefix: str = "t", **limits: int | float) -> ProbeBox:
        sb = await backend.create(SandboxSpec(prefix + uuid.uuid4().hex[:12], limits=Limits(**limits)))
        assert isinstance(sb, LinuxSandbox)
        return cls(sb, await AgentChannel.open(sb.sock))

    async def run(self, *argv: str, timeout: float = 60) -> tuple[int, str, str]:
        h = (await self.channel.call("exec", argv=list(argv), timeout=timeout)).header
        return h["exit_code"], h["stdout"], h["stderr"]


def execute_raw(sbx: Sandbox, server_url: str, **body: object) -> list[dict]:
    """POST /execute as it is, its NDJSON lines parsed (a run's own deadline: `timeout`, seconds)."""
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999",
               "X-Access-Token": sbx._conn.access_token or ""}
    with httpx.Client(base_url=server_url, headers=headers, timeout=60) as http:
        r = http.post("/execute", json=body)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]
