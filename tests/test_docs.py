"""The docs are true to the code: every repository file they name exists, they point nowhere outside the
repository, every `agentcell` command line they show names a real subcommand and real options, and the
licence the package declares is the one in LICENSE."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import click
import pytest

from agentcell.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "SPECIFICATION.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/*.md"),
               ROOT / "benchmarks" / "README.md"])
# a path from the repository's top, or one of agentcell's parts written short (backends/pool.py)
TOP = re.compile(r"(?<![\w./-])((?:agentcell|docs|tests|benchmarks|scripts|deploy|\.ci)/[\w./-]*[\w/])")
SHORT = re.compile(r"(?<![\w./-])((?:backends|server|network|record|runtime|sdk|gateway|cli|system)/[\w./-]*\.\w+)")
SHORT_ROOTS = ("agentcell", "agentcell/record", "agentcell/backends", "agentcell/record/linux",
               "agentcell/backends/linux")
# named on purpose though not in the tree: a user's own overlay, the JS SDK's test folder
NOT_OURS = {"deploy/kubernetes/overlays/mine", "tests/sandbox", "tests/secret", "tests/volume",
            "tests/shared/sandbox/test_egress_proxy.py"}  # E2B's JS SDK's folders, a file of its Python SDK's


def _lines() -> list[tuple[str, int, str]]:
    return [(p.relative_to(ROOT).as_posix(), n, line) for p in DOCS if p.exists()
            for n, line in enumerate(p.read_text().splitlines(), 1)]


def test_every_file_the_docs_name_exists() -> None:
    missing = []
    for doc, n, line in _lines():
        for m in TOP.finditer(line):
            path = m.group(1).rstrip(".").split("::")[0]
            if path not in NOT_OURS and not (ROOT / path).exists() and not (ROOT / f"{path}.py").exists():
                missing.append(f"{doc}:{n}: {path}")
        for m in SHORT.finditer(line):
            path = m.group(1).rstrip(".")
            if not any((ROOT / r / path).exists() for r in SHORT_ROOTS):
                missing.append(f"{doc}:{n}: {path}")
    assert not missing, "\n".join(missing)


def test_the_docs_point_nowhere_outside_the_repository() -> None:
    outside = [f"{doc}:{n}: {line.strip()}" for doc, n, line in _lines()
               if re.search(r"(?<![\w.])\.\./|(?<![\w/])shared/", line)]
    assert not outside, "\n".join(outside)


def _commands() -> dict[str, set[str]]:
    """Every command path ('serve', 'snapshot create') and its options."""
    found: dict[str, set[str]] = {}

    def walk(cmd: click.Command, path: str) -> None:
        found[path] = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                walk(sub, f"{path} {name}".strip())

    walk(main, "")
    return found


def _shown_command_lines() -> list[tuple[str, int, list[str]]]:
    """`agentcell ...` as the docs show it: in a code span, or a line of a code block."""
    shown, in_block = [], False
    for doc, n, line in _lines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        texts = [line] if in_block else re.findall(r"`([^`]+)`", line)
        for text in texts:
            # a command's start: the line's, or after a prompt, `&&`, `;`, `|`, `sudo`, `(`, `$(`
            for m in re.finditer(r"(?:^\s*|\$\s+|&&\s*|;\s*|\|\s*|sudo\s+|\()(?:[\w./-]*/)?agentcell"
                                 r"((?:[ \t]+[^\s#|;&)`]+)*)", text):
                try:
                    words = shlex.split(m.group(1), comments=True)
                except ValueError:
                    words = m.group(1).split()
                shown.append((doc, n, words))
    return shown


def test_every_agentcell_command_line_in_the_docs_exists() -> None:
    commands, wrong = _commands(), []
    for doc, n, words in _shown_command_lines():
        path = ""
        for w in words:
            if w.startswith("-") or f"{path} {w}".strip() not in commands:
                break
            path = f"{path} {w}".strip()
        if not path:
            if words and not words[0].startswith("-") and re.fullmatch(r"[a-z][a-z-]*", words[0]) \
                    and words[0] not in {"is", "and", "or", "the", "a", "to", "with", "on", "in"}:
                wrong.append(f"{doc}:{n}: no command 'agentcell {words[0]}'")
            continue
        for w in words:
            flag = w.split("=")[0]
            if re.fullmatch(r"--[a-z][a-z0-9-]*", flag) and flag not in commands[path]:
                wrong.append(f"{doc}:{n}: 'agentcell {path}' has no option {flag}")
    assert not wrong, "\n".join(wrong)


def test_the_licence_is_the_declared_one_and_there_is_a_changelog() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    declared = declared["text"] if isinstance(declared, dict) else declared
    assert declared == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "## Unreleased" in (ROOT / "CHANGELOG.md").read_text()


@pytest.mark.parametrize("doc", [p.name for p in DOCS if p.exists()])
def test_code_blocks_are_closed(doc: str) -> None:
    path = next(p for p in DOCS if p.name == doc)
    assert sum(1 for line in path.read_text().splitlines() if line.lstrip().startswith("```")) % 2 == 0
