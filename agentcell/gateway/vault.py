"""The secrets vault behind a gateway (docs/secrets.md): it lives on one cell, the template cell (the
routable cell of the lowest id, the same one from every gateway replica: app._to_template_cell).

`/secrets…` goes there, and so does every create whose body refers to a vault secret
(`${e2b.secrets.…}`), and only there: another cell has no such secret and would answer 400. A network
update that refers to one goes to its sandbox's cell like any: it resolves there only if the sandbox is
on the vault cell (a sandbox created with a reference is).
"""

from __future__ import annotations

MARK = b"${e2b.secrets."


def is_vault_path(path: str) -> bool:
    return path == "/secrets" or path.startswith("/secrets/")


def refers_to_vault(body: bytes) -> bool:
    """Whether a create's JSON body names a vault secret (JSON may escape '$', '{' or '}' as \\u00xx:
    those spellings count too)."""
    return MARK in body or b"e2b.secrets." in body
