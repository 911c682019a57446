"""E2B's volumes (docs/volumes.md): named, persistent directory trees with a size quota, served
without a sandbox (`/volumecontent/{id}/...`) and mounted into sandboxes at create."""

from agentcell.volumes.store import Volume, VolumeError, VolumeStore

__all__ = ["Volume", "VolumeError", "VolumeStore"]
