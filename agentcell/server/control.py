"""The control plane: E2B's REST API for sandboxes (see shared/e2b-protocol.md §2).

Every non-2xx answer is `{"code": <status>, "message": ...}` with a status the SDK lists for the path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentcell.backends.base import LIMIT_RANGES, Backend, Limits, check_pids_max
from agentcell.errors import BackendUnavailableError, InvalidArgumentError, SandboxError, SandboxGoneError
from agentcell.network.policy import ALL_TRAFFIC, NetworkPolicy, PolicyError
from agentcell.network.secrets import SecretError, SecretSet, parse_rules
from agentcell.policy import model as policy_model
from agentcell.policy.approvals import ApprovalDecided, ApprovalNotFound
from agentcell.policy.model import Policy
from agentcell.record import report, report_html
from agentcell.record.events import KIND_SET, KINDS
from agentcell.record.store import EventStore
from agentcell.server import api_events, ingress, policies, validate
from agentcell.server.access_log import note
from agentcell.server.auth import traffic_token
from agentcell.server.bodies import JSON_LIMIT, read_json
from agentcell.server.config import ServerConfig
from agentcell.server.egress_proxy import egress_proxy, egress_proxy_info
from agentcell.server.errors import HTTPError, internal_error
from agentcell.server.hosts import local_domain
from agentcell.server.idempotency import IdempotentCreates, parse_key
from agentcell.server.metrics import MIN_GAP_S, metric_json
from agentcell.server.registry import (
    AlreadyPausedError,
    CapacityError,
    Lifecycle,
    SandboxManager,
    SandboxRecord,
)
from agentcell.server.sandbox_state import SandboxState
from agentcell.server.snapshots import Snapshot, SnapshotError, SnapshotStore, tree_size
from agentcell.server.template_imports import template_root
from agentcell.server.tenancy import QuotaError, Tenancy, recorded_owner
from agentcell.vault.api import VaultApi
from agentcell.vault.store import Vault
from agentcell.volumes import mounts as volume_mounts
from agentcell.volumes.store import VolumeError, VolumeStore

ENVD_VERSION = "0.6.13"
BUILTIN_TEMPLATE = "code-interpreter-v1"
TEMPLATES = {"base": "base", "code-interpreter-v1": "code-interpreter-v1", "code-interpreter": "code-interpreter-v1"}
_LIMIT_FIELDS = {
    "memoryMB": ("memory_mb", int),
    "pids": ("pids", int),
    "cpuCount": ("cpu_count", float),
    "diskMB": ("disk_mb", int),
    "openFiles": ("open_files", int),
}
_UNSUPPORTED_NETWORK = {
    "dnsServers": "network.dnsServers: agentcell sandboxes resolve names only through agentcell's policy "
                  "resolver, which answers exactly the names allowOut allows",
}


_Owned = TypeVar("_Owned", SandboxRecord | None, Snapshot | None)


def rfc3339(dt: datetime) -> str:
    return dt.astimezone(UTC).isoformat().replace("+00:00", "Z")


# --- request parsing ------------------------------------------------------------------------------


def _unix_seconds(request: Request, name: str, default: int | None) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise HTTPError(400, f"'{name}' must be a unix time in whole seconds, not {raw[:40]!r}") from None
    if not 0 <= value < 1 << 40:
        raise HTTPError(400, f"'{name}' is out of range: {value}")
    return value


async def json_body(request: Request, *, required: bool = True, limit: int = JSON_LIMIT) -> dict[str, Any]:
    """The body as a JSON object, read with a size cap and within the server's body budget (bodies.py)."""
    body = await read_json(request, limit)
    if body is None:
        if required:
            raise HTTPError(400, "the request body must be a JSON object")
        return {}
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _timeout(cfg: ServerConfig, body: dict[str, Any], default: int, *, zero: bool = False) -> int:
    """`zero`: 0 is allowed (set_timeout's "expire now")."""
    value = body.get("timeout")
    if value is None:
        return default
    if not _is_int(value):
        raise HTTPError(400, "'timeout' must be an integer number of seconds")
    least = 0 if zero else 1
    if not least <= value <= cfg.max_timeout:
        raise HTTPError(400, f"'timeout' must be between {least} and {cfg.max_timeout} seconds, got {value}")
    return value


def _disk_within_ceiling(cfg: ServerConfig, limits: Limits) -> Limits:
    """A disk that follows the memory (disk_mb None) stays within the operator's disk maximum too."""
    if limits.disk_mb is None and limits.disk_limit_mb > cfg.max_limits.disk_mb:
        return dataclasses.replace(limits, disk_mb=cfg.max_limits.disk_mb)
    return limits


def _limits(cfg: ServerConfig, body: dict[str, Any]) -> Limits:
    value = body.get("limits")
    if value is None:
        return _disk_within_ceiling(cfg, cfg.limits)
    if not isinstance(value, dict):
        raise HTTPError(400, "'limits' must be an object like {\"memoryMB\": 512, \"pids\": 256}")
    changes: dict[str, Any] = {}
    for key, v in value.items():
        if key not in _LIMIT_FIELDS:
            raise HTTPError(400, f"unknown limit '{key}'; known: {', '.join(_LIMIT_FIELDS)}")
        name, typ = _LIMIT_FIELDS[key]
        if isinstance(v, bool) or not isinstance(v, int | float) or (typ is int and not _is_int(v)):
            raise HTTPError(400, f"limit '{key}' must be a{'n integer' if typ is int else ' number'}")
        low, most = LIMIT_RANGES[name][0], getattr(cfg.max_limits, name)
        if not low <= v <= most:
            raise HTTPError(400, f"invalid limits: {key} must be between {low:g} and {most:g} on this server "
                                 f"(its operator's maximum), got {v:g}")
        changes[name] = typ(v)
    limits = _disk_within_ceiling(cfg, dataclasses.replace(cfg.limits, **changes))
    try:
        limits.validate()
    except ValueError as e:
        camel = {snake: camel for camel, (snake, _) in _LIMIT_FIELDS.items()}
        msg = str(e)
        for snake, c in camel.items():
            msg = msg.replace(snake, c)
        raise HTTPError(400, f"invalid limits: {msg}") from None
    return limits


def _field(obj: dict[str, Any], camel: str, snake: str) -> Any:
    return obj.get(camel, obj.get(snake))


def _network_object(body: dict[str, Any]) -> dict[str, Any]:
    network = body.get("network")
    if network is None:
        return {}
    if not isinstance(network, dict):
        raise HTTPError(400, "'network' must be an object")
    return network


def network_policy(body: dict[str, Any], network: dict[str, Any], internet_default: bool) -> NetworkPolicy:
    """E2B's allow_internet_access and network.allowOut/denyOut (camelCase, snake_case accepted) as a
    NetworkPolicy. As on E2B, allow_internet_access=False is deny_out=[ALL_TRAFFIC]: with an allow
    list, only that list leaves."""
    internet = _field(body, "allowInternetAccess", "allow_internet_access")
    if internet is not None and not isinstance(internet, bool):
        raise HTTPError(400, "'allow_internet_access' must be a boolean")
    for key, why in _UNSUPPORTED_NETWORK.items():
        if _field(network, key, re.sub(r"([A-Z])", r"_\1", key).lower()) not in (None, [], {}):
            raise HTTPError(400, why)
    lists = []
    for camel, snake in (("allowOut", "allow_out"), ("denyOut", "deny_out")):
        value = _field(network, camel, snake)
        if value is None:
            value = []
        if not isinstance(value, list):
            raise HTTPError(400, f"'network.{camel}' must be a list of CIDRs, IP addresses or domain names")
        lists.append(value)
    allow, deny = lists
    internet = internet_default if internet is None else internet
    if not internet and allow:
        internet, deny = True, [*deny, ALL_TRAFFIC]
    try:
        return NetworkPolicy.parse(internet, allow, deny)
    except PolicyError as e:
        raise HTTPError(400, f"invalid network rule: {e}") from None


def _optional_bool(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise HTTPError(400, f"'{key}' must be a boolean")
    return value


def _lifecycle(body: dict[str, Any]) -> Lifecycle:
    """E2B's create fields autoPause (on_timeout "pause"), autoPauseMemory (what that pause keeps)
    and autoResume {"enabled"} (traffic resumes the paused sandbox)."""
    auto_pause = _optional_bool(body, "autoPause")
    memory = _optional_bool(body, "autoPauseMemory")
    resume = body.get("autoResume")
    if resume is not None and not (isinstance(resume, dict) and isinstance(resume.get("enabled", False), bool)):
        raise HTTPError(400, "'autoResume' must be an object like {\"enabled\": true}")
    auto_resume = bool(resume and resume.get("enabled"))
    if auto_resume and not auto_pause:
        raise HTTPError(400, "autoResume needs autoPause: only a sandbox paused at its timeout can be resumed by traffic")
    if auto_resume and memory is False:
        raise HTTPError(400, "autoResume cannot be combined with autoPauseMemory false: a sandbox paused without its "
                             "memory is resumed explicitly (Sandbox.connect)")
    return Lifecycle("pause" if auto_pause else "kill", auto_resume, memory is not False)


def _public_traffic(body: dict[str, Any]) -> bool:
    """E2B's network.allowPublicTraffic (the SDK sends camelCase; snake_case accepted too): whether the
    sandbox's served-out ports need no traffic token. Default true, as on E2B."""
    network = body.get("network")
    if not isinstance(network, dict):
        return True
    value = network.get("allowPublicTraffic", network.get("allow_public_traffic"))
    if value is None:
        return True
    if not isinstance(value, bool):
        raise HTTPError(400, "'network.allowPublicTraffic' must be a boolean")
    return value


def _epoch(query: Any, name: str) -> float | None:
    value = query.get(name)
    if value is None:
        return None
    try:
        t = float(value)
    except ValueError:
        try:
            t = datetime.fromisoformat(value).timestamp()
        except ValueError:
            raise HTTPError(400, f"'{name}' must be epoch seconds or an ISO 8601 time, got {value!r}") from None
    if not math.isfinite(t):
        raise HTTPError(400, f"'{name}' must be a finite time")
    return t


def _int_param(query: Any, name: str, default: int) -> int:
    try:
        value = int(query.get(name, default))
    except ValueError:
        raise HTTPError(400, f"'{name}' must be an integer") from None
    if value < 0:
        raise HTTPError(400, f"'{name}' must be at least 0")
    return value


def _jsonable(value: Any) -> Any:
    return sorted(value) if isinstance(value, set) else str(value)


def _page_limit(query: Any) -> int:
    """E2B's `limit` of a listing: 1..100, default 100."""
    try:
        limit = int(query.get("limit", "100"))
    except ValueError:
        raise HTTPError(400, "'limit' must be an integer") from None
    if not 1 <= limit <= 100:
        raise HTTPError(400, "'limit' must be between 1 and 100")
    return limit


_T = TypeVar("_T")


def _after(items: list[_T], ids: list[str], token: str | None, what: str) -> list[_T]:
    """The items after the one whose id is `token` (E2B's nextToken: the last of the previous page)."""
    if not token:
        return items
    if token not in ids:
        raise HTTPError(400, f"invalid 'nextToken' (the {what} it points to is gone; list again)")
    return items[ids.index(token) + 1:]


def _time_param(query: Any, name: str) -> datetime | None:
    value = query.get(name)
    if not value:
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise HTTPError(400, f"'{name}' is not an ISO 8601 time: {value!r}") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


# E2B API paths agentcell does not serve: an honest 501 (the SDKs read it as "not supported"), never a
# 404 that they would read as "sandbox not found"
UNSERVED = (
    ("/sandboxes/metrics", "metrics of many sandboxes at once"),
    ("/sandboxes/{sandbox_id}/logs", "sandbox logs"), ("/v2/sandboxes/{sandbox_id}/logs", "sandbox logs"),
    ("/default-templates", "default templates"), ("/templates", "template builds"),
    ("/v2/templates", "v2 template builds (the SDKs use /v3/templates)"),
    ("/v2/templates/{template_id}", "template updates"), ("/templates/{template_id}/{rest:path}", "template builds"),
    ("/v2/templates/{template_id}/{rest:path}", "template builds"),
)


# --- response objects ----------------------------------------------------------------------------------


class ControlPlane:
    def __init__(self, cfg: ServerConfig, manager: SandboxManager, snapshots: SnapshotStore) -> None:
        self.cfg = cfg
        self.manager = manager
        self.snapshots = snapshots
        self._idempotent = IdempotentCreates()
        self._reports = asyncio.Semaphore(4)
        self.tenancy = Tenancy.from_config(cfg)  # who sees what (server/tenancy.py); off but for --system
        self.vault = VaultApi(Vault(os.path.join(cfg.state_dir, "vault")), self.tenancy)  # E2B's Secret API
        self.built_templates: Any = None  # server/template_builds.py: names of E2B-built templates -> the store's
        self.volumes: VolumeStore | None = None  # agentcell/volumes/: what volumeMounts name

    def _visible(self, request: Request, rec: _Owned) -> _Owned:
        """`rec` if the caller may see it (its own, or no tenancy), else None: another tenant's is "not found"."""
        if rec is None or self.tenancy.sees(self.tenancy.caller(request.scope), rec.owner):
            return rec
        return None

    def _stored_name(self, request: Request, template: str) -> str:
        """The template store's name for `template`: a built template's alias[:tag] or id is its build's."""
        if self.built_templates is None:
            return template
        return str(self.built_templates.store_name(template, self.tenancy.caller(request.scope)))

    def _domain(self, request: Request) -> str | None:
        # get_host(port) is "{port}-{id}.{domain}": without --domain, the name this request came to,
        # with a loopback address turned into "localhost" (8000-id.localhost resolves, 8000-id.127.0.0.1 not).
        host = request.headers.get("host")
        return self.cfg.domain or (local_domain(host) if host else None)

    def sandbox_json(self, rec: SandboxRecord, request: Request) -> dict[str, Any]:
        return {
            "templateID": rec.template_id,
            "sandboxID": rec.sandbox_id,
            "clientID": rec.client_id,
            "alias": rec.alias,
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": rec.access_token,
            # The official code-interpreter SDK sends it (not the access token) on /contexts.
            "trafficAccessToken": traffic_token(rec.access_token),
            "domain": self._domain(request),
        }

    def listed_json(self, rec: SandboxRecord) -> dict[str, Any]:
        return {
            "templateID": rec.template_id,
            "alias": rec.alias,
            "sandboxID": rec.sandbox_id,
            "clientID": rec.client_id,
            "startedAt": rfc3339(rec.started_at),
            # a paused sandbox's end: when the server stops keeping it
            "endAt": rfc3339(self.manager.shown_end(rec)),
            "cpuCount": max(1, math.ceil(rec.limits.cpu_count)),
            "memoryMB": rec.limits.memory_mb,
            "diskSizeMB": rec.limits.disk_limit_mb,
            "state": rec.state.api_state,  # on its way to or from a pause: "paused"
            "envdVersion": ENVD_VERSION,
            "metadata": rec.metadata,
            "volumeMounts": [{"name": m.name, "path": m.path} for m in rec.spec.volumes],
        }

    def detail_json(self, rec: SandboxRecord, request: Request) -> dict[str, Any]:
        return {
            **self.listed_json(rec),
            "envdAccessToken": rec.access_token,
            "domain": self._domain(request),
            "allowInternetAccess": rec.network.internet,
            "network": {**rec.network.info(), "allowPublicTraffic": rec.public_traffic, "rules": rec.rules_info,
                        **({"maskRequestHost": rec.mask_request_host} if rec.mask_request_host else {}),
                        **egress_proxy_info(rec.spec.secrets.tunnel)},
            "secrets": rec.secret_hosts,  # agentcell extension: names and hosts only
            "lifecycle": {"autoResume": rec.lifecycle.auto_resume, "onTimeout": rec.lifecycle.on_timeout},
            **({"pauseMode": rec.pause_mode} if rec.pause_mode is not None else {}),
            **({"forkMode": rec.fork_mode} if rec.fork_mode is not None else {}),  # agentcell extension
            "isolation": rec.backend.isolation,  # agentcell extension: e.g. "microvm (TCG, emulated — ...)"
            "limits": {
                "memoryMB": rec.limits.memory_mb,
                "pids": rec.limits.pids,
                "cpuCount": rec.limits.cpu_count,
                "diskMB": rec.limits.disk_limit_mb,
                "openFiles": rec.limits.open_files,
            },
        }

    def _policy(self, body: dict[str, Any], network: dict[str, Any], backend: Backend,
                internet_default: bool | None = None) -> NetworkPolicy:
        default = self.cfg.internet_by_default and backend.has_egress
        policy = network_policy(body, network, default if internet_default is None else internet_default)
        if policy.internet and not backend.has_egress:
            if policy.allow_out or policy.deny_out or network.get("rules"):
                raise HTTPError(400, f"sandboxes of the {backend.name} backend get no internet on this server (its "
                                     "operator started it with --egress-uplink none, or the backend has no network), "
                                     "so it cannot carry out network rules; leave them out")
            # E2B's JS SDK asks for the internet in every create (allowInternetAccess defaults to true):
            # on a server without an uplink that is a sandbox without one, as get_info then says.
            return dataclasses.replace(policy, internet=False)
        return policy

    def _parsed_policy(self, value: Any, backend: Backend, previous: Policy | None = None,
                       limits: Limits | None = None) -> Policy:
        """The create body's (or an update's) `policy`, checked against what `backend` can enforce: a 400
        naming the part otherwise."""
        try:
            policy = policy_model.parse(value)
            if policy.processes_max is not None and limits is not None:
                try:
                    check_pids_max(policy.processes_max, limits.pids)
                except ValueError as e:
                    raise policy_model.PolicyError("policy.processes.max", str(e)) from None
            policies.check(backend, policy, previous)
        except policy_model.PolicyError as e:
            raise HTTPError(400, str(e)) from None
        return policy

    def _record(self, request: Request) -> SandboxRecord:
        """The running sandbox the path names (404 for a paused one too: resume it first)."""
        sandbox_id = request.path_params["sandbox_id"]
        rec = self._visible(request, self.manager.get(sandbox_id))
        if rec is None:
            if self._visible(request, self.manager.find(sandbox_id)) is not None:
                raise HTTPError(404, f"sandbox '{sandbox_id}' is paused: resume it first (Sandbox.connect)")
            raise HTTPError(404, f"sandbox '{sandbox_id}' not found")
        return rec

    def _any_record(self, request: Request) -> SandboxRecord:
        """The sandbox the path names, running or paused."""
        sandbox_id = request.path_params["sandbox_id"]
        rec = self._visible(request, self.manager.find(sandbox_id))
        if rec is None:
            raise HTTPError(404, f"sandbox '{sandbox_id}' not found")
        return rec

    # --- handlers ------------------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        body = await json_body(request)
        key = parse_key(request.headers.get("idempotency-key"))
        if key is None:
            answer = await self._create(request, body)
        else:
            owner = self.tenancy.caller(request.scope)
            if owner is not None:  # one tenant's key never replays another's create (its answer holds the token)
                key = f"{owner}\n{key}"
            answer, _ = await self._idempotent.run(key, body, lambda: self._create(request, body))
        note(answer.get("sandboxID"))  # the create's access line names the sandbox it made
        return JSONResponse(answer, status_code=201)

    async def _create(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        body = await self.vault.resolved_body(request, body)  # vault secrets' references: their values
        template = body.get("templateID", "base")
        if not isinstance(template, str):
            raise HTTPError(400, "'templateID' must be a string")
        snapshot = None
        root = None
        if template not in TEMPLATES:
            snapshot = self._visible(request, self.snapshots.find(template, self.tenancy.caller(request.scope)))
            # a template made from an image; a snapshot of one of its sandboxes starts on its layers too
            source, earlier = template, snapshot
            for _ in range(64):  # a snapshot of a sandbox made from a snapshot ...: the first one's template
                if earlier is None:
                    break
                source = earlier.source_template
                earlier = self.snapshots.find(source, self.tenancy.caller(request.scope))
            root = template_root(self.cfg, self._stored_name(request, source)) if source not in TEMPLATES else None
            if snapshot is None and root is None:
                raise HTTPError(404, f"template '{template}' not found; available: base, code-interpreter-v1, "
                                     "a template imported or built here (GET /templates), "
                                     "or the id or name of a snapshot (GET /snapshots)")
        backend = self._backend(body, template, snapshot)
        if root is not None and backend.name != "linux":
            raise HTTPError(400, f"template '{template}' is made from an image: its sandboxes run on the linux "
                                 f"backend only, not {backend.name}")
        timeout = _timeout(self.cfg, body, self.cfg.default_timeout)
        try:
            metadata = validate.string_map(body.get("metadata"), "metadata", validate.MAX_METADATA_BYTES)
            envs = validate.env_map(body.get("envVars"), "envVars")
        except InvalidArgumentError as e:
            raise HTTPError(400, e.message) from None
        limits = _limits(self.cfg, body)
        if snapshot is not None and body.get("limits") is None and (kept := snapshot.source_limits()) is not None:
            limits = kept  # the snapshot's own, as E2B's snapshot templates keep their resources
        lifecycle = _lifecycle(body)
        public_traffic = _public_traffic(body)
        network = _network_object(body)
        mask_host = ingress.mask_request_host(network)
        policy = self._policy(body, network, backend)
        try:
            secrets = dataclasses.replace(SecretSet.parse(body.get("secrets")), rules=parse_rules(network.get("rules")),
                                          tunnel=egress_proxy(network, backend))
        except SecretError as e:
            raise HTTPError(400, str(e)) from None
        if secrets and not backend.has_egress:
            raise HTTPError(400, "secrets need the egress proxy, and this server gives sandboxes no internet "
                                 "(--egress-uplink none)")
        policy_rules = self._parsed_policy(body.get("policy"), backend, limits=limits)
        clash = sorted(set(secrets.envs()) & set(envs))
        if clash:
            raise HTTPError(400, f"{clash[0]} is both an envVar and a secret; give it once")
        owner = self.tenancy.caller(request.scope)
        try:
            volumes = volume_mounts.resolve(body.get("volumeMounts"), self.volumes, owner, self.tenancy.sees)
        except VolumeError as e:
            raise HTTPError(e.status, e.message) from None
        try:
            with self.tenancy.reserve(owner, self._held(), limits.memory_mb):
                rec = await self.manager.create(
                    template_id=template, alias=template, timeout=timeout, metadata=metadata, envs=envs, limits=limits,
                    network=policy, secrets=secrets, lifecycle=lifecycle, backend=backend,
                    files=self.snapshots.content(snapshot) if snapshot and snapshot.mode == "filesystem" else None,
                    image=self.snapshots.content(snapshot) if snapshot and snapshot.mode == "full" else None,
                    caller=api_events.caller_id(request.scope), origin=f"snapshot {template}" if snapshot else None,
                    owner=owner, root=root, policy=policy_rules, volumes=volumes,
                )
        except QuotaError as e:
            raise HTTPError(429, str(e)) from None
        except CapacityError as e:
            raise HTTPError(429, str(e)) from None
        except InvalidArgumentError as e:
            raise HTTPError(400, e.message) from None
        except policy_model.PolicyError as e:  # what only the sandbox itself could tell (a rule's path, a program's files)
            raise HTTPError(400, str(e)) from None
        except (SandboxError, BackendUnavailableError) as e:
            if isinstance(e, SandboxError) and e.code == "resource_exhausted":  # a full host: nothing to hide
                raise HTTPError(500, f"the sandbox could not be started: {e.message}") from None
            # Backend errors name zygotes, cgroups, uids and paths: they go to the log only.
            raise internal_error("creating a sandbox", e, "the sandbox could not be started") from None
        rec.public_traffic = public_traffic  # the tenant has not got the id yet: nothing it serves is up
        rec.mask_request_host = mask_host
        rec.rules_info = secrets.rules_info()
        # what update_network falls back to: the create's allow_internet_access (explicit, or the
        # server's default), not its lists, which an update replaces (E2B: an empty update clears them)
        asked = _field(body, "allowInternetAccess", "allow_internet_access")
        rec.internet_at_create = (self.cfg.internet_by_default and backend.has_egress) if asked is None \
            else bool(asked)
        return self.sandbox_json(rec, request)

    def _held(self) -> list[SandboxRecord]:
        """Every sandbox the server holds (running or paused): what tenants' quotas count."""
        return self.manager.list() + self.manager.list_paused()

    def _filtered(self, request: Request, running: bool = True, paused: bool = False) -> list[SandboxRecord]:
        q = request.query_params
        records = (self.manager.list() if running else []) + (self.manager.list_paused() if paused else [])
        records = self.tenancy.visible(self.tenancy.caller(request.scope), records)
        meta_raw = q.get("metadata")
        if meta_raw:
            # The SDK encodes metadata as urlencode({quote(k): quote(v)}): decode twice.
            wanted = {unquote(k): unquote(v) for k, vs in parse_qs(meta_raw, keep_blank_values=True).items() for v in vs[:1]}
            records = [r for r in records if all(r.metadata.get(k) == v for k, v in wanted.items())]
        template = q.get("template")
        if template:
            records = [r for r in records if template in (r.template_id, r.alias)]
        # startedAfter / startedBefore: inclusive, as E2B's API has them
        after, before = _time_param(q, "startedAfter"), _time_param(q, "startedBefore")
        if after is not None:
            records = [r for r in records if r.started_at >= after]
        if before is not None:
            records = [r for r in records if r.started_at <= before]
        return records

    async def list_v1(self, request: Request) -> Response:
        return JSONResponse([self.listed_json(r) for r in self._filtered(request)])

    async def list_v2(self, request: Request) -> Response:
        q = request.query_params
        states = {s.strip() for s in q.get("state", "running,paused").split(",") if s.strip()}
        bad = states - {"running", "paused"}
        if bad:
            raise HTTPError(400, f"unknown state {sorted(bad)[0]!r}; use running and/or paused")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise HTTPError(400, "'order' must be asc or desc")
        limit = _page_limit(q)
        records = self._filtered(request, running="running" in states, paused="paused" in states)
        records.sort(key=lambda r: (r.started_at, r.sandbox_id), reverse=order == "desc")
        # The token is the id of the last sandbox of the previous page.
        records = _after(records, [r.sandbox_id for r in records], q.get("nextToken"), "sandbox")
        page = records[:limit]
        running = self.tenancy.visible(self.tenancy.caller(request.scope), self.manager.list())
        headers = {"X-Total-Running": str(len(running))}
        if len(records) > limit:
            headers["X-Next-Token"] = page[-1].sandbox_id
        return JSONResponse([self.listed_json(r) for r in page], headers=headers)

    async def get(self, request: Request) -> Response:
        return JSONResponse(self.detail_json(self._any_record(request), request))

    async def update_network(self, request: Request) -> Response:
        """E2B's PUT /sandboxes/{id}/network: the whole egress configuration is replaced (what the body
        leaves out is cleared); allow_internet_access left out is what the sandbox was created with,
        so an update meant to narrow the lists never opens a sandbox created without internet."""
        body = await json_body(request)
        rec = self._record(request)
        body = (await self.vault.resolved_body(request, {"network": body}))["network"]
        policy = self._policy(body, body, rec.backend, internet_default=rec.internet_at_create)
        try:
            rules = parse_rules(body.get("rules"))
        except SecretError as e:
            raise HTTPError(400, str(e)) from None
        tunnel = egress_proxy(body, rec.backend)  # left out: no proxy any more (E2B: the update replaces all)
        try:
            await rec.backend.set_network(rec.running, policy, rules, tunnel)
        except InvalidArgumentError as e:
            raise HTTPError(400, e.message) from None
        except SandboxError as e:
            raise HTTPError(404 if isinstance(e, SandboxGoneError) else 500, e.message) from None
        rec.network = policy
        rec.rules_info = SecretSet(rules=rules).rules_info()
        # what a cold resume starts it with
        rec.spec = dataclasses.replace(rec.spec, network=policy,
                                       secrets=dataclasses.replace(rec.spec.secrets, rules=rules, tunnel=tunnel))
        self.manager.redact_secrets(rec)  # new header values are kept out of its record too
        return Response(status_code=204)

    # --- the sandbox's policy and its approvals (issue 28) --------------------------------------------

    async def get_policy(self, request: Request) -> Response:
        rec = self._any_record(request)
        return JSONResponse(rec.spec.policy.to_json())

    async def put_policy(self, request: Request) -> Response:
        """agentcell extension: replace a running sandbox's policy (what the body leaves out is the default)."""
        body = await json_body(request)
        rec = self._record(request)
        previous = rec.spec.policy
        policy = self._parsed_policy(body, rec.backend, previous, rec.limits)
        assert rec.running is not None and rec.channel is not None
        async with rec.lock:
            try:
                kept = await policies.enforce(rec.backend, rec.running, rec.channel, self.manager.approvals, policy,
                                              previous)
            except policy_model.PolicyError as e:
                raise HTTPError(400, str(e)) from None
            except SandboxError as e:
                raise HTTPError(404 if isinstance(e, SandboxGoneError) else 500, e.message) from None
            rec.spec = dataclasses.replace(rec.spec, policy=policy)
        self.manager.note(rec.sandbox_id, "policy.set", policy=policy.to_json(), key_id=api_events.caller_id(request.scope))
        # contexts that ran code before a strict filter keep the default one: named, as the agent says
        return JSONResponse({**policy.to_json(), **({"contextsKept": list(kept)} if kept else {})})

    async def list_approvals(self, request: Request) -> Response:
        rec = self._any_record(request)
        everything = request.query_params.get("all", "false").lower() in ("1", "true", "yes")
        return JSONResponse({"approvals": [a.to_json() for a in
                                           self.manager.approvals.list(rec.sandbox_id, include_decided=everything)]})

    async def decide_approval(self, request: Request) -> Response:
        body = await json_body(request)
        rec = self._any_record(request)
        allow, remember = body.get("allow"), body.get("remember", False)
        if not isinstance(allow, bool) or not isinstance(remember, bool):
            raise HTTPError(400, "the body is {\"allow\": true|false, \"remember\": true|false}")
        aid = request.path_params["approval_id"]
        try:
            item = self.manager.approvals.decide(rec.sandbox_id, aid, allow, remember,
                                                 by=api_events.caller_id(request.scope) or "api")
        except ApprovalNotFound:
            raise HTTPError(404, f"sandbox '{rec.sandbox_id}' has no approval request '{aid}'") from None
        except ApprovalDecided as e:
            raise HTTPError(409, str(e)) from None
        return JSONResponse(item.to_json())

    async def follow_approvals(self, request: Request) -> Response:
        """NDJSON: the sandbox's pending requests, then each new request and decision as it happens."""
        rec = self._record(request)

        async def lines() -> AsyncIterator[bytes]:
            async for item in self.manager.approvals.follow(rec.sandbox_id):
                yield json.dumps(item, separators=(",", ":"), default=str).encode() + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    def _recorded(self, request: Request) -> tuple[EventStore, str]:
        """The store and the sandbox id whose record the path names (alive, paused or gone)."""
        sandbox_id = request.path_params["sandbox_id"]
        store = self.manager.events
        if store is None:
            raise HTTPError(404, "this server keeps no behaviour records (it was started with --no-record)")
        if not store.known(sandbox_id) or not self._record_visible(request, store, sandbox_id):
            raise HTTPError(404, f"sandbox '{sandbox_id}' has no behaviour record here (never created on this "
                                 "server, or its record is past the retention time)")
        return store, sandbox_id

    def _record_visible(self, request: Request, store: EventStore, sandbox_id: str) -> bool:
        """Whether the caller may read this record: its sandbox's owner, alive or gone (then its record says)."""
        if not self.tenancy.enabled:
            return True
        rec = self.manager.find(sandbox_id)
        owner = rec.owner if rec is not None else recorded_owner(store, sandbox_id)
        return self.tenancy.sees(self.tenancy.caller(request.scope), owner)

    async def events(self, request: Request) -> Response:
        """agentcell extension: the sandbox's behaviour record as NDJSON, oldest first. Filters:
        kind= (repeatable or comma-separated; "file." matches a prefix), since= / until= (epoch
        seconds), after= (a seq); follow=true streams each new event until the sandbox is gone."""
        store, sandbox_id = self._recorded(request)
        q = request.query_params
        follow = q.get("follow", "false").lower() in ("1", "true", "yes")
        kinds = [k for value in q.getlist("kind") for k in value.split(",") if k]
        unknown = [k for k in kinds if k not in KIND_SET and not (k.endswith(".") and any(
            x.startswith(k) for x in KIND_SET))]
        if unknown:
            raise HTTPError(400, f"unknown event kind {unknown[0]!r}; kinds: {', '.join(KINDS)} (or a prefix like 'file.')")
        since, until = _epoch(q, "since"), _epoch(q, "until")
        after = _int_param(q, "after", 0)
        events = store.follow(sandbox_id, after, kinds, since, until, live=follow)

        async def lines() -> AsyncIterator[bytes]:
            async for event in events:
                yield json.dumps(event, separators=(",", ":"), default=str).encode() + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def report(self, request: Request) -> Response:
        """agentcell extension: the record summed up for a reviewer (record/report.py); JSON, or
        ?format=text, or ?format=html (one self-contained page, record/report_html.py, under a CSP
        that lets it load nothing)."""
        store, sandbox_id = self._recorded(request)
        fmt = request.query_params.get("format") or "json"
        if fmt not in ("json", "text", "html"):
            raise HTTPError(400, f"format must be json, text or html, not {fmt[:20]!r}")
        async with self._reports:  # a report pages through up to 100,000 events: a few at a time
            built = await asyncio.to_thread(report.build, store.iterate(sandbox_id), store.summary(sandbox_id))
            if fmt == "html":
                page = await asyncio.to_thread(lambda: report_html.encode(report_html.render(built)))
                return Response(page, media_type="text/html; charset=utf-8", headers=report_html.HEADERS)
        if fmt == "text":
            return Response(report.render(built), media_type="text/plain; charset=utf-8")
        return JSONResponse(json.loads(json.dumps(built, default=_jsonable)))

    async def kill(self, request: Request) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        if self.tenancy.enabled:
            sandbox_id = self._any_record(request).sandbox_id  # another tenant's is "not found"
        if not await self.manager.kill(sandbox_id):
            raise HTTPError(404, f"sandbox '{sandbox_id}' not found")
        return Response(status_code=204)

    async def set_timeout(self, request: Request) -> Response:
        body = await json_body(request)
        if "timeout" not in body:
            raise HTTPError(400, "'timeout' is required")
        timeout = _timeout(self.cfg, body, self.cfg.default_timeout, zero=True)
        self.manager.set_timeout(self._any_record(request), timeout)
        return Response(status_code=204)

    async def connect(self, request: Request) -> Response:
        """E2B's connect: a running sandbox's endAt is extended (200); a paused one is resumed (201),
        from its memory, or with "memory": false (on_resume="reboot") cold-started from its files."""
        body = await json_body(request, required=False)
        timeout = _timeout(self.cfg, body, self.cfg.default_timeout)
        memory = _optional_bool(body, "memory")
        rec = self._any_record(request)
        resumed = await self._resume(rec, timeout, memory)
        return JSONResponse(self.sandbox_json(rec, request), status_code=201 if resumed else 200)

    async def resume(self, request: Request) -> Response:
        """E2B's older resume (SDKs <= 2.5): 409 when the sandbox runs."""
        body = await json_body(request, required=False)
        timeout = _timeout(self.cfg, body, self.cfg.default_timeout)
        auto_pause = _optional_bool(body, "autoPause")
        memory = _optional_bool(body, "memory")
        rec = self._any_record(request)
        if rec.state is SandboxState.RUNNING:
            raise HTTPError(409, f"sandbox '{rec.sandbox_id}' is already running")
        await self._resume(rec, timeout, memory)
        if auto_pause is not None:
            rec.lifecycle = dataclasses.replace(rec.lifecycle, on_timeout="pause" if auto_pause else "kill")
        return JSONResponse(self.sandbox_json(rec, request), status_code=201)

    async def _resume(self, rec: SandboxRecord, timeout: int, memory: bool | None) -> bool:
        try:
            return await self.manager.resume(rec, timeout, memory)
        except CapacityError as e:
            raise HTTPError(429, str(e)) from None
        except SandboxGoneError:
            raise HTTPError(404, f"sandbox '{rec.sandbox_id}' not found") from None
        except (SandboxError, BackendUnavailableError, OSError) as e:
            raise internal_error(f"resuming {rec.sandbox_id}", e, "the sandbox could not be resumed") from None

    async def pause(self, request: Request) -> Response:
        """E2B's pause: 204; 409 when already paused. "memory" (default true) keeps its memory
        (frozen, resumed in ms); false keeps only its files and stops everything else."""
        body = await json_body(request, required=False)
        memory = _optional_bool(body, "memory")
        _optional_bool(body, "requireHealthyGuest")  # the agent is asked nothing to pause: always healthy
        rec = self._any_record(request)
        if refusal := volume_mounts.checkpoint_refusal(rec, "pause"):
            raise HTTPError(400, refusal)
        try:
            await self.manager.pause(rec, memory is not False)
        except AlreadyPausedError as e:
            raise HTTPError(409, str(e)) from None
        except CapacityError as e:
            raise HTTPError(429, str(e)) from None
        except SandboxGoneError:
            raise HTTPError(404, f"sandbox '{rec.sandbox_id}' not found") from None
        except (SandboxError, OSError) as e:
            if isinstance(e, SandboxError) and e.code == "resource_exhausted":
                raise HTTPError(500, f"the sandbox's files could not be kept: {e.message}") from None
            raise internal_error(f"pausing {rec.sandbox_id}", e, "the sandbox could not be paused") from None
        return Response(status_code=204)

    def _backend(self, body: dict[str, Any], template: str, snapshot: Snapshot | None) -> Backend:
        """The backend a create runs on: its snapshot's; else the body's `backend` (an agentcell extension,
        where the operator allows it: --create-backends); else the template's (--template-backend); else
        the server's default (--backend)."""
        backends = self.manager.backends
        if snapshot is not None:
            if snapshot.backend not in backends:
                raise HTTPError(400, f"snapshot '{template}' was taken on the {snapshot.backend} backend, which this "
                                     f"server does not run (it runs {', '.join(backends)})")
            return backends[snapshot.backend]
        asked = body.get("backend")
        if asked is not None:
            if not isinstance(asked, str):
                raise HTTPError(400, "'backend' must be a string")
            if asked not in self.cfg.create_backends:
                allowed = ", ".join(self.cfg.create_backends) or "none"
                raise HTTPError(400, f"this server's operator lets creates choose among these backends: {allowed} "
                                     f"(--create-backends), not {asked!r}")
            return backends[asked]
        name = dict(self.cfg.template_backends).get(TEMPLATES.get(template, template))
        return backends[name] if name else self.manager.backend

    def _memory_snapshots(self, backend: Backend, what: str) -> None:
        if not backend.memory_snapshots:
            raise HTTPError(400, f"{what} needs a backend that can save a sandbox's memory: this sandbox runs on the "
                                 f"{backend.name} backend; use the gvisor backend (or take a snapshot with "
                                 "mode=\"filesystem\")")

    async def create_snapshot(self, request: Request) -> Response:
        """E2B's POST /sandboxes/{id}/snapshots: {"name"?, "memory"?} -> 201 {snapshotID, names}.
        memory true ("full") needs the gvisor backend; unset, the server takes what its backend can."""
        body = await json_body(request, required=False)
        name = body.get("name")
        if name is not None and not isinstance(name, str):
            raise HTTPError(400, "'name' must be a string")
        memory = _optional_bool(body, "memory")
        rec = self._any_record(request)
        if refusal := volume_mounts.checkpoint_refusal(rec, "snapshot"):
            raise HTTPError(400, refusal)
        if memory is True:
            self._memory_snapshots(rec.backend, 'a snapshot with mode="full" (memory)')
        full = memory is not False and rec.backend.memory_snapshots and rec.pause_mode != "filesystem"
        try:
            template_id, directory, room = self.snapshots.begin(
                name or None, self.tenancy.caller(request.scope),
                rec.limits.checkpoint_max_bytes if full else rec.limits.archive_max_bytes)
        except SnapshotError as e:
            raise HTTPError(e.status, e.message) from None
        snap = Snapshot(template_id=template_id, name=name or None, mode="full" if full else "filesystem",
                        backend=rec.backend.name, sandbox_id=rec.sandbox_id, source_template=rec.template_id,
                        created_at=datetime.now(UTC).timestamp(), size_bytes=0,
                        limits=dataclasses.asdict(rec.limits), owner=self.tenancy.caller(request.scope))
        content = self.snapshots.content(snap)
        try:
            if full:
                await self.manager.checkpoint(rec, content, room)
            else:
                await self.manager.snapshot_files(rec, content, room)
            snap.size_bytes = tree_size(content)
            if snap.size_bytes > room:
                raise CapacityError("the snapshot is bigger than what is left of this server's snapshot quota")
        except BaseException as e:
            self.snapshots.abort(template_id, room)
            if isinstance(e, CapacityError) or (isinstance(e, SandboxError) and e.code == "resource_exhausted"):
                raise HTTPError(429, f"the snapshot does not fit in this server's snapshot quota: {e}") from None
            if isinstance(e, SandboxGoneError):
                raise HTTPError(404, f"sandbox '{rec.sandbox_id}' not found") from None
            if isinstance(e, SandboxError | OSError | NotImplementedError):
                raise internal_error(f"snapshotting {rec.sandbox_id}", e, "the snapshot could not be taken") from None
            raise
        await self.snapshots.commit(snap, room)
        return JSONResponse({"snapshotID": snap.snapshot_id, "names": snap.names}, status_code=201)

    async def list_snapshots(self, request: Request) -> Response:
        """E2B's GET /snapshots ?sandboxID&name&limit&nextToken, newest first; X-Next-Token pages."""
        q = request.query_params
        limit = _page_limit(q)
        snaps = self.snapshots.list(q.get("sandboxID") or None, q.get("name") or None)
        snaps = self.tenancy.visible(self.tenancy.caller(request.scope), snaps)
        snaps = _after(snaps, [s.template_id for s in snaps], q.get("nextToken"), "snapshot")
        page = snaps[:limit]
        headers = {"X-Next-Token": page[-1].template_id} if len(snaps) > limit else {}
        return JSONResponse([s.info() for s in page], headers=headers)

    async def delete_template(self, request: Request) -> Response:
        """E2B's DELETE /templates/{id}: deletes a snapshot (templates are not built here)."""
        ref = unquote(request.path_params["template_id"])
        if ref in TEMPLATES:
            raise HTTPError(400, f"'{ref}' is a built-in template; it cannot be deleted")
        snap = self._visible(request, self.snapshots.find(ref, self.tenancy.caller(request.scope)))
        if snap is None or not self.snapshots.delete(snap):
            raise HTTPError(404, f"snapshot '{ref}' not found")
        return Response(status_code=204)

    async def fork(self, request: Request) -> Response:
        """E2B's POST /sandboxes/{id}/fork {"timeout"?, "count"?}: `count` new sandboxes from one copy of
        this one, each its own id, hostname and limits: on gvisor a checkpoint (memory, processes, files);
        on a backend without memory snapshots (linux) its files alone, processes started afresh. Each
        answer's sandbox says which ("forkMode": "memory" | "filesystem", an agentcell extension)."""
        body = await json_body(request, required=False)
        timeout = _timeout(self.cfg, body, self.cfg.default_timeout)
        count = body.get("count", 1)
        if not _is_int(count) or not 1 <= count <= self.cfg.max_fork:
            raise HTTPError(400, f"'count' must be an integer between 1 and {self.cfg.max_fork}")
        rec = self._any_record(request)
        if refusal := volume_mounts.checkpoint_refusal(rec, "fork"):
            raise HTTPError(400, refusal)
        try:
            with self.tenancy.reserve(rec.owner, self._held(), rec.limits.memory_mb, count):  # forks are its owner's
                results = await self.manager.fork(rec, count, timeout)
        except QuotaError as e:
            raise HTTPError(429, str(e)) from None
        answers: list[dict[str, Any]] = []
        for r in results:
            if isinstance(r, SandboxRecord):
                answers.append({"sandbox": {**self.sandbox_json(r, request), "forkMode": r.fork_mode}})
            else:
                status = 429 if isinstance(r, CapacityError) else 500
                answers.append({"error": {"code": status, "message": f"the fork could not be started: {r}"}})
        return JSONResponse(answers, status_code=201)

    async def template_alias(self, request: Request) -> Response:
        """E2B's GET /templates/aliases/{alias} (Template.exists): the templates this server has."""
        alias = request.path_params["alias"]
        if alias not in TEMPLATES:
            raise HTTPError(404, f"template '{alias}' not found; available: {', '.join(TEMPLATES)}")
        return JSONResponse({"templateID": TEMPLATES[alias], "public": True})

    @staticmethod
    def _not_served(what: str):  # type: ignore[no-untyped-def]
        async def handler(request: Request) -> Response:
            raise HTTPError(501, f"{what} are not supported by agentcell yet")

        return handler

    async def metrics(self, request: Request) -> Response:
        """E2B's metrics of one sandbox: the samples within `start`..`end` (unix seconds; default
        its whole kept history), a fresh one included when the range reaches now."""
        rec = self._any_record(request)  # a paused one's history is kept; it takes no new samples
        start = _unix_seconds(request, "start", 0)
        end = _unix_seconds(request, "end", None)
        if end is not None and end < start:
            raise HTTPError(400, "'end' must not be before 'start'")
        try:
            if rec.state is SandboxState.RUNNING:
                await rec.sample(rec.backend, MIN_GAP_S)
        except SandboxGoneError:
            raise HTTPError(404, f"sandbox {rec.sandbox_id} was not found") from None
        except Exception as e:
            raise internal_error(f"reading the metrics of {rec.sandbox_id}", e, "could not read the sandbox's metrics") from None
        # E2B's query is whole seconds: `end` covers the whole of its second.
        rows = rec.metrics.between(start, math.inf if end is None else end + 1)
        mem_total = rec.limits.memory_mb * 1024 * 1024
        disk_total = rec.limits.disk_limit_mb * 1024 * 1024
        return JSONResponse([metric_json(r, rec.limits.cpu_count, mem_total, disk_total) for r in rows])

    async def health(self, request: Request) -> Response:
        """Liveness for embedded mode and operators; needs no API key and reveals only a count."""
        caller = self.tenancy.caller(request.scope)  # with tenancy: only the caller's own are counted
        return JSONResponse({"status": "ok", "sandboxes": len(self.tenancy.visible(caller, self.manager.list())),
                             # how each backend isolates (agentcell extension; microvm under TCG says it is emulated)
                             "isolation": {name: b.isolation for name, b in self.manager.backends.items()}})

    def routes(self) -> list[Route]:
        sid = "/sandboxes/{sandbox_id}"
        return [
            Route("/health", self.health, methods=["GET"]),
            # before /sandboxes/{sandbox_id}, which would take /sandboxes/metrics for a sandbox id
            Route("/templates/aliases/{alias}", self.template_alias, methods=["GET"]),
            *self.vault.routes(),
            *(Route(path, self._not_served(what), methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
              for path, what in UNSERVED),
            Route("/sandboxes", self.create, methods=["POST"]),
            Route("/v2/sandboxes", self.create, methods=["POST"]),
            Route("/sandboxes", self.list_v1, methods=["GET"]),
            Route("/v2/sandboxes", self.list_v2, methods=["GET"]),
            Route(sid, self.get, methods=["GET"]),
            Route(sid, self.kill, methods=["DELETE"]),
            Route(sid + "/timeout", self.set_timeout, methods=["POST"]),
            Route(sid + "/network", self.update_network, methods=["PUT"]),
            Route(sid + "/policy", self.get_policy, methods=["GET"]),
            Route(sid + "/policy", self.put_policy, methods=["PUT"]),
            Route(sid + "/approvals", self.list_approvals, methods=["GET"]),
            Route(sid + "/approvals/stream", self.follow_approvals, methods=["GET"]),
            Route(sid + "/approvals/{approval_id}", self.decide_approval, methods=["POST"]),
            Route(sid + "/events", self.events, methods=["GET"]),
            Route(sid + "/report", self.report, methods=["GET"]),
            Route(sid + "/connect", self.connect, methods=["POST"]),
            Route("/v2" + sid + "/connect", self.connect, methods=["POST"]),
            Route(sid + "/resume", self.resume, methods=["POST"]),
            Route(sid + "/pause", self.pause, methods=["POST"]),
            Route(sid + "/fork", self.fork, methods=["POST"]),
            Route(sid + "/snapshots", self.create_snapshot, methods=["POST"]),
            Route("/snapshots", self.list_snapshots, methods=["GET"]),
            Route("/templates/{template_id}", self.delete_template, methods=["DELETE"]),
            Route("/templates/{template_id}", self._not_served("template builds"), methods=["GET", "POST", "PUT", "PATCH"]),
            Route(sid + "/metrics", self.metrics, methods=["GET"]),
        ]
