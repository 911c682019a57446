"""The linux backend's side of a sandbox's policy (issue 28): each part to the mechanism that enforces it.

| part | mechanism | module |
|---|---|---|
| exec | fanotify permission events on every mount of the sandbox, decided by file identity (the gate), and a BPF raw tracepoint killing what no mount mark sees (the ELF loader as the main program, memfd) | exec_hold.py, exec_verdicts.py, exec_targets.py, exec_guard.py |
| files | mounts in the sandbox's mount namespace | file_rules.py |
| processes | the sandbox's cgroup pids.max | backend.set_pids_max |
| network ask | the egress proxy holds the connection | network/ask.py |
| syscalls | the agent's second seccomp filter | runtime/policy.py (the server calls the agent) |

What a host cannot enforce is refused at check() with the reason, before any sandbox is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentcell import rootless
from agentcell.backends.base import Asker
from agentcell.policy.linux import exec_guard, exec_hold, exec_targets, file_rules
from agentcell.policy.linux.exec_hold import ExecHold, HeldExec
from agentcell.policy.linux.exec_verdicts import ExecVerdicts, TooManyVerdicts
from agentcell.policy.model import Policy, PolicyError
from agentcell.record.events import event

if TYPE_CHECKING:
    from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox

log = logging.getLogger("agentcell.policy")
# what every sandbox's commands run through (E2B's SDKs: /bin/bash -l -c): allowed whatever the rules say,
# since each program they start is judged on its own
SHELLS = ("/bin/bash", "/bin/sh", "/usr/bin/bash", "/usr/bin/sh")
SUDO, SUDO_INTERPRETER = "/usr/bin/sudo", "/opt/agentcell/venv/bin/python3"
# a held operation waits this much longer than the approval's own timeout, which decides (expired)
HOLD_GRACE_S = 5.0
MAX_HOLD_S = 3600.0  # the egress's own bound on a held connection


@dataclass
class _State:
    """What one sandbox's policy holds on the host."""

    asker: Asker | None = None
    files: Any = None  # file_rules.Applied
    verdicts: ExecVerdicts | None = None
    gate: ExecHold | None = None
    guarded: bool = False
    network_ask: bool = False
    timeout_s: float = 60.0


class LinuxPolicies:
    def __init__(self, backend: LinuxBackend) -> None:
        self.backend = backend
        self.guard: exec_guard.ExecGuard | None = None
        self.exec_unavailable: str | None = "not started"
        self._states: dict[str, _State] = {}

    async def start(self) -> None:
        """Load the exec backstop where this host can (its absence makes exec rules a 400, not weaker)."""
        if rootless.active():
            self.exec_unavailable = "rootless mode: exec rules need fanotify and BPF, which need root"
            return
        try:  # (probing fanotify and loading the guard: ~45 ms, off the loop, while the zygote starts)
            self.guard = await asyncio.to_thread(_load_guard)
        except (exec_hold.ExecHoldUnavailable, exec_guard.ExecGuardUnavailable) as e:
            self.exec_unavailable = str(e)
            return
        self.exec_unavailable = None
        asyncio.get_running_loop().add_reader(self.guard.fileno(), self._guard_events)

    def start_network(self) -> None:
        """Held connections of sandboxes whose policy asks go to their approvals."""
        if self.backend.egress is not None:
            self.backend.egress.set_asker(self.network_asker)

    def close(self) -> None:
        if self.guard is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.guard.fileno())
            self.guard.close()
            self.guard = None

    # -- checks before any sandbox ------------------------------------------------------------------

    def check(self, policy: Policy) -> None:
        if policy.exec_rules and self.exec_unavailable is not None:
            raise PolicyError("policy.exec", f"exec rules cannot be enforced on this host: {self.exec_unavailable}")
        if policy.files:
            if rootless.active():
                raise PolicyError("policy.files", "file rules need a server running as root (mounts in the "
                                                  "sandbox's namespace); rootless mode cannot enforce them")
            try:
                file_rules.validate(policy.files)
            except file_rules.FileRulesError as e:
                raise _files_error(e) from None
        if policy.network_ask and self.backend.egress is None:
            raise PolicyError("policy.network", "this server gives sandboxes no internet (--egress-uplink none): "
                                                "there is no connection to ask about")

    # -- a sandbox's policy -------------------------------------------------------------------------

    async def enforce(self, sandbox: LinuxSandbox, policy: Policy, previous: Policy, asker: Asker) -> None:
        state = self._states.setdefault(sandbox.sandbox_id, _State())
        state.asker, state.timeout_s = asker, policy.ask_timeout_s
        if policy.processes_max != previous.processes_max:
            try:
                await self.backend.set_pids_max(sandbox, policy.processes_max or sandbox.limits.pids)
            except NotImplementedError as e:
                raise PolicyError("policy.processes", str(e)) from None
        files = policy.files != previous.files or (policy.files and state.files is None)
        resolving = asyncio.ensure_future(asyncio.to_thread(_verdicts, sandbox.host_pid, policy)) \
            if policy.exec_rules else None
        try:
            if files:  # meanwhile, the exec rules' files are looked up (in another thread)
                await self._files(sandbox, state, policy)
        except BaseException:
            if resolving is not None:
                with contextlib.suppress(BaseException):
                    (await resolving)[0].close()
            raise
        resolved = await resolving if resolving is not None else None
        try:
            await self._exec(sandbox, state, policy, resolved)
        except BaseException:
            if resolved is not None and resolved[0] is not state.verdicts:
                resolved[0].close()
            raise
        if self.backend.egress is not None and (policy.network_ask or state.network_ask):
            await self.backend.egress.set_ask(sandbox.slot, policy.network_ask,
                                              min(policy.ask_timeout_s + HOLD_GRACE_S, MAX_HOLD_S))
            state.network_ask = policy.network_ask

    async def _files(self, sandbox: LinuxSandbox, state: _State, policy: Policy) -> None:
        """Mount the file rules. With exec rules in force the sandbox is frozen meanwhile, so that no
        exec can come through a new mount before the gate has marked it."""
        frozen = state.gate is not None
        if frozen:
            await self.backend.pause(sandbox)
        try:
            try:
                state.files = await asyncio.to_thread(file_rules.apply, sandbox.host_pid, policy.files, state.files)
            except file_rules.FileRulesApplyError as e:
                state.files = e.applied
                raise _files_error(e) from None
            except file_rules.FileRulesError as e:
                raise _files_error(e) from None
            finally:
                if state.gate is not None:
                    state.gate.refresh()  # the mounts changed: mark the new ones
        finally:
            if frozen:
                await self.backend.resume(sandbox)

    async def _exec(self, sandbox: LinuxSandbox, state: _State, policy: Policy,
                    resolved: tuple[ExecVerdicts, bool] | None) -> None:
        if not policy.exec_rules:
            if state.gate is not None:  # rules lifted: nothing is judged any more
                await state.gate.close()
                state.gate = None
            if state.guarded and self.guard is not None:
                self.guard.unguard(sandbox.host_uids)
                state.guarded = False
            if state.verdicts is not None:
                state.verdicts.close()
                state.verdicts = None
            return
        assert policy.exec is not None and self.guard is not None and resolved is not None
        verdicts, loader_allowed = resolved
        # the backstop first, then the gate: at no instant is a rule without its guard
        self.guard.guard(sandbox.host_uids, exec_guard.ALLOW_LOADER if loader_allowed else 0)
        state.guarded = True
        old, state.verdicts = state.verdicts, verdicts
        if state.gate is None:
            gate = ExecHold(sandbox.host_pid, self._verdict_of(sandbox.sandbox_id), self._asker_of(sandbox.sandbox_id),
                            ask_timeout=policy.ask_timeout_s + HOLD_GRACE_S, name=f"sandbox {sandbox.sandbox_id}",
                            fail="deny")
            try:
                gate.start()
            except exec_hold.ExecHoldUnavailable as e:  # (a fanotify limit of the host's, say)
                self.guard.unguard(sandbox.host_uids)
                state.guarded = False
                raise PolicyError("policy.exec", f"exec rules cannot be enforced now: {e}") from None
            state.gate = gate
        else:
            state.gate.ask_timeout = policy.ask_timeout_s + HOLD_GRACE_S
        state.gate.ignore_only(verdicts.allowed())  # the kernel stops asking about allowed files
        if old is not None:
            old.close()

    def _verdict_of(self, sandbox_id: str) -> Callable[[int], str]:
        def verdict(fd: int) -> str:
            state = self._states.get(sandbox_id)
            if state is None or state.verdicts is None:
                return "allow"  # rules lifted meanwhile
            said = state.verdicts.verdict(fd)
            if said == "deny":
                self._record(sandbox_id, path=_path_of(fd), action="refused", reason="rule" if state.verdicts.named(fd)
                             else "default")
            return said
        return verdict

    def _record(self, sandbox_id: str, **fields: Any) -> None:
        if self.backend.recorder is not None:
            self.backend.recorder.add(sandbox_id, event("deny.exec", source="host", **fields))

    def _asker_of(self, sandbox_id: str) -> Callable[[HeldExec], Awaitable[str]]:
        async def ask(held: HeldExec) -> str:
            state = self._states.get(sandbox_id)
            if state is None or state.asker is None or state.verdicts is None:
                return "deny"
            allowed, remember = await state.asker("exec", held.to_json())
            verdicts = state.verdicts
            try:
                if allowed:
                    (verdicts.allow if remember else verdicts.allow_once)(held.fd)
                    if remember and state.gate is not None:
                        state.gate.ignore(held.fd)
                elif remember:
                    verdicts.deny(held.fd)
            except (OSError, TooManyVerdicts) as e:
                log.warning("sandbox %s: an approval could not be kept (%s)", sandbox_id, e)
            return verdicts.verdict(held.fd) if allowed else "deny"
        return ask

    async def release(self, sandbox: LinuxSandbox) -> None:
        state = self._states.pop(sandbox.sandbox_id, None)
        if state is None:
            return
        if state.gate is not None:
            await state.gate.close()
        if state.guarded and self.guard is not None:
            self.guard.unguard(sandbox.host_uids)
        if state.verdicts is not None:
            state.verdicts.close()
        if state.files is not None:
            state.files.close()

    async def network_asker(self, sandbox_id: str, host: str | None, address: str | None, port: int) -> tuple[bool, bool]:
        state = self._states.get(sandbox_id)
        if state is None or state.asker is None:
            return False, False
        return await state.asker("network", {"host": host, "address": address, "port": port})

    def _guard_events(self) -> None:
        assert self.guard is not None
        for kill in self.guard.read():
            sandbox_id = self.backend.sandbox_of_uid(kill.uid)
            if sandbox_id is not None:
                self._record(sandbox_id, host_pid=kill.host_pid, comm=kill.comm, path=kill.filename, name=kill.name,
                             action="killed", reason=kill.reason)


def _load_guard() -> exec_guard.ExecGuard:
    """The guard, where the gate can work too (blocking: in a thread)."""
    why = exec_hold.available()
    if why is not None:
        raise exec_hold.ExecHoldUnavailable(why)
    return exec_guard.ExecGuard()


def _verdicts(init_pid: int, policy: Policy) -> tuple[ExecVerdicts, bool]:
    """The exec rules' files resolved in the sandbox's root (blocking: in a thread), and whether a rule
    allows one of its ELF loaders by name (then the guard lets it run as a program)."""
    assert policy.exec is not None
    verdicts = ExecVerdicts(policy.exec.default)
    loader_allowed = False
    try:
        with exec_targets.sandbox_root(init_pid) as root:
            loaders: set[tuple[int, int]] = set()
            for t in exec_targets.loaders_in(root):
                with _closing(t.fd):
                    loaders.add(verdicts.loader(t.fd))
            for t in exec_targets.resolve_in(root, SHELLS):
                with _closing(t.fd):
                    verdicts.allow(t.fd)
            sudo = False
            for t in exec_targets.resolve_in(root, policy.exec.allow):
                with _closing(t.fd):
                    loader_allowed |= verdicts.allow(t.fd) in loaders
                    sudo |= t.path == SUDO
            if sudo:  # the sandbox's sudo is a script of the runtime's Python (runtime/sudo_shim.py)
                for t in exec_targets.resolve_in(root, (SUDO_INTERPRETER,)):
                    with _closing(t.fd):
                        verdicts.allow(t.fd)
            for t in exec_targets.resolve_in(root, policy.exec.deny):
                with _closing(t.fd):
                    verdicts.deny(t.fd)
    except (exec_targets.ExecPatternError, TooManyVerdicts) as e:
        verdicts.close()
        raise PolicyError("policy.exec", str(e)) from None
    except OSError as e:
        verdicts.close()
        raise PolicyError("policy.exec", f"the sandbox's programs could not be looked up: {e}") from None
    return verdicts, loader_allowed


@contextlib.contextmanager
def _closing(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _path_of(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _files_error(e: file_rules.FileRulesError) -> PolicyError:
    part = f"policy.files[{e.index}]" if e.index is not None else "policy.files"
    return PolicyError(part, e.message)
