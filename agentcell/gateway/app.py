"""The gateway's ASGI app: API key, routing by the id's cell prefix, placement, list fan-out.

Trust: a data-plane request (routing.py, the parser the cells use) goes on without the gateway's key
and without any X-API-KEY (the cell checks the sandbox's token); every other request but `/health` and
an id-less signed `/files` needs the client's key to match before anything is sent to a cell, and only
then carries the cell key. Bodies stream (forward.py) under the cells' body deadline (server/edge.py);
only a create's JSON is held, within a gateway-wide budget (bodies.py).

| request | goes to |
|---|---|
| data plane (`E2b-Sandbox-Id` header, or Host `{port}-{id}.…`) | the cell named by the id's first CELL_ID_LEN chars |
| `/sandboxes/{id}…`, `/v2/sandboxes/{id}…` (fork, snapshots of it too) | the same |
| `POST /sandboxes`, `POST /v2/sandboxes` of a built-in template | the less loaded of two random ready cells; on 429/503 or a refused connection, another |
| `POST /sandboxes`, `POST /v2/sandboxes` from a snapshot | only the cell that holds it: named by its template id's prefix, else found by asking the cells (snapshots.py) |
| `DELETE /templates/{id}` | the cell named by the id's prefix; a name: every cell (204 if one deleted it) |
| `/secrets…`, and `POST /sandboxes`, `/v2/sandboxes` whose body refers to a vault secret | the template cell only, which holds the secrets vault (vault.py) |
| `GET /sandboxes`, `GET /v2/sandboxes`, `GET /snapshots` | every reachable cell, merged (listing.py, snapshots.py) |
| `/files` without a sandbox (a signed URL) | the cell whose sandbox signed it, found by asking every cell (signed.py) |
| `GET /health` | the gateway itself (no key): 200 while a cell is routable, else 503; `GET /v1/cells`: its view of the cells (key) |
| `GET /metrics` | the gateway itself (its key, also as a Bearer token): its own figures (metrics.py) |
| anything else on the control plane | one ready cell |

An id whose cell is unknown, down or no longer serving gets E2B's 502 "The sandbox was not found".

Every request is logged and counted as the server's are (server/access_log.py), by the route it took
(`classify`), with the cell that served it and the sandbox it concerns (a create's new one, a signed
URL's signer) noted on its access line.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from typing import Any
from urllib.parse import parse_qsl

import httpx
from starlette.responses import JSONResponse, Response

from agentcell.console import mount as console_mount
from agentcell.gateway import banner, listing, signed, snapshots, volumes
from agentcell.gateway import vault as gateway_vault
from agentcell.gateway.bodies import read_held
from agentcell.gateway.cells import CellState, CellTable
from agentcell.gateway.discovery import Discovery
from agentcell.gateway.forward import (
    CellFailed,
    CellUnreachable,
    ClientLeft,
    forward,
    relay_upgrade,
    upgrade_requested,
)
from agentcell.gateway.metrics import GatewayMetrics
from agentcell.server import prometheus, routing
from agentcell.server.access_log import AccessLog, note
from agentcell.server.asgi import header
from agentcell.server.banner import version
from agentcell.server.bodies import BodyBudget
from agentcell.server.cell import CELL_ID_LEN
from agentcell.server.control import TEMPLATES
from agentcell.server.edge import BodyDeadline
from agentcell.server.errors import HTTPError, json_error, sandbox_not_found
from agentcell.server.routing import SandboxTarget

log = logging.getLogger("agentcell.gateway")

# an id has a cell prefix and more: /sandboxes/metrics (no id) goes to a cell like any other path
_CONTROL_ID_RE = re.compile(rf"^/(?:v2/)?sandboxes/([a-z0-9]{{{CELL_ID_LEN + 1},64}})(?:/|$)")
_CREATE_PATHS = frozenset({"/sandboxes", "/v2/sandboxes", "/sandboxes/", "/v2/sandboxes/"})
REFUSALS = frozenset({429, 503})  # a cell said no at once: the create may go elsewhere
_LIST_PATHS = frozenset({"/sandboxes", "/v2/sandboxes", "/snapshots"})
CREATED_MAX = 64 << 10  # bytes of a create's answer read for the new sandbox's id
# Templates (imports, E2B's builds, their upload links, tags, aliases): one cell, the routable one with
# the lowest id, runs them all, so a build's status is where its build is; the cells share one template
# store (serve --template-store-dir on shared storage), so every cell starts sandboxes of the result.
_TEMPLATE_PATHS = ("/templates/", "/v2/templates", "/v3/templates", "/default-templates")
_TEMPLATE_FILES = "/template-files/"  # an upload link's PUT: its token is the credential, no key


def classify(scope: dict[str, Any], where: SandboxTarget | None) -> str:
    """The route a request takes (the `route` label of /metrics; `route` on its access line)."""
    if where is not None:
        return routing.plane_of(where.port)
    path, method = scope["path"], scope["method"]
    if path == "/health":
        return "health"
    if path == prometheus.PATH:
        return "metrics"
    if path == "/files" and method in ("GET", "POST"):
        return "signed_files"
    if path == "/v1/cells" and method == "GET":
        return "cells"
    if _CONTROL_ID_RE.match(path):
        return "sandbox"
    if path in _CREATE_PATHS and method == "POST":
        return "create"
    if method == "GET" and path in _LIST_PATHS:
        return "list"
    if method == "DELETE" and path.startswith("/templates/") and "/" not in path[len("/templates/"):]:
        ref = path[len("/templates/"):]
        if ref and ref not in TEMPLATES:  # a built-in's delete: any cell says no
            return "template_delete"
    if path.startswith(_TEMPLATE_FILES):
        return "template_files"
    if path == "/templates" or path.startswith(_TEMPLATE_PATHS):
        return "templates"
    if gateway_vault.is_vault_path(path):
        return "secrets"
    return "other"


def _replay(body: bytes) -> Any:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # like a client that stays: forward() reads the body once
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


class _Capture:
    """An ASGI send that holds a short answer back (a refusal may be retried elsewhere) and streams
    everything else through."""

    def __init__(self, send: Any) -> None:
        self._send = send
        self.status = 0
        self.held: list[dict[str, Any]] = []
        self.passing = False
        self.created = bytearray()  # a 201's body: the new sandbox's id for the access line

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.passing = self.status not in REFUSALS and self.status != 401
        elif self.status == 201 and len(self.created) < CREATED_MAX:
            self.created += message.get("body", b"")
        if self.passing:
            await self._send(message)
        else:
            self.held.append(message)

    async def release(self) -> None:
        for message in self.held:
            await self._send(message)
        self.held = []

    def created_id(self) -> str | None:
        try:
            sandbox_id = json.loads(self.created).get("sandboxID")
        except (ValueError, AttributeError):
            return None
        return sandbox_id if isinstance(sandbox_id, str) else None


class GatewayApp:
    def __init__(self, discovery: Discovery, api_key: str | None, cell_api_key: str | None,
                 poll_interval: float = 1.0, body_timeout: float = 30.0, max_body_memory: int = 64 << 20,
                 listen: banner.Listen | None = None, console: bool = True,
                 console_viewer_key: str | None = None) -> None:
        """`listen`: how it is exposed, for the startup banner (none without); `console`: serve the web
        console at /ui, across the cells (docs/console.md)."""
        self.discovery = discovery
        self.api_key = api_key
        self.cell_api_key = cell_api_key if cell_api_key is not None else api_key
        self.listen = listen
        self.cells = CellTable(self.cell_api_key, poll_interval, poll_timeout=max(0.2, min(1.0, poll_interval)))
        self.client: httpx.AsyncClient | None = None
        self.budget = BodyBudget(max_body_memory, wait_timeout=body_timeout)  # what creates hold (bodies.py)
        self.metrics = GatewayMetrics(version(), self.cells)
        self.cells.on_poll_failed = lambda: self.metrics.failed("cell_poll_failed")
        self._metrics_endpoint = prometheus.endpoint(self.metrics, api_key)  # as the server's: key or Bearer
        self.edge = AccessLog(BodyDeadline(self.route, body_timeout), self.metrics)
        self.console = console_mount.for_gateway(self, console_viewer_key) if console else None

    # --- lifespan --------------------------------------------------------------------------------

    async def startup(self) -> None:
        # no read deadline: a stream (a command's output, a download) lasts as long as it lasts
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=3.0), trust_env=False, http2=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=30))
        await self.discovery.start(self.cells.update)
        await self.cells.wait_first_polls(timeout=3.0)
        if self.listen is not None:
            banner.log_banner(self.listen, self.api_key, self.cell_api_key, self.cells)

    async def shutdown(self) -> None:
        await self.discovery.close()
        await self.cells.close()
        if self.client is not None:
            await self.client.aclose()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    try:
                        await self.startup()
                    except Exception as e:
                        log.exception("gateway startup failed")
                        await send({"type": "lifespan.startup.failed", "message": str(e)})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        await self.edge(scope, receive, send)

    # --- routing ---------------------------------------------------------------------------------

    def _key_ok(self, scope: dict[str, Any]) -> bool:
        if self.api_key is None:
            return True
        got = header(scope, b"x-api-key") or ""
        return hmac.compare_digest(got.encode("latin-1"), self.api_key.encode())

    def _cell_key(self, scope: dict[str, Any]) -> str | None:
        """The X-API-KEY a control-plane request takes to a cell, once its own key matched (_key_ok): the
        cell key, or with none the client's own (a gateway and cells without keys)."""
        return self.cell_api_key if self.cell_api_key is not None else header(scope, b"x-api-key")

    async def route(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            where = routing.target(scope)
        except routing.RoutingError as e:  # the cell would refuse it too: it never gets it
            note(route="invalid")
            await json_error(400, str(e))(scope, receive, send)
            return
        if where is None and self.console is not None and console_mount.mounted(scope["path"]):
            note(route="console")
            await self.console(scope, receive, send)  # its own sign-in; its calls come back through here
            return
        route = classify(scope, where)
        if where is None:
            route = volumes.classify(scope["path"], scope["method"]) or route
        note(route=route)
        if route == "volume_content":  # no key here, none sent on: the volume's token is for its cell
            await self._to_volume(volumes.volume_id(scope["path"]), scope, receive, send, None)
            return
        if where is not None:  # data plane: no key here, none sent on; the cell checks the sandbox's token
            await self._to_sandbox(where.sandbox_id, scope, receive, send, None, where)
            return
        if route == "health":  # a readiness probe: a gateway with no cell to route to is not ready
            ready = sum(1 for c in self.cells.by_url.values() if c.placeable)
            routable = len(self.cells.routable())
            await JSONResponse({"status": "ok" if routable else "no cells", "cells": routable, "ready": ready},
                               status_code=200 if routable else 503)(scope, receive, send)
            return
        if route == "metrics":  # its own key check, the server's: X-API-KEY or a Bearer token
            await self._metrics_endpoint(scope, receive, send)
            return
        if route == "signed_files":
            await self._signed_files(scope, receive, send)
            return
        if route == "template_files":  # no key here, none sent on: the cell checks the link's token
            await self._to_template_cell(scope, receive, send, None)
            return
        # the control plane: nothing goes to a cell, nor is answered, before the client's key matched
        if not self._key_ok(scope):
            await json_error(401, "invalid or missing X-API-KEY")(scope, receive, send)
            return
        path = scope["path"]
        if route == "cells":
            await JSONResponse([c.view() for c in self.cells.by_url.values()])(scope, receive, send)
        elif route == "sandbox" and (m := _CONTROL_ID_RE.match(path)):
            await self._to_sandbox(m.group(1), scope, receive, send, self._cell_key(scope))
        elif route == "create":
            await self._create(scope, receive, send)
        elif route == "volume":
            await self._to_volume(volumes.volume_id(path), scope, receive, send, self._cell_key(scope))
        elif route == "volumes_list":
            await self._list_volumes(scope, receive, send)
        elif route == "list":
            await self._list(scope, receive, send)
        elif route == "template_delete":
            await self._delete_snapshot(path[len("/templates/"):], scope, receive, send)
        elif route in ("templates", "secrets"):  # the vault lives on the template cell (gateway/vault.py)
            await self._to_template_cell(scope, receive, send, self._cell_key(scope))
        else:
            await self._anywhere(scope, receive, send)

    async def _to_template_cell(self, scope: dict[str, Any], receive: Any, send: Any, api_key: str | None) -> None:
        """Template requests: to the routable cell of the lowest id (the same one from every replica)."""
        cells = sorted(self.cells.routable(), key=lambda c: c.cell_id or "")
        if not cells:
            self.metrics.failed("no_cell")
            await json_error(503, "no cell is reachable; retry shortly")(scope, receive, send)
            return
        try:
            await self._forward(cells[0], scope, receive, send, api_key)
        except (CellUnreachable, CellFailed) as e:
            await json_error(502, f"cell {cells[0].cell_id} failed to answer ({e}); retry shortly")(scope, receive, send)
        except ClientLeft:
            pass

    async def _anywhere(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """A control-plane request no cell in particular must answer: one ready cell, else one up."""
        cell = self.cells.pick(set()) or next(iter(self.cells.routable()), None)
        if cell is None:
            self.metrics.failed("no_cell")
            await json_error(503, "no cell is reachable; retry shortly")(scope, receive, send)
            return
        try:
            await self._forward(cell, scope, receive, send, self._cell_key(scope))
        except (CellUnreachable, CellFailed) as e:
            await json_error(502, f"cell {cell.cell_id} failed to answer ({e}); retry shortly")(scope, receive, send)
        except ClientLeft:
            pass

    async def _forward(self, cell: CellState, scope: dict[str, Any], receive: Any, send: Any, api_key: str | None,
                       body: bytes | None = None, sandbox: SandboxTarget | None = None) -> int:
        """`api_key`: the cell key for an authenticated control-plane request, else None (forward.py).
        Timed to the cell's response head and noted on the access line; a cell whose port refuses is
        marked down; CellUnreachable, CellFailed and ClientLeft are counted, then propagate."""
        assert self.client is not None
        cell_id = cell.cell_id or "unknown"
        note(cell=cell_id)
        started = time.monotonic()

        async def timed(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.metrics.forwarded(cell_id, time.monotonic() - started)
            await send(message)

        try:
            if upgrade_requested(scope):
                await relay_upgrade(cell.url, scope, api_key, sandbox)
                return 101
            return await forward(self.client, cell.url, scope, receive, timed, api_key, body, sandbox)
        except CellUnreachable as e:
            self.metrics.failed("cell_unreachable")
            self.cells.mark_down(cell, f"connect failed: {e}")
            raise
        except CellFailed:
            self.metrics.failed("cell_failed")
            raise
        except ClientLeft:
            self.metrics.failed("client_left")
            raise

    async def _to_sandbox(self, sandbox_id: str, scope: dict[str, Any], receive: Any, send: Any,
                          api_key: str | None, sandbox: SandboxTarget | None = None) -> None:
        cell = self.cells.route(sandbox_id)
        lost = f"its cell {sandbox_id[:CELL_ID_LEN]} does not answer now (if the cell comes back, so may the sandbox)"
        if cell is None:
            known = self.cells.by_id.get(sandbox_id[:CELL_ID_LEN]) is not None
            self.metrics.failed("sandbox_cell_down" if known else "sandbox_cell_unknown")
            await sandbox_not_found(sandbox_id, lost if known else None)(scope, receive, send)
            return
        try:
            await self._forward(cell, scope, receive, send, api_key, sandbox=sandbox)
        except CellUnreachable:  # (marked down)
            await sandbox_not_found(sandbox_id, lost)(scope, receive, send)
        except CellFailed:  # the cell dropped the connection without an answer: it, or the sandbox, is gone
            await sandbox_not_found(sandbox_id)(scope, receive, send)
        except ClientLeft:  # its body stopped short (408 sent by the edge, or gone): the cell's request aborted
            pass

    async def _create(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            body, held = await read_held(scope, receive, self.budget)
        except HTTPError as e:
            await json_error(e.status, e.message)(scope, receive, send)
            return
        except ClientLeft:
            return
        try:
            await self._place(body, scope, receive, send)
        finally:
            await self.budget.release(held)

    async def _place(self, body: bytes, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (ref := snapshots.create_template(body)) is not None and await self._create_from_snapshot(ref, body, scope, send):
            return
        if (names := volumes.mounted_names(body)) and await self._create_with_volumes(names, body, scope, send):
            return  # on the volumes' cell (a vault reference there resolves only if it is the vault's cell too)
        if gateway_vault.refers_to_vault(body):
            await self._create_on_vault_cell(body, scope, receive, send)
            return
        # a built-in template, or one no cell holds a snapshot of: a template of the cells' shared store
        # (imported or built, docs/gateway.md), placed like any create; a cell answers 404 if none has it
        tried: set[str] = set()
        capture: _Capture | None = None
        while (cell := self.cells.pick(tried)) is not None:
            tried.add(cell.url)
            capture = _Capture(send)
            started = time.monotonic()
            try:
                status = await self._try_create(cell, scope, body, capture)
            except CellUnreachable:
                continue
            except CellFailed as e:
                await _failed_create(cell, e)(scope, receive, send)
                return
            if capture.passing:
                note(capture.created_id())
                return
            if status in REFUSALS:
                cell.refusals += 1
                self.metrics.failed("create_refused")
            log.warning("cell %s refused a create (%d, %.0f ms)%s", cell.cell_id, status,
                        (time.monotonic() - started) * 1000, "; trying another" if status in REFUSALS else "")
            if status not in REFUSALS:  # 401: the cell key is wrong; no other cell will differ
                break
        if capture is not None and capture.held:
            await capture.release()
            return
        self.metrics.failed("no_cell")
        await json_error(503, "no cell can take a new sandbox now (every cell is full, draining or down); "
                              "retry shortly")(scope, receive, send)

    async def _create_on_vault_cell(self, body: bytes, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """A create that refers to vault secrets: on the cell that holds the vault, and nowhere else."""
        cells = sorted(self.cells.routable(), key=lambda c: c.cell_id or "")
        if not cells:
            self.metrics.failed("no_cell")
            await json_error(503, "no cell is reachable; retry shortly")(scope, receive, send)
            return
        capture = _Capture(send)
        try:
            await self._try_create(cells[0], scope, body, capture)
        except CellUnreachable:
            await json_error(503, f"the cell that holds the secrets vault ({cells[0].cell_id}) is unreachable; "
                                  "retry shortly")(scope, receive, send)
            return
        except CellFailed as e:
            await _failed_create(cells[0], e)(scope, receive, send)
            return
        if capture.passing:
            note(capture.created_id())
        else:  # its refusal (a full cell, a missing secret) is the answer: no other cell has the vault
            await capture.release()

    async def _try_create(self, cell: CellState, scope: dict[str, Any], body: bytes, capture: _Capture) -> int:
        """One create on `cell` (its answer held in `capture` unless it passes); counted in the cell's
        load while it runs. CellUnreachable (the cell is marked down) and CellFailed propagate."""
        cell.inflight += 1
        try:
            status = await self._forward(cell, scope, _replay(body), capture, self._cell_key(scope), body)
        finally:
            cell.inflight -= 1
        cell.placed += 1
        return status

    async def _create_from_snapshot(self, ref: str, body: bytes, scope: dict[str, Any], send: Any) -> bool:
        """A create from a snapshot goes to the cell that holds it, and nowhere else (no other cell has
        its files); that cell's refusal is the answer, with the reason it was not placed elsewhere.
        False (nothing sent) when no cell answered that it holds a snapshot `ref`: it may be the name of
        a template of the cells' store."""
        assert self.client is not None
        try:
            cell = snapshots.owner_by_prefix(self.cells, ref)
            if cell is None:
                cell = await snapshots.find_holder(self.client, self.cells, ref, self.cells.headers())
            elif not cell.routable:
                raise snapshots.unreachable(ref, cell)
        except snapshots.SnapshotRouteError as e:
            if e.status == 404:
                return False
            await json_error(e.status, e.message)(scope, _replay(b""), send)
            return True
        capture = _Capture(send)
        try:
            status = await self._try_create(cell, scope, body, capture)
        except CellUnreachable:
            err = snapshots.unreachable(ref, cell)
            await json_error(err.status, err.message)(scope, _replay(b""), send)
            return True
        except CellFailed as e:
            await _failed_create(cell, e)(scope, _replay(b""), send)
            return True
        if capture.passing:
            note(capture.created_id())
            return True
        if status in REFUSALS:
            cell.refusals += 1
            self.metrics.failed("create_refused")
            said = b"".join(m.get("body", b"") for m in capture.held if m["type"] == "http.response.body")
            try:
                reason = str(json.loads(said).get("message", ""))
            except (ValueError, AttributeError):
                reason = said.decode(errors="replace")[:300]
            await json_error(status, f"snapshot '{ref}' lives on cell {cell.cell_id}, which cannot take a sandbox "
                                     f"now: {reason}; a snapshot is only on its own cell, so retry shortly, or "
                                     "delete sandboxes there")(scope, _replay(b""), send)
            return True
        await capture.release()
        return True

    async def _create_with_volumes(self, names: list[str], body: bytes, scope: dict[str, Any], send: Any) -> bool:
        """A create that mounts volumes goes to their cell (volumes.py); False (nothing sent) when no
        cell holds them: placed as any create, its cell answers 404."""
        assert self.client is not None
        try:
            cell = await volumes.cell_of_mounts(self.client, self.cells.by_id, self.cells.routable(), names,
                                                self.cells.headers())
        except volumes.VolumeRouteError as e:
            await json_error(e.status, e.message)(scope, _replay(b""), send)
            return True
        if cell is None:
            return False
        capture = _Capture(send)
        try:
            await self._try_create(cell, scope, body, capture)
        except (CellUnreachable, CellFailed) as e:
            await json_error(503, f"the volumes' cell {cell.cell_id} failed to answer ({e}); a volume is only on its "
                                  "own cell: retry shortly")(scope, _replay(b""), send)
            return True
        if capture.passing:
            note(capture.created_id())
        else:
            await capture.release()  # the cell's own refusal (full, draining ...): no other cell has the volumes
        return True

    async def _to_volume(self, volume_id: str, scope: dict[str, Any], receive: Any, send: Any,
                         api_key: str | None) -> None:
        """A volume's own calls: to the cell its id names (404 as for an unknown volume otherwise)."""
        cell = self.cells.route(volume_id)
        if cell is None:
            await json_error(404, f"volume '{volume_id}' not found (or its cell is unreachable now)")(scope, receive, send)
            return
        try:
            await self._forward(cell, scope, receive, send, api_key)
        except (CellUnreachable, CellFailed) as e:
            await json_error(502, f"cell {cell.cell_id} failed to answer ({e}); retry shortly")(scope, receive, send)
        except ClientLeft:
            pass

    async def _list_volumes(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert self.client is not None
        try:
            listed = await volumes.list_all(self.client, self.cells.routable(), self.cells.headers())
        except volumes.VolumeRouteError as e:
            await json_error(e.status, e.message)(scope, receive, send)
            return
        await JSONResponse([{k: v for k, v in item.items() if k != "_cell"} for item in listed])(scope, receive, send)

    async def _delete_snapshot(self, ref: str, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """DELETE /templates/{ref}: to the cell its template id names; a name to every cell."""
        assert self.client is not None
        cell = snapshots.owner_by_prefix(self.cells, ref)
        if cell is not None:
            if not cell.routable:
                err = snapshots.unreachable(ref, cell)
                await json_error(err.status, err.message)(scope, receive, send)
                return
            try:
                await self._forward(cell, scope, receive, send, self._cell_key(scope))
            except ClientLeft:
                pass
            except (CellUnreachable, CellFailed):  # (an unreachable one is marked down)
                err = snapshots.unreachable(ref, cell)
                await json_error(err.status, err.message)(scope, receive, send)
            return
        status = await snapshots.delete_everywhere(self.client, self.cells.routable(), ref, self.cells.headers())
        if status == 204:
            await Response(status_code=204)(scope, receive, send)
        else:
            await json_error(status, f"snapshot '{ref}' not found" if status == 404 else
                             f"snapshot '{ref}' could not be deleted")(scope, receive, send)

    def _snapshot_cells(self, query: str) -> list[CellState]:
        """The cells a snapshot listing asks: with `sandboxID`, only that sandbox's (its snapshots are there)."""
        sandbox_id = dict(parse_qsl(query)).get("sandboxID")
        if sandbox_id:
            cell = self.cells.by_id.get(sandbox_id[:CELL_ID_LEN])
            if cell is not None:
                return [cell] if cell.routable else []
        return self.cells.routable()

    async def _list(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert self.client is not None
        cells = self.cells.routable()
        query = scope.get("query_string", b"").decode("latin-1")
        headers = self.cells.headers()
        try:
            if scope["path"] == "/v2/sandboxes":
                page, token, running = await listing.list_v2(self.client, cells, query, headers)
                out = {"x-total-running": str(running)}
                if token:
                    out["x-next-token"] = token
                await JSONResponse(page, headers=out)(scope, receive, send)
            else:
                if scope["path"] == "/snapshots":
                    page, token = await snapshots.list_merged(self.client, self._snapshot_cells(query), query, headers)
                    await JSONResponse(page, headers={"x-next-token": token} if token else None)(scope, receive, send)
                    return
                items = await listing.list_v1(self.client, cells, query, headers)
                await JSONResponse(items)(scope, receive, send)
        except listing.ListError as e:
            await json_error(e.status, e.message)(scope, receive, send)

    async def _signed_files(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """An SDK's download_url()/upload_url() under E2B_SANDBOX_URL names no sandbox: the cells are
        asked whose sandbox signed it (signed.py), then the request, its body not yet read, streams to
        that one cell, with no key: that cell checks the signature as a lone server does."""
        assert self.client is not None
        found = await signed.find_signer(self.client, self.cells.routable(), scope, self.cells.headers())
        if isinstance(found, signed.Refusal):
            await json_error(found.status, found.message)(scope, receive, send)
            return
        cell, sandbox_id = found
        note(sandbox_id)  # its access line, and what is logged for it, name the signer
        try:
            await self._forward(cell, scope, receive, send, None)
        except (CellUnreachable, CellFailed):  # (an unreachable one is marked down)
            await json_error(502, "The sandbox was not found")(scope, receive, send)
        except ClientLeft:
            pass


def _failed_create(cell: CellState, e: CellFailed) -> Response:
    return json_error(502, f"cell {cell.cell_id} failed while creating the sandbox ({e}); it may or may not "
                           "exist: list sandboxes, or create again")


def serve(app: GatewayApp, host: str, port: int, log_level: str = "info", header_timeout: float = 10.0,
          max_connections: int = 4096, tls: tuple[str | None, str | None] = (None, None),
          log_format: str = "text") -> None:
    """Run the gateway in the foreground (uvicorn, with the server's guarded HTTP protocol: header
    deadlines, connection cap, and upgrades handed over as raw connections)."""
    import uvicorn

    from agentcell import allocator, logs
    from agentcell.server.http_protocol import KEEP_ALIVE, guarded_protocol

    logs.configure(log_level, log_format)  # stderr as a SafeStream: its lines and ours quote clients
    allocator.pin_thresholds()  # freed buffers go back to the kernel (allocator.py)
    uv = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", ws="none",
                        log_config=None, ssl_certfile=tls[0], ssl_keyfile=tls[1],
                        access_log=False,  # server/access_log.py's lines, with the sandbox id
                        http=guarded_protocol(header_timeout, max_connections), server_header=False,
                        timeout_keep_alive=int(KEEP_ALIVE), timeout_graceful_shutdown=5)
    uvicorn.Server(uv).run()
