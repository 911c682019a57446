"""Network "ask" (issue 28): a new destination outside a sandbox's allow list waits for a decision.

Where a connection waits: in the egress proxy (proxy.py). For a sandbox in ask mode, the router hands
every new TCP connection to an address its allow list and pins do not cover (and that is neither on
the never-list nor denied) to the proxy, which accepts it, reads the host it names (ports 80/443:
SNI, Host) and asks the server; the server asks its `Asker` (the approvals the sandbox's owner
answers) and answers when the decision comes. So a client sees its TCP connection established, then
silence until the decision: allowed, the bytes flow; refused, the connection ends (plain HTTP gets a
403 saying why). The server's loop and the proxy's never block on a decision: each is a task.

Names: a name outside the allow list is not resolved before it is approved (a query is itself a
message to the name's servers). The sandbox's resolver answers it with a *stand-in* address of its
own (`StandIns`: 198.18.0.0/15, on the never-list, TTL 1 s, one per name and sandbox); a connection
to a stand-in is held and asked about as that name, and only once it is allowed does the server
resolve the name (screened as every answer is: never-list, denied addresses) and the proxy connect
to the real address. A name remembered is allowed from then on: the resolver answers it for real.

This module is the gate: who asks (`set_asker`), which slots ask and for how long (`configure`),
one decision per (host, address, port) at a time that every connection waiting for it shares, at
most MAX_HELD_PER_SANDBOX connections held per sandbox (more are refused at once, and counted), the
unanswered timeout (a denial), and the counts. What may be asked about at all, and what a
remembered approval opens, is the egress service's (service.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger("agentcell.egress")

# (sandbox id, the host name (None: an address the connection went to without a name), the address
#  (None: a name not resolved yet), the port) -> (allow, remember)
Asker = Callable[[str, str | None, str | None, int], Awaitable[tuple[bool, bool]]]
MAX_HELD_PER_SANDBOX = 32  # connections of one sandbox waiting for a decision at once; more: refused
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 3600.0
STAND_IN_NET = ipaddress.IPv4Network("198.18.0.0/15")  # RFC 2544's benchmarking range: on the never-list
STAND_IN_TTL = 1  # seconds: once a name is allowed, the next lookup gets the real addresses
MAX_STAND_INS = 4096  # names per sandbox (the least recently answered goes first)


class AskError(ValueError):
    """A bad ask setting (a timeout out of range)."""


class StandIns:
    """One sandbox's stand-in addresses: name <-> address, at most MAX_STAND_INS names."""

    def __init__(self) -> None:
        self._by_name: OrderedDict[str, str] = OrderedDict()
        self._by_address: dict[str, str] = {}
        self._next = 1

    def address_for(self, name: str) -> str:
        address = self._by_name.get(name)
        if address is not None:
            self._by_name.move_to_end(name)
            return address
        if len(self._by_name) >= MAX_STAND_INS:
            _, old = self._by_name.popitem(last=False)
            del self._by_address[old]
        while True:  # the next free one (.0 and the broadcast address left out)
            address = str(STAND_IN_NET[self._next])
            self._next = self._next % (STAND_IN_NET.num_addresses - 2) + 1
            if address not in self._by_address:
                break
        self._by_name[name], self._by_address[address] = address, name
        return address

    def name_of(self, address: str) -> str | None:
        return self._by_address.get(address)


def is_stand_in(address: str) -> bool:
    try:
        return ipaddress.ip_address(address) in STAND_IN_NET
    except ValueError:
        return False


@dataclass(frozen=True)
class Question:
    owner: str  # the sandbox id
    host: str | None
    address: str | None  # None: a name not resolved yet (a stand-in's: resolved once allowed)
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
