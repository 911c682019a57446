"""Who may talk to the server: the bind-address rule at startup, and the Host/Origin check per request.

A browser is the confused deputy here. A page on any site can POST a form or a no-preflight `fetch` to
http://127.0.0.1:<port>/v2/sandboxes (CSRF), or point its own DNS name at 127.0.0.1 and then read the
answers as same-origin (DNS rebinding). Browsers always send the Host they resolved and, on such
requests, an Origin; SDKs and curl send no Origin. So: the Host must be a name this server is known
by, and an Origin, when present, must be one we trust.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from agentcell.server import routing
from agentcell.server.asgi import header
from agentcell.server.config import ServerConfig
from agentcell.server.routing import HOST_RE as _HOST_RE
from agentcell.server.routing import host_name

_WILDCARD_BINDS = {"", "0.0.0.0", "::", "*"}
_DEFAULT_PORTS = {"http": 80, "https": 443}


class InsecureExposureError(ValueError):
    """The server would be reachable from other machines without an API key."""


def is_loopback(name: str) -> bool:
    """localhost, *.localhost (RFC 6761: browsers resolve it to loopback themselves), 127/8 or ::1."""
    name = name.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(cfg: ServerConfig) -> None:
    """Refuse, before binding, to serve a non-loopback address with no API key (unless told to)."""
    if cfg.api_key == "":
        raise InsecureExposureError("--api-key is empty; pass a real key or leave the option out")
    if cfg.uds is not None or is_loopback(cfg.host) or cfg.api_key is not None or cfg.insecure_no_auth:
        return
    raise InsecureExposureError(
        f"refusing to listen on {cfg.host!r} without an API key: other machines can reach that address, and "
        "anyone who reaches it could create sandboxes and run code. Pass --api-key-file PATH (or set "
        "AGENTCELL_SERVER_API_KEY), listen on 127.0.0.1, or pass --insecure-no-auth if every client on "
        "that network is trusted."
    )


def local_domain(host: str) -> str:
    """The Host `host` with a loopback IP literal replaced by "localhost" (port kept): sandbox host
    names are `{port}-{id}.{domain}`, and only `*.localhost` resolves to loopback by itself."""
    m = _HOST_RE.match(host.strip().lower())
    if m is None:
        return host
    name = m.group("v6") or m.group("name")
    if not is_loopback(name) or name.endswith("localhost"):
        return host
    return "localhost" + (f":{m.group('port')}" if m.group("port") else "")


def _netloc(scheme: str, host: str, port: int | None) -> str:
    host = f"[{host}]" if ":" in host else host
    return host if port is None or port == _DEFAULT_PORTS.get(scheme) else f"{host}:{port}"


def _origin(value: str) -> tuple[str, str] | None:
    """(normalised origin, host name) of an Origin header, or None if it is not an http(s) origin."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/") or parts.query:
        return None
    return f"{scheme}://{_netloc(scheme, parts.hostname, port)}", parts.hostname


def _same_netloc(origin: str, host: str, scheme: str) -> bool:
    """Whether an Origin names the Host the request came to (a same-origin request)."""
    m = _HOST_RE.match(host.strip().lower())
    if m is None:
        return False
    name = m.group("v6") or m.group("name")
    port = int(m.group("port")) if m.group("port") else None
    netloc = origin.split("://", 1)[1]
    return netloc in (_netloc("http", name, port), _netloc("https", name, port), _netloc(scheme, name, port))


def same_origin(origin: str, host: str, scheme: str) -> bool:
    """Whether an Origin names exactly the scheme, host and port a request came to (stricter than the
    edge's check, which lets either scheme pass: the console's sign-in, unsafe calls and terminal)."""
    parsed = _origin(origin.lower())
    m = _HOST_RE.match(host.strip().lower())
    if parsed is None or m is None:
        return False
    scheme = "https" if scheme in ("https", "wss") else "http"
    port = int(m.group("port")) if m.group("port") else None
    return parsed[0] == f"{scheme}://{_netloc(scheme, m.group('v6') or m.group('name'), port)}"


def _target_sandbox(scope: dict[str, Any]) -> str | None:
    """The id of the sandbox a request is routed to (routing.py), else None (also when its routing is
    malformed: the router refuses it then)."""
    try:
        where = routing.target(scope)
    except routing.RoutingError:
        return None
    return where.sandbox_id if where is not None else None


@dataclass(frozen=True)
class HostPolicy:
    names: frozenset[str]  # exact host names, besides loopback
    suffixes: tuple[str, ...]  # ".example.com" for "*.example.com"
    origins: frozenset[str]  # extra trusted origins, normalised
    any_host: bool  # accept every Host (the Origin is still checked)

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> HostPolicy:
        names: set[str] = set()
        suffixes: list[str] = []
        any_host = False
        entries = list(cfg.allowed_hosts)
        if cfg.domain:
            entries += [cfg.domain, "*." + cfg.domain]
        if cfg.uds is None and cfg.host not in _WILDCARD_BINDS:
            entries.append(cfg.host)
        for entry in entries:
            entry = entry.strip().lower().rstrip(".")
            if entry == "*":
                any_host = True
            elif entry.startswith("*."):
                suffixes.append(entry[1:])
            elif entry:
                names.add(host_name(entry) or entry)
        # Behind a proxy the public name is often not known here; an API key already keeps strangers
        # out, so a keyed, publicly bound server takes any Host unless --allowed-host narrows it.
        if cfg.api_key is not None and cfg.uds is None and not is_loopback(cfg.host) and not cfg.allowed_hosts:
            any_host = True
        origins = set()
        for entry in cfg.allowed_origins:
            parsed = _origin(entry)
            if parsed is None:
                raise ValueError(f"--allowed-origin {entry!r} is not an origin like https://app.example.com")
            origins.add(parsed[0])
        return cls(frozenset(names), tuple(suffixes), frozenset(origins), any_host)

    def _name_allowed(self, name: str) -> bool:
        return is_loopback(name) or name in self.names or name.endswith(self.suffixes)

    def refusal(self, scope: dict[str, Any]) -> str | None:
        """Why this request is refused (403), or None to let it through."""
        host = header(scope, b"host")
        if host is not None and not self.any_host:
            name = host_name(host)
            if name is None or not self._name_allowed(name):
                return (f"Host {host!r} is not a name of this server (DNS rebinding protection); if clients "
                        f"reach it under that name, start it with --allowed-host {name or host}")
        origin = header(scope, b"origin")
        if origin is None:
            return None  # not a browser: SDKs and curl send no Origin
        parsed = _origin(origin)
        if parsed is None:
            return (f"requests with Origin {origin!r} are refused (cross-site request protection); "
                    "'null' is what sandboxed frames, file:// pages and cross-site redirects send")
        normalised, name = parsed
        if normalised in self.origins:
            return None
        if self._name_allowed(name):
            # A page served out of a sandbox ({port}-{id}.<domain>) is the sandbox's code: as an Origin
            # it is trusted only by requests to that same sandbox (any of its ports), never by the
            # control plane or another sandbox.
            page = routing.sandbox_label(name)
            if page is None or page[1] == _target_sandbox(scope):
                return None
        if host is not None and _same_netloc(normalised, host, scope.get("scheme", "http")):
            return None
        return (f"requests from the web page at {origin!r} are refused (cross-site request protection); "
                f"to allow that site, start the server with --allowed-origin {normalised}")
