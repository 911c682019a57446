"""`GET /ui/api/overview`: the sandboxes page in one call, with each one's sparklines.

The samples are the server's kept metrics (SandboxRecord.metrics, taken every 5 s by the manager):
nothing is sampled on the request, so 1,000 sandboxes cost one pass over memory. A gateway asks each
cell's console for its part (with the cell key) and merges.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from agentcell.server.control import rfc3339
from agentcell.server.registry import SandboxManager, SandboxRecord

SPARK = 30  # samples per sparkline
MAX_LISTED = 5000


def _item(manager: SandboxManager, rec: SandboxRecord) -> dict[str, Any]:
    flat = rec.metrics.last(SPARK)  # time, cpu %, memory, cache, disk: one row after another
    return {
        "sandboxID": rec.sandbox_id, "templateID": rec.template_id, "alias": rec.alias,
        "state": rec.state.api_state, "startedAt": rfc3339(rec.started_at), "endAt": rfc3339(manager.shown_end(rec)),
        "cpuCount": rec.limits.cpu_count, "memoryMB": rec.limits.memory_mb, "metadata": rec.metadata,
        "cpu": flat[1::5].tolist(), "mem": [int(m) for m in flat[2::5]],
    }


def server_overview(manager: SandboxManager, visible: Any = None, limit: int = MAX_LISTED) -> dict[str, Any]:
    """`visible`: a filter of records (the server's tenancy), None for all."""
    records = [*manager.list(), *manager.list_paused()]
    if visible is not None:
        records = [r for r in records if visible(r)]
    records.sort(key=lambda r: r.started_at, reverse=True)
    return {"sandboxes": [_item(manager, r) for r in records[:limit]], "truncated": len(records) > limit}


async def merged_overview(client: httpx.AsyncClient, cells: list[Any], headers: dict[str, str],
                          limit: int = MAX_LISTED) -> dict[str, Any]:
    """The cells' overviews as one (a cell that fails to answer is named in `unreachable`)."""

    async def one(cell: Any) -> dict[str, Any] | None:
        try:
            r = await client.get(f"{cell.url}/ui/api/overview", headers=headers, timeout=10.0)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    answers = await asyncio.gather(*(one(c) for c in cells))
    items: list[dict[str, Any]] = []
    truncated, unreachable = False, []
    for cell, answer in zip(cells, answers, strict=True):
        if answer is None:
            unreachable.append(cell.cell_id or cell.url)
            continue
        items += answer.get("sandboxes", [])
        truncated = truncated or bool(answer.get("truncated"))
    items.sort(key=lambda i: str(i.get("startedAt", "")), reverse=True)
    out: dict[str, Any] = {"sandboxes": items[:limit], "truncated": truncated or len(items) > limit}
    if unreachable:
        out["unreachable"] = unreachable
    return out
