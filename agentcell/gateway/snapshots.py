"""Snapshots across cells: which cell a create from a snapshot (or a snapshot's delete) must go to, and
`GET /snapshots` merged over every cell with one cursor.

A snapshot lives on the cell that took it, on its disk. Its template id starts with that cell's id
(like a sandbox id), so `<template id>` and `<template id>:default` name their cell. A name does not
(E2B's `<name>:default`): the cells are asked which of them has it (`GET /snapshots?name=`), and,
for an id with no known cell prefix (taken before the cell had an id), which one lists that template
id. Names are unique per cell only: two cells with the same name make the name ambiguous (409).

The listing's `nextToken` is, per cell, the template id of the last snapshot of that cell shown so far
(base64url JSON): the next page asks each cell for what follows its own cursor (the cell's own
`nextToken`), so no state is kept between pages and any gateway replica serves the next one. The cells'
pages are merged newest first by `createdAt` (ties: by cell id, then the cell's own order), which keeps
each cell's order, so what a page shows of a cell is always a prefix of what that cell has left.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

import httpx

from agentcell.gateway.cells import CellState, CellTable
from agentcell.gateway.listing import MAX_LIMIT, ListError, page_limit
from agentcell.server.cell import CELL_ID_LEN
from agentcell.server.control import TEMPLATES

# a template id a cell made: its cell id, then 20 random characters (server/snapshots.py)
_CELL_TEMPLATE_RE = re.compile(rf"^[a-z0-9]{{{CELL_ID_LEN + 20}}}$")
_LEGACY_TEMPLATE_RE = re.compile(r"^[a-z0-9]{20,64}$")


class SnapshotRouteError(Exception):
    """No single reachable cell holds the snapshot; `status` and `message` are the answer to send."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def base_ref(ref: str) -> str:
    """`ref` without its `:tag` (E2B's `name:tag`)."""
    return ref.split(":", 1)[0]


def create_template(body: bytes) -> str | None:
    """The snapshot a create's body names (its `templateID`), or None for a built-in template or a body
    the cell should judge (not JSON, no string templateID): then the create is placed like any other."""
    try:
        parsed = json.loads(body) if body.strip() else {}
    except ValueError:
        return None
    template = parsed.get("templateID", "base") if isinstance(parsed, dict) else None
    if not isinstance(template, str) or not template or template in TEMPLATES:
        return None
    return template


def owner_by_prefix(cells: CellTable, ref: str) -> CellState | None:
    """The cell a snapshot's template id names (up or not), or None when `ref` is not such an id."""
    base = base_ref(ref)
    if not _CELL_TEMPLATE_RE.match(base):
        return None
    return cells.by_id.get(base[:CELL_ID_LEN])


def _names(cells: list[CellState]) -> str:
    return ", ".join(sorted(c.cell_id or c.url for c in cells))


async def _cell_pages(client: httpx.AsyncClient, cell: CellState, params: list[tuple[str, str]],
                      headers: dict[str, str], most: int, after: str | None = None) -> tuple[list[Any], bool]:
    """Up to `most` of the cell's snapshots (after its own cursor `after`), and whether it has more."""
    items: list[Any] = []
    token = after
    while True:
        page = params + [("limit", str(min(MAX_LIMIT, most - len(items))))] + ([("nextToken", token)] if token else [])
        r = await client.get(cell.url + "/snapshots?" + urlencode(page), headers=headers)
        if r.status_code != 200:
            raise ListError(r.status_code, _message(r))
        items += r.json()
        token = r.headers.get("x-next-token") or None
        if token is None or len(items) >= most:
            return items, token is not None


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json().get("message", r.text))
    except (ValueError, AttributeError):
        return r.text[:300]


async def find_holder(client: httpx.AsyncClient, cells: CellTable, ref: str, headers: dict[str, str]) -> CellState:
    """The one reachable cell that holds the snapshot `ref` (a name, or a template id with no known cell
    prefix); raises SnapshotRouteError when none or several do."""
    routable = cells.routable()
    base = base_ref(ref)

    async def holds(cell: CellState) -> bool:
        items, _ = await _cell_pages(client, cell, [("name", ref)], headers, 1)
        if items:
            return True
        if not _LEGACY_TEMPLATE_RE.match(base):
            return False
        # an id from before the cell had one: only a full listing says who has it (rare, bounded by --max-snapshots)
        every, _ = await _cell_pages(client, cell, [], headers, 1 << 30)
        return any(s.get("templateID") == base for s in every)

    answers = await asyncio.gather(*(holds(c) for c in routable), return_exceptions=True)
    holders = [c for c, a in zip(routable, answers, strict=True) if a is True]
    silent = [c for c, a in zip(routable, answers, strict=True) if isinstance(a, BaseException)]
    if len(holders) == 1:
        return holders[0]
    if holders:
        raise SnapshotRouteError(409, f"the snapshot name '{ref}' exists on several cells ({_names(holders)}); "
                                      "create from its templateID instead (GET /snapshots?name=… lists them)")
    unknown = f"; cells {_names(silent)} did not answer, it may be on one of them: retry shortly" if silent else ""
    down = [c for c in cells.by_url.values() if not c.routable and c.cell_id]
    if down:
        unknown += f"; cells {_names(down)} are down now"
    raise SnapshotRouteError(404, f"template '{ref}' not found; available: base, code-interpreter-v1, or the id or "
                                  f"name of a snapshot (GET /snapshots){unknown}")


def unreachable(ref: str, cell: CellState) -> SnapshotRouteError:
    return SnapshotRouteError(503, f"snapshot '{ref}' lives on cell {cell.cell_id}, which cannot be reached now "
                                   f"({cell.last_error or 'down'}); retry when it is back")


async def delete_everywhere(client: httpx.AsyncClient, cells: list[CellState], ref: str,
                            headers: dict[str, str]) -> int:
    """DELETE /templates/{ref} on every cell: 204 if one deleted it, else 404 (or a cell's own 4xx)."""
    path = "/templates/" + quote(ref, safe="")
    answers = await asyncio.gather(*(client.delete(c.url + path, headers=headers) for c in cells),
                                   return_exceptions=True)
    statuses = [a.status_code for a in answers if isinstance(a, httpx.Response)]
    if 204 in statuses:
        return 204
    return next((s for s in statuses if 400 <= s < 500 and s != 404), 404)


# --- GET /snapshots, merged -------------------------------------------------------------------------


def encode_token(cursors: dict[str, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(cursors, sort_keys=True, separators=(",", ":")).encode()).decode().rstrip("=")


def decode_token(token: str) -> dict[str, str]:
    try:
        got = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        got = None
    if not isinstance(got, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in got.items()):
        raise ListError(400, "invalid 'nextToken' (use the X-Next-Token of the previous page)")
    return got


async def list_merged(client: httpx.AsyncClient, cells: list[CellState], query: str,
                      headers: dict[str, str]) -> tuple[list[Any], str | None]:
    """(page, next token or None) of `GET /snapshots` over `cells`, newest first."""
    q = dict(parse_qsl(query, keep_blank_values=True))
    limit = page_limit(q)
    cursors = decode_token(q["nextToken"]) if q.get("nextToken") else {}
    params = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k not in ("nextToken", "limit")]
    named = [c for c in cells if c.cell_id is not None]
    answers = await asyncio.gather(*(_cell_pages(client, c, params, headers, limit, cursors.get(c.cell_id or ""))
                                     for c in named), return_exceptions=True)
    merged: list[tuple[str, str, int, dict[str, Any]]] = []
    more = False
    for cell, a in zip(named, answers, strict=True):
        if isinstance(a, ListError) and a.status < 500:
            raise a
        if isinstance(a, tuple):
            items, has_more = a
            more = more or has_more
            merged += [(str(s.get("createdAt", "")), cell.cell_id or "", i, s) for i, s in enumerate(items)]
    # newest first (createdAt is fixed-width ISO 8601: its text order is its time order); within one
    # second, by cell id and then the cell's own order, so each cell's order is kept
    merged.sort(key=lambda t: (t[1], t[2]))
    merged.sort(key=lambda t: t[0], reverse=True)  # stable, reverse too: ties keep the order above
    page = merged[:limit]
    if not more and len(merged) <= limit:
        return [t[3] for t in page], None
    nxt = dict(cursors)
    for _, cell_id, _, snap in page:
        nxt[cell_id] = str(snap["templateID"])  # the page's last of each cell (sorted: its last wins)
    return [t[3] for t in page], encode_token(nxt)

