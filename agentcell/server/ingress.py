"""E2B's ingress options for the ports served out of a sandbox (the create's `network` object).

- `maskRequestHost`: the Host header the sandbox's server sees on requests that come through its
  served ports, in place of the one the client sent (which names this server). `${PORT}` in it
  becomes the port the request is for, as on E2B. envd and the code interpreter are not masked.
- `allowPublicTraffic` false: a port request without the sandbox's traffic token is refused with
  E2B's 403 and body (`traffic_token_refused`).
"""

from __future__ import annotations

import re
from typing import Any

from starlette.responses import JSONResponse

from agentcell.server.errors import HTTPError

PORT_PLACEHOLDER = "${PORT}"
MAX_HOST = 255  # a DNS name's length; a Host header has no use for more
# What a Host header may hold: printable ASCII without spaces (a name, an IP, a [v6] literal, :port)
_HOST_CHARS = re.compile(r"[!-~]+")


def mask_request_host(network: dict[str, Any]) -> str | None:
    """network.maskRequestHost (snake_case accepted), checked; None when not given."""
    value = network.get("maskRequestHost", network.get("mask_request_host"))
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise HTTPError(400, "'network.maskRequestHost' must be a string (a host, optionally with ${PORT})")
    if len(value) > MAX_HOST or not _HOST_CHARS.fullmatch(value):
        raise HTTPError(400, f"'network.maskRequestHost' must be at most {MAX_HOST} printable ASCII characters "
                             "without spaces (a host name, optionally with :port or ${PORT})")
    return value


def masked_host(mask: str | None, port: int) -> bytes | None:
    """The Host header a request to `port` presents to the sandbox (None: the client's own)."""
    if mask is None:
        return None
    return mask.replace(PORT_PLACEHOLDER, str(port)).encode("ascii")


def traffic_token_refused(sandbox_id: str, header_given: bool) -> JSONResponse:
    """E2B's answer to a port request of a sandbox created with allowPublicTraffic false that has no
    valid traffic token: 403, {"sandboxId", "message", "code"}."""
    if header_given:
        message = "Sandbox is secured with traffic access token. Provided token is invalid."
    else:
        message = "Sandbox is secured with traffic access token. Token header 'e2b-traffic-access-token' is missing"
    return JSONResponse({"sandboxId": sandbox_id, "message": message, "code": 403}, status_code=403)
