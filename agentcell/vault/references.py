"""References to vault secrets in a create (or a network update) body: E2B's `Secret.fill(name)`,
the placeholder `${e2b.secrets.<name or id>}`.

Resolved host-side, once, when the sandbox is created (or its network updated): the version current
then is the one the sandbox uses until it ends (docs/secrets.md). Where a reference may stand:

- in a header value of E2B's `network.rules` (`{host: [{"transform": {"headers": {...}}}]}`): the egress
  proxy sets the header with the value on requests to that host only;
- in the `value` of agentcell's own `secrets` entry (`{"NAME": {"value": Secret.fill("x"), "hosts":
  [...]}}`): the sandbox's env gets NAME = an unguessable placeholder, which the proxy swaps for the
  value on requests to the listed hosts (network/secrets.py).

Anywhere else in the body (envVars first) a reference is refused: the sandbox would see the literal
placeholder, and a value that a sandbox could send to any host is not one the proxy may put in.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

PLACEHOLDER = re.compile(r"\$\{e2b\.secrets\.([^{}\x00-\x1f\x7f-\x9f]+)\}")
MARK = "${e2b.secrets."


class MisplacedReference(ValueError):
    """A reference the create cannot use (400); the message names it, never a value."""


def _strings(value: Any, path: str) -> list[tuple[str, str]]:
    """(path, string) of every string in a JSON value, keys too."""
    if isinstance(value, str):
        return [(path, value)]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in (_strings(k, f"{path} key") + _strings(v, f"{path}.{k}"))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _strings(v, f"{path}[{i}]")]
    return []


def _usable_places(body: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """(container, key) of every string where a reference may stand: rules' header values, secrets' values."""
    places: list[tuple[dict[str, Any], str]] = []
    network = body.get("network")
    rules = network.get("rules") if isinstance(network, dict) else None
    for host_rules in (rules.values() if isinstance(rules, dict) else ()):
        for rule in (host_rules if isinstance(host_rules, list) else ()):
            transform = rule.get("transform") if isinstance(rule, dict) else None
            headers = transform.get("headers") if isinstance(transform, dict) else None
            if isinstance(headers, dict):
                places += [(headers, k) for k, v in headers.items() if isinstance(v, str)]
    own = body.get("secrets")
    for spec in (own.values() if isinstance(own, dict) else ()):
        if isinstance(spec, dict) and isinstance(spec.get("value"), str):
            places.append((spec, "value"))
    return places


def referenced(body: dict[str, Any]) -> set[str]:
    """The secrets (names or ids) a body refers to where it may; MisplacedReference for one anywhere else."""
    rest = copy.deepcopy(body)
    for container, key in _usable_places(rest):
        container[key] = ""
    for path, text in _strings(rest, "body"):
        if MARK in text:
            where = path.removeprefix("body.").split(".")[0]
            raise MisplacedReference(
                f"a vault secret's placeholder ({MARK}...}}) in '{where}' is not resolved there: the sandbox would "
                "see it as it is. Put it in a header of network.rules ({host: [{\"transform\": {\"headers\": "
                "{...}}}]}) or in an agentcell secret ({\"NAME\": {\"value\": Secret.fill(name), \"hosts\": [...]}}), "
                "where the egress proxy puts the value in for the named hosts only")
    refs: set[str] = set()
    for container, key in _usable_places(body):
        text = container[key]
        found = PLACEHOLDER.findall(text)
        if MARK in PLACEHOLDER.sub("", text):
            raise MisplacedReference(f"an unfinished or malformed {MARK}<name>}} placeholder in {key!r}")
        refs.update(found)
    return refs


def resolved(body: dict[str, Any], values: Callable[[str], str]) -> dict[str, Any]:
    """A copy of `body` with every reference replaced by `values(ref)` (what the vault holds)."""
    out = copy.deepcopy(body)
    for container, key in _usable_places(out):
        container[key] = PLACEHOLDER.sub(lambda m: values(m.group(1)), container[key])
    return out


def mentions(body: Any) -> bool:
    """Whether a body holds a reference at all (a cheap test before the vault is opened)."""
    return MARK in json.dumps(body) if not isinstance(body, str) else MARK in body
