"""Where the cells are: adapters behind one small interface (static list, Kubernetes EndpointSlices).

An adapter reports the whole set of endpoints each time it changes. `ready`: a create may be placed
there; `serving`: requests for its sandboxes may still go there (a draining cell is serving, not ready).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str  # http://host:port of one cell
    ready: bool = True
    serving: bool = True


OnChange = Callable[[list[Endpoint]], None]


class Discovery(abc.ABC):
    """Finds the cells; calls `on_change` with all of them, at start and whenever they change."""

    @abc.abstractmethod
    async def start(self, on_change: OnChange) -> None:
        """Report the endpoints known now (before returning), then keep watching in the background."""

    async def close(self) -> None:  # noqa: B027 - most adapters have nothing to stop
        """Stop watching."""


def cell_url(raw: str) -> str:
    """`http://host:port` (a bare host:port gets http://); ValueError for anything else."""
    raw = raw.strip().rstrip("/")
    if "://" not in raw:
        raw = "http://" + raw
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise ValueError(f"a cell is a URL like http://10.0.0.5:49982, not {raw!r}")
    return raw


class StaticDiscovery(Discovery):
    """A fixed list of cells (`--cell URL`, repeatable, and/or `--cells-file`, one URL a line, '#'
    comments). Whether each is up is the poller's business (cells.py): the list says nothing of it."""

    def __init__(self, urls: Iterable[str] = (), cells_file: str | None = None) -> None:
        found = [cell_url(u) for u in urls]
        if cells_file:
            for line in Path(cells_file).read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    found.append(cell_url(line))
        if not found:
            raise ValueError("no cells: pass --cell URL (repeatable) or --cells-file FILE")
        self.urls = list(dict.fromkeys(found))

    async def start(self, on_change: OnChange) -> None:
        on_change([Endpoint(u) for u in self.urls])
