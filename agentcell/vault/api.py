"""E2B's Secret API on the control plane: `/secrets` and `/secrets/{secret_id}` (docs/secrets.md).

| request | answer |
|---|---|
| `POST /secrets` `{name, value, metadata?}` | 201, the secret's info (version 1); 409 for a name in use |
| `GET /secrets?limit=&nextToken=` | 200, a page of infos, oldest first; `X-Next-Token` when more follow |
| `GET /secrets/{id or name}` | 200, its info; 404 |
| `POST /secrets/{id or name}` `{value, metadata?}` | 200, its info, the version one up; 404 |
| `DELETE /secrets/{id or name}` | 204; 404 |

Each tenant (server/tenancy.py; one for the whole server when tenancy is off) has its own vault: another
tenant's secrets are "not found", as names that never existed. No answer holds a value; the vault's
operations run in a thread (they take a file lock and fsync).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentcell.server.errors import HTTPError, internal_error
from agentcell.server.tenancy import Tenancy
from agentcell.vault import references
from agentcell.vault.keyring import VaultKeyError
from agentcell.vault.store import SecretExists, SecretNotFound, Vault, VaultError

MAX_BODY = 32 << 10  # a value (8 KiB) and metadata (8 KiB), JSON-escaped


def tenant_of(tenancy: Tenancy, request: Request) -> str:
    return tenancy.caller(request.scope) or ""


async def _run(what: str, fn: Any, *args: Any) -> Any:
    try:
        return await asyncio.to_thread(fn, *args)
    except SecretExists as e:
        raise HTTPError(409, str(e)) from None
    except VaultError as e:
        raise HTTPError(400, str(e)) from None
    except SecretNotFound as e:
        raise HTTPError(404, str(e)) from None
    except (VaultKeyError, OSError) as e:  # names paths and keys' ids: the log only
        raise internal_error(what, e, "the secrets vault cannot be read") from None


class VaultApi:
    def __init__(self, vault: Vault, tenancy: Tenancy) -> None:
        self.vault = vault
        self.tenancy = tenancy

    async def _body(self, request: Request) -> dict[str, Any]:
        from agentcell.server.control import json_body  # the control plane's reader (size cap, body budget)

        return await json_body(request, limit=MAX_BODY)

    async def create(self, request: Request) -> Response:
        body = await self._body(request)
        info = await _run("creating a secret", self.vault.create, tenant_of(self.tenancy, request), body.get("name"),
                          body.get("value"), body.get("metadata"))
        return JSONResponse(info.to_json(), status_code=201)

    async def update(self, request: Request) -> Response:
        body = await self._body(request)
        info = await _run("updating a secret", self.vault.update, tenant_of(self.tenancy, request),
                          request.path_params["secret_id"], body.get("value"), body.get("metadata"))
        return JSONResponse(info.to_json())

    async def get(self, request: Request) -> Response:
        info = await _run("reading a secret's info", self.vault.info, tenant_of(self.tenancy, request),
                          request.path_params["secret_id"])
        return JSONResponse(info.to_json())

    async def list(self, request: Request) -> Response:
        from agentcell.server.control import _after, _page_limit

        infos = await _run("listing secrets", self.vault.list, tenant_of(self.tenancy, request))
        limit = _page_limit(request.query_params)
        rest = _after(infos, [i.secret_id for i in infos], request.query_params.get("nextToken"), "secret")
        page = rest[:limit]
        headers = {"X-Next-Token": page[-1].secret_id} if len(rest) > limit else {}
        return JSONResponse([i.to_json() for i in page], headers=headers)

    async def destroy(self, request: Request) -> Response:
        gone = await _run("destroying a secret", self.vault.destroy, tenant_of(self.tenancy, request),
                          request.path_params["secret_id"])
        if not gone:
            raise HTTPError(404, f"secret '{request.path_params['secret_id'][:128]}' not found")
        return Response(status_code=204)

    async def resolved_body(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        """`body` with its references to this tenant's secrets replaced by their current values (the
        create's and the network update's; references.py). 400 for a missing secret or a misplaced reference."""
        if not references.mentions(body):
            return body
        try:
            refs = references.referenced(body)
        except references.MisplacedReference as e:
            raise HTTPError(400, str(e)) from None
        try:
            found = await _run("reading secrets for a sandbox", self.vault.resolve, tenant_of(self.tenancy, request),
                               refs)
        except HTTPError as e:
            if e.status == 404:
                raise HTTPError(400, f"{e.message}: the sandbox refers to it ({references.MARK}...}}); create it "
                                     "first (Secret.create) or fix the name") from None
            raise
        return references.resolved(body, lambda ref: found[ref].value)

    def routes(self) -> list[Route]:
        return [
            Route("/secrets", self.create, methods=["POST"]),
            Route("/secrets", self.list, methods=["GET"]),
            Route("/secrets/{secret_id}", self.get, methods=["GET"]),
            Route("/secrets/{secret_id}", self.update, methods=["POST"]),
            Route("/secrets/{secret_id}", self.destroy, methods=["DELETE"]),
        ]
