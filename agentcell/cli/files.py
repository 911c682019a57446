"""`agentcell cp SRC DST`: files and directories between this machine and a sandbox (`ID:/path` on one
side; `-` is stdin or stdout), as `docker cp` does. Content streams both ways: no file is held whole in
memory. Directories are copied entry by entry through the files API; symlinks are skipped (said on
stderr). A download keeps each file's permission bits; so does an upload, though the files API carries
no modes (E2B's does not either): after the upload one `chmod` command a mode sets them, for every file
whose mode is not the 0644 a write gives (an executable script stays executable).

A download trusts nothing the sandbox names: an entry whose name is not one plain path component
(`..`, a slash) is refused, so no listing can make this command write outside DST.
"""

from __future__ import annotations

import os
import posixpath
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import click

from agentcell.cli import main
from agentcell.cli.errors import CliError
from agentcell.cli.output import json_option, print_json
from agentcell.cli.target import Target, connect_running, server_options
from agentcell.text_escape import escape

_REMOTE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_-]*):(.*)$")
WRITTEN_MODE = 0o644  # what the files API gives a file it writes
CHMOD_BATCH = 200  # paths per chmod command (well under any argument-list limit)


@dataclass
class Tally:
    """What a copy did: `cp --json` prints it."""

    destination: str = ""
    files: int = 0
    directories: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)
    modes: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))  # uploads: mode -> paths


@dataclass(frozen=True)
class Spec:
    sandbox_id: str | None  # None: this machine
    path: str

    @classmethod
    def parse(cls, text: str) -> Spec:
        m = _REMOTE.match(text)
        if m and not text.startswith(("/", ".")):
            if not m.group(2):
                raise click.BadParameter(f"{text!r}: name a path in the sandbox, e.g. {m.group(1)}:/home/user/")
            return cls(m.group(1), m.group(2))
        return cls(None, text)


@main.command()
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option("--user", "-u", default=None, help="Read or write in the sandbox as this user (user, root).")
@json_option
@server_options
def cp(src: str, dst: str, user: str | None, as_json: bool, target: Target) -> None:
    """Copy files or directories between this machine and a sandbox.

    \b
      agentcell cp ./data ID:/home/user/       a directory into the sandbox
      agentcell cp ID:/home/user/out.csv .     a file out of it
      agentcell cp - ID:/tmp/in.bin            stdin to a file
      agentcell cp ID:/tmp/log.txt -           a file to stdout

    --json: {source, destination, files, directories, bytes, skipped} when done."""
    s, d = Spec.parse(src), Spec.parse(dst)
    if (s.sandbox_id is None) == (d.sandbox_id is None):
        raise click.UsageError("one of SRC and DST must be ID:/path in a sandbox, the other a local path or -")
    if as_json and d.sandbox_id is None and d.path == "-":
        raise click.UsageError("--json prints to stdout, where DST - writes the file: leave one out")
    sid = s.sandbox_id or d.sandbox_id
    assert sid is not None
    sbx = connect_running(target, sid, "cp")
    tally = Tally()
    if d.sandbox_id is not None:
        _upload(sbx, s.path, d.path, user, tally)
        _set_modes(sbx, tally, user)
    else:
        _download(sbx, s.path, d.path, user, tally)
    if as_json:
        print_json({"source": src, "destination": tally.destination, "files": tally.files,
                    "directories": tally.directories, "bytes": tally.bytes, "skipped": tally.skipped})


def _skip(tally: Tally, path: str, what: str) -> None:
    tally.skipped.append(path)
    click.echo(f"agentcell: {escape(f'skipped {what} {path}')}", err=True)


# --- this machine -> the sandbox ---------------------------------------------------------------------


def _remote_dir(sbx: Any, path: str, user: str | None) -> bool:
    from agentcell.errors import NotFoundException
    from agentcell.sdk.models import FileType

    try:
        return sbx.files.get_info(path, user=user).type == FileType.DIR
    except NotFoundException:
        return False


def _upload(sbx: Any, src: str, dst: str, user: str | None, tally: Tally) -> None:
    if src == "-":
        if dst.endswith("/"):
            raise click.UsageError("stdin has no file name: name the file to write, e.g. ID:/tmp/data.bin")
        sbx.files.write(dst, sys.stdin.buffer, user=user)
        tally.destination, tally.files = dst, 1
        tally.bytes = sbx.files.get_info(dst, user=user).size
        return
    if not os.path.lexists(src):
        raise CliError(f"{src}: no such file or directory")
    into = dst.endswith("/") or _remote_dir(sbx, dst, user)
    if into:
        dst = posixpath.join(dst, os.path.basename(os.path.normpath(src)))
    tally.destination = dst
    if os.path.isdir(src) and not os.path.islink(src):
        _upload_dir(sbx, src, dst, user, tally)
    else:
        _upload_file(sbx, src, dst, user, tally)


def _upload_file(sbx: Any, src: str, dst: str, user: str | None, tally: Tally) -> None:
    if os.path.islink(src):
        _skip(tally, src, "symlink")
        return
    with open(src, "rb") as f:
        st = os.fstat(f.fileno())
        mode = st.st_mode & 0o777
        sbx.files.write(dst, f, user=user)
        tally.bytes += st.st_size
    tally.files += 1
    if mode != WRITTEN_MODE:
        tally.modes[mode].append(dst)


def _upload_dir(sbx: Any, src: str, dst: str, user: str | None, tally: Tally) -> None:
    sbx.files.make_dir(dst, user=user)
    tally.directories += 1
    for root, dirs, names in os.walk(src):
        rel = os.path.relpath(root, src)
        here = dst if rel == "." else posixpath.join(dst, *rel.split(os.sep))
        for name in list(dirs):
            if os.path.islink(os.path.join(root, name)):
                dirs.remove(name)  # os.walk does not descend into it; say so
                _skip(tally, os.path.join(root, name), "symlink")
            else:
                sbx.files.make_dir(posixpath.join(here, name), user=user)
                tally.directories += 1
        for name in names:
            _upload_file(sbx, os.path.join(root, name), posixpath.join(here, name), user, tally)


def _set_modes(sbx: Any, tally: Tally, user: str | None) -> None:
    """The uploaded files' own modes, where they are not what a write gave them: chmod in the sandbox."""
    import shlex

    from agentcell.errors import CommandExitException

    for mode, paths in sorted(tally.modes.items()):
        for i in range(0, len(paths), CHMOD_BATCH):
            try:
                sbx.commands.run(f"chmod {mode:o} -- {shlex.join(paths[i:i + CHMOD_BATCH])}", user=user, timeout=60)
            except CommandExitException as e:
                raise CliError(f"the files were copied, but setting their mode {mode:o} failed: {e.stderr.strip()}",
                               "the sandbox needs chmod (coreutils) for an upload to keep modes") from None


# --- the sandbox -> this machine ---------------------------------------------------------------------


def _download(sbx: Any, src: str, dst: str, user: str | None, tally: Tally) -> None:
    from agentcell.sdk.models import FileType

    entry = sbx.files.get_info(src, user=user)
    if entry.type == FileType.DIR:
        if dst == "-":
            raise click.UsageError(f"{src} is a directory: it cannot go to stdout (copy it to a local path)")
        if os.path.isdir(dst):
            dst = os.path.join(dst, posixpath.basename(posixpath.normpath(src)))
        tally.destination = dst
        _download_dir(sbx, src, dst, user, tally)
        return
    if dst == "-":
        for chunk in sbx.files.read(src, format="stream", user=user):
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        return
    if os.path.isdir(dst) or dst.endswith(os.sep):
        dst = os.path.join(dst, posixpath.basename(src))
    tally.destination = dst
    _download_file(sbx, src, dst, entry.mode, user, tally)


def _download_file(sbx: Any, src: str, dst: str, mode: int, user: str | None, tally: Tally) -> None:
    with open(dst, "wb") as f:
        for chunk in sbx.files.read(src, format="stream", user=user):
            f.write(chunk)
            tally.bytes += len(chunk)
    tally.files += 1
    if mode:
        os.chmod(dst, mode & 0o777)


def _plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


def _download_dir(sbx: Any, src: str, dst: str, user: str | None, tally: Tally) -> None:
    from agentcell.sdk.models import FileType

    os.makedirs(dst, exist_ok=True)
    tally.directories += 1
    pending = [(src, dst)]
    while pending:
        remote, local = pending.pop()
        for entry in sbx.files.list(remote, depth=1, user=user):
            if not _plain_name(entry.name):
                raise CliError(f"the sandbox listed an entry named {entry.name!r} in {remote}: refused")
            there, here = posixpath.join(remote, entry.name), os.path.join(local, entry.name)
            if entry.type == FileType.DIR:
                os.makedirs(here, exist_ok=True)
                tally.directories += 1
                pending.append((there, here))
            elif entry.type == FileType.FILE:
                _download_file(sbx, there, here, entry.mode, user, tally)
            else:
                _skip(tally, there, entry.type.value if entry.type else "special file")
