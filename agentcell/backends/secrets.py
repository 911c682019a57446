"""Secrets that never enter a sandbox (issue 7): the create body's `secrets` (an agentcell extension),
`{"NAME": {"value": "...", "hosts": ["api.example.com", "*.example.org"]}}`.

The sandbox's environment gets NAME = a placeholder (unguessable, recognisable); the value stays in the
server. The egress proxy puts the value in place of the placeholder in the headers of HTTP(S)
requests to the listed hosts only (backends/linux/egress_secrets.py), and takes it out of what those
hosts answer. No API response carries a value (`public()`).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_SECRETS = 32
MAX_VALUE = 8 << 10
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_HOST = re.compile(r"^(\*\.)?(?!-)[a-z0-9-]{1,63}(?<!-)(\.(?!-)[a-z0-9-]{1,63}(?<!-))*$")


class SecretError(ValueError):
    """A `secrets` entry that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class Secret:
    name: str
    value: str = field(repr=False)
    hosts: tuple[str, ...]
    placeholder: str

    def serves(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == h or (h.startswith("*.") and host.endswith(h[1:]) and host != h[2:]) for h in self.hosts)


@dataclass(frozen=True)
class SecretSet:
    secrets: tuple[Secret, ...] = ()

    @classmethod
    def parse(cls, raw: Any) -> SecretSet:
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise SecretError("'secrets' must be an object: {NAME: {\"value\": ..., \"hosts\": [...]}}")
        if len(raw) > MAX_SECRETS:
            raise SecretError(f"at most {MAX_SECRETS} secrets per sandbox")
        out = []
        for name, spec in raw.items():
            if not isinstance(name, str) or not _NAME.match(name):
                raise SecretError(f"secret name {name!r} must be an environment variable name")
            if not isinstance(spec, Mapping) or set(spec) - {"value", "hosts"}:
                raise SecretError(f"secret {name}: an object with 'value' and 'hosts'")
            value = spec.get("value")
            if not isinstance(value, str) or not value or len(value.encode()) > MAX_VALUE:
                raise SecretError(f"secret {name}: 'value' must be a non-empty string of at most {MAX_VALUE} bytes")
            if any(c in value for c in "\r\n\0"):
                raise SecretError(f"secret {name}: 'value' must not contain CR, LF or NUL (it goes in a header)")
            hosts = spec.get("hosts")
            if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
                raise SecretError(f"secret {name}: 'hosts' must be a non-empty list of host names")
            clean = tuple(h.strip().lower().rstrip(".") for h in hosts)
            bad = [h for h in clean if not _HOST.match(h) or len(h) > 253]
            if bad:
                raise SecretError(f"secret {name}: {bad[0]!r} is not a host name (or *.name); no scheme, port or path")
            out.append(Secret(name, value, clean, f"agentcell-secret-{name.lower()}-{secrets.token_hex(16)}"))
        return cls(tuple(out))

    def __bool__(self) -> bool:
        return bool(self.secrets)

    def envs(self) -> dict[str, str]:
        return {s.name: s.placeholder for s in self.secrets}

    def for_host(self, host: str | None) -> list[Secret]:
        return [s for s in self.secrets if host and s.serves(host)]

    def hosts(self) -> tuple[str, ...]:
        return tuple(sorted({h for s in self.secrets for h in s.hosts}))

    def public(self) -> dict[str, dict[str, list[str]]]:
        """What get_info may show: names and hosts, never a value."""
        return {s.name: {"hosts": list(s.hosts)} for s in self.secrets}
