"""Small helpers for raw ASGI scopes, used before a request reaches a Starlette app."""

from __future__ import annotations

from typing import Any

from starlette.datastructures import QueryParams


def header(scope: dict[str, Any], name: bytes) -> str | None:
    """The first value of header `name` (lower-case bytes), or None."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def query(scope: dict[str, Any]) -> QueryParams:
    return QueryParams(scope.get("query_string", b""))


def declared_length(scope: dict[str, Any]) -> int | None:
    """The Content-Length, or None when the body is chunked or absent (the HTTP parser already rejected bad values)."""
    raw = header(scope, b"content-length")
    return int(raw) if raw is not None and raw.strip().isdigit() else None


def has_body(scope: dict[str, Any]) -> bool:
    """Whether the request carries a body (a non-zero Content-Length, or any Transfer-Encoding)."""
    if header(scope, b"transfer-encoding") is not None:
        return True
    length = declared_length(scope)
    return bool(length)


def is_connect_rpc(path: str) -> bool:
    return path.startswith(("/process.Process/", "/filesystem.Filesystem/"))


def named_by_connection(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    """Header names listed in Connection: hop-by-hop too (RFC 9110 7.6.1); a proxy drops them."""
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    named.discard(b"host")
    return named
