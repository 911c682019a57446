"""`GET /sandboxes` and `GET /v2/sandboxes` over every cell, merged; v2 pages with one cursor.

The gateway's `nextToken` is the sort key of the last sandbox of the page (its startedAt and id,
base64url): for the next page each cell is asked for what comes after that key (its own
startedBefore/startedAfter, inclusive, narrows it; ties are dropped by key), and the cells' answers
are merged in order. No state is kept between pages, so any gateway replica serves the next one.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, urlencode

import httpx

from agentcell.gateway.cells import CellState

MAX_LIMIT = 100


class ListError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _when(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _key(item: dict[str, Any]) -> tuple[datetime, str]:
    return _when(item["startedAt"]), item["sandboxID"]


def encode_token(item: dict[str, Any]) -> str:
    raw = f"{item['startedAt']}|{item['sandboxID']}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_token(token: str) -> tuple[datetime, str, str]:
    """(time, sandbox id, the time as the cells spell it)."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        started, sandbox_id = raw.rsplit("|", 1)
        return _when(started), sandbox_id, started
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ListError(400, "invalid 'nextToken' (use the X-Next-Token of the previous page)") from None


async def _get(client: httpx.AsyncClient, cell: CellState, path: str, params: list[tuple[str, str]],
               headers: dict[str, str]) -> httpx.Response:
    url = cell.url + path + ("?" + urlencode(params) if params else "")
    return await client.get(url, headers=headers)


async def list_v1(client: httpx.AsyncClient, cells: list[CellState], query: str,
                  headers: dict[str, str]) -> list[Any]:
    params = parse_qsl(query, keep_blank_values=True)
    answers = await asyncio.gather(*(_get(client, c, "/sandboxes", params, headers) for c in cells),
                                   return_exceptions=True)
    out: list[Any] = []
    for r in answers:
        if isinstance(r, httpx.Response) and r.status_code == 200:
            out += r.json()
        elif isinstance(r, httpx.Response) and r.status_code < 500:
            raise ListError(r.status_code, r.json().get("message", r.text))
    return out


def page_limit(q: dict[str, str]) -> int:
    """A list's `limit` (1..MAX_LIMIT, default MAX_LIMIT), checked as a cell checks it."""
    try:
        limit = int(q.get("limit", MAX_LIMIT))
    except ValueError:
        raise ListError(400, "'limit' must be an integer") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise ListError(400, f"'limit' must be between 1 and {MAX_LIMIT}")
    return limit


async def list_v2(client: httpx.AsyncClient, cells: list[CellState], query: str,
                  headers: dict[str, str]) -> tuple[list[Any], str | None, int]:
    """(page, next token or None, running sandboxes in all cells)."""
    params = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k not in ("nextToken", "limit")]
    q = dict(parse_qsl(query, keep_blank_values=True))
    limit = page_limit(q)
    desc = q.get("order", "desc") != "asc"
    cursor = decode_token(q["nextToken"]) if q.get("nextToken") else None
    if cursor is not None:  # the cells' own time filter narrows what they send (inclusive)
        bound = "startedBefore" if desc else "startedAfter"
        mine = q.get(bound)
        if mine is None or (_when(mine) > cursor[0] if desc else _when(mine) < cursor[0]):
            params = [(k, v) for k, v in params if k != bound] + [(bound, cursor[2])]

    def beyond(item: dict[str, Any]) -> bool:
        if cursor is None:
            return True
        key = _key(item)
        return key < cursor[:2] if desc else key > cursor[:2]

    async def one(cell: CellState) -> tuple[list[Any], int]:
        items: list[Any] = []
        token: str | None = None
        total = 0
        while True:  # the cell's own pages, until limit+1 items beyond the cursor (so we know of more)
            page_params = params + [("limit", str(MAX_LIMIT))] + ([("nextToken", token)] if token else [])
            r = await _get(client, cell, "/v2/sandboxes", page_params, headers)
            if r.status_code != 200:
                raise ListError(r.status_code, r.json().get("message", r.text))
            total = int(r.headers.get("x-total-running", "0") or 0)
            items += [it for it in r.json() if beyond(it)]
            token = r.headers.get("x-next-token") or None
            if len(items) > limit or token is None:
                return items, total

    answers = await asyncio.gather(*(one(c) for c in cells), return_exceptions=True)
    merged: list[Any] = []
    running = 0
    for a in answers:
        if isinstance(a, ListError) and a.status < 500:
            raise a
        if isinstance(a, tuple):
            merged += a[0]
            running += a[1]
    merged.sort(key=_key, reverse=desc)
    page = merged[:limit]
    return page, encode_token(page[-1]) if len(merged) > limit else None, running
