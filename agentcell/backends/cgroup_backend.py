"""What every backend whose sandboxes each have a cgroup of their own does the same way (linux,
gvisor, microvm): measure a sandbox, the budget all of them share, pause and resume with the freezer;
and what the two whose sandboxes are each one process tree in that cgroup (gvisor, microvm) share: a
create's first checks, new ids, killing a sandbox's cgroup."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import re
import time
from collections.abc import Callable, Container
from typing import Any

from agentcell.backends.base import Capacity, RunningSandbox, SandboxSpec, SandboxStats, new_cell_sandbox_id
from agentcell.backends.linux import cgroups, host
from agentcell.errors import InvalidArgumentError, SandboxError, SandboxGoneError

ID_RE = re.compile(r"^[a-z0-9]{1,63}$")


class CgroupSandboxes:
    """Mixed into a Backend whose sandboxes have `cgroups` (cgroups.Cgroups), `killed` and
    `kill_lock`, and which has `host_budget` (host.HostBudget | None) and `cgroup_parent`."""

    host_budget: Any
    cgroup_parent: str

    async def stats(self, sandbox: RunningSandbox) -> SandboxStats:
        sb: Any = sandbox
        if sb.killed:
            raise SandboxGoneError(f"sandbox {sb.sandbox_id} was killed")
        try:
            return sb.cgroups.stats()
        except OSError as e:
            raise SandboxGoneError(f"sandbox {sb.sandbox_id} has no cgroup any more: {e}") from e

    async def capacity(self) -> Capacity | None:
        if self.host_budget is None:
            return None
        try:
            used = cgroups.Cgroups.at(self.cgroup_parent).stats()
        except OSError:
            return None
        return Capacity(self.host_budget.memory_bytes, self.host_budget.pids, used.memory_bytes, used.pids)

    async def pause(self, sandbox: RunningSandbox) -> None:
        await self._freeze(sandbox, True)

    async def resume(self, sandbox: RunningSandbox) -> None:
        await self._freeze(sandbox, False)

    async def _freeze(self, sandbox: RunningSandbox, frozen: bool) -> None:
        """The host freezer (gvisor: `runsc pause` would leave systrap's stubs spinning)."""
        sb: Any = sandbox
        async with sb.kill_lock:  # never against a kill: its cgroups are going away
            if sb.killed:
                raise SandboxGoneError(f"sandbox {sb.sandbox_id} was killed")
            try:  # waits (ms) for the last task to stop: off the event loop
                await asyncio.to_thread(sb.cgroups.freeze if frozen else sb.cgroups.thaw)
            except OSError as e:
                raise SandboxError(f"sandbox {sb.sandbox_id} could not be {'paused' if frozen else 'resumed'}: "
                                   f"{e.strerror or e}") from e


class OwnSandboxes:
    """Mixed into a Backend that keeps its sandboxes in `_sandboxes` (by id), the claimed ones in
    `claimed`, and has `host_budget` and `max_sandboxes` (gvisor, microvm)."""

    _sandboxes: dict[str, Any]
    claimed: Any
    host_budget: Any
    max_sandboxes: int

    def _check_basics(self, spec_: SandboxSpec) -> None:
        """A create's id and its uniqueness, its limits within the host's, and room for one more."""
        check_create(spec_, self._sandboxes, len(self.claimed), self.host_budget, self.max_sandboxes)

    def _new_id(self) -> str:
        sandbox_id = new_cell_sandbox_id()
        while sandbox_id in self._sandboxes:
            sandbox_id = new_cell_sandbox_id()
        return sandbox_id


def check_create(spec_: SandboxSpec, known: Container[str], count: int, host_budget: Any,
                 max_sandboxes: int) -> None:
    """What every backend checks first at a create: the id's form and that it is not taken (`known`),
    the limits within what the backend and the host allow, and room for one more (`count` running)."""
    if spec_.sandbox_id and not ID_RE.match(spec_.sandbox_id):
        raise InvalidArgumentError(f"sandbox id must match {ID_RE.pattern}, got {spec_.sandbox_id!r}")
    if spec_.sandbox_id in known:
        raise SandboxError(f"sandbox {spec_.sandbox_id} already exists", "already_exists")
    try:
        spec_.limits.validate()
        host.check_limits(spec_.limits, host_budget)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None
    if count >= max_sandboxes:
        raise SandboxError("too many sandboxes on this host", "resource_exhausted")


def kill_cgroup(cg: cgroups.Cgroups, reap: Callable[[], None]) -> None:
    """SIGKILL every task of a sandbox's cgroups, `reap` the server's children among them, remove the
    cgroups (blocking: run it in a thread)."""
    deadline = time.monotonic() + 10
    delay = 0.002
    while True:
        with contextlib.suppress(OSError):
            cg.kill_all()  # thaws first: a frozen task dies only once thawed (v1)
        reap()
        try:
            if cg.remove():
                return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                raise
        if time.monotonic() > deadline:
            raise SandboxError(f"the cgroups of sandbox {cg.sandbox_id} stay busy; remove them by hand")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
