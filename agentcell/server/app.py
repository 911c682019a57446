"""The root ASGI app: the control plane and every sandbox's data plane on one port.

A request with an `E2b-Sandbox-Id` header, or a Host of the form `{port}-{sandboxid}.{anything}`, goes
to that sandbox's data plane for the port (49983 envd, 49999 code interpreter, any other port: a
server inside the sandbox, through ports.py); anything else is the control plane. This mirrors E2B's
own proxy, so `E2B_SANDBOX_URL` pointing here just works.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import IO, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentcell import allocator, logs
from agentcell.backends import get_backend
from agentcell.backends.base import Backend, set_sandbox_id_prefix
from agentcell.console import mount as console_mount
from agentcell.mcp.mounted import PATH as MCP_PATH
from agentcell.mcp.mounted import MountedMcp
from agentcell.network.service import EgressSettings
from agentcell.record import quiet
from agentcell.record.store import ROW_BYTES, EventStore
from agentcell.record.store import Limits as EventLimits
from agentcell.server import (
    api_events,
    auth,
    banner,
    cell,
    files,
    ingress,
    interpreter,
    ports,
    prometheus,
    routing,
    state_lock,
)
from agentcell.server.access_log import AccessLog, note
from agentcell.server.asgi import declared_length, has_body, header, is_connect_rpc
from agentcell.server.auth import ENVD_PORT, INTERPRETER_PORT
from agentcell.server.bodies import BUDGET_KEY, BodyBudget, json_content_type_refusal
from agentcell.server.build_sandboxes import ManagerBuildSandboxes
from agentcell.server.config import ServerConfig, backend_names
from agentcell.server.config import check as check_config
from agentcell.server.control import ControlPlane
from agentcell.server.edge import EdgeGuard
from agentcell.server.envd import READ_MAX_BYTES, filesystem_app, process_app
from agentcell.server.errors import HTTPError, internal_error, json_error, sandbox_not_found
from agentcell.server.hosts import HostPolicy, check_exposure
from agentcell.server.http_protocol import DROP_EXTENSION
from agentcell.server.observer import ObservedRecorder, Observer
from agentcell.server.registry import Admission, Retention, SandboxManager, SandboxRecord
from agentcell.server.sandbox_state import SandboxState
from agentcell.server.snapshots import SnapshotStore
from agentcell.server.streams import current_drop, current_sandbox
from agentcell.server.template_builds import TemplateBuilds
from agentcell.server.template_imports import TemplateImports
from agentcell.server.tenancy import Tenancy
from agentcell.templates import uploads as template_uploads
from agentcell.volumes import wiring as volume_wiring

log = logging.getLogger("agentcell.server")

_SANDBOX_ID_RE = re.compile(r"^[a-z0-9]{1,64}$")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPError)
    return json_error(exc.status, exc.message)


async def _starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code in (204, 304):
        return Response(status_code=exc.status_code)
    message = exc.detail if exc.status_code != 404 else f"no route for {request.method} {request.url.path}"
    return json_error(exc.status_code, str(message))


async def _internal_error(request: Request, exc: Exception) -> Response:
    err = internal_error(f"{request.method} {request.url.path}", exc)
    return json_error(err.status, err.message)


async def _client_gone(request: Request, exc: Exception) -> Response:
    # The client left mid-body (or edge.py answered 408 for it): nobody reads this response.
    return Response(status_code=400)


_HANDLERS: dict[Any, Any] = {
    HTTPError: _http_error,
    StarletteHTTPException: _starlette_error,
    ClientDisconnect: _client_gone,
    Exception: _internal_error,
}


def _route_target(scope: dict[str, Any]) -> tuple[str, int] | None:
    """(sandbox id, port) if this request is for a sandbox's data plane (routing.py, the parser the
    gateway uses too); RoutingError when its routing is malformed or ambiguous."""
    where = routing.target(scope)
    return (where.sandbox_id, where.port) if where is not None else None


class AgentcellApp:
    """The root ASGI app: lifespan, the edge checks (edge.py), then the router below."""

    def __init__(self, config: ServerConfig, backend: Backend | None = None) -> None:
        check_config(config)
        self.config = config
        set_sandbox_id_prefix(config.cell_id or "")  # before any standby is prepared (server/cell.py)
        self.backend = backend or _build_backend(config.backend, config)
        # the other backends templates or creates may use (--template-backend, --create-backends)
        self.others = {name: _build_backend(name, config) for name in backend_names(config)[1:]
                       if name != self.backend.name}
        state_dir = Path(config.state_dir)
        # the behaviour record (issue 10); --no-record: none kept, no collectors (the overhead's baseline)
        self.events = EventStore(state_dir / "events.db", EventLimits(
            per_sandbox=config.events_per_sandbox, rate=config.events_rate, burst=int(config.events_rate * 10),
            max_rows=(config.events_max_mb << 20) // ROW_BYTES, retention_s=config.events_retention),
            audit_log=_audit_log(config.audit_log)) if config.record else None
        self.metrics = prometheus.ServerMetrics(banner.version())  # GET /metrics
        observer = Observer(self.metrics)  # lifecycle, limit and refusal log lines and counters
        for b in (self.backend, *self.others.values()):
            if self.events is not None:
                b.attach_recorder(ObservedRecorder(self.events, observer), frozenset(config.record_collectors))
        self.manager = SandboxManager(self.backend, config.max_sandboxes,
                                      Admission(config.memory_overcommit, config.pids_overcommit),
                                      Retention(config.paused_ttl, config.max_paused, config.hibernate_after), state_dir,
                                      self.others, self.events)
        self.manager.observer = observer
        self.metrics.watch(self.manager, lambda: (self.backend, *self.others.values()), self.events,
                           config.max_sandboxes)
        self._metrics_endpoint = prometheus.endpoint(self.metrics, config.api_key,
                                                     lambda scope: self.tenancy.data_plane_caller(scope))
        self.cell = cell.Cell(config.cell_id, self.manager, config.max_sandboxes, cell.drain_grace(config))
        self.snapshots = SnapshotStore(state_dir / "snapshots", config.snapshot_quota_mb << 20, config.max_snapshots)
        # the template import route first: /templates/{id} routes of ControlPlane would take its path
        imports = TemplateImports(config)
        control_plane = ControlPlane(config, self.manager, self.snapshots)
        # E2B's template builds: RUN steps in sandboxes of the layers so far (linux backend: export_layer)
        steps = ManagerBuildSandboxes(self.manager) if hasattr(self.backend, "export_layer") else None
        self.template_builds = TemplateBuilds(config, imports, control_plane, steps)
        control_plane.built_templates = self.template_builds  # Sandbox.create("alias:tag") of a built template
        self.volumes = volume_wiring.store(config, self.manager)  # E2B's volumes: agentcell/volumes/
        control_plane.volumes = self.volumes
        self.volume_api = volume_wiring.api(config, self.volumes)
        self.control = Starlette(routes=[*imports.routes(), *self.template_builds.routes(), *self.volume_api.routes(),
                                         *control_plane.routes()],
                                 exception_handlers=_HANDLERS)
        self.envd_http = Starlette(
            routes=[
                Route("/health", files.health, methods=["GET"]),
                Route("/files", files.download, methods=["GET"]),
                Route("/files", files.upload_handler(config.max_upload_mb << 20, files.UploadSlots(
                    config.max_uploads, config.max_uploads_per_sandbox)), methods=["POST"]),
            ],
            exception_handlers=_HANDLERS,
        )
        self.process = process_app()
        self.filesystem = filesystem_app()
        self.interpreter = Starlette(routes=interpreter.routes(), exception_handlers=_HANDLERS)
        budget = BodyBudget(config.max_body_memory_mb << 20, wait_timeout=config.body_timeout)
        self.edge = AccessLog(EdgeGuard(self._route, HostPolicy.from_config(config), config.body_timeout, budget),
                              self.metrics)
        self.state_lock: state_lock.StateDirLock | None = None  # held from startup to shutdown
        self.tenancy = Tenancy.from_config(config)  # --system: a unix-socket peer reaches only its own sandboxes
        # /mcp: agentcell's MCP server (agentcell/mcp/mounted.py); --no-mcp: none
        self.mcp = MountedMcp(config, lambda scope: self.tenancy.peer_credential(scope) is not None) \
            if config.mcp else None
        self.console = console_mount.for_server(self) if config.console else None  # /ui: docs/console.md

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    # one server per --state-dir: a second one refuses, naming the first
                    self.state_lock = state_lock.acquire(self.config.state_dir, _listen(self.config))
                    if self.events is not None:
                        await self.events.start()
                    for b in (self.backend, *self.others.values()):
                        await b.start()
                    self.snapshots.load()
                    await self.volumes.start()  # before the kept paused sandboxes that mount them
                    await self.manager.start()
                except state_lock.StateDirError as e:
                    log.error("%s", e)
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                except Exception as e:
                    log.exception("startup failed")
                    if self.state_lock is not None:
                        self.state_lock.release()
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                banner.log_banner(self.config)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    if self.mcp is not None:  # its sessions first: they kill their sandboxes through this server
                        await self.mcp.stop()
                    await self.manager.close()
                    for b in (self.backend, *self.others.values()):
                        await b.close()
                    await self.volumes.close()
                    if self.events is not None:
                        await self.events.close()
                except Exception:
                    log.exception("shutdown failed")
                if self.state_lock is not None:  # last: everything of this server in the directory is done
                    self.state_lock.release()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # uvicorn runs with ws="none": upgrades come as http scopes (http_protocol.py)
        request = quiet.begin()  # the record's background work waits until requests are served (record/quiet.py)

        async def send_touched(message: Any) -> None:
            quiet.touch()
            await send(message)

        try:
            await self.edge(scope, receive, send_touched)
        finally:
            quiet.end(request)

    async def _route(self, scope: Any, receive: Any, send: Any) -> None:
        """Credentials and content type are checked here, once, before any handler reads the body."""
        try:
            target = _route_target(scope)
        except routing.RoutingError as e:
            await json_error(400, str(e))(scope, receive, send)
            return
        if target is None and self.console is not None and console_mount.mounted(scope["path"]):
            await self.console(scope, receive, send)  # its own sign-in; its calls come back through here
            return
        if target is None and scope["path"] == "/files" and scope["method"] in ("GET", "POST"):
            await self._signed_files(scope, receive, send)
            return
        if target is None and scope["path"].startswith(volume_wiring.CONTENT_PREFIX):  # the volume's token
            await self.volume_api.content(scope, receive, send)
            return
        if target is None and scope["path"].startswith(template_uploads.PATH_PREFIX):  # its token is its key
            await self.template_builds.upload(scope, receive, send)
            return
        if target is None and scope["path"] == prometheus.PATH:  # the API key, also as a Bearer token
            await self._metrics_endpoint(scope, receive, send)
            return
        if target is None and scope["path"] == MCP_PATH and self.mcp is not None:  # checks the API key itself,
            await self.mcp(scope, receive, send)  # also as a Bearer token (what MCP clients' configs send)
            return
        if target is None:
            try:
                scope[auth.CREDENTIAL] = auth.HEALTH if scope["path"] == "/health" \
                    else self.tenancy.peer_credential(scope) or auth.control_credential(scope, self.config.api_key)
            except auth.Refused as e:
                await json_error(401, e.message)(scope, receive, send)
                return
            if await self.cell.answer(scope, receive, send):  # /v1/cell; /health and creates while draining
                return
            if refusal := json_content_type_refusal(scope):
                await json_error(415, refusal)(scope, receive, send)
                return
            acted = api_events.control_action(scope["method"], scope["path"])
            if acted is not None and self.events is not None:  # a call that acts on one sandbox goes into its record
                await api_events.recorded(self.events.add, *acted, self.control, scope, receive, send)
            else:
                await self.control(scope, receive, send)
            return
        sandbox_id, port = target
        rec = self.manager.find(sandbox_id) if _SANDBOX_ID_RE.match(sandbox_id) else None
        if rec is not None and not self.tenancy.sees(self.tenancy.data_plane_caller(scope), rec.owner):
            rec = None  # another user's sandbox: as if it did not exist
        # E2B: a paused sandbox (or one on its way to or from a pause) is "not found"
        if rec is None or (rec.state is not SandboxState.RUNNING and not rec.lifecycle.auto_resume):
            await sandbox_not_found(sandbox_id)(scope, receive, send)
            return
        if port not in (ENVD_PORT, INTERPRETER_PORT):
            await self._user_port(rec, port, scope, receive, send)
            return
        try:
            scope[auth.CREDENTIAL] = auth.data_plane_credential(scope, rec.access_token, port)
        except auth.BadExpiration as e:
            await json_error(400, str(e))(scope, receive, send)
            return
        except auth.Refused as e:
            if is_connect_rpc(scope["path"]) and port == ENVD_PORT:
                body = {"code": "unauthenticated", "message": e.message}
                await JSONResponse(body, status_code=401)(scope, receive, send)
            else:
                await json_error(401, e.message)(scope, receive, send)
            return
        if port == INTERPRETER_PORT and (refusal := json_content_type_refusal(scope)):
            await json_error(415, refusal)(scope, receive, send)
            return
        if (rec := await self._awake(rec)) is None:
            await sandbox_not_found(sandbox_id)(scope, receive, send)
            return
        token = current_sandbox.set(rec)
        drop_token = current_drop.set(scope.get("extensions", {}).get(DROP_EXTENSION))
        if port == ENVD_PORT:
            app = self._connect_rpc if is_connect_rpc(scope["path"]) else self.envd_http
        else:
            app = self.interpreter
        try:
            action = api_events.data_plane_action(scope["method"], scope["path"], port == INTERPRETER_PORT)
            if action is not None and self.events is not None:
                await api_events.recorded(self.events.add, rec.sandbox_id, action, app, scope, receive, send)
            else:
                await app(scope, receive, send)
        finally:
            current_drop.reset(drop_token)
            current_sandbox.reset(token)

    async def _signed_files(self, scope: Any, receive: Any, send: Any) -> None:
        """`/files` with no sandbox named: an SDK's download_url()/upload_url() under E2B_SANDBOX_URL.
        The v1 signature names the sandbox (auth.signed_sandbox); envd's 401s otherwise."""
        try:
            sandbox_id, scope[auth.CREDENTIAL] = auth.signed_url_credential(
                scope, ((r.sandbox_id, r.access_token) for r in self.manager.list()
                        if self.tenancy.sees(self.tenancy.data_plane_caller(scope), r.owner)))
        except auth.BadExpiration as e:
            await json_error(400, str(e))(scope, receive, send)
            return
        except auth.Refused as e:
            await json_error(401, e.message)(scope, receive, send)
            return
        rec = self.manager.get(sandbox_id)
        if rec is None:  # gone since
            await json_error(401, auth.INVALID_SIGNATURE)(scope, receive, send)
            return
        note(sandbox_id)  # the access line names the signer
        token = current_sandbox.set(rec)
        try:
            action = api_events.data_plane_action(scope["method"], "/files", False)
            if action is not None and self.events is not None:
                await api_events.recorded(self.events.add, rec.sandbox_id, action, self.envd_http, scope, receive, send)
            else:
                await self.envd_http(scope, receive, send)
        finally:
            current_sandbox.reset(token)

    async def _awake(self, rec: SandboxRecord) -> SandboxRecord | None:
        """A request that passed its checks resumes a paused sandbox whose lifecycle says so
        (E2B's auto_resume); only then, so that no stranger can wake a sandbox."""
        return await self.manager.resume_on_traffic(rec) if rec.state is not SandboxState.RUNNING else rec

    async def _user_port(self, rec: SandboxRecord, port: int, scope: Any, receive: Any, send: Any) -> None:
        """A port served out of the sandbox: public unless the sandbox was created with
        allowPublicTraffic false, then E2B's traffic token is needed (auth.py)."""
        try:
            scope[auth.CREDENTIAL] = auth.user_port_credential(scope, rec.access_token, rec.public_traffic)
        except auth.Refused:  # E2B's 403, its body naming the header
            given = header(scope, b"e2b-traffic-access-token") is not None
            await ingress.traffic_token_refused(rec.sandbox_id, given)(scope, receive, send)
            return
        sandbox_id = rec.sandbox_id
        if (rec := await self._awake(rec)) is None:  # type: ignore[assignment]
            await sandbox_not_found(sandbox_id)(scope, receive, send)
            return
        if not 0 < port < 65536:
            await ports.port_not_open(rec.sandbox_id, port)(scope, receive, send)
            return
        await ports.serve_port(rec, port, scope, receive, send)

    async def _connect_rpc(self, scope: Any, receive: Any, send: Any) -> None:
        """envd's Connect services. connectrpc reads a whole message into memory (up to 16 MiB), so
        its body is under the same server-wide budget as JSON bodies (bodies.py)."""
        app = self.process if scope["path"].startswith("/process.") else self.filesystem
        budget: BodyBudget | None = scope.get(BUDGET_KEY)
        if budget is None or not has_body(scope):
            await app(scope, receive, send)
            return
        declared = declared_length(scope)
        try:
            taken = await budget.acquire(declared if declared is not None else READ_MAX_BYTES)
        except HTTPError as e:  # the budget stayed spent for too long
            await JSONResponse({"code": "unavailable", "message": e.message}, status_code=e.status)(scope, receive, send)
            return
        held = [taken]

        async def receive_then_release() -> Any:
            # The message is parsed once its body is in: a stream that runs for hours holds no budget.
            message = await receive()
            if held and not (message.get("type") == "http.request" and message.get("more_body")):
                await budget.release(held.pop())
            return message

        try:
            await app(scope, receive_then_release, send)
        finally:
            if held:
                await budget.release(held.pop())


def _listen(config: ServerConfig) -> str:
    return f"unix socket {config.uds}" if config.uds else f"{config.host}:{config.port}"


def _audit_log(target: str | None) -> IO[str] | None:
    """`serve --audit-log`: "-" is stdout; a path is appended to (0600, the operator's SIEM reads it)."""
    if target is None:
        return None
    if target == "-":
        return sys.stdout
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "a", buffering=1 << 16)


def _build_backend(name: str, config: ServerConfig) -> Backend:
    # every backend takes the linux one's options; linux and microvm have an egress (gvisor: no network yet)
    egress = EgressSettings(config.egress_uplink, config.egress_dns, config.egress_ca_bundle,
                            config.egress_allow_ranges, state_dir=config.state_dir,
                            plain_http_hosts=config.egress_plain_http_hosts,
                            proxy_ranges=config.egress_proxy_ranges) if name in ("linux", "microvm") else None
    extra: dict[str, Any] = {"accel": config.accel} if name == "microvm" else {}
    return get_backend(name, **extra, uid_base=config.uid_base, max_sandboxes=config.max_sandboxes,
                       tune_sysctls=config.tune_sysctls, ptys_per_sandbox=config.ptys_per_sandbox,
                       standbys=config.standbys, standby_limits=config.limits, egress=egress,
                       record_denials=config.record_denials,
                       memory_reserve_bytes=config.memory_reserve_mb << 20
                       if config.memory_reserve_mb is not None else None)


def create_app(config: ServerConfig, backend: Backend | None = None) -> AgentcellApp:
    """The ASGI app for `config` (pass `backend` to use an already-built one)."""
    return AgentcellApp(config, backend)


def serve(config: ServerConfig) -> None:
    """Run the server in the foreground with uvicorn until interrupted."""
    import resource

    import uvicorn

    from agentcell.server.http_protocol import KEEP_ALIVE, guarded_protocol

    check_exposure(config)  # before anything binds
    allocator.pin_thresholds()  # before threads start and buffers grow: freed memory goes back
    logs.configure(config.log_level, config.log_format)  # stderr as a SafeStream: log lines quote clients
    # Each sandbox holds a socket and a pidfd in the server: a 1024-fd soft limit would cap density.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    app = create_app(config)
    uv = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        uds=config.uds,
        log_level=config.log_level,
        log_config=None,  # logs.configure's handler, for uvicorn's loggers too
        access_log=False,  # server/access_log.py's lines have the sandbox's id
        ssl_certfile=config.tls_cert,
        ssl_keyfile=config.tls_key,
        lifespan="on",
        timeout_graceful_shutdown=5,
        http=guarded_protocol(config.header_timeout, config.max_connections),
        ws="none",  # an installed websockets/wsproto must not take upgrades from http_protocol.py
        server_header=False,  # a proxied response keeps its own Server header (ports.py); no banner otherwise
        timeout_keep_alive=int(KEEP_ALIVE),
    )
    socks = None
    if config.system:  # the shared unix socket (systemd's, or bound here), TCP only with a key
        from agentcell.server import system_listen

        socks = system_listen.sockets(config)
        print(f"agentcell: system service on {system_listen.describe(socks)}; each sandbox belongs to the uid "
              f"that created it (--max-sandboxes-per-user {config.max_sandboxes_per_user})", file=sys.stderr, flush=True)
    cell.DrainingServer(uv, app.cell).run(sockets=socks)  # SIGTERM drains first (server/cell.py)
