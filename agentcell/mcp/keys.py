"""The API key an HTTP request to an MCP endpoint carries (no mcp SDK import: the server checks it before
it loads the SDK)."""

from __future__ import annotations

import hmac
from typing import Any

from agentcell.server.asgi import header


def presented_key(scope: dict[str, Any]) -> str | None:
    """The API key an HTTP request carries: X-API-KEY, else `Authorization: Bearer KEY` (what MCP
    clients' configuration has a field for)."""
    key = header(scope, b"x-api-key")
    if key:
        return key
    authorization = header(scope, b"authorization") or ""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def matches(presented: str | None, api_key: str) -> bool:
    return hmac.compare_digest((presented or "").encode(), api_key.encode())
