"""The secrets vault: E2B's Secret API (store.py), sealed at rest (keyring.py), used by reference in
creates (references.py), served on the control plane (api.py). docs/secrets.md."""

from agentcell.vault.store import SecretInfo, Vault

__all__ = ["SecretInfo", "Vault"]
