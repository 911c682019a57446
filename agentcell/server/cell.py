"""One server as a *cell* behind `agentcell gateway` (docs/gateway.md): its id, `GET /v1/cell`, draining.

- Cell id: `--cell-id` (or AGENTCELL_CELL_ID, e.g. a pod's UID from the downward API). It is
  CELL_ID_LEN characters of [a-z0-9]: a value of that length is taken as it is (lowercased, other
  characters dropped), a longer one (a UUID) is hashed down to that length, a shorter one is refused.
  Every sandbox id this server makes is the cell id followed by 20 random characters, so an id says
  which cell holds it, still matches ^[a-z0-9]+$ and `{port}-{id}` still fits a DNS label (6+28 chars).
- `GET /v1/cell` (X-API-KEY, like the control plane): the gateway polls it for placement.
- `GET /v1/cell/file-signer/{read|write}?{a /files URL's query}` (X-API-KEY): which of this cell's
  sandboxes signed an id-less `/files` URL, `{"sandboxID", "refusal"}` (auth.signed_sandbox; 400 for a
  malformed expiration). The gateway asks every cell, then streams the request to the one that knows:
  no body is held to be tried cell by cell. The sandbox's cell checks the signature again when served.
- SIGTERM drains: `/health` answers 503 (Kubernetes takes the pod out of the ready endpoints), creates
  get 429, live sandboxes keep serving until they end or `--drain-grace` seconds pass; then the normal
  shutdown. A second SIGTERM, or SIGINT, stops at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import signal
import time
from types import FrameType
from typing import Any

import uvicorn
from starlette.responses import JSONResponse

from agentcell.server import auth
from agentcell.server.errors import json_error
from agentcell.server.registry import SandboxManager

log = logging.getLogger("agentcell.server")

CELL_ID_LEN = 8
_ID_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"
# creates (new sandboxes on this cell) a draining cell refuses; a resume or connect of one it holds goes on
_CREATE_RE = re.compile(r"^/(?:v2/)?sandboxes(?:/[a-z0-9]{1,64}/fork)?/?$")
FILE_SIGNER_PATH = "/v1/cell/file-signer/"  # + the operation signed: read (GET /files) or write (POST)
_FILE_METHODS = {"read": "GET", "write": "POST"}


def normalise_cell_id(raw: str | None) -> str | None:
    """The cell id for `raw` (see the module doc); None for None or empty. ValueError if too short."""
    if raw is None or not raw.strip():
        return None
    cleaned = re.sub(r"[^a-z0-9]", "", raw.lower())
    if len(cleaned) == CELL_ID_LEN:
        return cleaned
    if len(cleaned) < CELL_ID_LEN:
        raise ValueError(f"a cell id has {CELL_ID_LEN} characters a-z0-9 (longer values, e.g. a pod UID, are "
                         f"hashed down to {CELL_ID_LEN}); {raw!r} has {len(cleaned)}")
    n = int.from_bytes(hashlib.sha256(cleaned.encode()).digest(), "big")
    out = []
    for _ in range(CELL_ID_LEN):
        n, d = divmod(n, 36)
        out.append(_ID_CHARS[d])
    return "".join(out)


class Cell:
    """This server's cell state: id, drain, and the answers of /v1/cell and a draining /health."""

    def __init__(self, cell_id: str | None, manager: SandboxManager, max_sandboxes: int,
                 drain_grace: float) -> None:
        self.cell_id = cell_id
        self.manager = manager
        self.max_sandboxes = max_sandboxes
        self.drain_grace = drain_grace
        self.draining_since: float | None = None
        self._drain_task: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    async def answer(self, scope: dict[str, Any], receive: Any, send: Any) -> bool:
        """Answer a control-plane request that is the cell's (True), or leave it to the control plane."""
        path, method = scope["path"], scope["method"]
        if path == "/v1/cell" and method == "GET":
            await JSONResponse(await self.info())(scope, receive, send)
            return True
        if path.startswith(FILE_SIGNER_PATH) and method == "GET":
            await self._file_signer(path[len(FILE_SIGNER_PATH):], scope, receive, send)
            return True
        if not self.draining:
            return False
        if path == "/health" and method == "GET":
            body = {"status": "draining", "sandboxes": len(self.manager.list())}
            await JSONResponse(body, status_code=503)(scope, receive, send)
            return True
        if method == "POST" and _CREATE_RE.match(path):
            await json_error(429, f"this server (cell {self.cell_id or '-'}) is draining: it is shutting down and "
                                  "takes no new sandboxes; create it through the gateway (another cell) or on "
                                  "another server")(scope, receive, send)
            return True
        return False

    async def _file_signer(self, operation: str, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """`GET /v1/cell/file-signer/{operation}` (the module doc)."""
        if operation not in _FILE_METHODS:
            await json_error(404, f"no route for GET {scope['path']} (the operations: read, write)")(scope, receive, send)
            return
        signed = {"method": _FILE_METHODS[operation], "query_string": scope.get("query_string", b""), "headers": []}
        try:
            sandbox_id, refusal = auth.signed_sandbox(
                signed, ((r.sandbox_id, r.access_token) for r in self.manager.list()))
        except auth.BadExpiration as e:
            await json_error(400, str(e))(scope, receive, send)
            return
        await JSONResponse({"sandboxID": sandbox_id, "refusal": refusal})(scope, receive, send)

    async def info(self) -> dict[str, Any]:
        m = self.manager
        running, paused = len(m.list()), len(m.list_paused())
        live = m._live_count()  # running, or paused with memory: what holds a slot
        slots = max(0, self.max_sandboxes - live)
        load = live / self.max_sandboxes
        capacity: dict[str, Any] = {"slots": slots, "maxSandboxes": self.max_sandboxes}
        cap = await m.backend.capacity()
        if cap is not None:
            capacity.update(memoryBytes=cap.memory_bytes, memoryLeft=max(0, cap.memory_bytes - cap.memory_used),
                            pids=cap.pids, pidsLeft=max(0, cap.pids - cap.pids_used))
            load = max(load, cap.memory_used / max(1, cap.memory_bytes), cap.pids_used / max(1, cap.pids))
        return {"cellId": self.cell_id, "draining": self.draining, "sandboxes": running, "paused": paused,
                "capacity": capacity, "load": round(load, 4), "loadavg": round(os.getloadavg()[0], 2)}

    def start_drain(self, stop: Any) -> None:
        """Begin draining (on the event loop); `stop()` is called once it is over."""
        if self.draining:
            return
        self.draining_since = time.monotonic()
        log.warning("draining: no new sandboxes; waiting up to %g s for %d live ones to end",
                    self.drain_grace, len(self.manager.list()))
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(stop))

    async def _drain(self, stop: Any) -> None:
        deadline = time.monotonic() + self.drain_grace
        while self.manager.list() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        left = len(self.manager.list())
        log.warning("drained (%s): shutting down", f"{left} sandboxes left at the grace's end" if left else
                    "no live sandboxes")
        stop()


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM drains the cell (see the module doc) instead of stopping."""

    def __init__(self, config: uvicorn.Config, cell: Cell) -> None:
        super().__init__(config)
        self.cell = cell
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if (sig == signal.SIGTERM and self.cell.drain_grace > 0 and not self.cell.draining
                and self._loop is not None and not self.should_exit):
            self._captured_signals.append(sig)  # re-raised after the shutdown, as uvicorn does
            self._loop.call_soon_threadsafe(self.cell.start_drain, self._stop)
            return
        super().handle_exit(sig, frame)

    def _stop(self) -> None:
        self.should_exit = True


def drain_grace(config: Any) -> float:
    """`--drain-grace`, or its default: a cell waits out the longest sandbox lifetime, a lone server none."""
    if config.drain_grace is not None:
        return float(config.drain_grace)
    return float(config.max_timeout) if config.cell_id else 0.0
