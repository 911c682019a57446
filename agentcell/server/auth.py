"""Credentials, checked by the root router before any handler runs or any body is read.

Control plane: `X-API-KEY` when the server has a key. Data plane (every request routed to a sandbox):
the sandbox's `X-Access-Token`; on `/files` also the v1 signature the SDK puts in download/upload
URLs. Only `GET /health` is open, as in envd.

The `E2B-Traffic-Access-Token` is a port visitor's credential: it opens the ports served out of the
sandbox (which are public, as on E2B, unless the sandbox was created with `allowPublicTraffic`
false), and on the code interpreter only the context endpoints the official code-interpreter SDK
calls with it alone (`TRAFFIC_TOKEN_ROUTES`: listing, creating, restarting, deleting a context; none
runs code). Never `/execute`, never envd (commands, files, PTYs). All comparisons are constant-time.

Each check returns the `Credential` it verified (a kind and an id that names it without revealing
it), or raises `Refused` (401): the behaviour record says who made a call by what was verified, never
by what a request merely carried.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agentcell.server.asgi import header, query

ENVD_PORT = 49983
INTERPRETER_PORT = 49999
MISSING_TOKEN = "missing or invalid X-Access-Token"
MISSING_TRAFFIC_TOKEN = ("missing or invalid E2B-Traffic-Access-Token: this sandbox was created with "
                         "allowPublicTraffic false, so its ports need its trafficAccessToken")
TRAFFIC_TOKEN_NOT_ENOUGH = ("the E2B-Traffic-Access-Token opens this sandbox's ports and the code interpreter's "
                            "context endpoints only; this call needs the sandbox's X-Access-Token (envdAccessToken)")
MISSING_API_KEY = "invalid or missing X-API-KEY"

# (method, path) on the code interpreter that the traffic token opens: what the official
# code-interpreter SDK sends with the traffic token alone. None runs code; a restart or a delete
# loses that context's state.
TRAFFIC_TOKEN_ROUTES = (("GET", re.compile(r"/contexts")), ("POST", re.compile(r"/contexts")),
                        ("DELETE", re.compile(r"/contexts/[^/]+")), ("POST", re.compile(r"/contexts/[^/]+/restart")))
CREDENTIAL = "agentcell.credential"  # the scope key under which the router leaves what it verified


@dataclass(frozen=True)
class Credential:
    """What authenticated a request: `kind` (API_KEY, NO_KEY, ACCESS_TOKEN, TRAFFIC_TOKEN, SIGNED_URL,
    PUBLIC, OPEN) and `id`, what the record calls it: a kind and 12 hex digits of the credential's
    SHA-256, never the credential."""

    kind: str
    id: str


API_KEY, NO_KEY, ACCESS_TOKEN, TRAFFIC_TOKEN, SIGNED_URL, PUBLIC, OPEN = (
    "api-key", "none", "access-token", "traffic-token", "signed-url", "public", "open")
NONE_NEEDED = Credential(NO_KEY, "none")  # a server without an API key: nothing was verified
PUBLIC_PORT = Credential(PUBLIC, "public")  # a port served with public traffic
HEALTH = Credential(OPEN, "open")  # /health


class Refused(Exception):
    """A request without the credential it needs (401); `message` tells the client which."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _named(prefix: str, secret: str) -> Credential:
    kind = {"key": API_KEY, "token": ACCESS_TOKEN, "traffic": TRAFFIC_TOKEN, "signed-url": SIGNED_URL}[prefix]
    return Credential(kind, f"{prefix}:{hashlib.sha256(secret.encode()).hexdigest()[:12]}")


def _equal(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode("latin-1"), expected.encode())


def presented_keys(scope: dict[str, Any]) -> list[str]:
    """The API keys a request presents: its X-API-KEY, then an `Authorization: Bearer` token (what
    Prometheus's scrape config and MCP clients' configurations send)."""
    keys = [given] if (given := header(scope, b"x-api-key")) else []
    scheme, _, token = (header(scope, b"authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    return keys


def key_presented(scope: dict[str, Any], api_key: str) -> bool:
    """Whether the request presents `api_key` in either form (/metrics, /mcp); each compared in constant
    time, every one of them."""
    return any([_equal(k, api_key) for k in presented_keys(scope)])


def control_credential(scope: dict[str, Any], api_key: str | None) -> Credential:
    """The control plane's check: the server's API key when it has one (Refused otherwise)."""
    if api_key is None:
        return NONE_NEEDED
    if _equal(header(scope, b"x-api-key"), api_key):
        return _named("key", api_key)
    raise Refused(MISSING_API_KEY)


def traffic_token(access_token: str) -> str:
    """A sandbox's trafficAccessToken, derived from its access token so the registry keeps one secret.

    It opens the sandbox's ports and the code interpreter's context endpoints (TRAFFIC_TOKEN_ROUTES),
    never /execute nor envd.
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


def _signed(scope: dict[str, Any]) -> Credential:
    return _named("signed-url", query(scope).get("signature") or "")


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


def signed_url_credential(scope: dict[str, Any], tokens: Iterable[tuple[str, str]]) -> tuple[str, Credential]:
    """signed_sandbox as a check: (sandbox id, the signed URL's credential), or Refused (envd's message)."""
    sandbox_id, refusal = signed_sandbox(scope, tokens)
    if sandbox_id is None:
        raise Refused(refusal or INVALID_SIGNATURE)
    return sandbox_id, _signed(scope)


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


def traffic_token_opens(method: str, path: str) -> bool:
    """Whether the traffic token alone opens this call on the code interpreter."""
    return any(method == m and pattern.fullmatch(path) for m, pattern in TRAFFIC_TOKEN_ROUTES)


def data_plane_credential(scope: dict[str, Any], access_token: str, port: int) -> Credential:
    """What lets a request to a sandbox's envd (49983) or code interpreter (49999) through; Refused
    (401) if nothing does, BadExpiration (400) for a malformed signature expiry."""
    method, path = scope["method"], scope["path"]
    if path == "/health" and method in ("GET", "HEAD") and port in (ENVD_PORT, INTERPRETER_PORT):
        return HEALTH
    if _equal(header(scope, b"x-access-token"), access_token):
        return _named("token", access_token)
    if port == ENVD_PORT and path == "/files" and method in ("GET", "POST"):
        refusal = file_signature_refusal(scope, access_token, file_operation(method))
        if refusal is not None:
            raise Refused(refusal)
        return _signed(scope)
    traffic = traffic_token(access_token)
    if _equal(header(scope, b"e2b-traffic-access-token"), traffic):
        if port == INTERPRETER_PORT and traffic_token_opens(method, path):
            return _named("traffic", traffic)
        raise Refused(TRAFFIC_TOKEN_NOT_ENOUGH)
    raise Refused(MISSING_TOKEN)


def user_port_credential(scope: dict[str, Any], access_token: str, public: bool) -> Credential:
    """What lets a request to a port served out of a sandbox through (the traffic token, or the
    port being public); Refused if nothing does (the router answers E2B's 403: ingress.py)."""
    traffic = traffic_token(access_token)
    if _equal(header(scope, b"e2b-traffic-access-token"), traffic):
        return _named("traffic", traffic)
    if public:
        return PUBLIC_PORT
    raise Refused(MISSING_TRAFFIC_TOKEN)
