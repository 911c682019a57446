"""The shape of a sandbox's behaviour record (issue 10), shared by the host-side collectors and the
server's event store.

An event is a flat JSON object. Every event has:

* ``time``   -- seconds since the epoch (float), when the host saw it;
* ``kind``   -- one of KINDS below (``process.exec``, ``file.write``, ``deny.syscall`` ...);
* ``source`` -- who vouches for it: ``host`` (a kernel mechanism observed from outside the sandbox,
  which the sandbox cannot forge or suppress), ``api`` (the server, for an API call on the sandbox) or
  ``self`` (written by the sandbox into its own channel: never trust it);
* ``pid`` / ``ppid`` -- the process inside the sandbox (its pid namespace's numbers) when known,
  else None; ``host_pid`` may be added by a collector that only knows the host's number.

The store adds ``sandbox_id`` and ``seq`` (per sandbox, from 1, in the order events were stored).
Collectors call an ``EventSink`` with the sandbox id and the event; a sink never blocks and never
raises (the store counts what it drops).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

EventSink = Callable[[str, dict[str, Any]], None]

KINDS = (
    # processes: exec {path, argv, cwd, uid}; exit {code | signal, duration_s, comm}
    "process.exec", "process.exit",
    # files in the sandbox's writable places {path, size, count}; rename {path, to}; chmod {mode}
    "file.create", "file.write", "file.delete", "file.rename", "file.chmod",
    # network, from the egress router / resolver / proxy {proto, dst, dport, rule, bytes_out, bytes_in ...}
    "net.connect", "net.deny", "dns.query",
    # a secret (or an E2B rule's headers) the egress proxy would not send {secret, rule, domain, dst, dport}
    "secret.refused",
    # refused operations: seccomp {syscall, nr}; Landlock / read-only {path, reason}; EACCES/EPERM {path, errno}
    "deny.syscall", "deny.write", "deny.access",
    # the sandbox's policy (issue 28): a program its exec rules refused {path, comm, hook}; an operation
    # an "ask" policy held {approval, request, path | host ...} and its decision {verdict, by, remember}
    "deny.exec", "approval.request", "approval.decision",
    # limits {detail}: oom {victim pid, comm}, pids, disk, cpu {throttled_s}, timeout
    "limit.oom", "limit.pids", "limit.disk", "limit.cpu", "limit.timeout",
    # the sandbox's life as the server saw it, and API calls {action, key_id, ...}
    "sandbox.created", "sandbox.killed", "sandbox.paused", "sandbox.resumed", "api.call", "policy.set",
    # what code in the sandbox said of itself (runtime/self_report.py; source "self") {what, data}
    "self.report",
    # the store's own notes: events it dropped {count, reason}
    "record.dropped",
)
KIND_SET = frozenset(KINDS)
SOURCES = ("host", "api", "self")

# What each kind is, for the store's bounds: each class keeps a reserved share of a sandbox's cap and
# rate, so that a flood of one (a build's writes, a loop of execs, a sandbox's own reports, a client's
# calls) cannot push another out of the record. The API's own events are one class: the sandbox's
# life and the calls made on it.
CLASSES = ("processes", "files", "network", "refusals", "limits", "api", "self", "notes")
KIND_CLASS = {
    **{k: "processes" for k in KINDS if k.startswith("process.")},
    **{k: "files" for k in KINDS if k.startswith("file.")},
    "net.connect": "network", "net.deny": "network", "dns.query": "network", "secret.refused": "network",
    **{k: "refusals" for k in KINDS if k.startswith("deny.")},
    **{k: "limits" for k in KINDS if k.startswith("limit.")},
    **{k: "api" for k in KINDS if k.startswith("sandbox.")}, "api.call": "api", "policy.set": "api",
    "approval.request": "api", "approval.decision": "api",
    "self.report": "self",
    "record.dropped": "notes",
}
assert set(KIND_CLASS) == KIND_SET and set(KIND_CLASS.values()) == set(CLASSES)


def event(kind: str, *, source: str = "host", pid: int | None = None, ppid: int | None = None,
          at: float | None = None, **fields: Any) -> dict[str, Any]:
    """One event; ``at`` defaults to now."""
    assert kind in KIND_SET, kind
    return {"time": time.time() if at is None else at, "kind": kind, "source": source, "pid": pid,
            "ppid": ppid, **fields}


def not_recorded(collector: str, why: str) -> dict[str, Any]:
    """The note at the start of every record while a host-side collector (backends/base.py,
    COLLECTOR_NAMES) cannot run here: the report then says that part is not recorded, not empty."""
    return event("record.dropped", count=0, collector=collector, why=why, reason=f"{collector} not recorded here: {why}")


class Recorder(Protocol):
    """Where a backend's events go (the server's EventStore): `begin` when a tenant's sandbox starts
    (before any of its code runs), `add` for each event, `end` once it is gone."""

    def begin(self, sandbox_id: str) -> None: ...

    def add(self, sandbox_id: str, event: dict[str, Any]) -> None: ...

    def end(self, sandbox_id: str) -> None: ...
