"""`GET /ui/api/sandboxes/{id}/detail`: one sandbox's page, secrets redacted.

What the control plane says of it (GET /sandboxes/{id}: network rules' header values are already
redacted there, secrets are names and hosts) without its access tokens, its policy, and its
environment: the variables it was created with, and its secrets' names, each secret shown as REDACTED
(the sandbox itself only ever holds a placeholder; the value stays in the server). A gateway asks the
sandbox's cell's console.
"""

from __future__ import annotations

from typing import Any

import httpx

from agentcell.console.passthrough import TOKEN_FIELDS
from agentcell.console.upstream import Upstream, UpstreamError, error_message

REDACTED = "•••"
_LISTED = ("templateID", "alias", "sandboxID", "clientID", "startedAt", "endAt", "cpuCount", "memoryMB",
           "diskSizeMB", "state", "envdVersion", "metadata")


def redacted_envs(envs: dict[str, str], secret_names: list[str]) -> dict[str, str]:
    out = {k: (REDACTED if k in secret_names else v) for k, v in envs.items()}
    out.update({name: REDACTED for name in secret_names})
    return out


async def server_detail(upstream: Upstream, manager: Any, outer: dict[str, Any], sandbox_id: str) -> dict[str, Any]:
    reply = await upstream.control(outer, "GET", f"/sandboxes/{sandbox_id}")
    reply.raise_for_status()  # 404 for one the caller may not see
    got = {k: v for k, v in (reply.json() or {}).items() if k not in TOKEN_FIELDS}
    rec = manager.find(sandbox_id)
    if rec is None:
        raise UpstreamError(404, f"sandbox {sandbox_id} was not found")
    secrets = got.get("secrets") or {}
    policy_reply = await upstream.control(outer, "GET", f"/sandboxes/{sandbox_id}/policy")
    policy = policy_reply.json() if policy_reply.status == 200 else None
    return {
        "sandbox": {k: got[k] for k in _LISTED if k in got},
        "envVars": redacted_envs(dict(rec.envs), sorted(secrets)),
        "metadata": got.get("metadata") or {},
        "network": {**(got.get("network") or {}), "allowInternetAccess": got.get("allowInternetAccess"),
                    "secrets": secrets},
        "policy": policy,
        "limits": got.get("limits") or {},
        "lifecycle": got.get("lifecycle") or {},
    }


async def gateway_detail(gateway: Any, sandbox_id: str) -> dict[str, Any]:
    cell = gateway.cells.route(sandbox_id)
    if cell is None:
        raise UpstreamError(404, f"sandbox {sandbox_id} was not found")
    try:
        r = await gateway.client.get(f"{cell.url}/ui/api/sandboxes/{sandbox_id}/detail",
                                     headers=gateway.cells.headers(), timeout=10.0)
    except httpx.HTTPError as e:
        raise UpstreamError(502, f"cell {cell.cell_id} did not answer: {e}") from None
    if r.status_code != 200:
        raise UpstreamError(r.status_code, error_message(r.content, r.status_code))
    return dict(r.json())
