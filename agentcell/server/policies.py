"""A sandbox's policy as the server carries it out (issue 28): the backend's part (exec rules, file
rules, processes, held operations: Backend.enforce_policy) and the agent's (the strict syscall filter,
and starting processes without vfork while execs may be held: runtime/policy.py)."""

from __future__ import annotations

from typing import Any

from agentcell.backends.base import Asker, Backend, RunningSandbox
from agentcell.policy import model
from agentcell.policy.approvals import Approvals
from agentcell.policy.model import Policy
from agentcell.runtime.protocol import AgentChannel
from agentcell.server.agent_policy import set_agent_policy


def asker_for(approvals: Approvals, sandbox_id: str, policy: Policy) -> Asker:
    async def ask(kind: str, what: dict[str, Any]) -> tuple[bool, bool]:
        return await approvals.ask(sandbox_id, kind, what, policy.ask_timeout_s)
    return ask


def check(backend: Backend, policy: Policy, previous: Policy | None = None) -> None:
    """PolicyError (the server's 400, naming the part) for a policy this backend cannot enforce, or a
    change no backend can make to a running sandbox."""
    if previous is not None:
        model.check_change(previous, policy)
    if not policy.empty:  # (no policy: nothing for the backend to enforce)
        backend.check_policy(policy)


async def enforce(backend: Backend, running: RunningSandbox, channel: AgentChannel, approvals: Approvals,
                  policy: Policy, previous: Policy) -> tuple[str, ...]:
    """Make `policy` hold in a running sandbox whose policy was `previous` (Policy() when new). The
    code contexts that keep the default syscall filter (they ran code before strict came)."""
    kept: tuple[str, ...] = ()
    if policy.syscalls != previous.syscalls or policy.exec_asks != previous.exec_asks or policy.syscalls == "strict":
        # first: the agent starts no process with vfork before an exec can be held
        kept = (await set_agent_policy(channel, policy.syscalls, policy.exec_asks)).contexts_kept
    await backend.enforce_policy(running, policy, previous, asker_for(approvals, running.sandbox_id, policy))
    return kept

