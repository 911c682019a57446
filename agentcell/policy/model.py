"""A sandbox's fine-grained policy (issue 28): what its code may run, touch and reach, and what waits
for a human's (or the app's) decision. The create body's `policy` field, `PUT /sandboxes/{id}/policy`,
our SDK's `Sandbox.create(policy=...)`.

    {"exec":  {"default": "allow" | "deny" | "ask", "allow": ["python3", "/usr/bin/git", "pip*"], "deny": [...]},
     "files": [{"path": "/home/user/repo", "access": "read"}, ...],
     "syscalls": "default" | "strict",
     "processes": {"max": 64},
     "network": {"default": "allow" | "ask"},
     "ask_timeout_s": 60}

Parsing is strict: an unknown key is an error (a misspelt "exce" must not leave a sandbox unguarded),
and every error names the part it is about (`policy.exec.allow[2]`), so the server's 400 says where.
What a backend can enforce is its own question (backends/base.py Backend.check_policy).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

EXEC_DEFAULTS = ("allow", "deny", "ask")
ACCESS = ("none", "read", "write")
SYSCALLS = ("default", "strict")
NETWORK_DEFAULTS = ("allow", "ask")
MAX_PATTERNS = 64  # per exec list
MAX_FILE_RULES = 64
MAX_PATTERN_CHARS = 4096
ASK_TIMEOUT_S = 60.0
MAX_ASK_TIMEOUT_S = 3600.0


class PolicyError(ValueError):
    """A policy that is malformed, or that this server cannot enforce: `part` names where
    (`policy.files[1].access`), the message says what is wrong and what to write instead."""

    def __init__(self, part: str, message: str) -> None:
        super().__init__(f"{part}: {message}")
        self.part = part
        self.message = message


@dataclass(frozen=True, slots=True)
class ExecRules:
    default: str = "allow"
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"default": self.default, "allow": list(self.allow), "deny": list(self.deny)}


@dataclass(frozen=True, slots=True)
class FileRule:
    path: str
    access: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "access": self.access}


@dataclass(frozen=True, slots=True)
class Policy:
    exec: ExecRules | None = None
    files: tuple[FileRule, ...] = ()
    syscalls: str = "default"
    processes_max: int | None = None
    network_ask: bool = False
    ask_timeout_s: float = ASK_TIMEOUT_S

    @property
    def exec_rules(self) -> bool:
        """Whether execs are checked at all: anything but "allow everything" (an allow list under the
        default "allow" allows nothing more)."""
        return self.exec is not None and (self.exec.default != "allow" or bool(self.exec.deny))

    @property
    def exec_asks(self) -> bool:
        """Whether an exec may be held for a decision (the agent must then start processes without vfork)."""
        return self.exec is not None and self.exec.default == "ask"

    @property
    def empty(self) -> bool:
        return self == Policy()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"syscalls": self.syscalls, "ask_timeout_s": self.ask_timeout_s,
                               "files": [r.to_json() for r in self.files],
                               "network": {"default": "ask" if self.network_ask else "allow"}}
        out["exec"] = (self.exec or ExecRules()).to_json()
        out["processes"] = {"max": self.processes_max}
        return out


def _object(value: Any, part: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PolicyError(part, f"must be an object, not {type(value).__name__}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise PolicyError(f"{part}.{unknown[0]}", f"unknown key; {part} takes {', '.join(keys)}")
    return value


def _choice(value: Any, part: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise PolicyError(part, f"must be one of {', '.join(repr(c) for c in choices)}, not {value!r}")
    return str(value)


def _patterns(value: Any, part: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise PolicyError(part, "must be a list of program names, paths or globs (\"python3\", \"/usr/bin/git\", \"pip*\")")
    if len(value) > MAX_PATTERNS:
        raise PolicyError(part, f"at most {MAX_PATTERNS} entries")
    out: list[str] = []
    for i, p in enumerate(value):
        where = f"{part}[{i}]"
        if not isinstance(p, str) or not p.strip():
            raise PolicyError(where, "must be a non-empty string")
        if len(p) > MAX_PATTERN_CHARS or "\0" in p:
            raise PolicyError(where, f"must be at most {MAX_PATTERN_CHARS} characters, without NUL")
        if "/" in p and not p.startswith("/"):
            raise PolicyError(where, f"{p!r}: a path must be absolute (\"/usr/bin/git\"); a bare name matches the "
                                     "program's file name wherever it is on PATH")
        if p.startswith("/") and posixpath.normpath(p) != p:
            raise PolicyError(where, f"{p!r} is not a normalised path (write {posixpath.normpath(p)!r})")
        out.append(p)
    return tuple(out)


def _exec(value: Any) -> ExecRules:
    obj = _object(value, "policy.exec", ("default", "allow", "deny"))
    default = _choice(obj.get("default", "allow"), "policy.exec.default", EXEC_DEFAULTS)
    return ExecRules(default, _patterns(obj.get("allow"), "policy.exec.allow"),
                     _patterns(obj.get("deny"), "policy.exec.deny"))


def _files(value: Any) -> tuple[FileRule, ...]:
    if not isinstance(value, list):
        raise PolicyError("policy.files", "must be a list of {\"path\": ..., \"access\": \"none\"|\"read\"|\"write\"}")
    if len(value) > MAX_FILE_RULES:
        raise PolicyError("policy.files", f"at most {MAX_FILE_RULES} rules")
    rules: list[FileRule] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(value):
        part = f"policy.files[{i}]"
        obj = _object(item, part, ("path", "access"))
        path = obj.get("path")
        if not isinstance(path, str) or not path.startswith("/"):
            raise PolicyError(f"{part}.path", "must be an absolute path inside the sandbox")
        if len(path) > MAX_PATTERN_CHARS or "\0" in path:
            raise PolicyError(f"{part}.path", f"must be at most {MAX_PATTERN_CHARS} characters, without NUL")
        norm = posixpath.normpath(path)
        if norm.startswith("//"):
            norm = "/" + norm.lstrip("/")
        if norm != path.rstrip("/") and not (path == "/" and norm == "/"):
            raise PolicyError(f"{part}.path", f"{path!r} is not a normalised path (write {norm!r})")
        if norm in seen:
            raise PolicyError(f"{part}.path", f"{norm!r} has a rule already (policy.files[{seen[norm]}])")
        seen[norm] = i
        access = _choice(obj.get("access"), f"{part}.access", ACCESS)
        rules.append(FileRule(norm, access))
    return tuple(rules)


def _processes(value: Any) -> int | None:
    obj = _object(value, "policy.processes", ("max",))
    n = obj.get("max")
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PolicyError("policy.processes.max", f"must be a positive integer, not {n!r}")
    return n


def _network(value: Any) -> bool:
    obj = _object(value, "policy.network", ("default",))
    return _choice(obj.get("default", "allow"), "policy.network.default", NETWORK_DEFAULTS) == "ask"


def _timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= MAX_ASK_TIMEOUT_S:
        raise PolicyError("policy.ask_timeout_s", f"must be a number of seconds from 1 to {MAX_ASK_TIMEOUT_S:g}, "
                                                  f"not {value!r}")
    return float(value)


TOP_KEYS = ("exec", "files", "syscalls", "processes", "network", "ask_timeout_s")


def parse(value: Any) -> Policy:
    """The policy a client wrote (None or {}: no policy), or PolicyError naming the part."""
    if value is None:
        return Policy()
    obj = _object(value, "policy", TOP_KEYS)
    return Policy(
        exec=_exec(obj["exec"]) if obj.get("exec") is not None else None,
        files=_files(obj["files"]) if obj.get("files") is not None else (),
        syscalls=_choice(obj.get("syscalls", "default"), "policy.syscalls", SYSCALLS),
        processes_max=_processes(obj["processes"]) if obj.get("processes") is not None else None,
        network_ask=_network(obj["network"]) if obj.get("network") is not None else False,
        ask_timeout_s=_timeout(obj["ask_timeout_s"]) if obj.get("ask_timeout_s") is not None else ASK_TIMEOUT_S,
    )


def check_change(old: Policy, new: Policy) -> None:
    """What no backend can do to a running sandbox: lift a seccomp filter its processes carry."""
    if old.syscalls == "strict" and new.syscalls != "strict":
        raise PolicyError("policy.syscalls", "a running sandbox's strict syscall filter cannot be lifted (its processes "
                                             "carry it for good); create a new sandbox instead")
