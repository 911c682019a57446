"""The template store: unpacked layers, each stored once by its uncompressed digest, and the templates
that name them.

    <root>/layers/<hex of diff_id>/tree/    the layer's files (unpack.py: ready to be an overlay lowerdir)
    <root>/layers/<hex of diff_id>.json     what the layer holds (sizes, file capabilities ...)
    <root>/templates/<name>.json            a template: its image's config and its layers, bottom first
    <root>/tmp/                             imports in progress (the same filesystem: a rename commits)
    <root>/lock                             flock: imports hold it shared, collection exclusive

A layer is committed by one rename of its finished directory (an interrupted import leaves only tmp/);
two imports of the same layer at once both unpack it and the second rename loses, harmlessly. Garbage
collection (as the runtime store's, backends/linux/store_collect.py: out of sight by one rename, then
removed) takes the lock exclusively, so no import is between committing its layers and writing the
template that names them; a layer no template names is removed. The store's size is the sum of its
layers' file bytes, each layer counted once however many templates share it, and must stay under the
operator's budget (serve --template-store-max-gb): an import that would exceed it is refused after
the unused layers are collected.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from agentcell.errors import InvalidArgumentError, NotFoundError

DEFAULT_MAX_BYTES = 50 << 30
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
_HEX = re.compile(r"[0-9a-f]{64}")


BUILT_IN = frozenset({"base", "code-interpreter-v1", "code-interpreter"})  # the server's own templates


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise InvalidArgumentError(f"template name {name!r}: 1-63 of a-z 0-9 . _ -, starting with a letter or digit")
    if name in BUILT_IN:
        raise InvalidArgumentError(f"template name {name!r} is a built-in template's; choose another name")
    return name


@dataclass
class Collected:
    removed_layers: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    size_bytes: int = 0


class TemplateStore:
    def __init__(self, root: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.layers_dir = os.path.join(root, "layers")
        self.templates_dir = os.path.join(root, "templates")
        self.tmp_dir = os.path.join(root, "tmp")
        for d in (root, self.layers_dir, self.templates_dir, self.tmp_dir):
            os.makedirs(d, mode=0o700, exist_ok=True)
        os.chmod(root, 0o700)  # the layers hold other ids' set-id programs: no host user may reach them
        os.close(os.open(os.path.join(root, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))

    # locking ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, how: int) -> Iterator[None]:
        fd = os.open(os.path.join(self.root, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, how)
            yield
        finally:
            os.close(fd)

    def importing(self) -> contextlib.AbstractContextManager[None]:
        """Held for an import's whole length: no collection meanwhile."""
        return self._locked(fcntl.LOCK_SH)

    def private_dir(self) -> str:
        """A new 0700 directory for one import's work (under tmp/, removed by the caller or by collection)."""
        return tempfile.mkdtemp(prefix="import-", dir=self.tmp_dir)

    # layers ----------------------------------------------------------------------------------------

    def layer_path(self, diff_id: str) -> str:
        return os.path.join(self.layers_dir, _hex(diff_id))

    def has_layer(self, diff_id: str) -> bool:
        return os.path.exists(self.layer_path(diff_id) + ".json") and os.path.isdir(self.layer_path(diff_id))

    def layer_info(self, diff_id: str) -> dict[str, Any]:
        with open(self.layer_path(diff_id) + ".json") as f:
            info: dict[str, Any] = json.load(f)
        return info

    def commit_layer(self, diff_id: str, staged: str, info: dict[str, Any]) -> None:
        """Move an unpacked layer (`staged`, a directory under tmp/ holding tree/) into the store; a layer
        another import committed meanwhile stays, and `staged` is removed."""
        final = self.layer_path(diff_id)
        try:
            os.rename(staged, final)
        except OSError:
            if not os.path.isdir(final):
                raise
            shutil.rmtree(staged, ignore_errors=True)  # the same content, committed first by another import
        if not os.path.exists(final + ".json"):
            _write_json(final + ".json", info)

    def lease(self, diff_ids: list[str]) -> list[int]:
        """Shared flocks on these layers' records, held as long as the fds are open: a server holds them
        while sandboxes may run on the layers, and collect() leaves a leased layer in place even when
        no template names it any more (its template was replaced or deleted)."""
        fds: list[int] = []
        for diff_id in diff_ids:
            fd = os.open(self.layer_path(diff_id) + ".json", os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_SH)
            fds.append(fd)
        return fds

    def _leased(self, diff_id: str) -> bool:
        try:
            fd = os.open(self.layer_path(diff_id) + ".json", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # (drops the probe's own lock)

    def size_bytes(self) -> int:
        """The layers' bytes, each counted once."""
        return sum(self.layer_info(d)["file_bytes"] for d in self._layer_ids())

    def _layer_ids(self) -> list[str]:
        return ["sha256:" + n for n in os.listdir(self.layers_dir) if _HEX.fullmatch(n)
                and os.path.exists(os.path.join(self.layers_dir, n + ".json"))]

    # templates -------------------------------------------------------------------------------------

    def _template_path(self, name: str) -> str:
        return os.path.join(self.templates_dir, check_name(name) + ".json")

    def write_template(self, name: str, record: dict[str, Any]) -> None:
        """Name the layers (committed before) as template `name`; an earlier template of that name is
        replaced (its layers no other template names are collected later)."""
        missing = [d for d in record["layers"] if not self.has_layer(d)]
        if missing:
            raise InvalidArgumentError(f"template {name}: layers {missing} are not in the store")
        _write_json(self._template_path(name), record)

    def template(self, name: str) -> dict[str, Any]:
        try:
            with open(self._template_path(name)) as f:
                record: dict[str, Any] = json.load(f)
        except FileNotFoundError:
            raise NotFoundError(f"template {name} does not exist") from None
        return record

    def templates(self) -> list[dict[str, Any]]:
        found = []
        for n in sorted(os.listdir(self.templates_dir)):
            if n.endswith(".json") and _NAME.fullmatch(n[:-5]):
                with contextlib.suppress(OSError, ValueError):
                    found.append(self.template(n[:-5]))
        return found

    def delete_template(self, name: str) -> None:
        try:
            os.unlink(self._template_path(name))
        except FileNotFoundError:
            raise NotFoundError(f"template {name} does not exist") from None

    # collection ------------------------------------------------------------------------------------

    def collect(self) -> Collected:
        """Remove every layer no template names, and what dead imports left in tmp/ (waits for the
        imports in progress to finish)."""
        out = Collected()
        with self._locked(fcntl.LOCK_EX):
            for n in os.listdir(self.tmp_dir):
                shutil.rmtree(os.path.join(self.tmp_dir, n), ignore_errors=True)
            named = {d for t in self.templates() for d in t.get("layers", [])}
            for diff_id in self._layer_ids():
                if diff_id in named or self._leased(diff_id):
                    continue
                with contextlib.suppress(OSError, ValueError, KeyError):
                    out.freed_bytes += self.layer_info(diff_id)["file_bytes"]
                path = self.layer_path(diff_id)
                gone = os.path.join(self.tmp_dir, f"{_hex(diff_id)}.{os.getpid()}.{time.monotonic_ns()}.gone")
                os.rename(path, gone)  # out of sight first: never half a layer under layers/
                os.unlink(path + ".json")
                shutil.rmtree(gone, ignore_errors=True)
                out.removed_layers.append(diff_id)
            for n in os.listdir(self.layers_dir):  # a layer directory without its .json: an interrupted commit
                if _HEX.fullmatch(n) and not os.path.exists(os.path.join(self.layers_dir, n + ".json")):
                    shutil.rmtree(os.path.join(self.layers_dir, n), ignore_errors=True)
            out.size_bytes = self.size_bytes()
        return out


def _hex(diff_id: str) -> str:
    algo, _, hexa = diff_id.partition(":")
    if algo != "sha256" or not _HEX.fullmatch(hexa):
        raise InvalidArgumentError(f"{diff_id!r} is not a sha256 digest")
    return hexa


def _write_json(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
