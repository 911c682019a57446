"""A Dockerfile (with its build context and build args) as an E2B template build: `e2b.Template` steps.

E2B's own converter (`e2b.template.dockerfile_parser`, on `e2b_dockerfile_utils`, a port of BuildKit's
parser) does the parsing, heredocs, flags and the ENTRYPOINT + CMD rules; this module subclasses it
where it differs from `docker build`, rather than forking it:

- ARG follows Docker's scoping: an ARG before FROM is for FROM only (and a later bare `ARG NAME` takes
  its value), `--build-arg` overrides defaults, and ARG values reach RUN steps as exported variables,
  never the template's environment (E2B's converter turns every ARG into an ENV and leaves `${ARG}` in
  FROM unexpanded).
- Variables the Dockerfile defines (ARG, ENV) are expanded where Docker expands them (FROM, COPY/ADD,
  ENV, WORKDIR, USER); a reference to a variable it does not define (`$PATH`, from the base image) is
  kept for the build to expand. A relative WORKDIR or COPY destination is resolved against the WORKDIR.
- Refused, with the line: a second FROM (multi-stage), COPY --from, --exclude/--parents, ADD from a URL
  or git, RUN --mount of a bind/secret/ssh, FROM scratch, a COPY source that matches no file of the
  context (after .dockerignore). ADD of a local tar archive extracts it, as Docker does.
- SHELL applies to later shell-form RUN, CMD and ENTRYPOINT; HEALTHCHECK CMD becomes the ready command
  of the start command; EXPOSE, LABEL, MAINTAINER, VOLUME, STOPSIGNAL and ONBUILD are ignored with a
  warning naming the line (they describe an image's metadata, which a template does not keep).

The context's `.dockerignore` is applied by E2B's SDK (moby's pattern matcher, `!` exceptions, `**`)
both to the files hash of each COPY step and to the files it uploads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import posixpath
import re
import shlex
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2b import Template
from e2b.exceptions import TemplateException
from e2b.template.dockerfile_parser import _REMOTE_URL, _DockerfileConverter, _shell_join
from e2b.template.main import TemplateBuilder
from e2b.template.readycmd import wait_for_timeout
from e2b.template.utils import get_all_files_in_path, read_dockerignore
from e2b_dockerfile_utils import DockerfileInstruction, DockerfileSyntaxError, ShellLex, parse_dockerfile_ast
from wcmatch import glob

from agentcell.errors import InvalidArgumentError

# E2B's from_dockerfile makes every start command ready after `sleep 20`: E2B waits once, at build
# time; agentcell waits in every standby (runtime/start_command.py). Docker has no readiness but a
# HEALTHCHECK, so without one (or --ready-cmd) the sandbox is ready once the start command is started.
E2B_READY_CMD = wait_for_timeout(20_000).get_cmd()
DEFAULT_READY_CMD = "true"

_GIT_SOURCE = re.compile(r"^git@")
_E2B_LINE_NOTE = re.compile(r"^(?P<message>.*) \(line (?P<line>\d+)\)$")
_E2B_PARSE_PREFIX = re.compile(r"^Dockerfile parse error(?: on line \d+)?: ")
# staged outside /tmp: a build step's /tmp is its own tmpfs (as a sandbox's), not the layers'
_ADD_TMP = "/.agentcell-add"
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_IGNORED = {
    "EXPOSE": "a sandbox's ports are reachable without it",
    "LABEL": "a template keeps no image labels",
    "MAINTAINER": "a template keeps no image metadata",
    "VOLUME": "the directory stays part of the template's filesystem",
    "STOPSIGNAL": "a sandbox is stopped as a whole",
    "ONBUILD": "its triggers are for images built FROM this one",
}
_REFUSED_COPY_FLAGS = {
    "exclude": "list the files to copy instead, or exclude them in .dockerignore",
    "parents": "copy each directory to its destination",
}
_ALLOWED_MOUNTS = {"cache", "tmpfs"}


class DockerfileError(InvalidArgumentError):
    """The Dockerfile asks for what cannot be done (or is not valid); the message names its line."""

    def __init__(self, label: str, line: int | None, reason: str) -> None:
        self.label = label
        self.line = line
        self.reason = reason
        where = f"{label}:{line}" if line is not None else label
        super().__init__(f"{where}: {reason}")


@dataclass
class ConvertedDockerfile:
    """The template to build, with what the conversion noticed.

    `step_lines[i]` is the Dockerfile line of the template's step i (None: one of E2B's own default
    steps); a build error's step is `str(i + 1)` (E2B's numbering: its base is "base").
    """

    template: TemplateBuilder
    base_image: str
    label: str
    warnings: list[str] = field(default_factory=list)
    step_lines: list[int | None] = field(default_factory=list)
    from_line: int | None = None

    def spec(self) -> dict[str, Any]:
        """The build spec the SDK sends (POST /v2/templates/{id}/builds/{buildID}), with files hashes."""
        return json.loads(Template.to_json(self.template))

    def line_of_step(self, step: str | None) -> int | None:
        """The Dockerfile line of a build status' `reason.step`."""
        if step is None:
            return None
        if step == "base":
            return self.from_line
        if step.isdigit() and 1 <= int(step) <= len(self.step_lines):
            return self.step_lines[int(step) - 1]
        return None


def load_dockerfile(path: str | os.PathLike[str], context: str | os.PathLike[str],
                    build_args: Mapping[str, str] | None = None, *,
                    ready_cmd: str | None = None) -> ConvertedDockerfile:
    """Read the Dockerfile at `path` and convert it (see `convert_dockerfile`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DockerfileError(str(path), None, f"cannot read it: {e}") from None
    return convert_dockerfile(text, context, build_args, label=str(path), ready_cmd=ready_cmd)


def convert_dockerfile(text: str, context: str | os.PathLike[str], build_args: Mapping[str, str] | None = None,
                       *, label: str = "Dockerfile", ready_cmd: str | None = None) -> ConvertedDockerfile:
    """The E2B template for Dockerfile `text` with its build context directory `context`.

    `build_args` are `--build-arg`s; `ready_cmd` is the ready command of the start command (default:
    the HEALTHCHECK's command, else none: ready once started). Raises DockerfileError naming the line.
    """
    context_dir = os.path.abspath(context)
    if not os.path.isdir(context_dir):
        raise DockerfileError(label, None, f"the build context {context_dir} is not a directory")
    template = Template(file_context_path=context_dir)
    result = ConvertedDockerfile(TemplateBuilder(template), "", label)
    notes = io.StringIO()
    try:
        ast = parse_dockerfile_ast(text)
        steps = _StepRecorder(result.template, context_dir, read_dockerignore(context_dir), label)
        converter = _Converter(steps, ast.escape_token, label, dict(build_args or {}), ready_cmd)
        # E2B's converter prints its warnings (process-wide: a tool's call, not a server thread's)
        with contextlib.redirect_stdout(notes):
            result.base_image = converter.convert(ast.instructions)
    except DockerfileSyntaxError as e:
        raise DockerfileError(label, e.line, _E2B_PARSE_PREFIX.sub("", str(e))) from None
    except TemplateException as e:  # an invalid .dockerignore pattern
        raise DockerfileError(label, None, f".dockerignore: {e}") from None
    template._base_image = result.base_image
    result.step_lines = steps.lines
    result.from_line = converter.from_line
    warnings = [*(f"{label}:{w.line}: {w.message}" for w in ast.warnings),
                *_e2b_notes(notes.getvalue(), label), *converter.warnings]
    result.warnings = sorted(warnings, key=lambda w: _line_of(w, label))  # in the Dockerfile's order
    return result


def _line_of(warning: str, label: str) -> float:
    head = warning[len(label) + 1:].partition(":")[0]
    return int(head) if head.isdigit() else float("inf")


def _e2b_notes(printed: str, label: str) -> list[str]:
    out = []
    for line in printed.splitlines():
        m = _E2B_LINE_NOTE.match(line.strip())
        out.append(f"{label}:{m['line']}: {m['message']}" if m else f"{label}: {line.strip()}")
    return out


class _StepRecorder:
    """The TemplateBuilder E2B's converter calls, with Docker's COPY rules added, recording the
    Dockerfile line of every step and exporting the ARGs in scope to RUN steps."""

    def __init__(self, builder: TemplateBuilder, context: str, ignore: list[str], label: str) -> None:
        self.builder = builder
        self.context = context
        self.ignore = ignore
        self.label = label
        self.lines: list[int | None] = []
        self.line: int | None = None
        self.instruction = ""
        self.unpack = True
        self.workdir = "/"
        self.exports: dict[str, str] = {}
        self.ready_cmd: str | None = None

    def _record(self, call: Any, *args: Any, **kwargs: Any) -> _StepRecorder:
        before = len(self.builder._template._instructions)
        call(*args, **kwargs)
        self.lines.extend([self.line] * (len(self.builder._template._instructions) - before))
        return self

    def error(self, reason: str) -> DockerfileError:
        return DockerfileError(self.label, self.line, reason)

    def run_cmd(self, command: str | list[str], user: str | None = None) -> _StepRecorder:
        if self.exports:
            prefix = "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in self.exports.items())
            command = prefix + "; " + (command if isinstance(command, str) else " && ".join(command))
        return self._record(self.builder.run_cmd, command, user=user)

    def set_workdir(self, workdir: str) -> _StepRecorder:
        self.workdir = posixpath.normpath(posixpath.join(self.workdir, workdir))
        return self._record(self.builder.set_workdir, self.workdir)

    def set_user(self, user: str) -> _StepRecorder:
        return self._record(self.builder.set_user, user)

    def set_envs(self, envs: dict[str, str]) -> _StepRecorder:
        return self._record(self.builder.set_envs, envs)

    def set_start_cmd(self, start_cmd: str, ready_cmd: str) -> Any:
        return self.builder.set_start_cmd(start_cmd, self.ready_cmd or ready_cmd)

    def copy(self, src: str, dest: str, force_upload: Any = None, user: str | None = None,
             mode: int | None = None, resolve_symlinks: bool | None = None, gzip: bool | None = None) -> _StepRecorder:
        src = self._context_path(src)
        dest = self._absolute_dest(dest)
        found, matches = self._matches(src)
        if not found:
            raise self.error(f"{self.instruction} {src}: no such file in the build context {self.context} "
                             "(or it is excluded by .dockerignore)")
        archives = [m for m in matches if self.instruction == "ADD" and self.unpack and _is_tar(m)]
        if not archives:
            return self._record(self.builder.copy, src, dest, user=user, mode=mode)
        if user is not None or mode is not None:
            raise self.error("ADD --chown/--chmod of a tar archive is not supported: extract it with RUN "
                             "and chown/chmod there")
        for m in matches:
            rel = os.path.relpath(m, self.context)
            if m not in archives:
                self._record(self.builder.copy, rel, dest)
                continue
            # Docker's ADD extracts a local tar archive (plain, gzip, bzip2, xz) into the destination
            staged = shlex.quote(f"{_ADD_TMP}/{posixpath.basename(rel)}")
            self._record(self.builder.copy, rel, f"{_ADD_TMP}/")
            tool = _decompressor(m)  # decompressed apart: busybox tar's own gzip reading fails on some files
            unpack = (f"{tool} -dc {staged} > {_ADD_TMP}/.tar && tar -xf {_ADD_TMP}/.tar" if tool
                      else f"tar -xf {staged}")
            self.run_cmd(f"mkdir -p {shlex.quote(dest)} && {unpack} -C {shlex.quote(dest)} && rm -rf {_ADD_TMP}",
                         user="root")
        return self

    def _context_path(self, src: str) -> str:
        """Docker's source paths are inside the context: a leading / is its root; `..` may not leave it."""
        rel = src.lstrip("/") or "."
        normal = posixpath.normpath(rel)
        if normal == ".." or normal.startswith("../"):
            raise self.error(f"{self.instruction} {src}: the path is outside the build context")
        if ".." in rel.split("/"):  # a/../b: the server takes paths without '..'
            return normal + ("/" if rel.endswith("/") else "")
        return rel

    def _absolute_dest(self, dest: str) -> str:
        if dest.startswith("/"):
            return dest
        as_dir = dest.endswith("/") or dest in (".", "./") or dest.endswith("/.")
        joined = posixpath.normpath(posixpath.join(self.workdir, dest))
        return joined + "/" if as_dir and joined != "/" else joined

    def _matches(self, src: str) -> tuple[list[str], list[str]]:
        """The context's files and directories a source copies (those .dockerignore leaves), and which
        of them the source names itself (its glob's matches)."""
        try:
            found = get_all_files_in_path(src, self.context, self.ignore, True)
        except TemplateException as e:
            raise DockerfileError(self.label, None, f".dockerignore: {e}") from None
        tops = glob.glob(src, flags=glob.GLOBSTAR | glob.DOTMATCH, root_dir=self.context)
        return found, sorted({os.path.normpath(os.path.join(self.context, t)) for t in tops} & set(found))


_DECOMPRESSORS = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz"}


def _is_tar(path: str) -> bool:
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    try:
        return tarfile.is_tarfile(path)
    except OSError:
        return False


def _decompressor(path: str) -> str | None:
    """The program that decompresses this archive (None: a plain tar)."""
    with open(path, "rb") as f:
        head = f.read(6)
    return next((tool for magic, tool in _DECOMPRESSORS.items() if head.startswith(magic)), None)


class _Converter(_DockerfileConverter):
    """E2B's converter with Docker's ARG scoping, expansion, SHELL, HEALTHCHECK and refusals."""

    def __init__(self, steps: _StepRecorder, escape_token: str, label: str, build_args: dict[str, str],
                 ready_cmd: str | None) -> None:
        super().__init__(steps, escape_token)  # type: ignore[arg-type]
        self._steps = steps
        self._escape = escape_token
        self._label = label
        self._build_args = build_args
        self._consumed: set[str] = set()
        self._global_args: dict[str, str | None] = {}
        self._args: dict[str, str | None] = {}
        self._envs: dict[str, str] = {}
        self._shell: list[str] | None = None
        self._ready_cmd = ready_cmd
        self._healthcheck: str | None = None
        self.from_line: int | None = None
        self.warnings: list[str] = []

    def _error(self, instruction: DockerfileInstruction | None, reason: str) -> DockerfileError:
        return DockerfileError(self._label, instruction.start_line if instruction else None, reason)

    def _warn(self, instruction: DockerfileInstruction, message: str) -> None:
        self.warnings.append(f"{self._label}:{instruction.start_line}: {message}")

    # -- the whole file -------------------------------------------------------------------------
    def convert(self, instructions: list[DockerfileInstruction]) -> str:
        froms = [i for i in instructions if i.name == "FROM"]
        if not froms:
            raise self._error(None, "no FROM instruction: a Dockerfile starts from a base image")
        if len(froms) > 1:
            raise self._error(froms[1], "a second FROM: multi-stage builds are not supported (build from "
                                        "one stage; copy a stage's output into the context instead)")
        self.from_line = froms[0].start_line
        for instruction in instructions:
            if instruction.start_line > froms[0].start_line:
                break
            if instruction.name == "ARG":  # global ARGs: for FROM (and a later bare ARG NAME)
                for name, value in self._declare(instruction, self._global_args).items():
                    self._global_args[name] = value
        self._steps.line = self.from_line
        base = super().convert(instructions)
        unused = sorted(set(self._build_args) - self._consumed)
        if unused:
            self.warnings.append(f"{self._label}: build-args not consumed by any ARG: {', '.join(unused)}")
        return base

    def _handle_from(self, instruction: DockerfileInstruction) -> str:
        self._parse_flags(instruction, {"platform": ("string", True)})
        args = instruction.args
        if not (len(args) == 1 or (len(args) == 3 and args[1].lower() == "as")):
            raise self._error(instruction, "FROM takes an image and, optionally, AS name")
        lex = ShellLex(self._escape, env=self._values(self._global_args), skip_unset_env=False)
        image = self._expand(instruction, args[0], lex)
        if not image:
            raise self._error(instruction, f"FROM {args[0]}: the image name is empty (an ARG without value?)")
        if image.lower() == "scratch":
            raise self._error(instruction, "FROM scratch is not supported: the build runs its steps in a "
                                           "sandbox of the base image, which needs a shell")
        return image

    def _handle_instruction(self, instruction: DockerfileInstruction) -> None:
        name = instruction.name
        self._steps.line = instruction.start_line
        self._steps.instruction = name
        if instruction.start_line < (self.from_line or 0):
            if name == "ARG":
                return  # a global ARG, done in convert()
        if name == "ARG":
            self._handle_arg(instruction)
        elif name == "ENV":
            self._handle_env(instruction)
        elif name == "RUN":
            self._handle_run(instruction)
        elif name in ("COPY", "ADD"):
            self._check_copy_flags(instruction)
            super()._handle_instruction(instruction)
        elif name in ("CMD", "ENTRYPOINT"):
            super()._handle_instruction(self._in_shell(instruction))
        elif name == "SHELL":
            self._parse_flags(instruction, {})
            if not instruction.json or not instruction.args:
                raise self._error(instruction, 'SHELL takes a JSON array, e.g. SHELL ["/bin/bash", "-c"]')
            self._shell = list(instruction.args)
        elif name == "HEALTHCHECK":
            self._handle_healthcheck(instruction)
        elif name in _IGNORED:
            self._warn(instruction, f"{name} ignored: {_IGNORED[name]}")
        else:
            super()._handle_instruction(instruction)

    def _apply_start_cmd(self) -> None:
        self._steps.ready_cmd = self._ready_cmd or self._healthcheck or DEFAULT_READY_CMD
        super()._apply_start_cmd()
        self._steps.line = None  # E2B's default user and workdir steps follow: no line of the Dockerfile
        if self._cmd is None and self._entrypoint is None:
            if self._healthcheck:
                self.warnings.append(f"{self._label}: HEALTHCHECK ignored: there is no CMD or ENTRYPOINT to check")
            if self._ready_cmd:
                self.warnings.append(f"{self._label}: the ready command is ignored: there is no CMD or ENTRYPOINT")

    # -- variables ------------------------------------------------------------------------------
    @staticmethod
    def _values(args: Mapping[str, str | None]) -> dict[str, str]:
        return {k: v for k, v in args.items() if v is not None}

    def _known(self) -> dict[str, str]:
        return {**self._values(self._args), **self._envs}  # ENV wins over ARG, as in Docker

    def _expand(self, instruction: DockerfileInstruction, word: str, lex: ShellLex | None = None) -> str:
        """Quotes and escapes resolved, the Dockerfile's own variables expanded, others kept ($PATH)."""
        lex = lex or ShellLex(self._escape, env=self._known(), skip_unset_env=True)
        return super()._expand(instruction, word, lex)

    def _declare(self, instruction: DockerfileInstruction, scope: Mapping[str, str | None]) -> dict[str, str | None]:
        self._parse_flags(instruction, {})
        if not instruction.args:
            raise self._error(instruction, "ARG takes a name, optionally =default")
        declared: dict[str, str | None] = {}
        plain = ShellLex(self._escape)
        for arg in instruction.args:
            raw_name, has_default, raw_value = arg.partition("=")
            name = self._expand(instruction, raw_name, plain)
            if not name:
                raise self._error(instruction, "ARG names can not be blank")
            if name in self._build_args:
                self._consumed.add(name)
                declared[name] = self._build_args[name]
            elif has_default:  # the default may use the ARGs before it (in this instruction too)
                if scope is self._global_args:
                    env = {**self._values(scope), **self._values(declared)}
                else:
                    env = {**self._values(self._args), **self._values(declared), **self._envs}
                declared[name] = self._expand(instruction, raw_value,
                                              ShellLex(self._escape, env=env, skip_unset_env=True))
            else:
                declared[name] = self._global_args.get(name)  # a bare ARG NAME takes the global value
        return declared

    def _handle_arg(self, instruction: DockerfileInstruction) -> None:
        self._args.update(self._declare(instruction, self._args))
        self._update_exports()

    def _handle_env(self, instruction: DockerfileInstruction) -> None:
        self._parse_flags(instruction, {})
        args = instruction.args
        if not args:
            raise self._error(instruction, "ENV takes NAME=value pairs")
        envs: dict[str, str] = {}
        for i in range(0, len(args) - 2, 3):
            key = self._expand(instruction, args[i])
            if not key:
                raise self._error(instruction, "ENV names can not be blank")
            envs[key] = self._expand(instruction, args[i + 1])
            self._envs[key] = envs[key]  # later pairs of the same ENV see the earlier ones, as in Docker
        self._template_builder.set_envs(envs)
        self._update_exports()

    def _update_exports(self) -> None:
        """RUN sees the ARGs in scope as variables (an ENV of the same name wins), not the template."""
        self._steps.exports = {k: v for k, v in self._values(self._args).items()
                               if k not in self._envs and _SHELL_NAME.fullmatch(k)}  # a shell can export it

    # -- instructions ---------------------------------------------------------------------------
    def _handle_run(self, instruction: DockerfileInstruction) -> None:
        for flag in instruction.flags:
            name, _, value = flag.lstrip("-").partition("=")
            if name == "mount":
                kind = dict(p.partition("=")[::2] for p in value.split(",")).get("type", "bind")
                if kind not in _ALLOWED_MOUNTS:
                    raise self._error(instruction, f"RUN --mount=type={kind} is not supported (only cache and "
                                                   "tmpfs mounts, which are ignored): COPY the files instead")
        if self._shell and not instruction.json and not instruction.heredocs and instruction.args:
            instruction = dataclasses.replace(instruction, json=True, args=[*self._shell, instruction.args[0]])
        super()._handle_run(instruction)

    def _check_copy_flags(self, instruction: DockerfileInstruction) -> None:
        self._steps.unpack = True
        for flag in instruction.flags:
            name, _, value = flag.lstrip("-").partition("=")
            if name == "from":
                raise self._error(instruction, f"{instruction.name} --from={value} is not supported (multi-stage "
                                               "builds and copies from other images are not)")
            if name in _REFUSED_COPY_FLAGS:
                raise self._error(instruction, f"{instruction.name} --{name} is not supported: "
                                               f"{_REFUSED_COPY_FLAGS[name]}")
            if name == "unpack" and instruction.name == "ADD":
                self._steps.unpack = value in ("", "true")
        if instruction.name == "ADD":
            for raw in instruction.args[:-1]:
                src = self._expand(instruction, raw)
                if _REMOTE_URL.match(src) or _GIT_SOURCE.match(src):
                    raise self._error(instruction, f"ADD {src}: sources from URLs and git are not supported: "
                                                   "download them in a RUN step (curl, git clone)")

    def _in_shell(self, instruction: DockerfileInstruction) -> DockerfileInstruction:
        if self._shell and not instruction.json and instruction.args:
            return dataclasses.replace(instruction, json=True, args=[*self._shell, instruction.args[0]])
        return instruction

    def _handle_healthcheck(self, instruction: DockerfileInstruction) -> None:
        if instruction.flags:
            self._warn(instruction, f"HEALTHCHECK {' '.join(instruction.flags)} ignored: the check runs "
                                    "until it succeeds, once, when the start command starts")
        kind = instruction.args[0].upper() if instruction.args else ""
        if kind == "NONE":
            self._healthcheck = None
        elif kind == "CMD" and len(instruction.args) > 1:
            rest = instruction.args[1:]
            self._healthcheck = _shell_join(rest) if instruction.json else rest[0]
        else:
            raise self._error(instruction, "HEALTHCHECK takes CMD <command> or NONE")
