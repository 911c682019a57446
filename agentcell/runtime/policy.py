"""The parts of a sandbox's policy the agent enforces itself: the ``policy`` op.

``{"op": "policy", "syscalls": "default"|"strict", "hold_exec": bool}``:

* ``syscalls``: "strict" loads the strict seccomp filter (backends/linux/seccomp_filter.py, built once
  by the backend and handed over in the agent's config) into the agent itself, with TSYNC: every thread
  of the agent carries it, and so does every process it starts from then on (commands, sudo, code
  contexts made or restarted later). Processes already running keep the filters they had. Python
  contexts that never ran code (the default one, warmed before the claim) load it themselves before
  their first run: nothing of a tenant's ran there. Other contexts that never ran code are restarted.
  Contexts that ran code keep the old filter (their state would be lost): the answer names them. A
  filter cannot be lifted: "default" after "strict" is an error (syscalls_change_allowed).
  Idempotent: asking again for what is in force changes nothing.
* ``hold_exec``: while true, the agent starts processes with fork + exec instead of posix_spawn
  (vfork), so that an exec the server holds for a human's approval (fanotify's FAN_OPEN_EXEC_PERM)
  blocks the child only, never the agent (processes.spawn).

The answer: ``{"syscalls", "hold_exec", "contexts_kept": [ids of contexts with the old filter]}``.
"""

from __future__ import annotations

from typing import Any, Protocol

from agentcell.errors import InvalidArgumentError, SandboxError

SYSCALLS = ("default", "strict")


class StrictFilter(Protocol):
    def load_all_threads(self) -> None: ...


def syscalls_change_allowed(current: str, wanted: str) -> bool:
    """Whether a running sandbox can go from `current` to `wanted`: a seccomp filter can be added,
    never removed, so strict stays strict."""
    return wanted == current or (current == "default" and wanted == "strict")


_strict_filter: StrictFilter | None = None  # the backend's (agent config "strict_seccomp")
_syscalls = "default"
_hold_exec = False


def configure(strict_filter: StrictFilter | None) -> None:
    """At the agent's start, before any fork: the strict filter its backend built (None: none)."""
    global _strict_filter
    _strict_filter = strict_filter


def holds_exec() -> bool:
    """Processes are started with fork + exec (an exec may be held for a decision)."""
    return _hold_exec


def syscalls() -> str:
    return _syscalls


def check(syscalls: Any, hold_exec: Any) -> tuple[str, bool]:
    """The op's fields, validated against what is in force now."""
    if syscalls is None:
        syscalls = _syscalls
    if syscalls not in SYSCALLS:
        raise InvalidArgumentError(f"policy syscalls must be one of {', '.join(SYSCALLS)}, got {syscalls!r}")
    if not syscalls_change_allowed(_syscalls, syscalls):
        raise InvalidArgumentError(
            f"the sandbox runs with syscalls {_syscalls!r}: a seccomp filter cannot be lifted from running "
            "processes, so it cannot go back to 'default' (create a new sandbox instead)")
    if hold_exec is None:
        hold_exec = _hold_exec
    if not isinstance(hold_exec, bool):
        raise InvalidArgumentError("policy hold_exec must be true or false")
    if syscalls == "strict" and _syscalls != "strict" and _strict_filter is None:
        raise SandboxError("this sandbox's backend gave its agent no strict seccomp filter", "unimplemented")
    return syscalls, hold_exec


def set_hold_exec(hold: bool) -> None:
    global _hold_exec
    _hold_exec = hold


def load_strict() -> bool:
    """Load the strict filter into this process's every thread (the agent, or a context that never
    ran code); False if it was in force already. Raises SandboxError if the kernel refused it."""
    global _syscalls
    if _syscalls == "strict":
        return False
    if _strict_filter is None:
        raise SandboxError("this sandbox's backend gave its agent no strict seccomp filter", "unimplemented")
    try:
        _strict_filter.load_all_threads()
    except OSError as e:
        raise SandboxError(f"the strict seccomp filter could not be loaded: {e.strerror or e}") from None
    _syscalls = "strict"
    return True
