"""E2B's template build API (what `e2b.Template.build` and the JS SDK's call), served by agentcell.

    POST   /v3/templates                              {name, tags?, cpuCount?, memoryMB?} -> 202
                                                  {templateID, buildID, public, names, aliases, tags}
    GET    /templates/{id}/files/{hash}               -> 201 {present, url}: the SDK PUTs a tar.gz to url
    PUT    /template-files/{token}                    the upload (no API key: the token is the credential)
    POST   /v2/templates/{id}/builds/{build}          the spec (build_spec.py) -> 202; the build runs
    GET    /templates/{id}/builds/{build}/status      ?logsOffset&limit&level -> {status, logEntries, reason}
    GET    /templates/{id}/builds/{build}/logs        ?cursor&limit&direction&level -> {logs}
    GET    /templates/aliases/{alias}                 Template.exists (built-in templates too)
    POST   /templates/tags  DELETE /templates/tags    assign_tags / remove_tags
    GET    /templates/{id}/tags                       get_tags
    GET    /templates  GET /templates/{id}  DELETE /templates/{id}

Status codes are the ones the SDK's generated client lists for each path. The work is in
agentcell/templates/ (builds.py: records and slots; uploads.py: files; executor.py: the build). A
caller sees its own templates only (server/tenancy.py), as with snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import os
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentcell.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError, SandboxError
from agentcell.server.config import ServerConfig
from agentcell.server.errors import HTTPError
from agentcell.server.tenancy import Tenancy
from agentcell.templates import uploads as uploads_mod
from agentcell.templates.build_spec import BUILTIN_TEMPLATES, SpecError, parse_spec
from agentcell.templates.builds import (
    LEVELS,
    BuildRegistry,
    BuildsBusyError,
    ConflictError,
    TemplateRecord,
    now_iso,
)

DEFAULT_CPU, DEFAULT_MEMORY_MB = 2, 1024
MAX_LOG_PAGE = 100


class TemplateBuilds:
    def __init__(self, config: ServerConfig, imports: Any, control: Any = None, sandboxes: Any = None) -> None:
        self.config = config
        self.imports = imports  # server/template_imports.py: its importer (policy, limits, slots) and store
        self.control = control  # ControlPlane: built-in templates and snapshots answer what is not a build's
        self.sandboxes = sandboxes  # executor.BuildSandboxes of the backend, once it has them
        self.tenancy = Tenancy.from_config(config)
        # beside a shared template store (cells: serve --template-store-dir), shared too: every cell
        # resolves a built template's name, the one the gateway sends template requests to builds
        shared = config.template_store_dir is not None
        root = os.path.join(config.template_store_dir, "e2b-builds") if shared else \
            os.path.join(config.state_dir, "template-builds")
        self.registry = BuildRegistry(root, concurrent=config.max_concurrent_builds, timeout_s=config.build_timeout_s,
                                      cell=config.cell_id or "", shared=shared)
        self.uploads = uploads_mod.UploadStore(os.path.join(root, "files"), config.max_image_mb << 20)
        self._started: set[str] = set()  # builds whose spec came (a second POST is refused)

    # helpers ---------------------------------------------------------------------------------------

    def _caller(self, request: Request) -> str | None:
        return self.tenancy.caller(request.scope)

    def _template(self, request: Request, ref: str | None = None) -> TemplateRecord:
        ref = ref if ref is not None else request.path_params["template_id"]
        t = self.registry.find(ref, self._caller(request))
        if t is None:
            raise HTTPError(404, f"template '{ref}' not found")
        return t

    def _executor(self, build: Any) -> Any:
        from agentcell.templates.executor import BuildLimits, Executor

        importer = self.imports.importer()  # 501 on a rootless server (the store shifts owners)
        cfg = self.config
        return Executor(importer.store, self.sandboxes, BuildLimits(
            max_image_bytes=cfg.max_image_mb << 20, timeout_s=cfg.build_timeout_s,
            internet=cfg.internet_by_default, cpu_count=build.cpu_count, memory_mb=build.memory_mb))

    # routes ----------------------------------------------------------------------------------------

    async def request_build(self, request: Request) -> Response:
        from agentcell.server.control import json_body

        body = await json_body(request)
        name = body.get("name", body.get("alias"))
        if not isinstance(name, str) or not name:
            raise HTTPError(400, "the body needs 'name' (\"alias\" or \"alias:tag\")")
        tags = body.get("tags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise HTTPError(400, "'tags' must be a list of strings")
        cpu, memory = body.get("cpuCount", DEFAULT_CPU), body.get("memoryMB", DEFAULT_MEMORY_MB)
        limits = self.config.max_limits
        most_cpus = max(1, math.ceil(limits.cpu_count))
        if not isinstance(cpu, int) or isinstance(cpu, bool) or not 1 <= cpu <= most_cpus:
            raise HTTPError(400, f"'cpuCount' must be a whole number of CPUs between 1 and {most_cpus} (this server's "
                                 "maximum)")
        if not isinstance(memory, int) or isinstance(memory, bool) or not 128 <= memory <= limits.memory_mb:
            raise HTTPError(400, f"'memoryMB' must be between 128 and {limits.memory_mb} (this server's maximum)")
        self.imports.importer()
        try:
            t, b = self.registry.request(name, tags, self._caller(request), cpu, memory, set(BUILTIN_TEMPLATES))
        except ConflictError as e:
            raise HTTPError(409, e.message) from None
        except InvalidArgumentError as e:
            raise HTTPError(400, e.message) from None
        return JSONResponse({"templateID": t.template_id, "buildID": b.build_id, "public": False,
                             "names": list(t.names), "aliases": list(t.names), "tags": list(b.tags)}, status_code=202)

    async def upload_link(self, request: Request) -> Response:
        t = self._template(request)
        files_hash = request.path_params["hash"].lower()
        try:
            present = self.uploads.present(t.template_id, files_hash)
            token = self.uploads.grant(t.template_id, files_hash)
        except InvalidArgumentError as e:
            raise HTTPError(400, e.message) from None
        except ResourceExhaustedError as e:
            raise HTTPError(429, e.message) from None
        url = str(request.base_url).rstrip("/") + uploads_mod.PATH_PREFIX + token
        return JSONResponse({"present": present, "url": url}, status_code=201)

    async def upload(self, scope: Any, receive: Any, send: Any) -> None:
        """PUT /template-files/{token}: the ASGI app the root app hands these paths to (no API key)."""
        request = Request(scope, receive)
        try:
            response = await self._upload(request)
        except HTTPError as e:
            response = JSONResponse({"code": e.status, "message": e.message}, status_code=e.status)
        await response(scope, receive, send)

    async def _upload(self, request: Request) -> Response:
        if request.method != "PUT":
            raise HTTPError(405, "upload links take PUT")
        token = request.url.path[len(uploads_mod.PATH_PREFIX):]
        try:
            grant = self.uploads.claim(token)
        except NotFoundError as e:
            raise HTTPError(403, e.message) from None
        limit = self.uploads.max_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise HTTPError(413, f"an upload may take at most {limit} bytes on this server (serve --max-image-mb)")
        part = self.uploads.begin(grant)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        done = False
        try:
            got = 0
            with os.fdopen(fd, "wb") as f:
                async for chunk in request.stream():
                    got += len(chunk)
                    if got > limit:
                        raise HTTPError(413, f"an upload may take at most {limit} bytes on this server "
                                             "(serve --max-image-mb)")
                    await asyncio.to_thread(f.write, chunk)
            self.uploads.finish(grant, part)
            self.uploads.spent(token)
            done = True
        except ClientDisconnect:
            raise HTTPError(400, "the upload was cut short") from None
        finally:
            if not done:
                with contextlib.suppress(OSError, SandboxError):
                    os.unlink(part)
        return Response(status_code=200)

    def _build_of(self, t: Any, request: Request) -> Any:
        """The build the path names, of template `t`; 404 when it has none of that id."""
        try:
            return self.registry.build_of(t, request.path_params["build_id"])
        except NotFoundError as e:
            raise HTTPError(404, e.message) from None

    async def start_build(self, request: Request) -> Response:
        from agentcell.server.control import json_body

        t = self._template(request)
        b = self._build_of(t, request)
        if b.status != "waiting" or b.build_id in self._started:
            raise HTTPError(400, f"build {b.build_id} was started already (it is {b.status}): request a new build")
        body = await json_body(request, limit=8 << 20)
        try:
            spec = parse_spec(body)
        except SpecError as e:
            raise HTTPError(400, e.message) from None
        base_image = self.config.e2b_base_image
        if spec.builtin == "base" and base_image and base_image != "builtin":  # the image E2B's base is here
            spec = dataclasses.replace(spec, builtin=None, from_image=base_image)
        executor = self._executor(b)
        caller = self._caller(request)
        self._started.add(b.build_id)

        async def work(build: Any) -> None:
            await self._build(executor, spec, build, t, caller)

        try:
            self.registry.start(b, work)
        except BuildsBusyError as e:
            self._started.discard(b.build_id)
            raise HTTPError(429, e.message) from None
        return Response(status_code=202)

    async def _build(self, executor: Any, spec: Any, b: Any, t: TemplateRecord, caller: str | None) -> None:
        from agentcell.templates.executor import BuildContext, BuildStepError

        reg = self.registry

        def log(level: str, message: str, step: str | None = None) -> None:
            reg.log(b, level, message, step)

        ctx = BuildContext(
            store_name=b.store_name, build_id=b.build_id,
            files=lambda h: self.uploads.path(t.template_id, h),
            resolve_template=lambda ref: self._base_template(ref, caller, executor.store),
            import_image=lambda ref, creds, fresh: self._base_image(ref, creds, fresh, caller),
            extra={"template_id": t.template_id, "names": list(t.names), "owner": caller,
                   "cpu_count": b.cpu_count, "memory_mb": b.memory_mb})
        log("info", f"Building template {t.template_id}/{b.build_id}")
        try:
            await executor.run_build(spec, ctx, log)
        except BuildStepError as e:
            reg.fail(b, e.message, e.step)
            return
        except SpecError as e:
            reg.fail(b, e.message, e.step)
            return
        except SandboxError as e:
            reg.fail(b, e.message, None)
            return
        except HTTPError as e:
            reg.fail(b, e.message, None)
            return
        except Exception as e:  # noqa: BLE001 - any failure is the build's error, for the caller to read
            reg.fail(b, f"the build failed: {type(e).__name__}: {e}", None)
            return
        log("info", "Build finished")
        reg.succeed(b)

    def _base_template(self, ref: str, caller: str | None, store: Any) -> dict[str, Any]:
        """fromTemplate: the caller's built template (alias[:tag] or id), else an imported one."""
        try:
            _, b = self.registry.tagged_build(ref, caller)
        except NotFoundError:
            b = None
        if b is not None:
            if b.status != "ready":
                raise NotFoundError(f"template '{ref}' has no finished build")
            record: dict[str, Any] = store.template(b.store_name)
            return record
        imported: dict[str, Any] = store.template(ref)  # NotFoundError if none
        if imported.get("source") == "e2b-build":  # another caller's build: not this one's to see
            raise NotFoundError(f"template '{ref}' not found")
        return imported

    def _base_image(self, ref: str, creds: Any, fresh: bool, caller: str | None) -> dict[str, Any]:
        """fromImage: imported once per (caller, reference, registry user) and reused by later builds
        unless the build is forced (skip_cache on the base)."""
        importer = self.imports.importer()
        ref = mirrored(ref, dict(self.config.registry_mirrors))
        key = "\n".join([caller or "", ref, creds.username if creds is not None else ""])
        name = "img-" + hashlib.sha256(key.encode()).hexdigest()[:40]
        if not fresh:
            try:
                record: dict[str, Any] = importer.store.template(name)
                return record
            except NotFoundError:
                pass
        record = importer.import_image(ref, name, creds, remote=True)
        return record

    async def status(self, request: Request) -> Response:
        t = self._template(request)
        b = self._build_of(t, request)
        q = request.query_params
        offset = _int(q.get("logsOffset"), 0, "logsOffset")
        limit = min(_int(q.get("limit"), MAX_LOG_PAGE, "limit"), MAX_LOG_PAGE)
        entries = _at_level(b.log, q.get("level"))
        out: dict[str, Any] = {"templateID": t.template_id, "buildID": b.build_id, "status": b.status,
                               "logEntries": entries[offset:offset + limit], "logs": []}
        if b.reason is not None:
            out["reason"] = b.reason
        return JSONResponse(out)

    async def logs(self, request: Request) -> Response:
        t = self._template(request)
        b = self._build_of(t, request)
        q = request.query_params
        entries = _at_level(b.log, q.get("level"))
        cursor = _int(q.get("cursor"), 0, "cursor")
        limit = min(_int(q.get("limit"), MAX_LOG_PAGE, "limit"), MAX_LOG_PAGE)
        if q.get("direction") == "backward":
            entries = entries[::-1]
        return JSONResponse({"logs": entries[cursor:cursor + limit]})

    async def alias(self, request: Request) -> Response:
        name = request.path_params["alias"]
        t = self.registry.find(name, self._caller(request))
        if t is not None:
            return JSONResponse({"templateID": t.template_id, "public": False})
        if self.control is not None:
            return await self.control.template_alias(request)  # the built-in templates
        raise HTTPError(404, f"template '{name}' not found")

    async def assign_tags(self, request: Request) -> Response:
        from agentcell.server.control import json_body

        body = await json_body(request)
        target, tags = body.get("target"), body.get("tags")
        if not isinstance(target, str) or not isinstance(tags, list) or not tags:
            raise HTTPError(400, "the body needs 'target' (\"name:tag\") and 'tags' (a list)")
        try:
            b, assigned = self.registry.assign(target, tags, self._caller(request))
        except NotFoundError as e:
            raise HTTPError(404, e.message) from None
        except InvalidArgumentError as e:
            raise HTTPError(400, e.message) from None
        return JSONResponse({"tags": assigned, "buildID": b.build_id}, status_code=201)

    async def remove_tags(self, request: Request) -> Response:
        from agentcell.server.control import json_body

        body = await json_body(request)
        name, tags = body.get("name"), body.get("tags")
        if not isinstance(name, str) or not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise HTTPError(400, "the body needs 'name' and 'tags' (a list)")
        try:
            self.registry.untag(name, tags, self._caller(request))
        except NotFoundError as e:
            raise HTTPError(404, e.message) from None
        return Response(status_code=204)

    async def list_tags(self, request: Request) -> Response:
        t = self._template(request)
        return JSONResponse([{"tag": tag, "buildID": v["buildID"], "createdAt": now_iso(v["createdAt"])}
                             for tag, v in sorted(t.tags.items())])

    def _template_json(self, t: TemplateRecord, with_builds: bool = False) -> dict[str, Any]:
        from agentcell.server.control import ENVD_VERSION

        builds = [self.registry.builds[b] for b in t.builds if b in self.registry.builds]
        latest = builds[-1] if builds else None
        out: dict[str, Any] = {
            "templateID": t.template_id, "buildID": latest.build_id if latest else "",
            "cpuCount": t.cpu_count, "memoryMB": t.memory_mb, "diskSizeMB": 0, "public": False,
            "aliases": list(t.names), "names": list(t.names), "createdAt": now_iso(t.created_at),
            "updatedAt": now_iso(t.updated_at), "createdBy": None, "lastSpawnedAt": None, "spawnCount": 0,
            "buildCount": len(builds), "envdVersion": ENVD_VERSION,
            "buildStatus": latest.status if latest else "waiting"}
        if with_builds:
            out["builds"] = [b.api_json() for b in builds]
        return out

    async def list_templates(self, request: Request) -> Response:
        return JSONResponse([self._template_json(t) for t in self.registry.visible(self._caller(request))])

    async def get_template(self, request: Request) -> Response:
        return JSONResponse(self._template_json(self._template(request), with_builds=True))

    async def delete_template(self, request: Request) -> Response:
        ref = request.path_params["template_id"]
        t = self.registry.find(ref, self._caller(request))
        if t is None:
            if self.control is not None:
                return await self.control.delete_template(request)  # a snapshot, or 404
            raise HTTPError(404, f"template '{ref}' not found")
        if any(self.registry.builds.get(b) is not None and self.registry.builds[b].status == "building"
               for b in t.builds):
            raise HTTPError(400, f"template '{ref}' is being built: delete it when the build is done")
        store_names = self.registry.delete(t)
        self.uploads.forget(t.template_id)
        try:
            store = self.imports.importer().store
        except HTTPError:
            store = None
        if store is not None:
            for n in store_names:
                with contextlib.suppress(OSError, SandboxError):
                    store.delete_template(n)
        return Response(status_code=204)

    def routes(self) -> list[Route]:
        tid = "/templates/{template_id}"
        return [
            Route("/v3/templates", self.request_build, methods=["POST"]),
            Route("/templates", self.list_templates, methods=["GET"]),
            Route("/templates/aliases/{alias}", self.alias, methods=["GET"]),
            Route("/templates/tags", self.assign_tags, methods=["POST"]),
            Route("/templates/tags", self.remove_tags, methods=["DELETE"]),
            Route(tid + "/files/{hash}", self.upload_link, methods=["GET"]),
            Route("/v2" + tid + "/builds/{build_id}", self.start_build, methods=["POST"]),
            Route(tid + "/builds/{build_id}/status", self.status, methods=["GET"]),
            Route(tid + "/builds/{build_id}/logs", self.logs, methods=["GET"]),
            Route(tid + "/tags", self.list_tags, methods=["GET"]),
            Route(tid, self.get_template, methods=["GET"]),
            Route(tid, self.delete_template, methods=["DELETE"]),
        ]

    def store_name(self, ref: str, caller: str | None) -> str:
        """For sandbox creation: the template store's name of what `ref` names for `caller` — a built
        template's alias[:tag] or id[:tag] gives its build's record; a build's record of another caller
        gives "" (not found); anything else is `ref` itself (an imported template's name)."""
        self.registry.refresh()  # a build another cell finished (or tagged) since
        try:
            _, b = self.registry.tagged_build(ref, caller)
        except NotFoundError:
            b = None
        if b is None:
            build_id = ref.partition(".")[2]
            other = self.registry.builds.get(build_id)
            if other is not None and other.store_name == ref:  # a build's record named directly
                t = self.registry.templates.get(other.template_id)
                return ref if t is not None and self.registry.sees(caller, t.owner) else ""
            return ref
        if b.status != "ready":
            raise HTTPError(400, f"template '{ref}' is not built yet (its build is {b.status})")
        try:
            record = self.imports.importer().store.template(b.store_name)
        except NotFoundError:
            return ""
        if record.get("builtin_base"):
            raise HTTPError(501, f"template '{ref}' was built on E2B's default base (agentcell's built-in template): "
                                 "sandboxes of such templates cannot start yet; build it from an image "
                                 "(Template().from_image(...)) to start sandboxes of it")
        return b.store_name


def mirrored(ref: str, mirrors: dict[str, str]) -> str:
    """`ref` fetched from the operator's mirror of its registry (serve --registry-mirror), if any."""
    if not mirrors:
        return ref
    from agentcell.templates.refs import parse_ref

    try:
        parsed = parse_ref(ref)
    except InvalidArgumentError:
        return ref  # the importer says what is wrong with it
    mirror = mirrors.get(parsed.registry.lower()) if parsed.transport == "docker" else None
    if mirror is None:
        return ref
    at = f"@{parsed.digest}" if parsed.digest else f":{parsed.tag or 'latest'}"
    return f"docker://{mirror}/{parsed.repository}{at}"


def _int(raw: str | None, default: int, name: str) -> int:
    if raw is None or raw == "":
        return default
    if not raw.isdigit():
        raise HTTPError(400, f"'{name}' must be a whole number, not {raw[:40]!r}")
    return int(raw)


def _at_level(entries: list[dict[str, Any]], level: str | None) -> list[dict[str, Any]]:
    if not level:
        return entries
    if level not in LEVELS:
        raise HTTPError(400, f"'level' must be one of {', '.join(LEVELS)}")
    least = LEVELS.index(level)
    return [e for e in entries if LEVELS.index(e["level"]) >= least]
