"""Credentials, checked by the root router before any handler runs or any body is read.

Control plane: `X-API-KEY` when the server has a key. Data plane (every request routed to a sandbox):
the sandbox's `X-Access-Token`; on the code interpreter also its `E2B-Traffic-Access-Token`, which is
what the official code-interpreter SDK sends on /contexts; on `/files` also the v1 signature the SDK
puts in download/upload URLs. Only `GET /health` is open, as in envd. Ports served out of a sandbox
(any other port) are public, as on E2B, unless the sandbox was created with `allowPublicTraffic`
false: then they need the `E2B-Traffic-Access-Token`. All comparisons are constant-time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from typing import Any

from agentcell.server.asgi import header, query

ENVD_PORT = 49983
INTERPRETER_PORT = 49999
MISSING_TOKEN = "missing or invalid X-Access-Token"
MISSING_TRAFFIC_TOKEN = ("missing or invalid E2B-Traffic-Access-Token: this sandbox was created with "
                         "allowPublicTraffic false, so its ports need its trafficAccessToken")


def _equal(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode("latin-1"), expected.encode())


def api_key_ok(scope: dict[str, Any], api_key: str) -> bool:
    return _equal(header(scope, b"x-api-key"), api_key)


def traffic_token(access_token: str) -> str:
    """A sandbox's trafficAccessToken, derived from its access token so the registry keeps one secret.

    It opens the sandbox's ports (49999) but not envd, as E2B's traffic token does.
    """
    digest = hmac.new(access_token.encode(), b"agentcell traffic access token", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest[:24]).decode()


def signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """envd's v1 file URL signature (shared/e2b-protocol.md §3)."""
    raw = f"{path}:{operation}:{user}:{token}" + (f":{expiration}" if expiration is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def _file_signature_refusal(scope: dict[str, Any], token: str, operation: str) -> str | None:
    q = query(scope)
    sig = q.get("signature")
    if not sig:
        return MISSING_TOKEN
    expiration: int | None = None
    raw_exp = q.get("signature_expiration")
    if raw_exp:
        try:
            expiration = int(raw_exp)
        except ValueError:
            return "invalid signature_expiration"
        if expiration < time.time():
            return "the signature has expired"
    expected = signature(q.get("path") or "", operation, q.get("username") or "", token, expiration)
    return None if hmac.compare_digest(sig.encode(), expected.encode()) else "invalid signature"


def data_plane_refusal(scope: dict[str, Any], access_token: str, port: int) -> str | None:
    """Why a request to a sandbox's data plane is refused (401), or None to let it through."""
    method, path = scope["method"], scope["path"]
    if path == "/health" and method in ("GET", "HEAD") and port in (ENVD_PORT, INTERPRETER_PORT):
        return None
    if _equal(header(scope, b"x-access-token"), access_token):
        return None
    if port != ENVD_PORT and _equal(header(scope, b"e2b-traffic-access-token"), traffic_token(access_token)):
        return None
    if port == ENVD_PORT and path == "/files" and method in ("GET", "POST"):
        return _file_signature_refusal(scope, access_token, "read" if method == "GET" else "write")
    return MISSING_TOKEN


def user_port_refusal(scope: dict[str, Any], access_token: str, public: bool) -> str | None:
    """Why a request to a port served out of a sandbox is refused (401), or None to let it through."""
    if public or _equal(header(scope, b"e2b-traffic-access-token"), traffic_token(access_token)):
        return None
    return MISSING_TRAFFIC_TOKEN
