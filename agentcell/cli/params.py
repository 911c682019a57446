"""Parsing of the K=V options: --env, --metadata, --limit (with sizes such as 512M, 2G)."""

from __future__ import annotations

import re
from typing import Any

import click

# --limit NAME=VALUE -> the API's limits field and how its value is read
_LIMITS: dict[str, tuple[str, str]] = {
    "memory": ("memoryMB", "size"), "disk": ("diskMB", "size"), "cpus": ("cpuCount", "float"),
    "pids": ("pids", "int"), "open-files": ("openFiles", "int"),
}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?$", re.IGNORECASE)
_MB_PER_UNIT = {"": 1.0, "k": 1 / 1024, "m": 1.0, "g": 1024.0, "t": 1024.0 * 1024}


def key_values(pairs: tuple[str, ...], option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint=option)
        out[key] = value
    return out


def size_mb(text: str) -> int:
    """'512' (MiB), '512M', '2G', '2GiB' -> MiB."""
    m = _SIZE.match(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 512M, 2G)")
    return max(1, round(float(m.group(1)) * _MB_PER_UNIT[m.group(2).lower()]))


def limits(pairs: tuple[str, ...]) -> dict[str, Any]:
    """--limit memory=1G --limit cpus=0.5 ... as the create body's `limits`."""
    out: dict[str, Any] = {}
    for name, raw in key_values(pairs, "--limit").items():
        if name not in _LIMITS:
            raise click.BadParameter(f"unknown limit {name!r}; known: {', '.join(_LIMITS)}", param_hint="--limit")
        field, kind = _LIMITS[name]
        try:
            out[field] = size_mb(raw) if kind == "size" else float(raw) if kind == "float" else int(raw)
        except ValueError as e:
            raise click.BadParameter(f"{name}: {e}", param_hint="--limit") from None
    return out
