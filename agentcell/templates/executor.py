"""Running a build spec (build_spec.py) into a stored template: the base, then each step as a cached layer.

    base       fromImage: imported by the Importer (the operator's registry policy and size ceiling);
               fromTemplate: a stored template's layers and config; E2B's default base (e2bdev/base,
               "base", "code-interpreter-v1"): agentcell's built-in template, the layers going over its
               root (the record says `builtin_base`)
    ENV/USER   change the config only
    WORKDIR    changes the config; a layer holding the directory when the root lacks it (made here)
    COPY       a layer made here from the uploaded files (copy_step.py)
    RUN        a layer made by a sandbox: `BuildSandboxes.run` (the backend's part, see below)

Each layer-making step has a cache key, sha256(the key before it + the step's JSON + its filesHash),
the chain starting at the base's identity (its layers, or the image reference). The layer's id in the
store is that key (`sha256:<key>`), so a step whose key is stored is not run again: an unchanged
rebuild is a few stat calls. A forced step (`force`, skip_cache, the spec's `force`) adds the build's
id to its key: it and every step after it are made anew.

The backend's part (BuildSandboxes) runs one RUN step: a sandbox whose root is the layer trees (an
overlay, top first, over the built-in root when `builtin` is set), the command as the user, its changes
to the root exported into `upper` in the store's layer format. Until a backend provides it, RUN steps
fail with a clear message.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentcell.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from agentcell.templates import copy_step
from agentcell.templates.build_spec import BASE_STEP, FINALIZE_STEP, BuildSpec, SpecError, Step
from agentcell.templates.rootview import RootView
from agentcell.templates.store import TemplateStore
from agentcell.templates.unpack import ID_BASE

Log = Callable[[str, str, "str | None"], None]  # (level, message, step)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_UPLOAD_ENTRIES = 1_000_000


class BuildStepError(InvalidArgumentError):
    """A step failed (its command exited non-zero, a file is missing ...); `step` is E2B's step name."""

    def __init__(self, message: str, step: str | None) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class RunRequest:
    """One RUN step for the backend."""

    layers: tuple[str, ...]  # the root so far: layer tree directories, top first (overlay lowerdirs)
    builtin: str | None  # "base": the built-in template's root lies beneath the layers
    argv: tuple[str, ...]  # ("/bin/bash" or "/bin/sh", "-c", command)
    user: str
    uid: int  # image ids (inside the sandbox); stored files carry ID_BASE + these
    gid: int
    env: Mapping[str, str]
    cwd: str
    layer_tar: str  # where to write the step's changes: an uncompressed OCI layer tar
    internet: bool  # the build's network policy: all traffic out, or none
    cpu_count: float | None = None
    memory_mb: int | None = None
    timeout_s: float = 3600
    max_layer_bytes: int = 4 << 30


@dataclass(frozen=True)
class RunOutcome:
    exit_code: int
    diff_id: str | None  # the layer tar's digest (None: no tar written)


class BuildSandboxes(Protocol):
    async def run(self, request: RunRequest, output: Callable[[str, str], None]) -> RunOutcome:
        """Run `request.argv` in a sandbox whose root is `request.layers`, as `request.user`, with its
        env and cwd; stream its output lines to `output(stream, line)` ("stdout"/"stderr"); write what
        it changed in the root (and /home/user) to `request.layer_tar` as an OCI layer tar (whiteouts as
        .wh. entries); return the exit status and the tar's diff_id. The sandbox is gone when this
        returns."""
        ...


@dataclass(frozen=True)
class BuildLimits:
    max_image_bytes: int = 4 << 30  # the uploaded files of one COPY, unpacked
    timeout_s: float = 3600  # one build, all steps
    internet: bool = False
    cpu_count: float | None = None
    memory_mb: int | None = None


@dataclass
class BuildContext:
    """What the executor needs from the server for one build."""

    store_name: str  # the stored template's name (store.check_name)
    build_id: str
    files: Callable[[str], str | None]  # filesHash -> the uploaded archive's path (None: not uploaded)
    resolve_template: Callable[[str], dict[str, Any]]  # fromTemplate -> a stored template record
    import_image: Callable[[str, Any, bool], dict[str, Any]]  # (ref, credentials, fresh) -> a stored record
    extra: dict[str, Any] = field(default_factory=dict)  # written into the record (template id, names ...)


@dataclass
class _State:
    layers: list[str]  # diff_ids, bottom first
    builtin: str | None
    env: dict[str, str]
    workdir: str
    user: str
    key: str
    image_config: dict[str, Any]
    base: str = ""  # what the base is: "builtin:base", or the stored template's source (an image reference)


class Executor:
    def __init__(self, store: TemplateStore, sandboxes: BuildSandboxes | None = None,
                 limits: BuildLimits | None = None) -> None:
        self.store = store
        self.sandboxes = sandboxes
        self.limits = limits or BuildLimits()

    async def run_build(self, spec: BuildSpec, ctx: BuildContext, log: Log) -> dict[str, Any]:
        """Build `spec` into the stored template `ctx.store_name`; return its record."""
        started = time.monotonic()
        state = await asyncio.to_thread(self._base, spec, ctx, log)
        # the store's shared lock from the first layer to the record naming them all: no collection
        # meanwhile removes a layer this build made or reuses (the base's are named by its own record)
        lock = self.store.importing()
        await asyncio.to_thread(lock.__enter__)
        try:
            forced = spec.force
            for step in spec.steps:
                forced = forced or step.force
                t0 = time.monotonic()
                log("info", f"[builder {step.index}/{len(spec.steps)}] {step.describe()}", step.name)
                key = _chain(state.key, step, ctx.build_id if forced else None)
                if step.type == "ENV":
                    for k, v in zip(step.args[::2], step.args[1::2], strict=True):
                        state.env[k] = _expand(v, state.env)
                elif step.type == "USER":
                    self._check_user(state, step.args[0], step)
                    state.user = step.args[0]
                elif step.type == "WORKDIR":
                    path = step.args[0] if step.args[0].startswith("/") else os.path.join(state.workdir, step.args[0])
                    state.workdir = os.path.normpath(path)
                    await self._layer(state, key, forced, step, log, lambda tree, s=state: self._workdir(s, tree))
                elif step.type == "COPY":
                    await self._layer(state, key, forced, step, log, lambda tree, s=state, st=step: self._copy(s, st, ctx, tree))
                elif step.type == "RUN":
                    await self._run(state, key, forced, step, log)
                state.key = key
                log("info", f"step {step.index} done in {time.monotonic() - t0:.2f}s", step.name)
            record = self._record(spec, ctx, state)
            await asyncio.to_thread(self.store.write_template, ctx.store_name, record)
        finally:
            lock.__exit__(None, None, None)
        log("info", f"template stored: {len(state.layers)} layers, built in {time.monotonic() - started:.2f}s",
            FINALIZE_STEP)
        return record

    # the base --------------------------------------------------------------------------------------

    def _base(self, spec: BuildSpec, ctx: BuildContext, log: Log) -> _State:
        if spec.builtin is not None:
            log("info", f"base: agentcell's built-in template '{spec.builtin}' (E2B's default base)", BASE_STEP)
            return _State([], spec.builtin, {"PATH": DEFAULT_PATH}, "/home/user", "root",
                          _sha(f"builtin:{spec.builtin}"), {}, f"builtin:{spec.builtin}")
        try:
            if spec.from_template is not None:
                log("info", f"base: template {spec.from_template}", BASE_STEP)
                record = ctx.resolve_template(spec.from_template)
            else:
                assert spec.from_image is not None
                log("info", f"base: image {spec.from_image}", BASE_STEP)
                creds = None
                if spec.registry is not None:
                    from agentcell.templates.fetch import Credentials

                    creds = Credentials(spec.registry.username, spec.registry.password)
                record = ctx.import_image(spec.from_image, creds, spec.force)
        except SpecError:
            raise
        except (InvalidArgumentError, NotFoundError, ResourceExhaustedError) as e:
            raise BuildStepError(str(e), BASE_STEP) from None
        config = dict(record.get("config") or {})
        env = dict(e.split("=", 1) for e in config.get("Env") or [] if "=" in e)
        env.setdefault("PATH", DEFAULT_PATH)
        ident = _sha("\n".join([record.get("builtin_base") or "", *record["layers"]]) + "\n" + _canon(config))
        log("info", f"base: {len(record['layers'])} layers", BASE_STEP)
        return _State(list(record["layers"]), record.get("builtin_base"), env, config.get("WorkingDir") or "/",
                      config.get("User") or "root", ident, config, str(record.get("source") or record.get("name")))

    # layers ----------------------------------------------------------------------------------------

    def view(self, state: _State) -> RootView:
        return RootView([os.path.join(self.store.layer_path(d), "tree") for d in reversed(state.layers)],
                        state.builtin)

    async def _layer(self, state: _State, key: str, forced: bool, step: Step, log: Log,
                     make: Callable[[str], bool]) -> None:
        """The layer of `key`: the stored one, or made by `make(tree)` (False: the step changes no file)."""
        diff_id = "sha256:" + key
        if not forced and self.store.has_layer(diff_id):
            log("info", f"CACHED {step.describe()}", step.name)
            state.layers.append(diff_id)
            return
        work = self.store.private_dir()
        try:
            tree = os.path.join(work, "tree")
            os.mkdir(tree, 0o755)
            os.chown(tree, ID_BASE, ID_BASE)
            if await asyncio.to_thread(make, tree):
                self._commit(diff_id, work, step)
                state.layers.append(diff_id)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(work + ".layer", ignore_errors=True)

    def _commit(self, diff_id: str, work: str, step: Step) -> None:
        files, entries = _measure(os.path.join(work, "tree"))
        if self.store.size_bytes() + files > self.store.max_bytes:
            raise ResourceExhaustedError(f"step {step.index}: the template store is full (its budget is "
                                         f"{self.store.max_bytes} bytes: serve --template-store-max-gb)")
        stage = work + ".layer"
        os.mkdir(stage, 0o700)
        os.rename(os.path.join(work, "tree"), os.path.join(stage, "tree"))
        self.store.commit_layer(diff_id, stage, {
            "diff_id": diff_id, "digest": diff_id, "media_type": "agentcell.build-step", "tar_bytes": 0,
            "file_bytes": files, "entries": entries, "capabilities": {}, "dropped_xattrs": [],
            "built": {"type": step.type, "args": list(step.args)}, "imported_at": time.time()})

    def _workdir(self, state: _State, tree: str) -> bool:
        view = self.view(state)
        try:
            canonical, entry = view.resolve(state.workdir)
        except InvalidArgumentError:
            canonical, entry = state.workdir, None
        if entry is not None:
            return False
        uid, gid = view.owner(state.user) if state.user else (0, 0)
        copy_step._Layer(tree, view, (uid, gid)).ensure_dir(canonical)
        return True

    def _copy(self, state: _State, step: Step, ctx: BuildContext, tree: str) -> bool:
        src, dest = step.args[0], step.args[1]
        user = step.args[2] if len(step.args) > 2 and step.args[2] else "root"
        mode = int(step.args[3], 8) if len(step.args) > 3 and step.args[3] else None
        archive = ctx.files(step.files_hash or "")
        if archive is None:
            raise BuildStepError(f"COPY {src}: the files (hash {step.files_hash}) were not uploaded", step.name)
        view = self.view(state)
        try:
            owner = view.owner(user)
        except InvalidArgumentError as e:
            raise BuildStepError(f"COPY {src} {dest}: {e}", step.name) from None
        staging = os.path.join(os.path.dirname(tree), "upload")
        os.mkdir(staging, 0o700)
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            copy_step.unpack_upload(archive, fd, max_bytes=self.limits.max_image_bytes,
                                    max_entries=MAX_UPLOAD_ENTRIES)
        except (InvalidArgumentError, ResourceExhaustedError) as e:
            raise BuildStepError(f"COPY {src}: {e}", step.name) from None
        finally:
            os.close(fd)
        try:
            copy_step.copy_layer(view, tree, staging, src, dest, state.workdir, owner, mode)
        except InvalidArgumentError as e:
            raise BuildStepError(f"COPY {src} {dest}: {e}", step.name) from None
        return True

    def _check_user(self, state: _State, user: str, step: Step) -> tuple[int, int, str]:
        found = self.view(state).user(user.partition(":")[0])
        if found is None:
            what = f"run command '{step.args[0]}'" if step.type == "RUN" else f"set user '{user}'"
            raise BuildStepError(f"failed to {what}: command failed: unauthenticated: invalid username: "
                                 f"'{user.partition(':')[0]}'", step.name)
        return found

    async def _run(self, state: _State, key: str, forced: bool, step: Step, log: Log) -> None:
        user = step.args[1] if len(step.args) > 1 and step.args[1] else state.user or "root"
        uid, gid, home = self._check_user(state, user, step)
        cached = None if forced else _read_cache(self.store, key)
        if cached is not None and self.store.has_layer(cached):
            log("info", f"CACHED {step.describe()}", step.name)
            state.layers.append(cached)
            return
        if self.sandboxes is None:
            raise BuildStepError(f"failed to run command '{step.args[0]}': this server cannot run build commands "
                                 "yet (RUN steps need the linux backend's build sandboxes)", step.name)
        view = self.view(state)
        shell = "/bin/bash" if view.lookup("/bin/bash") is not None else "/bin/sh"
        env = {"HOME": home, "USER": user, **state.env}
        if state.builtin is not None:
            raise BuildStepError(f"failed to run command '{step.args[0]}': RUN steps on E2B's default base "
                                 "(agentcell's built-in template) are not supported yet: start from an image "
                                 "(Template().from_image(...))", step.name)
        work = self.store.private_dir()
        try:
            request = RunRequest(
                layers=tuple(os.path.join(self.store.layer_path(d), "tree") for d in reversed(state.layers)),
                builtin=state.builtin, argv=(shell, "-c", step.args[0]), user=user, uid=uid, gid=gid,
                env=env, cwd=state.workdir, layer_tar=os.path.join(work, "layer.tar"), internet=self.limits.internet,
                cpu_count=self.limits.cpu_count, memory_mb=self.limits.memory_mb, timeout_s=self.limits.timeout_s,
                max_layer_bytes=self.limits.max_image_bytes)

            def output(stream: str, line: str) -> None:
                log("error" if stream == "stderr" else "info", line, step.name)

            try:
                outcome = await self.sandboxes.run(request, output)
            except (InvalidArgumentError, ResourceExhaustedError) as e:
                raise BuildStepError(f"failed to run command '{step.args[0]}': {e}", step.name) from None
            if outcome.exit_code != 0:
                raise BuildStepError(f"failed to run command '{step.args[0]}': exit status {outcome.exit_code}",
                                     step.name)
            if outcome.diff_id is None:
                raise BuildStepError(f"failed to run command '{step.args[0]}': its changes were not exported",
                                     step.name)
            diff_id = outcome.diff_id
            await asyncio.to_thread(self._store_run_layer, request.layer_tar, diff_id, key)
            state.layers.append(diff_id)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _store_run_layer(self, tar: str, diff_id: str, key: str) -> None:
        from agentcell.templates import capture

        capture.store_layer(self.store, tar, diff_id, self.limits.max_image_bytes)
        if self.store.size_bytes() > self.store.max_bytes:
            raise ResourceExhaustedError(f"the template store is full (its budget is {self.store.max_bytes} bytes: "
                                         "serve --template-store-max-gb)")
        _write_cache(self.store, key, diff_id)

    def _record(self, spec: BuildSpec, ctx: BuildContext, state: _State) -> dict[str, Any]:
        config = dict(state.image_config)
        config["Env"] = [f"{k}={v}" for k, v in state.env.items()]
        config["WorkingDir"] = state.workdir
        config["User"] = state.user
        size = 0
        for d in state.layers:
            try:
                size += self.store.layer_info(d)["file_bytes"]
            except (OSError, KeyError, ValueError):
                pass
        return {
            "name": ctx.store_name, "source": "e2b-build", "manifest_digest": "", "config_digest": "",
            "config": config, "architecture": "", "os": "linux", "layers": list(state.layers),
            "builtin_base": state.builtin, "base": state.base,
            # what a sandbox of it runs at its start (templates/roots.py reads these)
            "agentcell": {"start_cmd": spec.start_cmd or "", "ready_cmd": spec.ready_cmd or ""},
            "size_bytes": size, "imported_at": time.time(), "build_id": ctx.build_id, **ctx.extra,
        }


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _canon(obj: Any) -> str:
    import json

    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _chain(parent: str, step: Step, nonce: str | None) -> str:
    return _sha(f"{parent}\n{step.cache_json()}\n{nonce or ''}")


def _expand(value: str, env: Mapping[str, str]) -> str:
    """$NAME and ${NAME} in an ENV value, from the variables so far (Docker's ENV does this)."""
    import re

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)",
                  lambda m: env.get(m.group(1) or m.group(2), ""), value)


def _cache_path(store: TemplateStore, key: str) -> str:
    return os.path.join(store.root, "build-cache", key)


def _read_cache(store: TemplateStore, key: str) -> str | None:
    """The layer a RUN step of this cache key made before (its diff_id: a RUN layer is stored by its tar's
    digest, as an image's are)."""
    try:
        with open(_cache_path(store, key)) as f:
            value = f.read().strip()
    except OSError:
        return None
    return value if value.startswith("sha256:") else None


def _write_cache(store: TemplateStore, key: str, diff_id: str) -> None:
    os.makedirs(os.path.dirname(_cache_path(store, key)), mode=0o700, exist_ok=True)
    tmp = _cache_path(store, key) + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(diff_id)
    os.replace(tmp, _cache_path(store, key))


def _measure(tree: str) -> tuple[int, int]:
    files = entries = 0
    for root, dirs, names in os.walk(tree):
        for n in names + dirs:
            entries += 1
            st = os.lstat(os.path.join(root, n))
            if stat.S_ISREG(st.st_mode):
                files += st.st_size
    return files, entries

