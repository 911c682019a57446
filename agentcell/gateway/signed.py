"""Id-less signed `/files` URLs through the gateway: which cell's sandbox signed it.

The SDKs' download_url()/upload_url() under E2B_SANDBOX_URL name no sandbox: only the v1 signature,
made with one sandbox's access token, says which. The gateway holds no tokens, so it asks every cell at
once (`GET /v1/cell/file-signer/{read|write}?{the URL's query}`, server/cell.py, with the cell key: a
request of the gateway's own that carries the query and nothing of the client's else) and then streams
the request, body unread until then, to the one cell that knows; that cell checks the signature again
as a lone server would. The answers a client gets are envd's (auth.py): a malformed expiration 400, no
signature, a signature nobody made or an expired one 401, each with envd's message.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from agentcell.gateway.cells import CellState
from agentcell.server import auth
from agentcell.server.cell import FILE_SIGNER_PATH

log = logging.getLogger("agentcell.gateway")
ASK_TIMEOUT = 5.0  # seconds a cell has to answer; a cell that does not is left out, as if down


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str


def refusal_without_cells(scope: dict[str, Any]) -> Refusal:
    """What a lone server with no sandbox answers this request: 400 or 401 with envd's message."""
    try:
        _, why = auth.signed_sandbox(scope, ())
    except auth.BadExpiration as e:
        return Refusal(400, str(e))
    return Refusal(401, why or auth.INVALID_SIGNATURE)


async def _ask(client: httpx.AsyncClient, cell: CellState, operation: str, query: str,
               headers: dict[str, str]) -> dict[str, Any] | None:
    url = f"{cell.url}{FILE_SIGNER_PATH}{operation}" + (f"?{query}" if query else "")
    try:
        r = await client.get(url, headers=headers, timeout=ASK_TIMEOUT)
        answer = r.json() if r.status_code == 200 else None
        if answer is None:
            log.warning("cell %s did not say who signed a /files URL: %d %s", cell.cell_id, r.status_code, r.text[:200])
    except (httpx.HTTPError, ValueError) as e:
        log.warning("cell %s did not say who signed a /files URL: %s", cell.cell_id, f"{type(e).__name__}: {e}")
        return None
    return answer if isinstance(answer, dict) else None


async def find_signer(client: httpx.AsyncClient, cells: list[CellState], scope: dict[str, Any],
                      headers: dict[str, str]) -> tuple[CellState, str] | Refusal:
    """The cell whose sandbox signed this id-less /files request and that sandbox's id, or the refusal
    to answer."""
    refusal = refusal_without_cells(scope)
    if refusal.status == 400 or refusal.message == auth.MISSING_SIGNATURE:
        return refusal  # whatever the cells hold, they would answer this too: none is asked
    operation = auth.file_operation(scope["method"])
    query = scope.get("query_string", b"").decode("latin-1")
    answers = await asyncio.gather(*(_ask(client, c, operation, query, headers) for c in cells))
    for cell, answer in zip(cells, answers, strict=True):
        if answer is not None and isinstance(answer.get("sandboxID"), str):
            return cell, answer["sandboxID"]
    if any(answer is not None and answer.get("refusal") == auth.EXPIRED_SIGNATURE for answer in answers):
        return Refusal(401, auth.EXPIRED_SIGNATURE)
    return refusal
