"""A stored template as a sandbox's root (backends.base.ImageRoot): its layer trees top first, and what
the image's config says about running in it (Env, WorkingDir), plus what agentcell finds in its files
(its own python3, a bash) without mounting anything.

Names E2B's SDKs send as templateID go through `resolve`: the built-in templates come first (the
server's control plane), then these.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from typing import Any

from agentcell.backends.base import ImageRoot
from agentcell.templates.store import TemplateStore

# where an image's own python3 usually is; the image's PATH is searched first
_PYTHONS = ("usr/local/bin/python3", "usr/bin/python3")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _lookup(trees: list[str], rel: str) -> str | None:
    """The layer tree (top first) that holds `rel`, as overlayfs would resolve it: a whiteout (a 0:0
    character device) or an opaque parent above hides what is below. Symlinks in the path's
    directories are followed one level (merged /usr: /bin -> usr/bin)."""
    parts = [p for p in rel.split("/") if p]
    for tree in trees:
        path = tree
        for i, part in enumerate(parts):
            path = os.path.join(path, part)
            try:
                st = os.lstat(path)
            except OSError:
                break
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                return None  # deleted by this layer
            if i == len(parts) - 1:
                return tree
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(path)
                if target.startswith("/"):
                    return _lookup(trees, target + "/" + "/".join(parts[i + 1:]))
                base = "/".join(parts[:i])
                return _lookup(trees, os.path.normpath(f"{base}/{target}/" + "/".join(parts[i + 1:])))
    return None


def find_python(trees: list[str], path: str) -> str:
    """The image's python3: the first on its PATH, else where images usually have it; "" if none."""
    dirs = [d.rstrip("/") for d in path.split(":") if d.startswith("/")]
    for rel in [f"{d.lstrip('/')}/python3" for d in dirs] + list(_PYTHONS):
        if _lookup(trees, rel):
            return "/" + rel
    return ""


def image_root(store: TemplateStore, record: dict[str, Any]) -> ImageRoot:
    trees = [os.path.join(store.layer_path(d), "tree") for d in reversed(record["layers"])]
    config = record.get("config") or {}
    env: dict[str, str] = {}
    for item in config.get("Env") or []:
        key, sep, value = str(item).partition("=")
        if sep and key:
            env[key] = value
    path = env.get("PATH", _PATH)
    python = find_python(trees, path)
    shell = "/bin/bash" if _lookup(trees, "bin/bash") else "/bin/sh"
    # E2B: the template's last USER is its sandboxes' default user; here that can be its root or `user`
    user = str(config.get("User") or "")
    default_user = "root" if user.split(":")[0] in ("root", "0") else ""
    extra = record.get("agentcell") or {}  # what a build adds: start and ready commands
    root = {"layers": record["layers"], "env": sorted(env.items()), "workdir": config.get("WorkingDir") or "",
            "python": python, "shell": shell, "user": default_user, "start_cmd": extra.get("start_cmd", ""),
            "ready_cmd": extra.get("ready_cmd", "")}
    key = hashlib.sha256(json.dumps(root, sort_keys=True).encode()).hexdigest()[:24]
    return ImageRoot(key=key, layers=tuple(trees), env=tuple(sorted(env.items())), workdir=root["workdir"],
                     python=python, shell=shell, user=default_user, start_cmd=root["start_cmd"],
                     ready_cmd=root["ready_cmd"])
