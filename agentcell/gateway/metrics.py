"""The gateway's `GET /metrics` (docs/operations.md lists every name): the server's exposition and
authentication (server/prometheus.py), the gateway's own figures.

As on a server, what can be read from the gateway's state is read at scrape time (the cells by state,
from the poller's table), and only what happens is counted: responses by route and status class (the
access log, server/access_log.py), each forward's time to the cell's answer by cell, and failures by
kind. There is no routing cache to count: a sandbox's cell is its id's first 8 characters, looked up
in the table of polled cells (cells.py); an id that names no routable cell is counted as an error.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agentcell.gateway.cells import STATES, CellTable
from agentcell.server.prometheus import BoundedLabel, GaugeInfo, ResponseCounter

# seconds to a cell's response head: a data-plane call ~ms, a create ~10 ms to seconds (a restore)
FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# the route label: how GatewayApp.route classified a request (docs/operations.md)
ROUTES = ("envd", "interpreter", "port", "sandbox", "create", "list", "template_delete", "signed_files",
          "health", "cells", "metrics", "other", "invalid")
# the errors' kinds the gateway names itself (besides the exception types of requests that failed with a 500)
KINDS = ("cell_unreachable", "cell_failed", "client_left", "sandbox_cell_unknown", "sandbox_cell_down",
         "no_cell", "create_refused", "cell_poll_failed")


class GatewayMetrics:
    """The counters the gateway increments, and the registry /metrics exposes."""

    def __init__(self, version: str, cells: CellTable) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        GaugeInfo(r, version)
        self.requests = Counter("agentcell_gateway_http_responses", "HTTP responses by route (the gateway's "
                                "classification: envd, interpreter, port, sandbox, create, list, ...) and status "
                                "class (2xx ... 5xx; none: the connection ended before a response).",
                                ["route", "status_class"], registry=r)
        self.forward_seconds = Histogram("agentcell_gateway_forward_seconds", "Seconds from sending a request to "
                                         "a cell to its response's head (a stream's own length is not in it), "
                                         "by cell id.", ["cell"], buckets=FORWARD_BUCKETS, registry=r)
        self.errors = Counter("agentcell_gateway_errors", "Failures by kind: cell_unreachable, cell_failed, "
                              "client_left, sandbox_cell_unknown, sandbox_cell_down, no_cell, create_refused, "
                              "cell_poll_failed, or the exception type of a request that failed with a 500.",
                              ["kind"], registry=r)
        self._responses = ResponseCounter(self.requests)
        self._error_label = BoundedLabel()
        self._timed: set[str] = set()  # cells with a forward_seconds series
        self._cells = cells
        r.register(_CellsCollector(cells))
        ProcessCollector(registry=r)

    def responded(self, scope: dict[str, Any], port: int | None, status: int | None, noted: dict[str, Any]) -> None:
        """A response ended (the access log): counted by the route the gateway noted."""
        self._responses.inc(noted.get("route", "other"), status)

    def error(self, exc: BaseException) -> None:
        self.errors.labels(self._error_label(type(exc).__name__)).inc()

    def failed(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def forwarded(self, cell_id: str, seconds: float) -> None:
        self._timed.add(cell_id)
        self.forward_seconds.labels(cell_id).observe(seconds)

    def render(self) -> bytes:
        # a cell gone from the table takes its series along: cell ids (pod UIDs) come and go for good
        for cell_id in [c for c in self._timed if c not in self._cells.by_id]:
            self._timed.discard(cell_id)
            self.forward_seconds.remove(cell_id)
        return generate_latest(self.registry)


class _CellsCollector(Collector):
    """The cells by state, read from the poller's table at each scrape."""

    def __init__(self, cells: CellTable) -> None:
        self.cells = cells

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("agentcell_gateway_cells", "Cells by state: ready (creates may go there), full, "
                              "draining, not_ready (discovery's word), not_serving (discovery's word), down (its "
                              "polls fail, or it has no cell id).", labels=["state"])
        counts = Tally(c.state for c in self.cells.by_url.values())
        for state in STATES:
            g.add_metric([state], counts[state])
        yield g
