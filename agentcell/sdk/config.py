"""Where the SDK finds a server, and with which key.

Endpoint: the `api_url` argument, else AGENTCELL_URL, else the machine's system service when this user can
reach its socket (system_socket.py), else an embedded local server (root only; started lazily, one per
process). API key: the argument, else AGENTCELL_API_KEY, else E2B_API_KEY, else none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_REQUEST_TIMEOUT = 60.0  # seconds, like e2b's connection config


@dataclass(frozen=True)
class Endpoint:
    """One server: its base URL and, for the embedded server, the unix socket it listens on."""

    base_url: str
    uds: str | None = None


@dataclass(frozen=True)
class ConnectionConfig:
    endpoint: Endpoint
    api_key: str | None
    request_timeout: float

    @property
    def base_url(self) -> str:
        return self.endpoint.base_url

    def control_headers(self) -> dict[str, str]:
        return {"X-API-KEY": self.api_key} if self.api_key else {}


def resolve_api_key(api_key: str | None) -> str | None:
    return api_key or os.environ.get("AGENTCELL_API_KEY") or os.environ.get("E2B_API_KEY") or None


def resolve(api_url: str | None = None, api_key: str | None = None, request_timeout: float | None = None) -> ConnectionConfig:
    """Resolve the endpoint (may start the embedded server: blocking) and the API key."""
    url = api_url or os.environ.get("AGENTCELL_URL")
    if url:
        endpoint = Endpoint(url.rstrip("/"))
    else:  # the system service if this user can reach it, else the embedded server (system_socket.py)
        from agentcell.sdk.system_socket import local_endpoint

        endpoint = local_endpoint()
    return ConnectionConfig(endpoint, resolve_api_key(api_key), request_timeout or DEFAULT_REQUEST_TIMEOUT)


def needs_embedded(api_url: str | None) -> bool:
    """Whether resolve() would start (or use) an embedded server: no URL and no system service to use."""
    if api_url or os.environ.get("AGENTCELL_URL"):
        return False
    from agentcell.sdk.system_socket import probe, socket_path

    return probe(socket_path()) is not None


ENVD_PORT = "49983"
INTERPRETER_PORT = "49999"


class SandboxConnection:
    """Everything a sandbox's data-plane calls need: config, id and the routing/auth headers (built once)."""

    def __init__(self, config: ConnectionConfig, sandbox_id: str, access_token: str | None,
                 domain: str | None = None, traffic_access_token: str | None = None) -> None:
        self.config = config
        self.sandbox_id = sandbox_id
        self.access_token = access_token
        self.domain = domain
        self.traffic_access_token = traffic_access_token
        auth = {"X-Access-Token": access_token} if access_token else {}
        self.envd_headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": ENVD_PORT, **auth}
        self.code_headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": INTERPRETER_PORT, **auth}

    def get_host(self, port: int) -> str:
        """`{port}-{id}.{domain}`: the server's `domain`, else the host of the URL the SDK uses."""
        domain = self.domain or urlsplit(self.config.base_url).netloc
        return f"{port}-{self.sandbox_id}.{domain}"

    def envd_user_headers(self, user: str | None) -> dict[str, str]:
        if not user:
            return self.envd_headers
        import base64

        return {**self.envd_headers, "Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


async def aresolve(api_url: str | None = None, api_key: str | None = None,
                   request_timeout: float | None = None) -> ConnectionConfig:
    """resolve() for async code: starting the embedded server blocks, so that part runs in a thread."""
    if needs_embedded(api_url):
        from agentcell.sdk.embedded import running_endpoint

        if running_endpoint() is None:
            import asyncio

            return await asyncio.to_thread(resolve, api_url, api_key, request_timeout)
    return resolve(api_url, api_key, request_timeout)
