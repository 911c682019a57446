"""Which plane a request is for: the one parser of routing, used by the server (a cell), its Host/Origin
policy and the gateway alike.

A request is for a sandbox's data plane when it names the sandbox by E2B's headers (`E2b-Sandbox-Id`,
and `E2b-Sandbox-Port`, 49983 when absent) or by its Host, `{port}-{id}.{domain}`; anything else is the
control plane. The gateway lets the data plane through without its API key (the cell checks the
sandbox's own token) and the cell checks the API key on the control plane, so the two must decide the
same from the same bytes: when the gateway lower-cased the Host and the cell did not, a Host
`1-{ID IN CAPITALS}.x` was data plane at one and control plane at the other (issue 25). Hence one
strict parser, and every doubtful request refused (400) by both rather than read two ways:

- The Host is read as DNS reads it: case-insensitive (lower-cased), a trailing dot dropped. A Host
  that is not a host name (userinfo, spaces, a path) names no sandbox.
- A sandbox id is [a-z0-9]{1,64}; an `E2b-Sandbox-Id` is lower-cased too. Any other id is refused.
- A port is a decimal number written without leading zeros (one spelling per port); anything else
  where a port belongs is refused. A number that is no TCP port (0, above 65535) is still a sandbox's
  data plane: its cell answers E2B's 502 "port is not open", as E2B's proxy does.
- A routing header sent twice, two Hosts, `E2b-Sandbox-Port` without `E2b-Sandbox-Id`, or headers and
  a Host that name different sandboxes or ports are refused: nobody along the way (an ingress that
  routes by Host, a cell of another version) may pick another reading than ours.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from agentcell.server.auth import ENVD_PORT, INTERPRETER_PORT

ID_HEADER = b"e2b-sandbox-id"
PORT_HEADER = b"e2b-sandbox-port"
_ROUTING_NAMES = frozenset({ID_HEADER, PORT_HEADER, b"host"})
# A Host header value: a name or a bracketed IPv6 literal, then an optional port (RFC 9110 7.2).
HOST_RE = re.compile(r"^(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._-]+))(?::(?P<port>\d{1,5}))?$")
# The first label of a sandbox's host name: `{port}-{id}`.
_SANDBOX_LABEL_RE = re.compile(r"^(?P<port>\d+)-(?P<id>[a-z0-9]+)$")
_SANDBOX_ID_RE = re.compile(r"^[a-z0-9]{1,64}$")
_PORT_RE = re.compile(r"^(?:0|[1-9][0-9]{0,9})$")


class RoutingError(ValueError):
    """The request's routing is malformed or ambiguous; it is refused with 400 and this message."""


@dataclass(frozen=True)
class SandboxTarget:
    """A data-plane request's destination."""

    sandbox_id: str
    port: int


def plane_of(port: int | None) -> str:
    """A request's plane by its sandbox port (None: the control plane), as /metrics names it."""
    if port is None:
        return "control"
    return {ENVD_PORT: "envd", INTERPRETER_PORT: "interpreter"}.get(port, "port")


def host_name(value: str) -> str | None:
    """The host name of a Host header value (`name[:port]`, `[v6]:port`), lower-case, without a trailing
    dot; None if it is not one."""
    m = HOST_RE.match(value.strip().lower())
    if m is None:
        return None
    return m.group("v6") or m.group("name").rstrip(".")


def sandbox_label(name: str) -> tuple[str, str] | None:
    """(port as written, id) when host name `name` has the shape of a sandbox's, `{port}-{id}.{domain}`,
    else None. Only the shape: a page's Origin is judged by it (hosts.py) even when its port is not valid."""
    label, dot, rest = name.partition(".")
    m = _SANDBOX_LABEL_RE.match(label)
    if m is None or not dot or not rest.strip("."):
        return None
    return m.group("port"), m.group("id")


def _port(raw: str, where: str) -> int:
    if not _PORT_RE.match(raw):
        raise RoutingError(f"{where}: {raw[:20]!r} is not a port number (decimal, no leading zeros)")
    return int(raw)


def _sandbox_id(raw: str, where: str) -> str:
    sandbox_id = raw.strip().lower()
    if not _SANDBOX_ID_RE.match(sandbox_id):
        raise RoutingError(f"{where}: {raw[:80]!r} is not a sandbox id (1-64 characters a-z0-9)")
    return sandbox_id


def sandbox_in_host(host: str) -> SandboxTarget | None:
    """The sandbox a Host header value names (`{port}-{id}.{domain}[:port]`), else None. RoutingError
    when it has that shape with an invalid port or id."""
    name = host_name(host)
    if name is None:
        return None
    found = sandbox_label(name)
    if found is None:
        return None
    raw_port, raw_id = found
    return SandboxTarget(_sandbox_id(raw_id, "Host"), _port(raw_port, "Host"))


def _routing_values(scope: dict[str, Any]) -> dict[bytes, str]:
    """The values of the routing headers (id, port, Host) in one pass; RoutingError if one is sent twice."""
    found: dict[bytes, str] = {}
    for name, value in scope.get("headers", ()):
        name = name.lower()
        if name in _ROUTING_NAMES:
            if name in found:
                raise RoutingError(f"the {name.decode()} header is sent more than once; send it once")
            found[name] = value.decode("latin-1")
    return found


def target(scope: dict[str, Any]) -> SandboxTarget | None:
    """The sandbox a request is for (its data plane), or None for the control plane. RoutingError when
    its routing is malformed or ambiguous (see the module doc)."""
    values = _routing_values(scope)
    by_id, by_port, host = values.get(ID_HEADER), values.get(PORT_HEADER), values.get(b"host")
    in_host = sandbox_in_host(host) if host is not None else None
    if by_id is None:
        if by_port is not None:
            raise RoutingError("E2b-Sandbox-Port is sent without E2b-Sandbox-Id; send both, or neither")
        return in_host
    by_header = SandboxTarget(_sandbox_id(by_id, "E2b-Sandbox-Id"),
                              _port(by_port.strip(), "E2b-Sandbox-Port") if by_port is not None else ENVD_PORT)
    if in_host is not None and in_host != by_header:
        raise RoutingError(f"the E2b-Sandbox-Id/-Port headers name port {by_header.port} of sandbox "
                           f"{by_header.sandbox_id} but the Host names port {in_host.port} of sandbox "
                           f"{in_host.sandbox_id}; name one")
    return by_header


def routing_headers(where: SandboxTarget) -> list[tuple[bytes, bytes]]:
    """E2B's routing headers for `where`: what a proxy (the gateway) sends on in place of the client's,
    so that the next hop reads the decision already made rather than deciding again."""
    return [(ID_HEADER, where.sandbox_id.encode()), (PORT_HEADER, str(where.port).encode())]
