"""Control-plane REST calls (sandbox create / connect / list / info / timeout / kill), sync and async."""

from __future__ import annotations

import json as _json
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import httpx

from agentcell.errors import (
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
    SandboxNotFoundException,
)
from agentcell.sdk import fast_async_http
from agentcell.sdk.config import ConnectionConfig
from agentcell.sdk.fast_http import JSON_HEADERS
from agentcell.sdk.transport import error_from_http, error_from_transport, sync_client, timeout

_R = TypeVar("_R", httpx.Response, fast_async_http.Response)


ALL_TRAFFIC = "0.0.0.0/0"  # as e2b.sandbox.network.ALL_TRAFFIC


@dataclass(frozen=True)
class NetworkSelectorContext:
    """What an `allow_out`/`deny_out` callable receives (e2b's SandboxNetworkSelectorContext)."""

    all_traffic: str = ALL_TRAFFIC
    rules: Mapping[str, Any] = field(default_factory=dict)


_NETWORK_KEYS = {"allow_out": "allowOut", "deny_out": "denyOut", "allow_public_traffic": "allowPublicTraffic",
                 "mask_request_host": "maskRequestHost", "dns_servers": "dnsServers",
                 "egress_proxy": "egressProxy", "rules": "rules", "https_ports": "httpsPorts"}


def network_body(network: Mapping[str, Any]) -> dict[str, Any]:
    """e2b's SandboxNetworkOpts (snake_case; allow_out/deny_out may be callables) as the API's JSON."""
    body: dict[str, Any] = {}
    for key, value in network.items():
        if key not in _NETWORK_KEYS:
            raise InvalidArgumentException(f"unknown network option {key!r}; known: {', '.join(_NETWORK_KEYS)}")
        if key in ("allow_out", "deny_out") and callable(value):
            value = value(NetworkSelectorContext(rules=network.get("rules") or {}))
        if key in ("allow_out", "deny_out", "dns_servers", "https_ports") and value is not None:
            value = list(value)
        if key == "egress_proxy" and value is not None:
            value = egress_proxy_body(value)
        if value is not None:
            body[_NETWORK_KEYS[key]] = value
    return body


def egress_proxy_body(proxy: Any) -> dict[str, Any]:
    """e2b's SandboxEgressProxyOpts (``address``, ``username``, ``password``, ``tls``: bool or
    ``{server_name, ca_cert}``) as the API's JSON, known fields only; None credentials left out."""
    if not isinstance(proxy, Mapping) or not isinstance(proxy.get("address"), str):
        raise InvalidArgumentException("network egress_proxy must be a dict with a string 'address' "
                                       "(e.g. 'proxy.example.com:1080').")
    body: dict[str, Any] = {"address": proxy["address"]}
    for key in ("username", "password"):
        if proxy.get(key) is not None:
            body[key] = proxy[key]
    tls = proxy.get("tls")
    if isinstance(tls, bool):
        if tls:
            body["tls"] = {"enabled": True}
    elif isinstance(tls, Mapping):
        body["tls"] = {"enabled": True, **{camel: tls[snake] for snake, camel in
                                           (("server_name", "serverName"), ("ca_cert", "caCert"))
                                           if tls.get(snake) is not None}}
    elif tls is not None:
        raise InvalidArgumentException("network egress_proxy tls must be a bool or a dict.")
    return body


def create_body(template: str, timeout_s: int | None, metadata: dict[str, str] | None, envs: dict[str, str] | None,
                limits: dict[str, Any] | None, allow_internet_access: bool | None = None,
                network: Mapping[str, Any] | None = None,
                secrets: Mapping[str, Mapping[str, Any]] | None = None, secure: bool | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"templateID": template, "metadata": metadata or {}, "envVars": envs or {}}
    if secure is not None:
        body["secure"] = bool(secure)
    if timeout_s is not None:
        body["timeout"] = int(timeout_s)
    if limits:
        body["limits"] = limits  # agentcell extension: memoryMB, pids, cpuCount, diskMB, openFiles
    if allow_internet_access is not None:  # None: the server's default (--internet-default)
        body["allow_internet_access"] = bool(allow_internet_access)
    if network:
        body["network"] = network_body(network)
    if secrets:
        body["secrets"] = {name: dict(spec) for name, spec in secrets.items()}  # agentcell extension
    return body


def snapshot_memory(mode: str | None, keep_memory: bool | None = None, what: str = "mode") -> bool | None:
    """e2b's mode ("full" | "filesystem", or the older keep_memory) as the API's `memory` flag;
    None leaves the choice to the server."""
    if mode is not None and keep_memory is not None:
        raise InvalidArgumentException(f"pass either {what} or the deprecated keep_memory, not both")
    if mode is None:
        return None if keep_memory is None else bool(keep_memory)
    if mode not in ("full", "filesystem"):
        raise InvalidArgumentException(f"{what} must be 'full' or 'filesystem', got {mode!r}")
    return mode == "full"


def lifecycle_body(lifecycle: Mapping[str, Any] | None) -> dict[str, Any]:
    """e2b's SandboxLifecycle as the create fields autoPause / autoPauseMemory / autoResume.
    on_timeout is "kill" | "pause" | {"action": ..., "mode": "full" | "filesystem"}."""
    if not lifecycle:
        return {}
    raw = lifecycle.get("on_timeout")
    opts: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    action = opts.get("action") if isinstance(raw, Mapping) else raw
    if raw is not None and action not in ("kill", "pause"):
        raise InvalidArgumentException(f"on_timeout must be 'kill' or 'pause', got {action!r}")
    if ("mode" in opts or "keep_memory" in opts) and action != "pause":
        raise InvalidArgumentException("mode is only allowed when on_timeout's action is 'pause'")
    memory = snapshot_memory(opts.get("mode"), opts.get("keep_memory"), 'on_timeout["mode"]')
    auto_resume = lifecycle.get("auto_resume")
    if auto_resume and action != "pause":
        raise InvalidArgumentException("auto_resume can only be True when on_timeout is 'pause'")
    if auto_resume and memory is False:
        raise InvalidArgumentException("auto_resume cannot be combined with mode 'filesystem': such a sandbox is "
                                       "resumed explicitly (Sandbox.connect)")
    body: dict[str, Any] = {}
    if raw is not None:
        body["autoPause"] = action == "pause"
    if memory is not None and action == "pause":
        body["autoPauseMemory"] = memory
    if auto_resume is not None:
        body["autoResume"] = {"enabled": bool(auto_resume)}
    return body


def connect_body(timeout_s: int | None, on_resume: str = "restore") -> dict[str, Any]:
    """e2b's connect: on_resume "restore" (memory, if it was kept) or "reboot" (a cold start from its files)."""
    if on_resume not in ("restore", "reboot"):
        raise InvalidArgumentException(f"on_resume must be 'restore' or 'reboot', got {on_resume!r}")
    body: dict[str, Any] = {"timeout": int(timeout_s)} if timeout_s else {}
    if on_resume == "reboot":
        body["memory"] = False
    return body


def pause_body(keep_memory: bool | None, mode: str | None) -> dict[str, Any]:
    memory = snapshot_memory(mode, keep_memory)
    return {} if memory is None else {"memory": memory}


def snapshot_body(name: str | None, mode: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name} if name else {}
    memory = snapshot_memory(mode)
    if memory is not None:
        body["memory"] = memory
    return body


def fork_body(timeout_s: int | None, count: int | None) -> dict[str, Any]:
    if count is not None and (not isinstance(count, int) or count < 1):
        raise InvalidArgumentException("count must be at least 1")
    body: dict[str, Any] = {}
    if timeout_s is not None:
        body["timeout"] = int(timeout_s)
    if count is not None:
        body["count"] = count
    return body


def fork_results(data: Any) -> list[tuple[dict[str, Any] | None, Exception | None]]:
    """The fork response's entries: (sandbox JSON, None) or (None, the error as an exception)."""
    out: list[tuple[dict[str, Any] | None, Exception | None]] = []
    for entry in data if isinstance(data, list) else []:
        sandbox = entry.get("sandbox") if isinstance(entry, dict) else None
        if isinstance(sandbox, dict):
            out.append((sandbox, None))
            continue
        err = entry.get("error") if isinstance(entry, dict) else None
        err = err if isinstance(err, dict) else {}
        out.append((None, error_from_http(int(err.get("code", 500)), _json.dumps(err).encode(), None, "fork")))
    return out


def snapshot_params(sandbox_id: str | None, name: str | None, limit: int | None, next_token: str | None) -> dict[str, str]:
    params = {"sandboxID": sandbox_id, "name": name, "limit": str(limit) if limit else None, "nextToken": next_token}
    return {k: v for k, v in params.items() if v}


def network_update_body(network: Mapping[str, Any]) -> dict[str, Any]:
    """e2b's SandboxNetworkUpdate: allow_out, deny_out, allow_internet_access (the rest is replaced)."""
    rest = {k: v for k, v in network.items() if k != "allow_internet_access"}
    body = network_body(rest)
    if "allow_internet_access" in network:
        body["allow_internet_access"] = bool(network["allow_internet_access"])
    return body


def create_headers(idempotency_key: str | None) -> dict[str, str]:
    """e2b's idempotency_key: a create retried with it gets the first one's sandbox (for an hour)."""
    if idempotency_key is None:
        return {}
    if not isinstance(idempotency_key, str) or not re.fullmatch(r"[a-z0-9-]{1,255}", idempotency_key):
        raise InvalidArgumentException(
            "idempotency_key must be 1-255 characters of lowercase letters, digits and hyphens")
    return {"Idempotency-Key": idempotency_key}


def metrics_params(start: datetime | None, end: datetime | None) -> dict[str, str]:
    """e2b's get_metrics range: whole unix seconds."""
    params = {}
    if start is not None:
        params["start"] = str(int(start.timestamp()))
    if end is not None:
        params["end"] = str(int(end.timestamp()))
    return params


def list_params(metadata: dict[str, str] | None, state: list[str] | None, limit: int | None,
                next_token: str | None, order: str | None = None) -> dict[str, str]:
    params: dict[str, str] = {}
    if order is not None:
        if order not in ("asc", "desc"):
            raise InvalidArgumentException(f"invalid order {order!r}, expected 'asc' or 'desc'")
        params["order"] = order
    if metadata:
        params["metadata"] = urllib.parse.urlencode({urllib.parse.quote(k): urllib.parse.quote(v) for k, v in metadata.items()})
    if state:
        params["state"] = ",".join(state)
    if limit:
        params["limit"] = str(limit)
    if next_token:
        params["nextToken"] = next_token
    return params


def _check(r: _R, ok: tuple[int, ...], what: str, sandbox_id: str | None) -> _R:
    if r.status_code in ok:
        return r
    e = error_from_http(r.status_code, r.content, sandbox_id, what)
    if isinstance(e, NotFoundException) and sandbox_id:
        raise SandboxNotFoundException(f"sandbox {sandbox_id} not found (killed, timed out, or never existed): {e}")
    raise e


def call(config: ConnectionConfig, method: str, path: str, *, json: Any = None, params: dict[str, str] | None = None,
         ok: tuple[int, ...] = (200,), sandbox_id: str | None = None, request_timeout: float | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    what = f"{method} {path}"
    try:
        r = sync_client(config.endpoint).request(
            method, path, json=json, params=params, headers={**config.control_headers(), **(headers or {})},
            timeout=timeout(request_timeout or config.request_timeout))
    except httpx.HTTPError as e:
        raise error_from_transport(e, what) from None
    return _check(r, ok, what, sandbox_id)


async def acall(config: ConnectionConfig, method: str, path: str, *, json: Any = None,
                params: dict[str, str] | None = None, ok: tuple[int, ...] = (200,), sandbox_id: str | None = None,
                request_timeout: float | None = None, headers: dict[str, str] | None = None) -> fast_async_http.Response:
    """call() for async code; the response's body is read (status_code, headers, content, json())."""
    what = f"{method} {path}"
    headers = {**config.control_headers(), **(headers or {})}
    body = None
    if json is not None:
        body = fast_async_http.json_body(json)
        headers = {**headers, **JSON_HEADERS}
    rt = request_timeout or config.request_timeout or None
    try:
        r = await fast_async_http.client(config.endpoint).request(
            method, fast_async_http.with_query(path, params), body=body, headers=headers, connect=rt, read=rt)
    except fast_async_http.HTTPError as e:
        raise fast_async_http.transport_error(e, what) from None
    return _check(r, ok, what, sandbox_id)


def sandbox_fields(data: Any) -> tuple[str, str | None]:
    if not isinstance(data, dict) or "sandboxID" not in data:
        raise SandboxException(f"the server's sandbox response has no sandboxID: {data!r}")
    return data["sandboxID"], data.get("envdAccessToken")


def sandbox_extras(data: dict[str, Any]) -> dict[str, str | None]:
    """The create/connect response's domain and traffic token, as SandboxConnection's keywords."""
    domain, traffic = data.get("domain"), data.get("trafficAccessToken")
    return {"domain": domain if isinstance(domain, str) else None,
            "traffic_access_token": traffic if isinstance(traffic, str) else None}


def events_query(kinds: str | list[str] | None, since: float | datetime | None, until: float | datetime | None,
                 follow: bool) -> dict[str, str]:
    """The query of GET /sandboxes/{id}/events (agentcell extension)."""
    params: dict[str, str] = {}
    if kinds:
        params["kind"] = kinds if isinstance(kinds, str) else ",".join(kinds)
    for name, t in (("since", since), ("until", until)):
        if t is not None:
            params[name] = str(t.timestamp() if isinstance(t, datetime) else float(t))
    if follow:
        params["follow"] = "true"
    return params


def report_query(format: str) -> dict[str, str]:
    if format not in ("json", "text", "html"):
        raise InvalidArgumentException(f"format must be 'json', 'text' or 'html', got {format!r}")
    return {"format": format}
