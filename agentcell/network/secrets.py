"""Secrets that never enter a sandbox (issue 7): the create body's `secrets` (an agentcell extension),
`{"NAME": {"value": "...", "hosts": ["api.example.com", "*.example.org"]}}`.

E2B's `network.rules` (headers set on requests to a host) travel the same way (`HeaderRule`).

The sandbox's environment gets NAME = a placeholder (unguessable, recognisable); the value stays in the
server. The egress proxy puts the value in place of the placeholder in the headers of HTTP(S)
requests to the listed hosts only (network/inspection.py), and takes it out of what those
hosts answer. No API response carries a value (`public()`).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentcell.network.tunnel import EgressTunnel

MAX_SECRETS = 32
MAX_VALUE = 8 << 10
MIN_VALUE = 8
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_HOST = re.compile(r"^(\*\.)?(?!-)[a-z0-9-]{1,63}(?<!-)(\.(?!-)[a-z0-9-]{1,63}(?<!-))*$")


def host_matches(host: str, pattern: str) -> bool:
    """Whether `host` is `pattern`, or below it for a `*.name` pattern (not the name itself)."""
    host = host.lower().rstrip(".")
    return host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:]) and host != pattern[2:])


def is_host_pattern(text: str) -> bool:
    """A host name, or `*.` followed by one (what secrets, rules and the operator's plain-HTTP hosts name)."""
    return len(text) <= 253 and _HOST.match(text) is not None


def placeholder_in(data: bytes, secrets: list[Secret]) -> Secret | None:
    """The first of `secrets` whose placeholder is in `data`."""
    return next((s for s in secrets if s.placeholder.encode() in data), None)


class SecretError(ValueError):
    """A `secrets` entry that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class Secret:
    name: str
    value: str = field(repr=False)
    hosts: tuple[str, ...]
    placeholder: str
    bodies: bool = False  # also put in request bodies (opt-in)

    def serves(self, host: str) -> bool:
        return any(host_matches(host, h) for h in self.hosts)


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$")
MAX_RULE_HOSTS = 32
MAX_RULE_HEADERS = 32


@dataclass(frozen=True)
class HeaderRule:
    """E2B's `network.rules` entry: headers the egress proxy sets on every request to `host` (the
    sandbox never sees their values, like a secret's)."""

    host: str
    headers: tuple[tuple[str, str], ...] = field(repr=False)

    def serves(self, host: str) -> bool:
        return host_matches(host, self.host)


def parse_rules(raw: Any) -> tuple[HeaderRule, ...]:
    """E2B's `network.rules`: {host: [{"transform": {"headers": {name: value}}}, ...]}."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping) or len(raw) > MAX_RULE_HOSTS:
        raise SecretError(f"'network.rules' must be an object of at most {MAX_RULE_HOSTS} hosts")
    out = []
    for host, rules in raw.items():
        clean = host.strip().lower().rstrip(".") if isinstance(host, str) else ""
        if not is_host_pattern(clean):
            raise SecretError(f"network.rules: {host!r} is not a host name (or *.name)")
        if not isinstance(rules, list):
            raise SecretError(f"network.rules[{host!r}] must be a list of rules")
        headers: list[tuple[str, str]] = []
        for rule in rules:
            transform = rule.get("transform") if isinstance(rule, Mapping) else None
            if rule is not None and not isinstance(rule, Mapping) or (transform is not None
                                                                      and not isinstance(transform, Mapping)):
                raise SecretError(f"network.rules[{host!r}]: each rule is {{\"transform\": {{\"headers\": {{...}}}}}}")
            for name, value in ((transform or {}).get("headers") or {}).items():
                if not isinstance(name, str) or not _HEADER_NAME.match(name):
                    raise SecretError(f"network.rules[{host!r}]: {name!r} is not a header name")
                if not isinstance(value, str) or any(c in value for c in "\r\n\0") or len(value) > MAX_VALUE:
                    raise SecretError(f"network.rules[{host!r}]: the value of {name} must be a string without "
                                      f"CR, LF or NUL, at most {MAX_VALUE} bytes")
                headers.append((name, value))
        if len(headers) > MAX_RULE_HEADERS:
            raise SecretError(f"network.rules[{host!r}]: at most {MAX_RULE_HEADERS} headers")
        out.append(HeaderRule(clean, tuple(headers)))
    return tuple(out)


@dataclass(frozen=True)
class SecretSet:
    secrets: tuple[Secret, ...] = ()
    rules: tuple[HeaderRule, ...] = ()  # E2B's network.rules
    tunnel: EgressTunnel | None = field(default=None, repr=False)  # E2B's network.egressProxy (tunnel.py)

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
            if not isinstance(spec, Mapping) or set(spec) - {"value", "hosts", "bodies"}:
                raise SecretError(f"secret {name}: an object with 'value', 'hosts' and optionally 'bodies'")
            if not isinstance(spec.get("bodies", False), bool):
                raise SecretError(f"secret {name}: 'bodies' must be true or false")
            value = spec.get("value")
            if not isinstance(value, str) or not MIN_VALUE <= len(value.encode()) <= MAX_VALUE:
                raise SecretError(f"secret {name}: 'value' must be a string of {MIN_VALUE} to {MAX_VALUE} bytes (a "
                                  "shorter one would be taken out of every answer where it happens to appear)")
            if any(c in value for c in "\r\n\0"):
                raise SecretError(f"secret {name}: 'value' must not contain CR, LF or NUL (it goes in a header)")
            hosts = spec.get("hosts")
            if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
                raise SecretError(f"secret {name}: 'hosts' must be a non-empty list of host names")
            clean = tuple(h.strip().lower().rstrip(".") for h in hosts)
            bad = [h for h in clean if not is_host_pattern(h)]
            if bad:
                raise SecretError(f"secret {name}: {bad[0]!r} is not a host name (or *.name); no scheme, port or path")
            out.append(Secret(name, value, clean, f"agentcell-secret-{name.lower()}-{secrets.token_hex(16)}",
                              bool(spec.get("bodies", False))))
        return cls(tuple(out))

    def __bool__(self) -> bool:
        """Whether the sandbox has anything host-side that must stay out of records, disks and logs."""
        return bool(self.secrets or self.rules or self.tunnel)

    @property
    def inspects(self) -> bool:
        """Whether the egress proxy must read its requests (secrets to put in, header rules to apply)."""
        return bool(self.secrets or self.rules)

    def headers_for(self, host: str | None) -> list[tuple[str, str]]:
        """Headers E2B's rules set on requests to `host`."""
        return [h for r in self.rules if host and r.serves(host) for h in r.headers]

    def intercepts(self, host: str | None) -> bool:
        return bool(self.for_host(host) or self.headers_for(host))

    def values(self) -> list[tuple[bytes, bytes]]:
        """(value, its placeholder) of every secret, for taking them out of answers. E2B's rule headers
        are not taken out: as on E2B, a host that echoes them shows them to the sandbox."""
        return [(s.value.encode(), s.placeholder.encode()) for s in self.secrets]

    def rules_info(self) -> dict[str, list[dict[str, Any]]]:
        """E2B's info shape for `network.rules`, the header values redacted."""
        return {r.host: [{"transform": {"headers": {n: "[redacted]" for n, _ in r.headers}}}] for r in self.rules}

    def envs(self) -> dict[str, str]:
        return {s.name: s.placeholder for s in self.secrets}

    def for_host(self, host: str | None) -> list[Secret]:
        return [s for s in self.secrets if host and s.serves(host)]

    def public(self) -> dict[str, dict[str, list[str]]]:
        """What get_info may show: names and hosts, never a value."""
        return {s.name: {"hosts": list(s.hosts)} for s in self.secrets}
