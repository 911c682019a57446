"""`GET /metrics`: the server's figures in Prometheus's text exposition format (docs/operations.md lists
every name). Not E2B's per-sandbox metrics history (server/metrics.py): this is the operator's view of
the whole server.

Each server has its own CollectorRegistry (never prometheus_client's global one: two servers in one
process, as in tests, keep their figures apart). What can be read from the server's state is read at
scrape time (`_StateCollector`: sandboxes by state, standbys, the record's counters), so nothing is
added to the request path for it; only what must be counted when it happens is a counter or a
histogram (creates and their latency, responses by status class, errors by type, egress bytes and
refusals, limit events: server/observer.py and server/access_log.py count them).

Authentication: as the control plane, the server's API key when it has one, in `X-API-KEY` or as
`Authorization: Bearer <key>` (what Prometheus's scrape config `authorization:` sends). Under the system
service's tenancy (`--system`), a request on the unix socket needs root (uid 0): the figures count every
user's sandboxes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from agentcell.server import routing
from agentcell.server.auth import MISSING_API_KEY, key_presented
from agentcell.server.errors import json_error
from agentcell.server.tenancy import ADMIN

if TYPE_CHECKING:
    from agentcell.backends.base import Backend
    from agentcell.record.store import EventStore
    from agentcell.server.registry import SandboxManager

PATH = "/metrics"
# seconds: a create from a standby takes ~10 ms, one that prepares its own ~100 ms, a restore seconds
CREATE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_.:-]{1,48}$")
MAX_LABEL_VALUES = 64  # distinct values of one free-form label (a rule, an error type) before "other"


class BoundedLabel:
    """A label whose values come from events (rule names, exception types): at most MAX_LABEL_VALUES
    distinct ones, then "other", so that no input can grow the exposition without bound."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, value: object) -> str:
        text = str(value) if value is not None else "none"
        if text in self.seen:
            return text
        if not _LABEL_VALUE.match(text) or len(self.seen) >= MAX_LABEL_VALUES:
            return "other"
        self.seen.add(text)
        return text


class ServerMetrics:
    """The server's metrics: the counters others increment, and the registry /metrics exposes."""

    def __init__(self, version: str) -> None:
        self.registry = CollectorRegistry()  # (no auto_describe: nothing is read until a scrape)
        r = self.registry
        GaugeInfo(r, version)
        self.creates = Counter("agentcell_sandbox_creates", "Sandbox creates (and fork and snapshot restores) by "
                               "outcome: ok, capacity (refused: the server is full), error.", ["outcome"], registry=r)
        self.create_seconds = Histogram("agentcell_sandbox_create_seconds", "Seconds from a create's admission to "
                                        "its sandbox's agent answering (successful creates).",
                                        buckets=CREATE_BUCKETS, registry=r)
        self.ends = Counter("agentcell_sandbox_ends", "Sandboxes gone, by cause: kill (the API), timeout, retention "
                            "(paused too long), exit (its agent ended), oom (it ended after an out-of-memory kill), "
                            "shutdown (the server stopped).", ["cause"], registry=r)
        self.lifecycle = Counter("agentcell_sandbox_lifecycle_events", "Pauses and resumes.", ["event"], registry=r)
        self.requests = Counter("agentcell_http_responses", "HTTP responses by plane (control, envd, interpreter, "
                                "port: a port served out of a sandbox, metrics) and status class (2xx ... 5xx; "
                                "none: the connection ended before a response).", ["plane", "status_class"],
                                registry=r)
        self.errors = Counter("agentcell_errors", "Errors by kind: the exception type of a request that failed "
                              "with a 500, or of a create that failed.", ["kind"], registry=r)
        self.egress_bytes = Counter("agentcell_egress_bytes", "Bytes of sandboxes' internet connections (IP "
                                    "layer, counted when a connection closes), by direction: out (sent by sandboxes) "
                                    "or in.", ["direction"], registry=r)
        self.egress_connections = Counter("agentcell_egress_connections", "Sandboxes' internet connections "
                                          "opened (allowed by their policy).", registry=r)
        self.egress_refusals = Counter("agentcell_egress_refusals", "Refused egress: net.deny (a connection the "
                                       "policy or a proxy budget refused), dns (a name the policy refused), secret "
                                       "(a secret not sent), by the rule that refused it. The kernel logs at most 50 "
                                       "refused connections a second per rule (the rest are dropped uncounted).",
                                       ["kind", "rule"], registry=r)
        self.limit_events = Counter("agentcell_limit_events", "Sandboxes reaching a limit: oom, pids, disk, cpu "
                                    "(throttled), timeout (from the behaviour record's limit.* events).", ["limit"],
                                    registry=r)
        self.rule_label = BoundedLabel()
        self.error_label = BoundedLabel()
        self._responses = ResponseCounter(self.requests)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu, open fds, start time

    def watch(self, manager: SandboxManager, backends: Callable[[], Iterable[Backend]], events: EventStore | None,
              max_sandboxes: int) -> None:
        """Read the server's state at each scrape."""
        self.registry.register(_StateCollector(manager, backends, events, max_sandboxes))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def error(self, exc: BaseException) -> None:
        self.errors.labels(self.error_label(type(exc).__name__)).inc()

    def responded(self, scope: dict[str, Any], port: int | None, status: int | None, noted: dict[str, Any]) -> None:
        """A response ended (server/access_log.py): counted by plane and status class."""
        plane = "metrics" if port is None and scope.get("path") == PATH else routing.plane_of(port)
        self._responses.inc(plane, status)


class ResponseCounter:
    """Responses by a label of the caller's (a plane, a route) and status class, the counter's children
    kept at hand (a request's end should not look them up by label)."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self._children: dict[tuple[str, str], Any] = {}

    def inc(self, kind: str, status: int | None) -> None:
        status_class = f"{status // 100}xx" if status is not None else "none"
        child = self._children.get((kind, status_class))
        if child is None:
            child = self._children[(kind, status_class)] = self.counter.labels(kind, status_class)
        child.inc()


class Exposition(Protocol):
    """What /metrics serves: the server's ServerMetrics, the gateway's GatewayMetrics."""

    def render(self) -> bytes: ...


class GaugeInfo(Collector):
    """agentcell_build_info{version} 1."""

    def __init__(self, registry: CollectorRegistry, version: str) -> None:
        self.version = version
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("agentcell_build_info", "agentcell's version (always 1).", labels=["version"])
        g.add_metric([self.version], 1)
        yield g


class _StateCollector(Collector):
    """Figures read from the server's own state when Prometheus scrapes (nothing counted meanwhile)."""

    def __init__(self, manager: SandboxManager, backends: Callable[[], Iterable[Backend]],
                 events: EventStore | None, max_sandboxes: int) -> None:
        self.manager = manager
        self.backends = backends
        self.events = events
        self.max_sandboxes = max_sandboxes

    def collect(self) -> Iterator[Metric]:
        by_state = GaugeMetricFamily("agentcell_sandboxes", "Sandboxes by state: starting (being created), running, "
                                     "paused (frozen, memory resident), paused_on_disk (files or memory written to "
                                     "disk, nothing running).", labels=["state"])
        for state, n in self.manager.counts().items():
            by_state.add_metric([state], n)
        yield by_state
        yield GaugeMetricFamily("agentcell_sandboxes_max", "Most sandboxes alive at once (--max-sandboxes).",
                                value=self.max_sandboxes)
        ready = GaugeMetricFamily("agentcell_standbys_ready", "Prepared sandboxes waiting for a create (pool depth), "
                                  "by backend and template.", labels=["backend", "template"])
        preparing = GaugeMetricFamily("agentcell_standbys_preparing", "Standbys being prepared.",
                                      labels=["backend", "template"])
        target = GaugeMetricFamily("agentcell_standbys_target", "Standbys the pool keeps ready (--standbys).",
                                   labels=["backend", "template"])
        for backend in self.backends():
            pools = getattr(backend, "standby_pools", None)  # (a test's stand-in backend may lack it)
            for template, pool in (pools() if pools is not None else {}).items():
                ready.add_metric([backend.name, template], pool.ready)
                preparing.add_metric([backend.name, template], pool.preparing)
                target.add_metric([backend.name, template], pool.size)
        yield from (ready, preparing, target)
        lost = CounterMetricFamily("agentcell_egress_events_lost", "Connection events the kernel could not "
                                   "deliver (its socket overran): the egress figures undercount by at least this "
                                   "many; source conntrack (connections) or nflog (refusals).", labels=["source"])
        for backend in self.backends():
            egress = getattr(backend, "egress", None)
            stats = egress.event_stats() if egress is not None else {}
            for source in ("conntrack", "nflog"):
                if f"lost_{source}" in stats:
                    lost.add_metric([source], stats[f"lost_{source}"])
        yield lost
        if self.events is not None:
            stats = self.events.stats
            yield CounterMetricFamily("agentcell_record_events_stored", "Behaviour-record events stored.",
                                      value=stats["stored"])
            yield CounterMetricFamily("agentcell_record_events_dropped", "Behaviour-record events dropped (a "
                                      "sandbox's rate or cap, the writer behind, the store full).",
                                      value=stats["dropped"])
            yield CounterMetricFamily("agentcell_record_evicted_sandboxes", "Ended sandboxes' records removed early "
                                      "to keep the store within --events-max-mb.", value=stats["evicted_sandboxes"])


def _authorized(scope: dict[str, Any], api_key: str | None) -> bool:
    return api_key is None or key_presented(scope, api_key)


ROOT_ONLY = ("/metrics counts every user's sandboxes: on the system socket only root may read it "
             "(or scrape the TCP listener with its API key)")


def endpoint(metrics: Exposition, api_key: str | None,
             socket_user: Callable[[dict[str, Any]], str | None] = lambda scope: None) -> Callable[..., Any]:
    """The ASGI app of GET /metrics, the server's and the gateway's. `socket_user`: the tenant a unix-socket request comes from under the
    system service's tenancy (server/tenancy.py), None otherwise; such a request needs no key but must
    be root's (the figures are every user's)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["method"] not in ("GET", "HEAD"):
            await json_error(405, "GET /metrics")(scope, receive, send)
            return
        user = socket_user(scope)
        if user is not None and user != ADMIN:
            await json_error(403, ROOT_ONLY)(scope, receive, send)
            return
        if user is None and not _authorized(scope, api_key):
            await json_error(401, MISSING_API_KEY)(scope, receive, send)
            return
        body = metrics.render()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                                (b"content-length", str(len(body)).encode()), (b"cache-control", b"no-store")]})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    return app
