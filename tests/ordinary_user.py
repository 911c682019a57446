"""An ordinary user made for the test session (useradd, with a subordinate id range; removed after),
and a venv it can run: made from /usr/bin/python3 with this tree and its pinned dependencies
installed (the repository's .venv is a build under /root that other users cannot run).

Used by test_rootless.py and test_doctor.py (import the fixture there)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBID_BLOCK = 65536


@dataclass
class OrdinaryUser:
    name: str
    uid: int
    gid: int
    home: str
    python: str  # the venv's interpreter, with agentcell installed

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "LANG": "C.UTF-8",
                "PATH": f"{os.path.dirname(self.python)}:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONUNBUFFERED": "1",
                # no uplink for its servers unless a test gives one in a namespace of its own (the network rule:
                # user-mode networking would otherwise open its sockets in the host's namespace)
                "AGENTCELL_EGRESS_UPLINK": "none"}

    def popen(self, argv: list[str], **kw: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, user=self.uid, group=self.gid, extra_groups=[], env=self.env(), cwd=self.home,
                                **kw)  # type: ignore[call-overload]

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, user=self.uid, group=self.gid, extra_groups=[], env=self.env(), cwd=self.home,
                              capture_output=True, text=True, timeout=timeout)


def _free_subid_start() -> int:
    """A 65536-aligned block above every range /etc/subuid and /etc/subgid hand out."""
    end = 100_000
    for path in ("/etc/subuid", "/etc/subgid"):
        with contextlib.suppress(OSError), open(path) as f:
            for line in f:
                fields = line.strip().split(":")
                if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                    end = max(end, int(fields[1]) + int(fields[2]))
    return (end // SUBID_BLOCK + 1) * SUBID_BLOCK


def _has_subids(name: str) -> bool:
    with contextlib.suppress(OSError), open("/etc/subuid") as f:
        return any(line.startswith(name + ":") for line in f)
    return False


def make_user(name: str, subids: bool) -> tuple[int, int, str]:
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True, capture_output=True)
    entry = pwd.getpwnam(name)
    if subids and not _has_subids(name):
        start = _free_subid_start()
        rng = f"{start}-{start + SUBID_BLOCK - 1}"
        subprocess.run(["usermod", "--add-subuids", rng, "--add-subgids", rng, name], check=True, capture_output=True)
    if not subids:  # useradd may have given it a range already (SUB_UID_COUNT in login.defs)
        for path in ("/etc/subuid", "/etc/subgid"):
            with open(path) as f:
                kept = [line for line in f if not line.startswith(name + ":")]
            with open(path, "w") as f:
                f.writelines(kept)
    return entry.pw_uid, entry.pw_gid, entry.pw_dir


def remove_user(name: str) -> None:
    # its processes are gone: the tests stop their servers by pid, and a rootless server's sandboxes die with it
    subprocess.run(["userdel", "--remove", name], capture_output=True)
    for path in ("/etc/subuid", "/etc/subgid"):  # userdel of shadow < 4.11 keeps them
        with contextlib.suppress(OSError):
            with open(path) as f:
                kept = [line for line in f if not line.startswith(name + ":")]
            with open(path, "w") as f:
                f.writelines(kept)


def make_venv() -> str:
    """A venv of /usr/bin/python3 with this tree installed from the registry's pinned versions (pip's cache)."""
    base = tempfile.mkdtemp(prefix="agentcell-rootless-venv-")
    os.chmod(base, 0o755)
    venv = os.path.join(base, "venv")
    subprocess.run(["/usr/bin/python3", "-m", "venv", venv], check=True, capture_output=True)
    done = subprocess.run([f"{venv}/bin/pip", "install", "-q", "--disable-pip-version-check", str(REPO)],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        raise RuntimeError(f"pip install of the tree failed:\n{done.stderr[-3000:]}")
    subprocess.run(["chmod", "-R", "a+rX", base], check=True)
    return f"{venv}/bin/python"


def skip_unless_possible() -> None:
    if os.geteuid() != 0:
        pytest.skip("making an ordinary user needs root")
    for tool in ("useradd", "usermod", "userdel"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} on this host")
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("no /usr/bin/python3 to make the user's venv from")


@pytest.fixture(scope="session")
def user_venv() -> Iterator[str]:
    skip_unless_possible()
    python = make_venv()
    yield python
    shutil.rmtree(os.path.dirname(os.path.dirname(os.path.dirname(python))), ignore_errors=True)


@pytest.fixture(scope="session")
def ordinary_user(user_venv: str) -> Iterator[OrdinaryUser]:
    """An ordinary user with a subordinate id range (rootless mode's needs)."""
    name = f"acrl{os.getpid() % 100000}"
    remove_user(name)
    uid, gid, home = make_user(name, subids=True)
    try:
        yield OrdinaryUser(name, uid, gid, home, user_venv)
    finally:
        remove_user(name)


@pytest.fixture(scope="session")
def user_without_subids(user_venv: str) -> Iterator[OrdinaryUser]:
    name = f"acns{os.getpid() % 100000}"
    remove_user(name)
    uid, gid, home = make_user(name, subids=False)
    try:
        yield OrdinaryUser(name, uid, gid, home, user_venv)
    finally:
        remove_user(name)
