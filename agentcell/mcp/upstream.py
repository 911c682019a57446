"""Which agentcell server the tools call, and with whose key.

stdio: the server and key `agentcell mcp` was given (--api-url/--api-key, else the SDK's own resolution:
AGENTCELL_URL, the system service, else an embedded server private to this process). HTTP: the key the
MCP client presented, forwarded as it is, so the MCP endpoint never acts with more than its caller's
rights; the agentcell server checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken


@dataclass(frozen=True)
class Upstream:
    api_url: str | None  # None: the SDK's resolution (AGENTCELL_URL, system service, embedded server)
    api_key: str | None = None  # stdio's key; HTTP sessions carry their caller's
    request_timeout: float | None = None

    def sdk(self, api_key: str | None) -> dict[str, Any]:
        """The keywords of the SDK's class methods (AsyncSandbox.create, connect ...)."""
        return {"api_url": self.api_url, "api_key": api_key, "request_timeout": self.request_timeout}


def as_user(key: str | None) -> AuthenticatedUser:
    """The request's principal for the MCP SDK, which binds each HTTP session to the credential that
    opened it (a request of another key for that session is answered 404)."""
    import hashlib

    client_id = hashlib.sha256((key or "").encode()).hexdigest()[:32]  # the key itself is never logged
    return AuthenticatedUser(AccessToken(token=key or "", client_id=client_id, scopes=[]))


def key_of(user: Any) -> str | None:
    """The key of a request's principal (as_user), None when it carried none."""
    if isinstance(user, AuthenticatedUser):
        return user.access_token.token or None
    return None
