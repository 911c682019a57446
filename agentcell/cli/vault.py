"""`agentcell secrets rotate-key`: seal every value of a server's secrets vault under a new key
(docs/secrets.md). Works on the state directory's files, under the vault's lock, so the server may keep
running; a crash at any step leaves every value readable (vault/keyring.py)."""

from __future__ import annotations

import os

import click

from agentcell.cli import main
from agentcell.cli.errors import CliError


@main.group(name="secrets")
def secrets_group() -> None:
    """The server's secrets vault (E2B's Secret API): rotate-key."""


@secrets_group.command(name="rotate-key")
@click.option("--state-dir", default="/var/lib/agentcell", show_default=True, envvar="AGENTCELL_STATE_DIR",
              type=click.Path(file_okay=False), help="The server's --state-dir (its vault is <state-dir>/vault).")
def rotate_key(state_dir: str) -> None:
    """Make a new vault key and seal every stored value with it; the old key is gone after."""
    from agentcell.vault.keyring import VaultKeyError
    from agentcell.vault.store import Vault

    directory = os.path.join(state_dir, "vault")
    if not os.path.isdir(directory):
        raise CliError(f"{state_dir} has no secrets vault ({directory}): nothing to rotate")
    vault = Vault(directory)
    try:
        before = vault.key_id()
        count = vault.rotate_key()
        after = vault.key_id()
    except (VaultKeyError, OSError) as e:
        raise CliError(f"the vault key was not rotated: {e}") from None
    click.echo(f"vault key {before or '(none)'} -> {after}: {count} value(s) sealed again")
