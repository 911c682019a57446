"""The server's side of the agent's ``policy`` op (runtime/policy.py): a sandbox policy's syscalls
and whether execs may be held, set on a running sandbox's agent.

Check first with `syscalls_change_allowed(current, wanted)`: strict never goes back to default (a
seccomp filter cannot be lifted); the agent refuses that too (InvalidArgumentError).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from agentcell.errors import DeadlineExceededError
from agentcell.runtime.policy import SYSCALLS, syscalls_change_allowed
from agentcell.runtime.protocol import AgentChannel

__all__ = ["SYSCALLS", "AgentPolicy", "set_agent_policy", "syscalls_change_allowed"]

POLICY_CALL_TIMEOUT_S = 30.0  # loading a filter and restarting an unused context: well under a second


@dataclass(frozen=True)
class AgentPolicy:
    """What the agent enforces now."""

    syscalls: str
    hold_exec: bool
    contexts_kept: tuple[str, ...]  # code contexts that ran code before strict: they keep the old filter


async def set_agent_policy(channel: AgentChannel, syscalls: str, hold_exec: bool) -> AgentPolicy:
    """Set the sandbox agent's syscalls ("default" | "strict") and hold_exec (start processes with
    fork + exec, so an exec held for a decision blocks only the child). Raises the agent's typed
    errors: InvalidArgumentError for strict -> default or a bad value, SandboxError("unimplemented")
    when the backend gave the agent no strict filter, SandboxGoneError if the sandbox is gone."""
    try:
        frame = await asyncio.wait_for(channel.call("policy", syscalls=syscalls, hold_exec=hold_exec),
                                       POLICY_CALL_TIMEOUT_S)
    except TimeoutError:
        raise DeadlineExceededError(f"the sandbox did not answer its policy within {POLICY_CALL_TIMEOUT_S:.0f} s") from None
    h = frame.header
    return AgentPolicy(str(h.get("syscalls")), bool(h.get("hold_exec")),
                       tuple(str(c) for c in h.get("contexts_kept") or ()))
