"""A sandbox's lifecycle state, and the only transitions between states the registry may make.

One field says where a sandbox is in its life; every part of the server (lookups, the channel
watcher, the reaper, pause/resume/kill, snapshots, a stopping server) asks it instead of combining
flags and clocks. The three states ending in "-ing" are under way: one task owns each (a pause,
a write to disk, a resume) and ends it; everything else waits for it (`settled`) or kills.

    running ──> pausing ──> paused ──> resuming ──> running
       │           │  └──────> running (the pause failed)     │
       │           │            paused <──> persisting        └──> paused (the resume failed)
       └───────────┴──── any but gone ──> killing ──> gone
"""

from __future__ import annotations

import asyncio
from enum import StrEnum


class SandboxState(StrEnum):
    RUNNING = "running"
    PAUSING = "pausing"  # a pause under way (asked for, or its timeout passed with on_timeout "pause")
    PAUSED = "paused"  # frozen with its memory, or kept on disk (its files or its checkpoint)
    PERSISTING = "persisting"  # a frozen sandbox being written to disk (hibernation, a stopping server)
    RESUMING = "resuming"
    KILLING = "killing"  # out of the registry, its processes and files going
    GONE = "gone"

    @property
    def under_way(self) -> bool:
        """A transition a task is carrying out: wait for it to end (`SandboxLife.settled`)."""
        return self in _UNDER_WAY

    @property
    def api_state(self) -> str:
        """E2B's state ("running" | "paused"): a sandbox on its way to or from a pause is paused."""
        return "running" if self is SandboxState.RUNNING else "paused"


_UNDER_WAY = frozenset({SandboxState.PAUSING, SandboxState.PERSISTING, SandboxState.RESUMING})

S = SandboxState
TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    S.RUNNING: frozenset({S.PAUSING, S.KILLING}),
    S.PAUSING: frozenset({S.PAUSED, S.RUNNING, S.KILLING}),
    S.PAUSED: frozenset({S.RESUMING, S.PERSISTING, S.KILLING}),
    S.PERSISTING: frozenset({S.PAUSED, S.KILLING}),
    S.RESUMING: frozenset({S.RUNNING, S.PAUSED, S.KILLING}),
    S.KILLING: frozenset({S.GONE}),
    S.GONE: frozenset(),
}


class InvalidTransitionError(Exception):
    """A transition the lifecycle does not allow: a bug in the registry, or a sandbox killed meanwhile."""

    def __init__(self, sandbox_id: str, old: SandboxState, new: SandboxState) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[old])) or "none"
        super().__init__(f"sandbox {sandbox_id} cannot go from {old} to {new} (from {old}: {allowed})")
        self.sandbox_id, self.old, self.new = sandbox_id, old, new


class SandboxLife:
    """One sandbox's state; `to` checks each transition, `settled` waits out one under way."""

    def __init__(self, sandbox_id: str, state: SandboxState = SandboxState.RUNNING) -> None:
        self.sandbox_id = sandbox_id
        self._state = state
        self._changed = asyncio.Event()

    @property
    def state(self) -> SandboxState:
        return self._state

    def to(self, new: SandboxState) -> None:
        """Go to `new`; InvalidTransitionError if the lifecycle has no such step from here."""
        if new not in TRANSITIONS[self._state]:
            raise InvalidTransitionError(self.sandbox_id, self._state, new)
        self._state = new
        self._changed.set()  # wakes whoever waits on this state, then a fresh event for the next
        self._changed = asyncio.Event()

    def ended(self) -> bool:
        return self._state in (SandboxState.KILLING, SandboxState.GONE)

    async def settled(self) -> SandboxState:
        """The state once no transition is under way (returns at once if none is)."""
        while self._state.under_way:
            await self._changed.wait()
        return self._state

    async def left(self, state: SandboxState) -> SandboxState:
        """The state once it is no longer `state` (a test or a caller watching a transition)."""
        while self._state is state:
            await self._changed.wait()
        return self._state

    async def reached(self, state: SandboxState) -> None:
        """Returns once the sandbox is in `state` (now or later); never returns if it never is."""
        while self._state is not state:
            await self._changed.wait()
