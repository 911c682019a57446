"""What the operator hears of sandboxes: lifecycle log lines and counters (from the registry), and the
behaviour record's limit and refusal events as log lines and counters (a tap on the recorder).

Log lines (logger `agentcell.lifecycle`, `agentcell.limits`, `agentcell.policy`), each with the
sandbox's id:

* created (template, backend, limits, timeout, the key id that asked: never a key), paused, resumed,
  and gone with its cause: kill (the API), timeout, retention, exit (its agent ended), oom (it ended
  after an out-of-memory kill), shutdown;
* a limit reached (limit.oom, .pids, .disk, .cpu, .timeout), and refused egress (net.deny, a refused
  DNS name, a secret not sent): the first of a kind for a sandbox is logged when it happens, the
  rest of a SUMMARY_S window are summed up in one line at its end (how many, by rule, a few
  destinations). A flood of refused packets costs a line per sandbox per window, not one per packet.

The tap (`ObservedRecorder`) sees every event handed to the record, before the store's bounds: a
sandbox that floods its own record cannot hide its refusals from the counters. With `--no-record`
there is no record and no collectors: the lifecycle lines and counters remain, the event-based ones
are absent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally
from dataclasses import dataclass, field
from typing import Any

from agentcell.logs import fields
from agentcell.server.prometheus import ServerMetrics

life_log = logging.getLogger("agentcell.lifecycle")
limit_log = logging.getLogger("agentcell.limits")
policy_log = logging.getLogger("agentcell.policy")

SUMMARY_S = 10.0  # seconds a sandbox's refusals (or limit events) of one kind are summed up over
SAMPLES = 3  # destinations named in a summary
OOM_MEMORY_S = 5.0  # a sandbox whose agent ends this soon after an OOM kill ended by the OOM

# the registry's reasons (registry.py) -> the cause counted and logged
CAUSES = {
    "the sandbox was killed": "kill",
    "the sandbox timed out": "timeout",
    "the paused sandbox reached the end of its retention": "retention",
    "the server stopped": "shutdown",
}
# record kinds watched by the tap, and what they are
REFUSALS = {"net.deny": "net.deny", "secret.refused": "secret"}
LIMITS = frozenset({"limit.oom", "limit.pids", "limit.disk", "limit.cpu", "limit.timeout"})


@dataclass
class _Window:
    """One sandbox's events of one kind since the line that opened the window."""

    count: int = 0
    rules: Tally[str] = field(default_factory=Tally)
    samples: list[str] = field(default_factory=list)


class Observer:
    """Told of lifecycle events by the registry and of record events by ObservedRecorder."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._windows: dict[tuple[str, str], _Window] = {}
        self._oom_at: dict[str, float] = {}

    # -- from the registry ------------------------------------------------------------------------

    def created(self, sandbox_id: str, seconds: float, info: dict[str, Any]) -> None:
        self.metrics.creates.labels("ok").inc()
        self.metrics.create_seconds.observe(seconds)
        limits = info.get("limits") or {}
        life_log.info("sandbox created", extra=fields(
            sandbox_id, template=info.get("template"), backend=info.get("backend"), timeout_s=info.get("timeout_s"),
            key_id=info.get("key_id"), owner=info.get("owner"), origin=info.get("origin"),
            create_ms=round(seconds * 1000, 1),
            **{k: v for k, v in limits.items() if v is not None}))

    def create_failed(self, exc: BaseException) -> None:
        from agentcell.server.registry import CapacityError

        capacity = isinstance(exc, CapacityError)
        self.metrics.creates.labels("capacity" if capacity else "error").inc()
        if not capacity:
            self.metrics.error(exc)
        life_log.warning("create failed: %s", exc, extra=fields(outcome="capacity" if capacity else "error",
                                                                 error=type(exc).__name__))

    def life(self, sandbox_id: str, kind: str, info: dict[str, Any]) -> None:
        """sandbox.paused / .resumed / .killed and limit.timeout, as the registry records them."""
        if kind == "sandbox.paused":
            self.metrics.lifecycle.labels("pause").inc()
            life_log.info("sandbox paused", extra=fields(sandbox_id, mode=info.get("mode"),
                                                         at_timeout=info.get("at_timeout")))
        elif kind == "sandbox.resumed":
            self.metrics.lifecycle.labels("resume").inc()
            life_log.info("sandbox resumed", extra=fields(sandbox_id, memory=info.get("memory")))
        elif kind == "sandbox.killed":
            reason = str(info.get("reason") or "")
            cause = CAUSES.get(reason, "exit")
            oom_at = self._oom_at.pop(sandbox_id, None)
            if cause == "exit" and oom_at is not None and time.monotonic() - oom_at < OOM_MEMORY_S:
                cause = "oom"
            self.metrics.ends.labels(cause).inc()
            for key in [k for k in self._windows if k[0] == sandbox_id]:
                self._flush(key)
            level = logging.INFO if cause in ("kill", "timeout", "retention", "shutdown") else logging.WARNING
            life_log.log(level, "sandbox gone (%s)", cause, extra=fields(sandbox_id, cause=cause, reason=reason))
        elif kind == "limit.timeout":
            self.metrics.limit_events.labels("timeout").inc()

    # -- from the record's tap ----------------------------------------------------------------------

    def seen(self, sandbox_id: str, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "net.connect":
            if event.get("state") == "closed":  # conntrack's DESTROY: the connection's bytes
                self.metrics.egress_bytes.labels("out").inc(_number(event.get("bytes_out")))
                self.metrics.egress_bytes.labels("in").inc(_number(event.get("bytes_in")))
            elif event.get("state") == "open":
                self.metrics.egress_connections.inc()
        elif kind in REFUSALS or (kind == "dns.query" and event.get("verdict") == "denied"):
            what = REFUSALS.get(kind, "dns")  # type: ignore[arg-type]
            rule = self.metrics.rule_label(event.get("rule"))
            count = max(1, int(_number(event.get("count")) or 1)) if event.get("rule") == "proxy-budget" else 1
            self.metrics.egress_refusals.labels(what, rule).inc(count)
            target = event.get("domain") or event.get("dst")
            if target and event.get("dport"):
                target = f"{target}:{event['dport']}"
            self._summed(policy_log, sandbox_id, what, "egress refused", rule, count, target)
        elif kind in LIMITS:
            name = kind.partition(".")[2]  # type: ignore[union-attr]
            if name != "timeout":  # counted by life(): the registry records it
                self.metrics.limit_events.labels(name).inc()
            if name == "oom":
                self._oom_at[sandbox_id] = time.monotonic()
            detail = {k: v for k, v in event.items() if k not in ("time", "kind", "source", "pid", "ppid", "host_pid")
                      and v is not None}
            self._summed(limit_log, sandbox_id, kind, f"limit reached: {name}", name, 1, None, detail)

    # -- summing up ----------------------------------------------------------------------------------

    def _summed(self, logger: logging.Logger, sandbox_id: str, what: str, message: str, rule: str, count: int,
                target: object, detail: dict[str, Any] | None = None) -> None:
        key = (sandbox_id, what)
        window = self._windows.get(key)
        if window is None:  # the first of its window: said now, in full
            self._windows[key] = _Window()
            said = {**(detail or {}), "kind": what, "rule": rule, "target": target}
            if count > 1:
                said["count"] = count
            logger.warning(message, extra=fields(sandbox_id, **said))
            self._later(key, logger, message)
            return
        window.count += count
        window.rules[rule] += count
        if target is not None and len(window.samples) < SAMPLES and str(target) not in window.samples:
            window.samples.append(str(target))

    def _later(self, key: tuple[str, str], logger: logging.Logger, message: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test's direct call): the window closes with the next event
            return
        loop.call_later(SUMMARY_S, self._flush, key, logger, message)

    def _flush(self, key: tuple[str, str], logger: logging.Logger | None = None, message: str = "") -> None:
        window = self._windows.pop(key, None)
        if window is None or not window.count:
            return
        logger = logger or (limit_log if key[1].startswith("limit.") else policy_log)
        message = message or ("limit reached" if key[1].startswith("limit.") else "egress refused")
        logger.warning("%s: %d more in %g s", message, window.count, SUMMARY_S, extra=fields(
            key[0], kind=key[1], count=window.count, rules=dict(window.rules), targets=window.samples or None))


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and value >= 0 else 0.0


class ObservedRecorder:
    """The record (an EventStore) as the backends and the registry see it, with the observer's tap on
    `add`: one dict lookup per event for the kinds nobody watches."""

    WATCHED = frozenset({"net.connect", "net.deny", "secret.refused", "dns.query", *LIMITS})

    def __init__(self, store: Any, observer: Observer) -> None:
        self.store = store
        self.observer = observer

    def add(self, sandbox_id: str, event: dict[str, Any]) -> None:
        if event.get("kind") in self.WATCHED and self.store.recording(sandbox_id):  # (not a standby's, nor a gone one's)
            try:
                self.observer.seen(sandbox_id, event)
            except Exception:  # noqa: BLE001 - the record never raises to a collector; nor does its tap
                logging.getLogger("agentcell.server").exception("the observer failed on an event")
        self.store.add(sandbox_id, event)

    def __getattr__(self, name: str) -> Any:  # begin, end, redact, follow, stats ...
        return getattr(self.store, name)
