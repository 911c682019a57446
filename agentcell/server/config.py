"""Server configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentcell.backends.base import Limits


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 3000
    uds: str | None = None  # serve on this unix socket instead of host:port
    api_key: str | None = None  # None = accept any X-API-KEY (the SDK always sends one)
    max_sandboxes: int = 1000
    limits: Limits = field(default_factory=Limits)  # default limits of a new sandbox
    default_timeout: int = 300  # seconds, when the create request has none
    max_timeout: int = 24 * 3600  # seconds
    backend: str = "linux"
    uid_base: int | None = None  # first host uid of this server's sandboxes; None = a free range
    # The `domain` reported to SDKs. None = the Host the request came to, so an SDK without
    # E2B_SANDBOX_URL never falls back to E2B's own cloud domain.
    domain: str | None = None
    max_upload_mb: int = 512  # largest /files upload body held in memory
    log_level: str = "info"
    # --- the HTTP edge (docs/architecture.md, "The HTTP edge") ---
    insecure_no_auth: bool = False  # allow a non-loopback address without an API key
    allowed_hosts: tuple[str, ...] = ()  # extra Host names ("*.example.com" = any subdomain; "*" = any)
    allowed_origins: tuple[str, ...] = ()  # extra browser origins, e.g. "https://app.example.com"
    header_timeout: float = 10.0  # seconds to send a request's line and headers
    body_timeout: float = 30.0  # seconds a request body may stall
    max_connections: int = 1024  # open client connections, server-wide
    max_body_memory_mb: int = 64  # JSON request bodies held in memory at once, server-wide
