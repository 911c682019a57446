"""One persistent httpx keep-alive client per endpoint for the sync SDK's control plane, and the mapping of
HTTP failures to the SDK's exceptions. (The sync hot paths use fast_http, the async SDK fast_async_http.)"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx

from agentcell.errors import (
    AuthenticationException,
    InvalidArgumentException,
    NotEnoughSpaceException,
    NotFoundException,
    RateLimitException,
    SandboxException,
    SandboxNotRunningException,
    ServerUnreachableException,
    TimeoutException,
)
from agentcell.sdk.config import ENVD_PORT, Endpoint

_LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=60)
_lock = threading.Lock()
_sync_clients: dict[Endpoint, httpx.Client] = {}


def sync_client(endpoint: Endpoint) -> httpx.Client:
    client = _sync_clients.get(endpoint)
    if client is None:
        with _lock:
            client = _sync_clients.get(endpoint)
            if client is None:
                transport = httpx.HTTPTransport(uds=endpoint.uds, limits=_LIMITS, retries=0)
                client = httpx.Client(base_url=endpoint.base_url, transport=transport, timeout=None)
                _sync_clients[endpoint] = client
    return client


def close_sync_clients() -> None:
    with _lock:
        for client in _sync_clients.values():
            client.close()
        _sync_clients.clear()


def timeout(request_timeout: float | None, read: float | None = ...) -> httpx.Timeout:  # type: ignore[assignment]
    """`request_timeout` bounds connecting and each read; `read`, when given, replaces the read bound
    (None = wait forever, for long streams)."""
    rt = request_timeout if request_timeout else None
    return httpx.Timeout(rt, read=rt if read is ... else read)


GONE_MESSAGE = (
    "sandbox {sid} is gone: it was killed or its timeout passed. Create a new one with Sandbox.create(), "
    "and use set_timeout() / the create timeout to keep a sandbox alive longer"
)


def _message(body: Any, text: str) -> str:
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return text.strip() or "(empty body)"


def error_from_http(status: int, content: bytes, sandbox_id: str | None = None, what: str = "request") -> SandboxException:
    """An exception for a non-2xx response (REST or Connect error body)."""
    text = content.decode("utf-8", "replace")
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    message = _message(body, text)
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        return error_from_connect(body["code"], message, sandbox_id)
    if status == 502 and "was not found" in message:
        return SandboxNotRunningException(GONE_MESSAGE.format(sid=sandbox_id or (body or {}).get("sandboxId", "?")))
    if status == 401:
        return AuthenticationException(f"{what} refused ({status}): {message}; check the API key (api_key= / AGENTCELL_API_KEY)")
    if status == 403:
        return AuthenticationException(f"{what} refused ({status}): {message}")
    if status == 404:
        return NotFoundException(message)
    if status == 400 or status == 422:
        return InvalidArgumentException(message)
    if status == 429:
        return RateLimitException(message)
    if status == 507:
        return NotEnoughSpaceException(message)
    if status == 504:
        return TimeoutException(message)
    return SandboxException(f"{what} failed ({status}): {message}")


_CONNECT: dict[str, type[SandboxException]] = {
    "not_found": NotFoundException,
    "invalid_argument": InvalidArgumentException,
    "unauthenticated": AuthenticationException,  # type: ignore[dict-item]
    "resource_exhausted": NotEnoughSpaceException,
    "deadline_exceeded": TimeoutException,
    "canceled": TimeoutException,
    "unavailable": SandboxNotRunningException,
}


class ConnectCodeError(SandboxException):
    """A Connect error the caller may branch on (e.g. already_exists); `code` is the Connect code name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def error_from_connect(code: str, message: str, sandbox_id: str | None = None) -> SandboxException:
    if code == "deadline_exceeded":
        return TimeoutException(f"{message}: the timeout passed; raise `timeout=` (seconds, 0 = none) to allow longer")
    if code == "unavailable" and sandbox_id:
        return SandboxNotRunningException(f"{message} ({GONE_MESSAGE.format(sid=sandbox_id)})")
    cls = _CONNECT.get(code)
    if cls is not None:
        exc = cls(message)
    else:
        exc = ConnectCodeError(code, message)
    exc.code = code  # type: ignore[attr-defined]
    return exc


def transport_failure(e: BaseException, what: str, timed_out: bool) -> SandboxException:
    """The SDK's exception for a call that got no HTTP answer (any of its HTTP clients)."""
    if timed_out:
        return TimeoutException(f"{what} timed out; the 'request_timeout' (or 'timeout') option can raise the limit")
    return ServerUnreachableException(f"{what}: cannot reach the agentcell server ({type(e).__name__}: {e})")


PROBE_TIMEOUT_S = 5.0
HEALTH_PATH = "/health"


def probe_headers(sandbox_id: str) -> dict[str, str]:
    """envd's /health of the sandbox: no token needed; the server answers 502 once it is gone."""
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": ENVD_PORT}


def cut_off_error(e: BaseException, what: str, timed_out: bool, gone: bool) -> SandboxException:
    """The exception for a response cut off mid-way. The server (like E2B's proxy) cuts a stream
    when the sandbox behind it dies; `gone` is what a health probe said after that."""
    if gone:
        return SandboxNotRunningException(
            f"{what}: the sandbox was killed or reached its end of life while the request was in flight "
            f"({type(e).__name__}: {e})")
    return transport_failure(e, what, timed_out)


def error_from_transport(e: httpx.HTTPError, what: str) -> SandboxException:
    return transport_failure(e, what, isinstance(e, httpx.TimeoutException))
