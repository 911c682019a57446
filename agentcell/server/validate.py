"""Checks on values a client sends that end up in a sandbox (env vars, metadata), shared by every API.

Each function returns the clean value or raises InvalidArgumentError with a message naming the field,
so a bad request fails alone, before any sandbox or the zygote sees it.
"""

from __future__ import annotations

from typing import Any

from agentcell.errors import InvalidArgumentError

MAX_ENV_BYTES = 128 << 10  # all of a request's env vars; Linux takes at most 128 KiB per string anyway
MAX_METADATA_BYTES = 16 << 10


def _size(mapping: dict[str, str]) -> int:
    return sum(len(k.encode()) + len(v.encode()) + 2 for k, v in mapping.items())


def string_map(value: Any, name: str, max_bytes: int) -> dict[str, str]:
    """A JSON object of strings (None = empty), at most `max_bytes` of keys and values together."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidArgumentError(f"'{name}' must be an object of string values")
    size = _size(value)
    if size > max_bytes:
        raise InvalidArgumentError(f"'{name}' is too large: {size} bytes of keys and values, at most {max_bytes}")
    return value


def env_map(value: Any, name: str) -> dict[str, str]:
    """Environment variables: names without '=' or NUL, values without NUL, 128 KiB in all."""
    envs = string_map(value, name, MAX_ENV_BYTES)
    for key, val in envs.items():
        if not key or "=" in key or "\0" in key:
            raise InvalidArgumentError(f"'{name}' has an invalid variable name {key[:64]!r}: "
                                       "names must be non-empty and contain neither '=' nor NUL")
        if "\0" in val:
            raise InvalidArgumentError(f"'{name}' variable {key[:64]!r} contains a NUL byte")
    return envs
