"""What Sandbox and AsyncSandbox read straight from their connection, written once for both."""

from __future__ import annotations

from agentcell.sdk.config import ConnectionConfig, SandboxConnection
from agentcell.sdk.files import file_url


class ConnectedSandbox:
    _conn: SandboxConnection
    default_template = "base"  # e2b's class attributes; agentcell's "base" runs code too
    default_sandbox_timeout = 300

    @property
    def sandbox_domain(self) -> str | None:
        """The domain the server named for this sandbox's hosts (``get_host``), as e2b's."""
        return self._conn.domain

    @property
    def envd_api_url(self) -> str:
        """Where this SDK sends the sandbox's data-plane calls (the server; routed by headers)."""
        return self._conn.config.base_url

    @property
    def envd_direct_url(self) -> str:
        """The base of download_url() / upload_url(): the server, which finds the sandbox by the
        URL's signature (e2b's direct URL)."""
        return self._conn.config.base_url

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sandbox_id={self.sandbox_id!r}, url={self._conn.config.base_url!r})"

    @property
    def sandbox_id(self) -> str:
        return self._conn.sandbox_id

    @property
    def connection_config(self) -> ConnectionConfig:
        return self._conn.config

    @property
    def traffic_access_token(self) -> str | None:
        """The token a port served out of this sandbox needs when it was created with
        ``network={"allow_public_traffic": False}`` (header ``e2b-traffic-access-token``)."""
        return self._conn.traffic_access_token

    def get_host(self, port: int) -> str:
        """The host (``{port}-{sandbox_id}.{domain}``) under which a server listening on `port` inside
        the sandbox is reached through the server, over HTTP or WebSocket; as e2b's get_host. With a
        local server that is ``{port}-{id}.localhost:{server port}`` (browsers and curl resolve
        ``*.localhost`` to loopback; other clients can connect to the server and send it as Host)."""
        return self._conn.get_host(port)

    def download_url(self, path: str, user: str | None = None, use_signature_expiration: int | None = None) -> str:
        """A URL that downloads the file with a plain GET, no headers (as e2b's download_url): signed
        with the sandbox's access token; `use_signature_expiration` seconds bound its validity."""
        return file_url(self._conn.config.base_url, self._conn.access_token, path, "read", user,
                        use_signature_expiration)

    def upload_url(self, path: str | None = None, user: str | None = None,
                   use_signature_expiration: int | None = None) -> str:
        """A URL that uploads a file with a plain POST (multipart/form-data or octet-stream), as e2b's
        upload_url; signed like download_url."""
        return file_url(self._conn.config.base_url, self._conn.access_token, path or "", "write", user,
                        use_signature_expiration)
