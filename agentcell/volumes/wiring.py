"""The server's volumes, built from its config and tied to its sandboxes (server/app.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentcell.server.tenancy import Tenancy
from agentcell.volumes.api import VolumeApi
from agentcell.volumes.store import Limits, VolumeStore

CONTENT_PREFIX = "/volumecontent/"


def store(config: Any, manager: Any) -> VolumeStore:
    s = VolumeStore(Path(config.state_dir), Limits(
        default_size_mb=getattr(config, "volume_size_mb", Limits.default_size_mb),
        max_size_mb=getattr(config, "max_volume_size_mb", Limits.max_size_mb),
        max_volumes=getattr(config, "max_volumes", Limits.max_volumes)))

    def in_use(volume_id: str) -> list[str]:  # running or paused: a paused one mounts it again at its resume
        return [r.sandbox_id for r in manager.list() + manager.list_paused()
                if any(m.volume_id == volume_id for m in r.spec.volumes)]

    s.in_use = in_use
    return s


def api(config: Any, volumes: VolumeStore) -> VolumeApi:
    tenancy = Tenancy.from_config(config)
    return VolumeApi(volumes, tenancy.caller, tenancy.sees, getattr(config, "domain", None))
