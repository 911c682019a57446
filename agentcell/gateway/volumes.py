"""Volumes behind the gateway (docs/volumes.md): a volume lives on the cell that created it, its id
starting with that cell's id like a sandbox's. Its calls (`/volumes/{id}`, `/volumecontent/{id}/...`)
go to that cell; `GET /volumes` merges every cell's; `POST /volumes` is placed on any cell; a sandbox
create that names volumes goes to their cell, and one naming volumes of two cells is refused (400): a
volume is a loop-mounted image on its cell's disk, and no sandbox elsewhere can mount it.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx

from agentcell.gateway.cells import CellState
from agentcell.server.cell import CELL_ID_LEN

_ID = rf"[a-z0-9]{{{CELL_ID_LEN + 1},64}}"
CONTENT_RE = re.compile(rf"^/volumecontent/({_ID})/")
VOLUME_RE = re.compile(rf"^/volumes/({_ID})/?$")


class VolumeRouteError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def classify(path: str, method: str) -> str | None:
    """The gateway route of a volume request (None: not one)."""
    if CONTENT_RE.match(path):
        return "volume_content"
    if VOLUME_RE.match(path):
        return "volume"
    if path.rstrip("/") == "/volumes":
        return "volumes_list" if method == "GET" else "volume_create"
    return None


def volume_id(path: str) -> str:
    m = CONTENT_RE.match(path) or VOLUME_RE.match(path)
    assert m is not None
    return m.group(1)


async def _list(client: httpx.AsyncClient, cell: CellState, headers: dict[str, str]) -> list[dict[str, Any]]:
    r = await client.get(f"{cell.url}/volumes", headers=headers, timeout=10)
    if r.status_code != 200:
        raise VolumeRouteError(r.status_code if r.status_code < 500 else 502,
                               f"cell {cell.cell_id} did not list its volumes ({r.status_code})")
    return [{**v, "_cell": cell} for v in r.json()]


async def list_all(client: httpx.AsyncClient, cells: list[CellState], headers: dict[str, str]) -> list[dict[str, Any]]:
    """Every reachable cell's volumes, each with the cell that holds it under "_cell"."""
    answers = await asyncio.gather(*(_list(client, c, headers) for c in cells), return_exceptions=True)
    out: list[dict[str, Any]] = []
    for a in answers:
        if isinstance(a, VolumeRouteError) and a.status < 500:
            raise a
        if isinstance(a, list):
            out += a
    return out


def mounted_names(body: bytes) -> list[str]:
    """The volume names (or ids) a create's body mounts; [] if none (or not JSON: the cell says why)."""
    try:
        mounts = json.loads(body).get("volumeMounts")
    except (ValueError, AttributeError):
        return []
    if not isinstance(mounts, list):
        return []
    return [m["name"] for m in mounts if isinstance(m, dict) and isinstance(m.get("name"), str)]


async def cell_of_mounts(client: httpx.AsyncClient, cells: dict[str, CellState], routable: list[CellState],
                         names: list[str], headers: dict[str, str]) -> CellState | None:
    """The one cell holding every volume `names` names; None when none of them is found (the cell the
    create is placed on answers 404). VolumeRouteError 400 for volumes of two cells, 503 for a cell down."""
    listed = await list_all(client, routable, headers)
    holders: dict[str, CellState] = {}
    for name in names:
        found = [v["_cell"] for v in listed if name in (v.get("name"), v.get("volumeID"))]
        if not found and (owner := cells.get(name[:CELL_ID_LEN])) is not None and not owner.routable:
            raise VolumeRouteError(503, f"volume '{name}' lives on cell {owner.cell_id}, which is unreachable now; "
                                        "retry shortly")
        if found:
            holders[name] = found[0]
    distinct = {c.url: c for c in holders.values()}
    if len(distinct) > 1:
        where = ", ".join(f"'{n}' on cell {c.cell_id}" for n, c in holders.items())
        raise VolumeRouteError(400, f"the volumes of one sandbox must live on one cell, and these do not: {where}; "
                                    "a volume is a disk image on its cell, mounted by that cell's sandboxes only")
    return next(iter(distinct.values()), None)
