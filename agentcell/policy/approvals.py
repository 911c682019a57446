"""Approval requests: an operation of an "ask" policy waits here for a decision (issue 28).

The enforcement point that holds the operation (an exec held by fanotify, a connection held by the
egress proxy) calls `Approvals.ask()`; the request is visible at once (`pending()`, `follow()`), and
`decide()` answers it. Unanswered within the policy's ask_timeout_s, it is denied. Every request and
every decision goes to the behaviour record (`approval.request`, `approval.decision`).

Bounds: at most MAX_PENDING requests wait per sandbox (beyond: denied at once, "flood", recorded once
per burst as the count of refusals), decided requests are kept a while for GET (KEEP_DECIDED), and a
stream's queue is bounded (a client that does not read loses requests on its stream, never the server's
memory; they stay listed).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from agentcell.record.events import EventSink, event

MAX_PENDING = 16  # per sandbox
KEEP_DECIDED = 64  # per sandbox, for GET after the fact
STREAM_QUEUE = 256


class ApprovalNotFound(KeyError):
    pass


class ApprovalDecided(ValueError):
    """The request was already answered (or timed out); the message says how."""


@dataclass
class Approval:
    id: str
    sandbox_id: str
    kind: str  # "exec" | "network"
    what: dict[str, Any]  # exec: path, argv, pid, tree; network: host, address, port
    created: float
    expires: float
    state: str = "pending"  # pending | allowed | denied | expired
    remember: bool = False
    decided_by: str | None = None
    decided_at: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "sandboxID": self.sandbox_id, "kind": self.kind, **self.what,
                "state": self.state, "remember": self.remember, "created": self.created, "expires": self.expires,
                "decidedBy": self.decided_by, "decidedAt": self.decided_at}


class _Sandbox:
    def __init__(self) -> None:
        self.pending: OrderedDict[str, Approval] = OrderedDict()
        self.decided: deque[Approval] = deque(maxlen=KEEP_DECIDED)
        self.streams: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self.flooded = 0


class Approvals:
    """Every sandbox's approval requests on this server."""

    def __init__(self, sink: EventSink | None = None, max_pending: int = MAX_PENDING) -> None:
        self.sink = sink
        self.max_pending = max_pending
        self._sandboxes: dict[str, _Sandbox] = {}
        self._ids = itertools.count(1)

    def _of(self, sandbox_id: str) -> _Sandbox:
        box = self._sandboxes.get(sandbox_id)
        if box is None:
            box = self._sandboxes[sandbox_id] = _Sandbox()
        return box

    def _record(self, sandbox_id: str, kind: str, **fields: Any) -> None:
        if self.sink is not None:
            self.sink(sandbox_id, event(kind, source="host", **fields))

    def _publish(self, box: _Sandbox, item: dict[str, Any]) -> None:
        for q in box.streams:
            if q.qsize() < STREAM_QUEUE:
                q.put_nowait(item)

    async def ask(self, sandbox_id: str, kind: str, what: dict[str, Any], timeout_s: float) -> tuple[bool, bool]:
        """Hold the caller until the request is decided: (allowed, remember). A flood beyond
        max_pending, a timeout or the sandbox's end deny."""
        box = self._of(sandbox_id)
        if len(box.pending) >= self.max_pending:
            box.flooded += 1
            if box.flooded == 1 or box.flooded % 100 == 0:
                self._record(sandbox_id, "approval.decision", approval=None, request=kind, verdict="denied",
                             by="flood", detail=f"{box.flooded} requests refused: {self.max_pending} already wait",
                             **_short(what))
            return False, False
        box.flooded = 0
        now = time.time()
        aid = f"a{next(self._ids)}{secrets.token_hex(3)}"
        item = Approval(aid, sandbox_id, kind, what, now, now + timeout_s)
        box.pending[aid] = item
        self._record(sandbox_id, "approval.request", approval=aid, request=kind, timeout_s=timeout_s, **what)
        self._publish(box, {"event": "request", **item.to_json()})
        try:
            await asyncio.wait_for(item.done.wait(), timeout_s)
        except TimeoutError:
            self._finish(box, item, "expired", False, "timeout")
        except asyncio.CancelledError:
            self._finish(box, item, "denied", False, "cancelled")
            raise
        return item.state == "allowed", item.remember

    def _finish(self, box: _Sandbox, item: Approval, state: str, remember: bool, by: str) -> None:
        if item.state != "pending":
            return
        item.state, item.remember, item.decided_by, item.decided_at = state, remember, by, time.time()
        box.pending.pop(item.id, None)
        box.decided.append(item)
        item.done.set()
        self._record(item.sandbox_id, "approval.decision", approval=item.id, request=item.kind,
                     verdict="allowed" if state == "allowed" else "denied", remember=remember, by=by,
                     waited_s=round(item.decided_at - item.created, 3), **_short(item.what))
        self._publish(box, {"event": "decision", **item.to_json()})

    def decide(self, sandbox_id: str, aid: str, allow: bool, remember: bool, by: str = "api") -> Approval:
        box = self._sandboxes.get(sandbox_id)
        item = box.pending.get(aid) if box else None
        if item is None:
            done = next((a for a in box.decided if a.id == aid), None) if box else None
            if done is not None:
                raise ApprovalDecided(f"approval {aid} is {done.state} already (by {done.decided_by})")
            raise ApprovalNotFound(aid)
        self._finish(box, item, "allowed" if allow else "denied", remember, by)  # type: ignore[arg-type]
        return item

    def list(self, sandbox_id: str, include_decided: bool = False) -> list[Approval]:
        box = self._sandboxes.get(sandbox_id)
        if box is None:
            return []
        return list(box.pending.values()) + (list(box.decided) if include_decided else [])

    async def follow(self, sandbox_id: str) -> AsyncIterator[dict[str, Any]]:
        """The sandbox's requests (those pending now first) and decisions as they happen, until it is gone."""
        box = self._of(sandbox_id)
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        for item in box.pending.values():
            q.put_nowait({"event": "request", **item.to_json()})
        box.streams.add(q)
        try:
            while True:
                got = await q.get()
                if got is None:
                    return
                yield got
        finally:
            box.streams.discard(q)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: its pending requests are denied, its streams end."""
        box = self._sandboxes.pop(sandbox_id, None)
        if box is None:
            return
        for item in list(box.pending.values()):
            self._finish(box, item, "denied", False, "sandbox gone")
        for q in box.streams:
            q.put_nowait(None)


def _short(what: dict[str, Any]) -> dict[str, Any]:
    """The request's identifying fields for a decision's event (not its whole process tree)."""
    return {k: what[k] for k in ("path", "host", "address", "port") if k in what}
