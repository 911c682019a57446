"""A standby's preparation before it is frozen, and its claim by a create (the gvisor warm pool).

A standby restored from the template has every page of the guest in the sentry's memory file, but
none mapped in the address spaces of the guest's processes (the systrap stubs start empty): after a
restore, the first touch of each page is a fault the sentry serves. A first run_code straight after
the claim paid ~70-130 ms of those. So a standby does, while it is prepared, everything a create would
otherwise do that is not its tenant's:

* the agent's claim without env vars: the sandbox takes its own name (its id, drawn when it is
  prepared: host name and /etc files), and the agent and its default context redraw their random
  generators (guest.claimed, kernel.py's set_env): each standby is a sandbox of its own already;
* one code cell in the default context on the path a user's first cell takes (the agent's frames, the
  kernel's run, the displayhook, the result line), whose traces a post_run_cell hook then undoes
  (IPython's reset: count 1, empty In/Out, a fresh namespace, as the kernel was before).

The pages those touch stay mapped while the standby waits frozen. A create thaws it and makes one
call, `gvisor.claim` (guest.py), that hands the agent and its contexts the tenant's env vars (the
contexts redraw their generators once more). Nothing of a tenant reaches a standby before that.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from agentcell.errors import SandboxError
from agentcell.runtime.protocol import MAX_HEADER, PREFIX, encode_frame

WARM_CALL = (1 << 31) - 2  # call ids of the backend's own calls: never the server's (they count from 1)
CLAIM_CALL = (1 << 31) - 3
_MAX_WARM_PAYLOAD = 1 << 20  # the warm cell's lines are a few hundred bytes

# Runs as a user's cell runs (store_history). Its hook runs after the count went up and the result
# was sent, and leaves the shell as the kernel had it: IPython's reset(new_session=True), as the zygote
# did after its own warm-up (runtime/agent.py, preload), without the displayhook's flush (its
# gc.collect() would touch every page of the heap, ~0.2 s per standby for nothing: the reset drops the
# names it clears); the input names (_i, _ii) and the last results (_, __) as they were, the cell's
# source out of linecache.
WARM_CELL = """\
def _agentcell_standby(ip=get_ipython()):
    import linecache, sys
    name = sys._getframe().f_code.co_filename
    def undo(result):
        ip.events.unregister("post_run_cell", undo)
        hm, hook = ip.history_manager, ip.displayhook
        hm._i00, hm._i, hm._ii = hm._i, hm._ii, hm._iii
        hook._, hook.__, hook.___ = hook.__, hook.___, ""
        full, hook.do_full_cache = hook.do_full_cache, 0
        try:
            ip.reset(new_session=True)
        finally:
            hook.do_full_cache = full
        linecache.cache.pop(name, None)
        ip.compile._filename_map.pop(name, None)
    ip.events.register("post_run_cell", undo)
_agentcell_standby()
_agentcell_warm = [i * 2 for i in range(3)]
len(_agentcell_warm)
"""
WARM_RESULT = "3"


async def warm(sock: socket.socket, sandbox_id: str, timeout: float) -> None:
    """Claim a freshly restored standby for no tenant (its name, its generators) and run the warm
    cell in its default context. `sock` is non-blocking."""
    try:
        async with asyncio.timeout(timeout):
            await _warm(sock, sandbox_id)
    except TimeoutError:
        raise SandboxError(f"standby {sandbox_id} did not warm up within {timeout:g} s") from None


async def _warm(sock: socket.socket, sandbox_id: str) -> None:
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, encode_frame({"id": 0, "op": "claim", "envs": {}, "hostname": sandbox_id})
                            + encode_frame({"id": WARM_CALL, "op": "code.run"}, WARM_CELL.encode()))
    result = ""
    spent = 0  # connection credit the run's frames took: given back, so the tenant has the full window
    while True:
        header, payload, size = await _read(loop, sock)
        if header.get("id") != WARM_CALL:
            raise SandboxError(f"standby {sandbox_id} answered an unexpected frame while warming: {header}")
        if header.get("done"):
            if header.get("error"):
                raise SandboxError(f"standby {sandbox_id} failed its warm-up: {header['error']}")
            break
        spent += size
        if header.get("event") == "line":
            line = json.loads(payload)
            if line.get("type") == "error":
                raise SandboxError(f"standby {sandbox_id}'s warm-up cell failed: {line}")
            if line.get("type") == "result":
                result = line.get("text", "")
    if result != WARM_RESULT:
        raise SandboxError(f"standby {sandbox_id}'s warm-up cell gave {result!r}, not {WARM_RESULT!r}")
    if spent:
        await loop.sock_sendall(sock, encode_frame({"id": 0, "op": "credit", "bytes": spent}))


async def claim(sock: socket.socket, sandbox_id: str, envs: dict[str, str], timeout: float,
                op: str = "gvisor.claim") -> None:
    """The tenant's env vars to a warm standby (thawed), and its answer: one round trip. `op`: the
    backend's claim call (gvisor.claim, microvm.claim: the same in their guests)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_sendall(sock, encode_frame({"id": CLAIM_CALL, "op": op, "envs": envs}))
            header, _, _ = await _read(loop, sock)
    except TimeoutError:
        raise SandboxError(f"standby {sandbox_id} did not answer its claim within {timeout:g} s") from None
    if header.get("id") != CLAIM_CALL or not header.get("done") or header.get("error"):
        raise SandboxError(f"standby {sandbox_id} did not take its claim: {header}")


async def _read(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                max_payload: int = _MAX_WARM_PAYLOAD) -> tuple[dict[str, Any], bytes, int]:
    """One frame, and never a byte past it (the rest of the stream is the server's); the microvm
    backend reads its guests' control port with it too (a larger `max_payload`: tar's chunks)."""
    head_len, payload_len = PREFIX.unpack(await _exact(loop, sock, PREFIX.size))
    if head_len > MAX_HEADER or payload_len > max_payload:
        raise SandboxError(f"a standby sent a frame too large ({head_len}+{payload_len} bytes)")
    try:
        header = json.loads(await _exact(loop, sock, head_len))
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise SandboxError("a standby sent a malformed frame")
    payload = await _exact(loop, sock, payload_len) if payload_len else b""
    return header, payload, head_len + payload_len


async def _exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise SandboxError("a standby closed its socket (its sandbox ended)")
        buf += chunk
    return bytes(buf)
