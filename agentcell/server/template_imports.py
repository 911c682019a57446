"""The template import route, agentcell's extension of E2B's API (agentcell/templates/ does the work).

    POST /templates/imports
    {"name": "py312", "fromImage": "python:3.12-slim",
     "fromImageRegistry": {"type": "registry", "username": "...", "password": "..."}}   (optional)
    -> 201 {"templateID": "py312", "source": "docker://docker.io/library/python:3.12-slim",
            "manifestDigest": "sha256:...", "layers": ["sha256:..."], "sizeBytes": 123, "config": {...}}

`fromImage` and `fromImageRegistry` are the names E2B's template build (POST /v2/templates/{id}/builds/
{build}) gives its base image and its registry credentials; only registries (docker://, or a bare Docker
Hub name) are taken here: a path would name one of the server's own files (`agentcell template import`
on the server's host imports OCI layouts and `docker save` tarballs). The import runs in a worker
thread: skopeo downloads, then the layers are unpacked; the response comes when the template is stored.
A new import of a name replaces the template of that name. Errors: 400 a bad reference or image (a
hostile layer, a digest that does not match), 403 a registry the operator does not allow (or refused
credentials), 404 no such image, 429 too many imports at once, 502 the registry cannot be reached,
507 the size ceiling or the store's budget.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentcell.backends.base import ImageRoot
from agentcell.errors import BackendUnavailableError, InvalidArgumentError, NotFoundError, SandboxError
from agentcell.server.config import ServerConfig
from agentcell.server.errors import HTTPError, from_sandbox_error

PATH = "/templates/imports"


def store_dir(config: ServerConfig) -> str:
    return config.template_store_dir or os.path.join(config.state_dir, "templates")


def open_store(config: ServerConfig) -> Any:
    from agentcell.templates.store import TemplateStore

    return TemplateStore(store_dir(config), int(config.template_store_max_gb * (1 << 30)))


def template_root(config: ServerConfig, name: str) -> ImageRoot | None:
    """The root of the stored template `name` (templates/roots.py), or None if there is none."""
    from agentcell.templates.roots import image_root
    from agentcell.templates.store import check_name

    try:
        check_name(name)
    except InvalidArgumentError:
        return None
    if os.geteuid() != 0:
        return None
    try:  # a create's hot path: the record's identity says whether the last answer still holds
        st = os.stat(os.path.join(store_dir(config), "templates", name + ".json"))
    except OSError:
        return None
    seen = (store_dir(config), name, st.st_ino, st.st_mtime_ns, st.st_size)
    cached = _ROOTS.get(seen[:2])
    if cached is not None and cached[0] == seen:
        return cached[1]
    store = open_store(config)
    try:
        record = store.template(name)
        root = image_root(store, record)
    except NotFoundError:
        return None
    if root.key not in _LEASES:  # this server may run sandboxes on these layers from now on
        _LEASES[root.key] = store.lease(record["layers"])
    _ROOTS[seen[:2]] = (seen, root)
    return root


# (store, name) -> (the record file's identity when read, its root): a record is replaced by a rename
_ROOTS: dict[tuple[str, str], tuple[tuple[str, str, int, int, int], ImageRoot]] = {}


# ImageRoot.key -> flocked fds of its layers (TemplateStore.lease), for the server's life: a template
# replaced or deleted meanwhile keeps its layers until the server that used them exits
_LEASES: dict[str, list[int]] = {}


class TemplateImports:
    """The server's importer, made at the first import (the store's directory with it)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._importer: Any = None

    def importer(self) -> Any:
        if self._importer is None:
            from agentcell import rootless

            if rootless.active() or os.geteuid() != 0:
                # the store keeps the images' owners shifted to ids only host root can give
                raise HTTPError(501, "template imports need a server running as root (not rootless mode)")
            from agentcell.templates.importer import Importer, ImportLimits
            from agentcell.templates.refs import RegistryPolicy

            cfg = self.config
            store = open_store(cfg)
            self._importer = Importer(store, RegistryPolicy.of(cfg.allowed_registries, cfg.insecure_registries),
                                      ImportLimits(max_image_bytes=cfg.max_image_mb << 20,
                                                   concurrent=cfg.max_concurrent_imports))
        return self._importer

    async def create(self, request: Request) -> JSONResponse:
        from agentcell.server.control import json_body
        from agentcell.templates.fetch import Credentials
        from agentcell.templates.importer import ImportsBusyError

        body = await json_body(request)
        name, image = body.get("name"), body.get("fromImage")
        if not isinstance(name, str) or not isinstance(image, str) or not image:
            raise HTTPError(400, "the body needs 'name' (the template's) and 'fromImage' (an image reference)")
        registry = body.get("fromImageRegistry")
        creds = None
        if registry is not None:
            if not isinstance(registry, dict) or registry.get("type", "registry") != "registry":
                raise HTTPError(400, "'fromImageRegistry' must be {\"type\": \"registry\", \"username\", \"password\"} "
                                     "(agentcell has no cloud-registry types)")
            user, password = registry.get("username"), registry.get("password")
            if not isinstance(user, str) or not isinstance(password, str):
                raise HTTPError(400, "'fromImageRegistry' needs 'username' and 'password' strings")
            creds = Credentials(user, password)
        try:
            record = await asyncio.to_thread(self.importer().import_image, image, name, creds, remote=True)
        except ImportsBusyError as e:
            raise HTTPError(429, e.message) from None
        except SandboxError as e:
            raise from_sandbox_error(e) from None
        except BackendUnavailableError as e:
            raise HTTPError(502, str(e)) from None
        return JSONResponse({"templateID": record["name"], "source": record["source"],
                             "manifestDigest": record["manifest_digest"], "layers": record["layers"],
                             "sizeBytes": record["size_bytes"], "config": record["config"]}, status_code=201)

    def routes(self) -> list[Route]:
        return [Route(PATH, self.create, methods=["POST"])]
