"""`GET /ui/api/health`: what the server knows of its own health (pool depth, admission, egress,
the record's drops). A field the server does not have is absent, never invented. A gateway answers
with its cells' health, summed, and its view of each cell."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from agentcell.server.banner import version

STARTED = time.monotonic()


async def server_health(app: Any) -> dict[str, Any]:
    """`app`: the server's AgentcellApp."""
    manager, config = app.manager, app.config
    counts = manager.counts()
    out: dict[str, Any] = {
        "kind": "server", "version": version(), "uptime_s": round(time.monotonic() - STARTED, 1),
        "sandboxes": {"running": counts["running"], "paused": counts["paused"] + counts["paused_on_disk"],
                      "starting": counts["starting"], "max": config.max_sandboxes},
    }
    backends = (app.backend, *app.others.values())
    standbys, target = 0, 0
    pools_seen = False
    for backend in backends:
        pools = getattr(backend, "standby_pools", None)
        for pool in (pools() if pools is not None else {}).values():
            pools_seen = True
            standbys += pool.ready
            target += pool.size
    if pools_seen:
        out["pool"] = {"standbys": standbys, "target": target}
    cap = await app.backend.capacity()
    if cap is not None:
        adm = manager.admission
        held = [r.limits for r in [*manager.list(), *manager.list_paused()] if r.holds_memory()]
        out["admission"] = {
            "memory": {"limitsMB": sum(x.memory_mb for x in held), "promiseMB": int(cap.memory_bytes * adm.memory_overcommit) >> 20,
                       "usedMB": cap.memory_used >> 20, "budgetMB": cap.memory_bytes >> 20},
            "pids": {"limits": sum(x.pids for x in held), "promise": int(cap.pids * adm.pids_overcommit),
                     "used": cap.pids_used, "budget": cap.pids},
        }
    egress = getattr(app.backend, "egress", None)
    if egress is not None:
        out["egress"] = {"uplink": config.egress_uplink, **_egress_counts(app.metrics), **egress.event_stats()}
    elif app.backend.name == "linux":  # --egress-uplink none: the sandboxes have no internet at all
        out["egress"] = {"uplink": config.egress_uplink, "internet": "none (no uplink)"}
    if app.events is not None:
        stats = app.events.stats
        out["record"] = {"events": stats.get("stored", 0), "dropped": stats.get("dropped", 0)}
        out["record"].update({k: v for k, v in stats.items() if k in ("bytes", "evicted_sandboxes")})
    return out


def _egress_counts(metrics: Any) -> dict[str, int]:
    """Since the server started: connections opened, refusals (connections, names, secrets), bytes each
    way; the counters GET /metrics shows, each read alone (never the whole registry: its collectors
    read every backend and /proc)."""
    def total(counter: Any, **labels: str) -> int:
        return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")
                       and all(s.labels.get(k) == v for k, v in labels.items())))

    return {"connections": total(metrics.egress_connections), "refused": total(metrics.egress_refusals),
            "bytes_out": total(metrics.egress_bytes, direction="out"),
            "bytes_in": total(metrics.egress_bytes, direction="in")}


async def gateway_health(gateway: Any) -> dict[str, Any]:
    """`gateway`: the GatewayApp. Each routable cell's health (its console, with the cell key), summed."""
    cells = gateway.cells.routable()
    headers = gateway.cells.headers()

    async def one(cell: Any) -> dict[str, Any] | None:
        try:
            r = await gateway.client.get(f"{cell.url}/ui/api/health", headers=headers, timeout=10.0)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    answers = await asyncio.gather(*(one(c) for c in cells))
    total = {"running": 0, "paused": 0, "max": 0}
    record = {"events": 0, "dropped": 0}
    shown = []
    for cell, answer in zip(cells, answers, strict=True):
        shown.append({"cell": cell.cell_id, "url": cell.url, "up": answer is not None,
                      **({"health": answer} if answer is not None else {})})
        for k in total:
            total[k] += int(((answer or {}).get("sandboxes") or {}).get(k, 0))
        for k in record:
            record[k] += int(((answer or {}).get("record") or {}).get(k, 0))
    known = {c.url for c in cells}
    shown += [{"cell": c.cell_id, "url": c.url, "up": False} for c in gateway.cells.by_url.values() if c.url not in known]
    return {"kind": "gateway", "version": version(), "uptime_s": round(time.monotonic() - STARTED, 1),
            "sandboxes": total, "record": record, "cells": shown}
