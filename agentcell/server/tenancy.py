"""Users of one server kept apart: the system service's tenancy (docs/system-service.md).

With tenancy on (`agentcell serve --system`), every sandbox has an owner, the tenant whose request
created it, and every request acts as a tenant:

- on the unix socket, the uid the kernel reports for the connecting process (SO_PEERCRED, peer.py):
  `uid:1001`; whatever the request's headers say does not matter;
- on the TCP listener (which the system service opens only with an API key), the verified credential
  (`key:<12 hex>`, auth.Credential.id): the key's holders are one tenant.

A tenant sees only its own sandboxes, snapshots and records: another's are "not found" (404), exactly as
an id that never existed, so a tenant cannot even learn which ids exist. `uid:0` (root on the socket) is
the administrator and sees everything. A data-plane request on TCP carries no identity but the
sandbox's access token, so only unix-socket data-plane requests are checked by owner (the token is
checked for every request either way).

Quotas (per tenant, root exempt): sandboxes alive or paused at once, and the memory their limits add up to.
With tenancy off (the default, and the embedded server) there are no owners and nothing here applies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from agentcell.server import auth
from agentcell.server.peer import request_peer

ADMIN = "uid:0"
PEER_UID = "peer-uid"  # auth.Credential kind of a unix-socket peer identified by SO_PEERCRED
UNVERIFIED = "unverified"


class QuotaError(Exception):
    """A tenant's create would go over its quota (429); the message says which and what to do."""


@dataclass(frozen=True)
class Quotas:
    sandboxes: int | None = None  # alive or paused at once; None: only the server's --max-sandboxes
    memory_mb: int | None = None  # their memory limits together; None: no per-tenant bound


@dataclass(frozen=True)
class _Reserved:
    """A create under way, counted against its tenant's quota until its record exists."""

    owner: str
    limits: Any


@dataclass(frozen=True)
class _Memory:
    memory_mb: int


@dataclass(frozen=True)
class Tenancy:
    enabled: bool = False
    quotas: Quotas = Quotas()
    _creating: list[_Reserved] = field(default_factory=list, compare=False)

    @classmethod
    def from_config(cls, config: Any) -> Tenancy:
        return cls(bool(getattr(config, "system", False)), Quotas(getattr(config, "max_sandboxes_per_user", None),
                                                                   getattr(config, "max_memory_mb_per_user", None)))

    def peer_credential(self, scope: dict[str, Any]) -> auth.Credential | None:
        """A unix-socket request's credential with tenancy on: the peer's uid, which the kernel vouches for
        (the API key, if the server has one, is for its TCP listener). None otherwise."""
        peer = request_peer(scope) if self.enabled else None
        return None if peer is None else auth.Credential(PEER_UID, f"uid:{peer.uid}")

    def caller(self, scope: dict[str, Any]) -> str | None:
        """The tenant a control-plane request acts as (None: tenancy is off)."""
        if not self.enabled:
            return None
        peer = request_peer(scope)
        if peer is not None:
            return f"uid:{peer.uid}"
        credential = scope.get(auth.CREDENTIAL)
        return credential.id if isinstance(credential, auth.Credential) else UNVERIFIED

    def data_plane_caller(self, scope: dict[str, Any]) -> str | None:
        """The tenant a data-plane request acts as: the socket's peer; None on TCP (the token decides)."""
        if not self.enabled:
            return None
        peer = request_peer(scope)
        return None if peer is None else f"uid:{peer.uid}"

    @staticmethod
    def sees(caller: str | None, owner: str | None) -> bool:
        """Whether `caller` may see something `owner` made (None caller: no tenancy, or no identity)."""
        return caller is None or caller == ADMIN or caller == owner

    def visible(self, caller: str | None, items: Iterable[Any]) -> list[Any]:
        return [item for item in items if self.sees(caller, item.owner)]

    @contextlib.contextmanager
    def reserve(self, caller: str | None, held: Iterable[Any], memory_mb: int, count: int = 1) -> Iterator[None]:
        """admit(), holding the room while the creates run (concurrent creates of one tenant cannot
        together pass its quota)."""
        self.admit(caller, [*held, *self._creating], memory_mb, count)
        if caller is None:
            yield
            return
        mine = [_Reserved(caller, _Memory(memory_mb)) for _ in range(count)]
        self._creating.extend(mine)
        try:
            yield
        finally:
            for r in mine:
                self._creating.remove(r)

    def admit(self, caller: str | None, held: Iterable[Any], memory_mb: int, count: int = 1) -> None:
        """Refuse (QuotaError) `count` more sandboxes of `memory_mb` each for `caller`, given all the
        server's sandboxes `held` (records with .owner and .limits)."""
        if caller is None or caller == ADMIN:
            return
        own = [r for r in held if r.owner == caller]
        most = self.quotas.sandboxes
        if most is not None and len(own) + count > most:
            raise QuotaError(f"you ({describe(caller)}) have {len(own)} sandboxes on this server and may have at "
                             f"most {most} at once (its operator's --max-sandboxes-per-user): kill one first "
                             "(Sandbox.kill, `agentcell kill ID`)")
        budget = self.quotas.memory_mb
        used = sum(r.limits.memory_mb for r in own)
        if budget is not None and used + memory_mb * count > budget:
            raise QuotaError(f"you ({describe(caller)}) hold {used} MiB of sandbox memory on this server and may hold at "
                             f"most {budget} MiB (its operator's --max-memory-mb-per-user): this needs "
                             f"{memory_mb * count} MiB more; kill a sandbox or ask for less memory (limits memoryMB)")


def describe(tenant: str) -> str:
    kind, _, value = tenant.partition(":")
    return f"uid {value}" if kind == "uid" else tenant


def recorded_owner(store: Any, sandbox_id: str) -> str | None:
    """The owner a sandbox's behaviour record names in its `sandbox.created` event (the sandbox may be
    gone); None if the record does not say."""
    for ev in store.read(sandbox_id, kinds=("sandbox.created",), limit=64):
        owner = ev.get("owner")
        if isinstance(owner, str):
            return owner
    return None
