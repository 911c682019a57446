"""Network "ask" (issue 28): a new destination outside a sandbox's allow list waits for a decision.

Where a connection waits: in the egress proxy (proxy.py). For a sandbox in ask mode, the router hands
every new TCP connection to an address its allow list and pins do not cover (and that is neither on
the never-list nor denied) to the proxy, which accepts it, reads the host it names (ports 80/443:
SNI, Host) and asks the server; the server asks its `Asker` (the approvals the lead wires in) and
answers when the decision comes. So a client sees its TCP connection established, then silence until
the decision: allowed, the bytes flow; refused, the connection ends (plain HTTP gets a 403 saying
why). The server's loop and the proxy's never block on a decision: each is a task.

This module is the gate: who asks (`set_asker`), which slots ask and for how long (`configure`),
one decision per (host, address, port) at a time that every connection waiting for it shares, at
most MAX_HELD_PER_SANDBOX connections held per sandbox (more are refused at once, and counted), the
unanswered timeout (a denial), and the counts. What may be asked about at all, and what a
remembered approval opens, is the egress service's (service.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger("agentcell.egress")

# (sandbox id, the host name the connection names or its address was answered for (None: neither),
#  the address, the port) -> (allow, remember)
Asker = Callable[[str, str | None, str, int], Awaitable[tuple[bool, bool]]]
MAX_HELD_PER_SANDBOX = 32  # connections of one sandbox waiting for a decision at once; more: refused
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 3600.0


class AskError(ValueError):
    """A bad ask setting (a timeout out of range)."""


@dataclass(frozen=True)
class Question:
    owner: str  # the sandbox id
    host: str | None
    address: str
    port: int


@dataclass(frozen=True)
class Answer:
    allowed: bool
    outcome: str  # approved, remembered, denied, timeout, flood, no-asker, error, gone
    waited_s: float = 0.0

    @property
    def rule(self) -> str:
        return f"ask:{self.outcome}"


class AskGate:
    """`on_remember(slot, question)` is awaited (before the held connections go on) when an approval
    says remember."""

    def __init__(self, on_remember: Callable[[int, Question], Awaitable[None]]) -> None:
        self.asker: Asker | None = None
        self.on_remember = on_remember
        self._timeouts: dict[int, float] = {}  # slots in ask mode -> their unanswered timeout
        self._held: dict[int, int] = {}
        self._deciding: dict[int, dict[Question, asyncio.Task[Answer]]] = {}
        self.counts: Counter[str] = Counter()  # outcomes, all sandboxes (flood: refused at once)
        self.flooded: Counter[int] = Counter()  # per slot, since its sandbox's claim

    def set_asker(self, asker: Asker | None) -> None:
        self.asker = asker

    def configure(self, slot: int, enabled: bool, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if enabled:
            if not 0 < timeout_s <= MAX_TIMEOUT_S:
                raise AskError(f"ask timeout must be within (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s!r}")
            self._timeouts[slot] = float(timeout_s)
        else:
            self._timeouts.pop(slot, None)

    def enabled(self, slot: int) -> bool:
        return slot in self._timeouts

    def timeout(self, slot: int) -> float:
        return self._timeouts.get(slot, 0.0)

    def held(self, slot: int) -> int:
        return self._held.get(slot, 0)

    async def ask(self, slot: int, question: Question) -> Answer:
        """The decision for one held connection (joins a decision already asked for the same question)."""
        if self.asker is None or slot not in self._timeouts:
            self.counts["no-asker"] += 1
            return Answer(False, "no-asker")
        if self._held.get(slot, 0) >= MAX_HELD_PER_SANDBOX:
            self.counts["flood"] += 1
            self.flooded[slot] += 1
            return Answer(False, "flood")
        self._held[slot] = self._held.get(slot, 0) + 1
        try:
            deciding = self._deciding.setdefault(slot, {})
            task = deciding.get(question)
            if task is None:
                task = deciding[question] = asyncio.create_task(self._decide(slot, question, self._timeouts[slot]))
                task.add_done_callback(lambda t: deciding.pop(question, None) if deciding.get(question) is t else None)
            return await asyncio.shield(task)
        finally:
            left = self._held.get(slot, 1) - 1
            if left > 0:
                self._held[slot] = left
            else:
                self._held.pop(slot, None)

    async def _decide(self, slot: int, q: Question, timeout_s: float) -> Answer:
        assert self.asker is not None
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                allow, remember = await self.asker(q.owner, q.host, q.address, q.port)
        except TimeoutError:
            answer = Answer(False, "timeout", time.monotonic() - t0)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an asker that fails is a no
            log.warning("asking about %s:%d for %s failed: %s", q.host or q.address, q.port, q.owner, e)
            answer = Answer(False, "error", time.monotonic() - t0)
        else:
            if allow and remember:
                await self.on_remember(slot, q)
            answer = Answer(bool(allow), ("remembered" if remember else "approved") if allow else "denied",
                            time.monotonic() - t0)
        self.counts[answer.outcome] += 1
        return answer

    def forget(self, slot: int) -> None:
        """The slot's sandbox is gone: its decisions are cancelled (the asker's task sees CancelledError)
        and its settings dropped, before the slot serves another sandbox."""
        self._timeouts.pop(slot, None)
        self.flooded.pop(slot, None)
        for task in self._deciding.pop(slot, {}).values():
            task.cancel()

    def close(self) -> None:
        for slot in list(self._deciding):
            self.forget(slot)
