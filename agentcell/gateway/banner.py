"""The gateway's startup banner (logger `agentcell.gateway`), once its first polls of the cells are in:
version, where it listens, whether clients need a key (never the key), what the cells get, how the
cells are found, and each cell with its state. Made as the server's is (server/banner.py `announce`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from agentcell.gateway.cells import CellTable
from agentcell.server.banner import announce, version

log = logging.getLogger("agentcell.gateway")


@dataclass(frozen=True)
class Listen:
    """How the gateway is exposed (its command line): for the banner."""

    host: str
    port: int
    tls: bool
    discovery: str  # static, kubernetes

    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"


def facts(listen: Listen, api_key: str | None, cell_api_key: str | None, cells: CellTable) -> dict[str, Any]:
    """What the banner says, by name."""
    if cell_api_key is None:
        cell_auth = "none (a client's own X-API-KEY is passed on)"
    elif cell_api_key == api_key:
        cell_auth = "the clients' key (--api-key)"
    else:
        cell_auth = "a key of their own (--cell-api-key)"
    return {
        "version": version(),
        "listen": listen.url(),
        "tls": "on" if listen.tls else "off",
        "auth": "API key required (X-API-KEY)" if api_key is not None
        else "none: every client that reaches the address can create sandboxes on the cells",
        "cell_auth": cell_auth,
        "discovery": listen.discovery,
        "cells": [f"{c.cell_id or '-'} {c.url} {c.state}" for c in cells.by_url.values()],
    }


def log_banner(listen: Listen, api_key: str | None, cell_api_key: str | None, cells: CellTable) -> None:
    announce(log, "agentcell gateway", facts(listen, api_key, cell_api_key, cells))
