"""E2B's template build spec (the body of POST /v2/templates/{id}/builds/{build}), checked and typed.

    {"fromImage": "python:3.12-slim" | "fromTemplate": "base", "fromImageRegistry": {...}?,
     "steps": [{"type": "RUN", "args": ["pip install x", "root"], "force": false},
               {"type": "COPY", "args": ["src/*", "/app", "user", "0755"], "filesHash": "<hex>", "force": false},
               {"type": "ENV", "args": ["K", "V", ...]}, {"type": "WORKDIR", "args": ["/app"]},
               {"type": "USER", "args": ["user"]}],
     "startCmd": "...", "readyCmd": "...", "force": false}

This is what the official SDKs send (e2b/template/main.py `_serialize`). Every refusal is an
InvalidArgumentError naming the step as E2B's SDK counts them: step N (1-based) is the N-th of
`steps`, "base" the base image or template (the SDK maps the number back to the line of the user's
code that added it).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from agentcell.errors import InvalidArgumentError

# E2B's default base image (Template() without from_*; from_base_image()) and its default templates:
# agentcell's built-in template stands for them (a build on it is layers over the default sandbox root)
BUILTIN_IMAGES = {"e2bdev/base", "e2bdev/base:latest", "docker.io/e2bdev/base", "docker.io/e2bdev/base:latest",
                  "e2bdev/code-interpreter", "e2bdev/code-interpreter:latest"}
BUILTIN_TEMPLATES = {"base": "base", "code-interpreter-v1": "code-interpreter-v1",
                     "code-interpreter": "code-interpreter-v1"}
STEP_TYPES = ("COPY", "ENV", "RUN", "WORKDIR", "USER")
MAX_STEPS = 500  # overlayfs takes up to 500 lower layers; a build has at most one layer per step
MAX_ARG_BYTES = 256 << 10
_HASH = re.compile(r"[0-9a-fA-F]{16,128}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,63}(:[A-Za-z0-9_.][A-Za-z0-9_.-]{0,63})?")
_MODE = re.compile(r"0?[0-7]{1,4}")
BASE_STEP = "base"
FINALIZE_STEP = "finalize"


class SpecError(InvalidArgumentError):
    """A build spec the server cannot run; `step` is E2B's name of the step at fault."""

    def __init__(self, message: str, step: str | None = None) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class Step:
    index: int  # 1-based, E2B's step number
    type: str
    args: tuple[str, ...]
    force: bool = False
    files_hash: str | None = None

    @property
    def name(self) -> str:
        return str(self.index)

    def describe(self) -> str:
        if self.type == "RUN":
            return f"RUN {self.args[0]}" + (f" (as {self.args[1]})" if len(self.args) > 1 and self.args[1] else "")
        if self.type == "ENV":
            return "ENV " + " ".join(f"{k}={v}" for k, v in zip(self.args[::2], self.args[1::2], strict=True))
        return f"{self.type} {' '.join(a for a in self.args if a)}"

    def cache_json(self) -> str:
        """What identifies the step for the layer cache: never `force` (it only says "do not reuse")."""
        return json.dumps({"type": self.type, "args": list(self.args), "filesHash": self.files_hash},
                          sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Registry:
    username: str
    password: str


@dataclass(frozen=True)
class BuildSpec:
    from_image: str | None = None  # an image reference (skopeo's docker:// or a bare Docker Hub name)
    from_template: str | None = None  # a template of this server (built, imported or built-in)
    builtin: str | None = None  # "base"/"code-interpreter-v1": the default template is the base
    registry: Registry | None = None
    steps: tuple[Step, ...] = ()
    start_cmd: str | None = None
    ready_cmd: str | None = None
    force: bool = False
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    def base_key(self) -> str:
        return hashlib.sha256(json.dumps({"image": self.from_image, "template": self.from_template,
                                          "builtin": self.builtin}, sort_keys=True).encode()).hexdigest()


def parse_spec(body: Any) -> BuildSpec:
    if not isinstance(body, dict):
        raise SpecError("the build spec must be a JSON object")
    image, template = body.get("fromImage"), body.get("fromTemplate")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise SpecError("'fromImage' must be an image reference such as \"python:3.12-slim\"", BASE_STEP)
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise SpecError("'fromTemplate' must be a template name", BASE_STEP)
    if image and template:
        raise SpecError("give either 'fromImage' or 'fromTemplate', not both", BASE_STEP)
    if not image and not template:
        image = "e2bdev/base"  # what Template() starts from when no from_* is called
    builtin = None
    if image and image.strip() in BUILTIN_IMAGES:
        builtin, image = "base", None
    elif template and template.split(":")[0] in BUILTIN_TEMPLATES and ":" not in template:
        builtin, template = BUILTIN_TEMPLATES[template], None
    registry = _registry(body.get("fromImageRegistry"))
    if registry is not None and image is None:
        raise SpecError("'fromImageRegistry' (credentials) goes with 'fromImage' of a registry image", BASE_STEP)
    steps_raw = body.get("steps", [])
    if steps_raw is None:
        steps_raw = []
    if not isinstance(steps_raw, list):
        raise SpecError("'steps' must be a list")
    if len(steps_raw) > MAX_STEPS:
        raise SpecError(f"a build has at most {MAX_STEPS} steps, this one {len(steps_raw)}")
    steps = tuple(_step(i + 1, s) for i, s in enumerate(steps_raw))
    start, ready = body.get("startCmd"), body.get("readyCmd")
    for key, value in (("startCmd", start), ("readyCmd", ready)):
        if value is not None and (not isinstance(value, str) or len(value.encode()) > MAX_ARG_BYTES):
            raise SpecError(f"'{key}' must be a command (a string)", FINALIZE_STEP)
    force = body.get("force", False)
    if not isinstance(force, bool):
        raise SpecError("'force' must be true or false")
    return BuildSpec(from_image=image or None, from_template=template or None, builtin=builtin, registry=registry,
                     steps=steps, start_cmd=start or None, ready_cmd=ready or None, force=force, raw=body)


def _registry(value: Any) -> Registry | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SpecError("'fromImageRegistry' must be an object", BASE_STEP)
    kind = value.get("type", "registry")
    if kind != "registry":
        raise SpecError(f"'fromImageRegistry' of type {kind!r}: agentcell takes registry credentials "
                        "(type \"registry\": username and password) only, no cloud registry types", BASE_STEP)
    user, password = value.get("username"), value.get("password")
    if not isinstance(user, str) or not isinstance(password, str) or not user:
        raise SpecError("'fromImageRegistry' needs 'username' and 'password' strings", BASE_STEP)
    return Registry(user, password)


def _step(index: int, raw: Any) -> Step:
    where = f"step {index}"
    if not isinstance(raw, dict):
        raise SpecError(f"{where} must be an object with 'type' and 'args'", str(index))
    kind, args = raw.get("type"), raw.get("args", [])
    if kind not in STEP_TYPES:
        raise SpecError(f"{where}: unknown step type {kind!r} (agentcell runs {', '.join(STEP_TYPES)})", str(index))
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise SpecError(f"{where} ({kind}): 'args' must be a list of strings", str(index))
    if sum(len(a.encode()) for a in args) > MAX_ARG_BYTES:
        raise SpecError(f"{where} ({kind}): its arguments take more than {MAX_ARG_BYTES} bytes", str(index))
    force = raw.get("force", False)
    if force is None:
        force = False
    if not isinstance(force, bool):
        raise SpecError(f"{where} ({kind}): 'force' must be true or false", str(index))
    files_hash = raw.get("filesHash")

    def bad(why: str) -> SpecError:
        return SpecError(f"{where} ({kind} {' '.join(args)[:120]}): {why}", str(index))

    if kind == "RUN":
        if not 1 <= len(args) <= 2 or not args[0].strip():
            raise bad("RUN takes [command] or [command, user]")
        if len(args) == 2 and args[1] and not _USER.fullmatch(args[1]):
            raise bad(f"{args[1]!r} is not a user name")
    elif kind == "COPY":
        if not 2 <= len(args) <= 4 or not args[0] or not args[1]:
            raise bad("COPY takes [source, destination, user?, mode?]")
        if args[0].startswith("/") or ".." in args[0].split("/"):
            raise bad("the source must be a path inside the build context (relative, no '..')")
        if len(args) > 2 and args[2] and not _USER.fullmatch(args[2]):
            raise bad(f"{args[2]!r} is not a user or user:group")
        if len(args) > 3 and args[3] and not _MODE.fullmatch(args[3]):
            raise bad(f"{args[3]!r} is not an octal mode")
        if not isinstance(files_hash, str) or not _HASH.fullmatch(files_hash):
            raise bad("COPY needs 'filesHash' (the hash the SDK uploaded the files under)")
        files_hash = files_hash.lower()
    elif kind == "ENV":
        if not args or len(args) % 2:
            raise bad("ENV takes [name, value, name, value ...]")
        for name in args[::2]:
            if not _ENV_NAME.fullmatch(name):
                raise bad(f"{name!r} is not a variable name")
    elif kind == "WORKDIR":
        if len(args) != 1 or not args[0] or "\0" in args[0]:
            raise bad("WORKDIR takes [path]")
    elif kind == "USER":
        if len(args) != 1 or not _USER.fullmatch(args[0]):
            raise bad("USER takes [user]")
    if kind != "COPY":
        files_hash = None
    return Step(index, kind, tuple(args), force, files_hash)
