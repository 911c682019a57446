"""Signatures: the flags of a record (record/flags.py) as a reviewer reads them, each with a severity
and a title, and the small rules that recognise the newer ones in an event's fields.

A signature is a flag plus `severity` and `title`: `{signature, flag, severity, title, why, events,
count, not_stored}`. The flags stay the machinery (raised online by the store on every event seen,
merged with a pass over the stored events, bounded per record); this module says how bad each is,
and holds the matchers the flag rules call:

| matcher | reads | what it recognises |
|---|---|---|
| `reverse_shell` | a command line | a shell wired to a socket: `/dev/tcp/`, `nc -e`, `nc ... \\| sh`, `socat ... exec:`, `mkfifo ... nc`, a python/perl/ruby/php one-liner that opens a socket and runs a shell |
| `credential_path` | a command line or a path | credential files: `/etc/shadow`, `~/.ssh/id_*`, `~/.aws/credentials`, `.netrc`, `.git-credentials`, `.docker/config.json`, `/proc/*/environ`, kube config, gcloud credentials |
| `privileged_file` | a path | the files that grant privilege: `/etc/passwd`, `/etc/shadow`, `/etc/sudoers(.d)` ... |
| `escalation_command` | an argv | an exec of `sudo`, `su`, `pkexec` or `doas`, or a shell command line running one |
| `setuid_mode` | a `file.chmod`'s mode | a setuid or setgid bit |

Each is a few lines and a pattern; a regular expression is compiled once, and a cheap substring test
runs before it, so that the store's per-event cost stays small.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

SEVERITIES = ("critical", "high", "medium", "low", "info")  # most severe first
_RANK = {s: i for i, s in enumerate(SEVERITIES)}

# flag name -> (severity, title); a flag not named here (a newer server's) is shown as "medium"
SIGNATURES: dict[str, tuple[str, str]] = {
    "reverse-shell": ("critical", "Reverse shell"),
    "cloud-metadata": ("high", "Cloud metadata access"),
    "crypto-mining": ("high", "Crypto mining"),
    "credential-read": ("high", "Credential file read"),
    "privilege-escalation": ("high", "Privilege escalation attempt"),
    "secret-misuse": ("high", "Secret sent where it may not go"),
    "persistence": ("medium", "Persistence"),
    "scanning": ("medium", "Network scanning"),
    "privilege-syscalls": ("medium", "Privileged syscalls refused"),
    "host-or-lan": ("medium", "Host or LAN access"),
    "denied-egress": ("low", "Egress to denied hosts"),
    "sensitive-paths": ("low", "Protected paths refused"),
    "left-running": ("low", "Left running"),
    "cpu-bound": ("low", "CPU-bound"),
    "record-incomplete": ("low", "Record incomplete"),
    "secrets-used": ("info", "Secrets used"),
}


def severity(flag: str) -> str:
    return SIGNATURES.get(flag, ("medium", ""))[0]


def from_flags(flags: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The report's `signatures`: its flags with severity and title, the most severe first (then by name)."""
    out = []
    for f in flags:
        sev, title = SIGNATURES.get(f["flag"], ("medium", f["flag"]))
        out.append({"signature": f["flag"], "severity": sev, "title": title, **f})
    return sorted(out, key=lambda s: (_RANK[s["severity"]], s["signature"]))


# -- reverse shells -------------------------------------------------------------------------------------

_NC = r"(?:nc|ncat|netcat|nc\.traditional|nc\.openbsd)"
_SHELL = r"(?:/bin/|/usr/bin/)?(?:ba|da|z|k|c|tc|fi)?sh\b"
_REVERSE_RE = re.compile("|".join((
    r"/dev/(?:tcp|udp)/",  # bash's network redirections: bash -i >& /dev/tcp/h/p 0>&1
    rf"(?:^|[\s/;&|(]){_NC}\s(?:[^|;&]*\s)?(?:-[a-z]*[ec]\s*\S|--exec|--sh-exec|--lua-exec)",  # nc -e /bin/sh
    rf"(?:^|[\s/;&|(]){_NC}\s[^|;&]*\|\s*{_SHELL}",  # nc host port | sh
    r"\bsocat\b.*\b(?:exec|system):",  # socat tcp:h:p exec:sh,pty
    rf"\bmkfifo\b.*(?:^|[\s/;&|(]){_NC}\s",  # mkfifo /tmp/f; cat /tmp/f | sh -i | nc h p > /tmp/f
    # a one-liner that opens a socket and hands it to a shell
    r"\b(?:python[0-9.]*|perl|ruby|php[0-9.]*)\b.*(?:socket|fsockopen|tcpsocket|io::socket)"
    r".*(?:dup2|pty\.spawn|/bin/(?:ba)?sh\b|\bexec\b|proc_open|popen|spawn)",
)), re.DOTALL)
_REVERSE_HINTS = re.compile(r"/dev/|nc|socat|mkfifo|sock")  # what every pattern above needs


def reverse_shell(line: str) -> bool:
    """A command line (argv joined, lowered) that wires a shell to a network socket."""
    return _REVERSE_HINTS.search(line) is not None and _REVERSE_RE.search(line) is not None


# -- credential files -----------------------------------------------------------------------------------

_CREDENTIAL_RE = re.compile(
    r"/etc/g?shadow\b|\.ssh/(?:id_|identity)|\.aws/credentials|\.netrc\b|\.git-credentials"
    r"|\.docker/config\.json|/proc/[^/\s]+/environ|\.kube/config|\.config/gcloud/"
    r"(?:credentials|application_default_credentials|access_tokens|legacy_credentials)|\.pgpass\b")
_CREDENTIAL_HINTS = re.compile(r"shadow|\.ssh/|\.aws/|netrc|credentials|config|environ|pgpass")


def credential_path(text: str) -> bool:
    """A path, or a command line, naming a credential file."""
    return _CREDENTIAL_HINTS.search(text) is not None and _CREDENTIAL_RE.search(text) is not None


_LINE_HINTS = re.compile(f"{_REVERSE_HINTS.pattern}|{_CREDENTIAL_HINTS.pattern}")


def worth_a_look(line: str) -> bool:
    """Whether a command line may match `reverse_shell` or `credential_path` (one search for both: the
    store runs this on every exec, and most match neither)."""
    return _LINE_HINTS.search(line) is not None


# -- privilege escalation -------------------------------------------------------------------------------

PRIVILEGED_FILES = frozenset({"/etc/passwd", "/etc/shadow", "/etc/group", "/etc/gshadow", "/etc/sudoers"})
PRIVILEGED_DIRS = ("/etc/sudoers.d/", "/etc/pam.d/", "/etc/security/")
ESCALATION_PROGRAMS = frozenset({"sudo", "su", "pkexec", "doas"})
_ESCALATION_RE = re.compile(r"(?:^|[;&|(`]\s*|\$\(\s*|\s&&\s*)(?:/usr/bin/|/bin/)?(?:sudo|su|pkexec|doas)(?:\s|$)")
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash", "busybox"})


def privileged_file(path: Any) -> bool:
    """A file whose change grants privilege (accounts, sudo rules, PAM)."""
    return isinstance(path, str) and (path in PRIVILEGED_FILES or path.startswith(PRIVILEGED_DIRS))


def escalation_command(path: Any, argv: Any) -> bool:
    """An exec of sudo, su, pkexec or doas, or a shell's `-c` command line that runs one."""
    if isinstance(path, str) and path.rpartition("/")[2] in ESCALATION_PROGRAMS:
        return True
    first = argv[0] if isinstance(argv, list) and argv else None
    if not isinstance(first, str):
        return False
    name = first.rpartition("/")[2]
    if name in ESCALATION_PROGRAMS:
        return True
    if name.lstrip("-") in _SHELLS:
        return any(isinstance(a, str) and _ESCALATION_RE.search(a.strip()) for a in argv[1:])
    return False


def setuid_mode(mode: Any) -> bool:
    """A file.chmod's mode (octal text, "4755", or a number) with the setuid or setgid bit."""
    try:
        bits = int(mode, 8) if isinstance(mode, str) else int(mode)
    except (TypeError, ValueError):
        return False
    return bool(bits & 0o6000)
