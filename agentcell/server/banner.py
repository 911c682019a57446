"""The startup banner: one log line (`agentcell.server`) once the server is ready, saying what it is and
how it is exposed: version, where it listens, whether a key is required (never the key), its backends,
the sandboxes' way to the internet, its state dir, the most a sandbox may have, the behaviour record.

Text: a block under the line; JSON: the same as fields of one line. The gateway's banner
(gateway/banner.py) is made the same way (`announce`).
"""

from __future__ import annotations

import dataclasses
import logging
from importlib import metadata
from typing import Any

from agentcell.logs import fields
from agentcell.server.config import ServerConfig, backend_names

log = logging.getLogger("agentcell.server")


def version() -> str:
    try:
        return metadata.version("agentcell")
    except metadata.PackageNotFoundError:
        return "unknown"


def listen_url(config: ServerConfig) -> str:
    if config.uds:
        return f"unix:{config.uds}"
    scheme = "https" if config.tls_cert else "http"
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"{scheme}://{host}:{config.port}"


def facts(config: ServerConfig) -> dict[str, Any]:
    """What the banner says, by name."""
    ceilings = {k: v for k, v in dataclasses.asdict(config.max_limits).items() if v is not None}
    from agentcell import rootless

    return {
        "version": version(),
        "mode": "rootless (reduced guarantees: agentcell doctor)" if rootless.active()
        else "system service" if getattr(config, "system", False) else "root",
        "listen": listen_url(config),
        "tls": "on" if config.tls_cert else "off",
        "auth": _auth(config),
        "backends": backend_names(config),
        "microvm": ("KVM" if config.accel != "tcg" else "TCG: emulated — no hardware isolation claim")
        if "microvm" in backend_names(config) else None,
        "egress_uplink": config.egress_uplink,
        "internet_default": "on" if config.internet_by_default else "off",
        "state_dir": config.state_dir,
        "max_sandboxes": config.max_sandboxes,
        "max_timeout_s": config.max_timeout,
        "max_limits": ceilings,
        "record": ",".join(config.record_collectors) if config.record else "off",
        "cell_id": config.cell_id,
    }


def _auth(config: ServerConfig) -> str:
    if getattr(config, "system", False):  # the system service (server/tenancy.py)
        tcp = ", TCP with its API key" if config.api_key is not None else ""
        return f"per user: the socket's peer uid (each sees only their own sandboxes){tcp}"
    if config.api_key is not None:
        return "API key required (X-API-KEY)"
    if config.uds:
        return "none: whoever can open the socket can run code"
    return "none: every client that reaches the address can run code"


def log_banner(config: ServerConfig) -> None:
    announce(log, "agentcell", facts(config))


def announce(logger: logging.Logger, title: str, said: dict[str, Any]) -> None:
    """`{title} {version} serving on {listen}`, what `said` says as a block under it (text) or as fields
    (JSON); None values are left out of the block. The server's banner and the gateway's."""
    width = max(len(k) for k in said) + 1
    block = [f"{k + ':':<{width}} {_text(v)}" for k, v in said.items() if v is not None]
    logger.info("%s %s serving on %s", title, said["version"], said["listen"], extra=fields(block=block, **said))


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)
