"""E2B's `network.egressProxy` in the API: read from a create's `network` or an update's body, shown
back by get_info without its password or CA certificate (network/tunnel.py does the rest)."""

from __future__ import annotations

from typing import Any

from agentcell.backends.base import Backend
from agentcell.network.tunnel import EgressTunnel, TunnelConfigError
from agentcell.server.errors import HTTPError


def egress_proxy(network: dict[str, Any], backend: Backend) -> EgressTunnel | None:
    """The SOCKS5 proxy a create's `network` (or an update's body) names, or None; a 400 when it is
    malformed or the backend has no egress to tunnel. Where the proxy may be is the backend's check
    (it resolves the name), made before the sandbox starts or its network changes."""
    try:
        tunnel = EgressTunnel.parse(network.get("egressProxy", network.get("egress_proxy")))
    except TunnelConfigError as e:
        raise HTTPError(400, str(e)) from None
    if tunnel is not None and not backend.has_egress:
        raise HTTPError(400, f"network.egressProxy: sandboxes of the {backend.name} backend get no internet on this "
                             "server (--egress-uplink none, or the backend has no network), so there is nothing to "
                             "tunnel; leave it out")
    return tunnel


def egress_proxy_info(tunnel: EgressTunnel | None) -> dict[str, Any]:
    """`{"egressProxy": ...}` for get_info's `network`, or nothing when the sandbox has no proxy."""
    return {"egressProxy": tunnel.info()} if tunnel is not None else {}
