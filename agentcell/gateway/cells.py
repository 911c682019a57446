"""The gateway's view of the cells: who they are (`GET /v1/cell`, polled), whether they are up, how
loaded, and the placement choice (the less loaded of two random ready cells).

A cell is *up* while its polls answer; one failed poll (refused, timed out, an error status) or a
refused connection on a forwarded request marks it down at once, the next good poll marks it up
again. Routing needs: the cell id known, discovery says serving, and up. Placement also needs:
discovery says ready, the cell is not draining and has a free slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from agentcell.gateway.discovery import Endpoint
from agentcell.server.cell import CELL_ID_LEN

log = logging.getLogger("agentcell.gateway")
# a cell's state (CellState.state), in the order they are checked
STATES = ("down", "not_serving", "draining", "not_ready", "full", "ready")


@dataclass
class CellState:
    url: str
    ready: bool = True  # discovery's word: a create may go there
    serving: bool = True  # discovery's word: its sandboxes may be reached there
    cell_id: str | None = None  # from its /v1/cell
    up: bool = False
    draining: bool = False
    slots: int = 0
    max_sandboxes: int = 1
    load: float = 0.0
    sandboxes: int = 0
    placed: int = 0  # creates sent since the last poll (the poll's figures do not count them yet)
    inflight: int = 0  # creates sent and not answered
    refusals: int = 0  # creates it refused at once (429/503), sent on to another cell
    last_ok: float = 0.0
    last_error: str = ""
    poller: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def routable(self) -> bool:
        return self.up and self.serving and self.cell_id is not None

    @property
    def placeable(self) -> bool:
        return self.routable and self.ready and not self.draining and self.slots - self.placed - self.inflight > 0

    @property
    def state(self) -> str:
        """One word for the banner and /metrics: ready is placeable; full, draining, not_ready are
        routable but take no create; not_serving and down are not routed to."""
        if not self.up or self.cell_id is None:
            return "down"
        if not self.serving:
            return "not_serving"
        if self.draining:
            return "draining"
        if not self.ready:
            return "not_ready"
        return "ready" if self.placeable else "full"

    def score(self) -> float:
        """Lower is better: the cell's own load, plus what this gateway sent since it last said."""
        return self.load + (self.placed + self.inflight) / max(1, self.max_sandboxes)

    def view(self) -> dict[str, Any]:
        return {"url": self.url, "cellId": self.cell_id, "state": self.state, "up": self.up, "ready": self.ready,
                "serving": self.serving, "draining": self.draining, "sandboxes": self.sandboxes,
                "slots": self.slots, "load": self.load, "refusals": self.refusals, "lastError": self.last_error or None}


class CellTable:
    def __init__(self, cell_api_key: str | None, poll_interval: float = 1.0, poll_timeout: float = 1.0) -> None:
        self.cell_api_key = cell_api_key
        self.poll_interval = poll_interval
        self.poll_timeout = poll_timeout
        self.by_url: dict[str, CellState] = {}
        self.by_id: dict[str, CellState] = {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(poll_timeout), trust_env=False,
                                        limits=httpx.Limits(max_keepalive_connections=64))
        self._first_polls: list[asyncio.Task[None]] = []
        self.on_poll_failed: Callable[[], None] | None = None  # counted in /metrics (gateway/metrics.py)

    # --- discovery's changes ---------------------------------------------------------------------

    def update(self, endpoints: list[Endpoint]) -> None:
        """The whole set of endpoints now (Discovery's on_change)."""
        seen = set()
        for ep in endpoints:
            seen.add(ep.url)
            cell = self.by_url.get(ep.url)
            if cell is None:
                cell = self.by_url[ep.url] = CellState(ep.url)
                cell.poller = asyncio.get_running_loop().create_task(self._poll_loop(cell))
            cell.ready, cell.serving = ep.ready, ep.serving
        for url in [u for u in self.by_url if u not in seen]:
            cell = self.by_url.pop(url)
            log.warning("cell %s (%s) is gone from discovery", cell.cell_id, url)
            if cell.poller is not None:
                cell.poller.cancel()
            if cell.cell_id is not None and self.by_id.get(cell.cell_id) is cell:
                del self.by_id[cell.cell_id]

    async def wait_first_polls(self, timeout: float) -> None:
        """At start: until every known cell answered (or failed) its first poll."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(c.last_ok == 0 and not c.last_error for c in self.by_url.values()):
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        for cell in self.by_url.values():
            if cell.poller is not None:
                cell.poller.cancel()
                with contextlib.suppress(BaseException):
                    await cell.poller
        await self.client.aclose()

    # --- polling ---------------------------------------------------------------------------------

    def headers(self) -> dict[str, str]:
        return {"x-api-key": self.cell_api_key} if self.cell_api_key else {}

    async def _poll_loop(self, cell: CellState) -> None:
        while True:
            started = time.monotonic()
            await self.poll(cell)
            await asyncio.sleep(max(0.0, self.poll_interval - (time.monotonic() - started)))

    async def poll(self, cell: CellState) -> None:
        try:
            r = await self.client.get(cell.url + "/v1/cell", headers=self.headers())
            if r.status_code != 200:
                raise RuntimeError(f"/v1/cell answered {r.status_code}: {r.text[:200]}")
            info = r.json()
            cell_id = info.get("cellId")
            if not isinstance(cell_id, str) or len(cell_id) != CELL_ID_LEN:
                raise RuntimeError("the server has no cell id (start it with agentcell serve --cell-id)")
        except Exception as e:  # noqa: BLE001 - every failure means the same: not up now
            if self.on_poll_failed is not None:
                self.on_poll_failed()
            self.mark_down(cell, f"{type(e).__name__}: {e}".strip())
            return
        self._learn_id(cell, cell_id)
        capacity = info.get("capacity") or {}
        cell.draining = bool(info.get("draining"))
        cell.slots = int(capacity.get("slots", 0))
        cell.max_sandboxes = max(1, int(capacity.get("maxSandboxes", 1)))
        cell.load = float(info.get("load", 0.0))
        cell.sandboxes = int(info.get("sandboxes", 0))
        cell.placed = 0
        cell.last_ok, cell.last_error = time.monotonic(), ""
        if not cell.up:
            log.warning("cell %s (%s) is up", cell_id, cell.url)
        cell.up = True

    def _learn_id(self, cell: CellState, cell_id: str) -> None:
        if cell.cell_id == cell_id:
            return
        if cell.cell_id is not None and self.by_id.get(cell.cell_id) is cell:
            del self.by_id[cell.cell_id]  # the server at that URL restarted with another id
        cell.cell_id = cell_id
        self.by_id[cell_id] = cell

    def mark_down(self, cell: CellState, why: str) -> None:
        if cell.up:
            log.warning("cell %s (%s) is down: %s", cell.cell_id, cell.url, why)
        cell.up, cell.last_error = False, why or "down"

    # --- routing and placement -------------------------------------------------------------------

    def route(self, sandbox_id: str) -> CellState | None:
        """The cell that holds `sandbox_id`, if it can be reached now."""
        cell = self.by_id.get(sandbox_id[:CELL_ID_LEN])
        return cell if cell is not None and cell.routable else None

    def candidates(self, exclude: set[str]) -> list[CellState]:
        return [c for c in self.by_url.values() if c.placeable and c.url not in exclude]

    def pick(self, exclude: set[str]) -> CellState | None:
        """The less loaded of two random placeable cells (power of two choices)."""
        pool = self.candidates(exclude)
        if not pool:
            return None
        if len(pool) == 1:
            return pool[0]
        a, b = random.sample(pool, 2)
        return a if a.score() <= b.score() else b

    def routable(self) -> list[CellState]:
        return [c for c in self.by_url.values() if c.routable]
