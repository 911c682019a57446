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
import binascii
import hashlib
import hmac
import time
from collections.abc import Iterable
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


# envd's own 401 messages for /files (infra/packages/envd/internal/api/auth.go, validateSigning).
TOKEN_MISMATCH = "access token present in header but does not match"
MISSING_SIGNATURE = "missing signature query parameter"
INVALID_SIGNATURE = "invalid signature"
EXPIRED_SIGNATURE = "signature is already expired"


class BadExpiration(ValueError):
    """signature_expiration is not an integer (envd answers 400 for the malformed parameter)."""


def file_operation(method: str) -> str:
    return "read" if method in ("GET", "HEAD") else "write"


def _expiration(scope: dict[str, Any]) -> int | None:
    raw = query(scope).get("signature_expiration")
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise BadExpiration(f"Invalid format for parameter signature_expiration: {raw!r} is not an integer") from None


def _signature_matches(scope: dict[str, Any], token: str, operation: str, expiration: int | None) -> bool:
    q = query(scope)
    expected = signature(q.get("path") or "", operation, q.get("username") or "", token, expiration)
    return hmac.compare_digest((q.get("signature") or "").encode("latin-1", "replace"), expected.encode())


def file_signature_refusal(scope: dict[str, Any], token: str, operation: str) -> str | None:
    """envd's check of a /files request without the right X-Access-Token, in envd's order: a wrong
    header, no signature, a signature that does not match, then its expiry (raises BadExpiration)."""
    if header(scope, b"x-access-token"):
        return TOKEN_MISMATCH
    if not query(scope).get("signature"):
        return MISSING_SIGNATURE
    expiration = _expiration(scope)
    if not _signature_matches(scope, token, operation, expiration):
        return INVALID_SIGNATURE
    if expiration is not None and expiration < time.time():
        return EXPIRED_SIGNATURE
    return None


def signed_sandbox(scope: dict[str, Any], tokens: Iterable[tuple[str, str]]) -> tuple[str | None, str | None]:
    """(sandbox id, None) of the sandbox whose token signed this id-less /files URL, else (None, why).

    E2B_SANDBOX_URL makes the SDKs' download_url()/upload_url() name no sandbox (no Host, no header):
    only the signature, made with one sandbox's access token, tells which. Every live token is tried
    (one SHA-256 each, constant-time compares), so the cost is bounded by --max-sandboxes."""
    if not query(scope).get("signature"):
        return None, MISSING_SIGNATURE
    expiration = _expiration(scope)
    operation = file_operation(scope["method"])
    found = None
    for sandbox_id, token in tokens:
        if _signature_matches(scope, token, operation, expiration) and found is None:
            found = sandbox_id  # no early exit: the time taken does not tell which one matched
    if found is None:
        return None, INVALID_SIGNATURE
    if expiration is not None and expiration < time.time():
        return None, EXPIRED_SIGNATURE
    return found, None


class MalformedAuthorization(ValueError):
    pass


def basic_user(authorization: str | None) -> str | None:
    """The name in `Authorization: Basic base64("<user>:")` (how E2B's SDKs say who runs a call),
    None without such a header; MalformedAuthorization when it cannot be decoded."""
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise MalformedAuthorization("malformed Basic authorization header") from None


def run_as(name: str | None) -> str:
    """A data-plane call's user: `user` (also when none is named) or the sandbox's `root`;
    ValueError for any other name."""
    if name in (None, "", "user"):
        return "user"
    if name == "root":
        return "root"
    raise ValueError(f"unknown user '{name}': the users are 'user' and 'root'")


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
        return file_signature_refusal(scope, access_token, file_operation(method))
    return MISSING_TOKEN


def user_port_refusal(scope: dict[str, Any], access_token: str, public: bool) -> str | None:
    """Why a request to a port served out of a sandbox is refused (401), or None to let it through."""
    if public or _equal(header(scope, b"e2b-traffic-access-token"), traffic_token(access_token)):
        return None
    return MISSING_TRAFFIC_TOKEN
