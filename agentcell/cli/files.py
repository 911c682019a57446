"""`agentcell cp SRC DST`: files and directories between this machine and a sandbox (`ID:/path` on one
side; `-` is stdin or stdout), as `docker cp` does. Content streams both ways: no file is held whole in
memory. Directories are copied entry by entry through the files API; symlinks are skipped (said on
stderr), and a download keeps each file's permission bits.

A download trusts nothing the sandbox names: an entry whose name is not one plain path component
(`..`, a slash) is refused, so no listing can make this command write outside DST.
"""

from __future__ import annotations

import os
import posixpath
import re
import sys
from dataclasses import dataclass
from typing import Any

import click

from agentcell.cli import main
from agentcell.cli.errors import CliError
from agentcell.cli.target import Target, connect_running, server_options
from agentcell.text_escape import escape

_REMOTE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_-]*):(.*)$")


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
@server_options
def cp(src: str, dst: str, user: str | None, target: Target) -> None:
    """Copy files or directories between this machine and a sandbox.

    \b
      agentcell cp ./data ID:/home/user/       a directory into the sandbox
      agentcell cp ID:/home/user/out.csv .     a file out of it
      agentcell cp - ID:/tmp/in.bin            stdin to a file
      agentcell cp ID:/tmp/log.txt -           a file to stdout
    """
    s, d = Spec.parse(src), Spec.parse(dst)
    if (s.sandbox_id is None) == (d.sandbox_id is None):
        raise click.UsageError("one of SRC and DST must be ID:/path in a sandbox, the other a local path or -")
    sid = s.sandbox_id or d.sandbox_id
    assert sid is not None
    sbx = connect_running(target, sid, "cp")
    if d.sandbox_id is not None:
        _upload(sbx, s.path, d.path, user)
    else:
        _download(sbx, s.path, d.path, user)


def _warn(text: str) -> None:
    click.echo(f"agentcell: {escape(text)}", err=True)


# --- this machine -> the sandbox ---------------------------------------------------------------------


def _remote_dir(sbx: Any, path: str, user: str | None) -> bool:
    from agentcell.errors import NotFoundException
    from agentcell.sdk.models import FileType

    try:
        return sbx.files.get_info(path, user=user).type == FileType.DIR
    except NotFoundException:
        return False


def _upload(sbx: Any, src: str, dst: str, user: str | None) -> None:
    if src == "-":
        if dst.endswith("/"):
            raise click.UsageError("stdin has no file name: name the file to write, e.g. ID:/tmp/data.bin")
        sbx.files.write(dst, sys.stdin.buffer, user=user)
        return
    if not os.path.lexists(src):
        raise CliError(f"{src}: no such file or directory")
    into = dst.endswith("/") or _remote_dir(sbx, dst, user)
    if into:
        dst = posixpath.join(dst, os.path.basename(os.path.normpath(src)))
    if os.path.isdir(src) and not os.path.islink(src):
        _upload_dir(sbx, src, dst, user)
    else:
        _upload_file(sbx, src, dst, user)


def _upload_file(sbx: Any, src: str, dst: str, user: str | None) -> None:
    if os.path.islink(src):
        _warn(f"skipped symlink {src}")
        return
    with open(src, "rb") as f:
        sbx.files.write(dst, f, user=user)


def _upload_dir(sbx: Any, src: str, dst: str, user: str | None) -> None:
    sbx.files.make_dir(dst, user=user)
    for root, dirs, names in os.walk(src):
        rel = os.path.relpath(root, src)
        here = dst if rel == "." else posixpath.join(dst, *rel.split(os.sep))
        for name in list(dirs):
            if os.path.islink(os.path.join(root, name)):
                dirs.remove(name)  # os.walk does not descend into it; say so
                _warn(f"skipped symlink {os.path.join(root, name)}")
            else:
                sbx.files.make_dir(posixpath.join(here, name), user=user)
        for name in names:
            _upload_file(sbx, os.path.join(root, name), posixpath.join(here, name), user)


# --- the sandbox -> this machine ---------------------------------------------------------------------


def _download(sbx: Any, src: str, dst: str, user: str | None) -> None:
    from agentcell.sdk.models import FileType

    entry = sbx.files.get_info(src, user=user)
    if entry.type == FileType.DIR:
        if dst == "-":
            raise click.UsageError(f"{src} is a directory: it cannot go to stdout (copy it to a local path)")
        if os.path.isdir(dst):
            dst = os.path.join(dst, posixpath.basename(posixpath.normpath(src)))
        _download_dir(sbx, src, dst, user)
        return
    if dst == "-":
        for chunk in sbx.files.read(src, format="stream", user=user):
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        return
    if os.path.isdir(dst) or dst.endswith(os.sep):
        dst = os.path.join(dst, posixpath.basename(src))
    _download_file(sbx, src, dst, entry.mode, user)


def _download_file(sbx: Any, src: str, dst: str, mode: int, user: str | None) -> None:
    with open(dst, "wb") as f:
        for chunk in sbx.files.read(src, format="stream", user=user):
            f.write(chunk)
    if mode:
        os.chmod(dst, mode & 0o777)


def _plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


def _download_dir(sbx: Any, src: str, dst: str, user: str | None) -> None:
    from agentcell.sdk.models import FileType

    os.makedirs(dst, exist_ok=True)
    pending = [(src, dst)]
    while pending:
        remote, local = pending.pop()
        for entry in sbx.files.list(remote, depth=1, user=user):
            if not _plain_name(entry.name):
                raise CliError(f"the sandbox listed an entry named {entry.name!r} in {remote}: refused")
            there, here = posixpath.join(remote, entry.name), os.path.join(local, entry.name)
            if entry.type == FileType.DIR:
                os.makedirs(here, exist_ok=True)
                pending.append((there, here))
            elif entry.type == FileType.FILE:
                _download_file(sbx, there, here, entry.mode, user)
            else:
                _warn(f"skipped {entry.type.value if entry.type else 'special file'} {there}")
