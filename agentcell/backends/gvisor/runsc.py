"""Running `runsc`: one state directory (--root) per sandbox, the same global flags for every command.

The flags are the backend's security choices (see docs/security.md, "The gvisor backend"):
--network=none (no network stack reaches the host; gVisor#10704 makes netns networking impossible in
this runsc anyway), --overlay2=root:memory (the root is writable, its changes live in the sandbox's
memory and never reach the host), --directfs=false (every file operation of the sentry goes through
the gofer: a bug or exploit in the sentry cannot open host files itself, and read-only binds cannot be
truncated through it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from typing import BinaryIO

from agentcell.errors import BackendUnavailableError, SandboxError

PLATFORMS = ("systrap", "ptrace")  # kvm hangs on this kind of host (PVM)
MIN_VERSION = "20240729"


@dataclass(frozen=True, slots=True)
class Runsc:
    binary: str
    platform: str = "systrap"
    directfs: bool = False
    # A character device 1:3 (null) of our own, bound over /dev/null in a mount namespace of runsc's:
    # runsc chowns the null device its sandbox process gets as stdio to that process's user (nobody),
    # which made the host's /dev/null nobody's. None: runsc sees the host's /dev/null.
    null_dev: str | None = None

    def with_private_null(self, directory: str) -> Runsc:
        """The same runsc, every call of it in a mount namespace whose /dev/null is a node in `directory`."""
        path = os.path.join(directory, "null")
        if not os.path.exists(path):
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        os.chmod(path, 0o666)
        return dataclasses.replace(self, null_dev=path)

    @classmethod
    def find(cls, platform: str = "systrap", directfs: bool = False) -> Runsc:
        if platform not in PLATFORMS:
            raise BackendUnavailableError(f"gVisor platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
        binary = shutil.which("runsc")
        if binary is None:
            raise BackendUnavailableError("runsc is not installed: run scripts/setup (Debian: apt-get install "
                                          "runsc/bookworm-backports)")
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
        version = out.split("version", 1)[-1].split()[0] if "version" in out else ""
        digits = "".join(c for c in version.split("~")[-1] if c.isdigit())[:8]
        if digits and digits < MIN_VERSION:
            raise BackendUnavailableError(f"runsc {version} is too old (no --overlay2, no checkpoint of systrap "
                                          f"sandboxes): install {MIN_VERSION} or later from bookworm-backports")
        return cls(binary, platform, directfs)

    def argv(self, root: str, *args: str) -> list[str]:
        wrap: list[str] = []
        if self.null_dev:
            wrap = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                    'mount --bind "$0" /dev/null && exec "$@"', self.null_dev]
        return [*wrap, self.binary, f"--root={root}", "--network=none", "--overlay2=root:memory",
                f"--directfs={'true' if self.directfs else 'false'}", f"--platform={self.platform}",
                "--host-uds=none", *args]

    async def call(self, root: str, *args: str, stdio: int | None = None, timeout: float = 30.0) -> str:
        """Run one runsc command; its stdout. `stdio`: the socket the sandbox's init gets as stdin
        (run/restore); its stdout is an empty private file: the sentry imports each stdio fd as a file
        of its own, and closing a socket's file shuts the socket down, so the socket must be one of them
        only. stderr goes to a file: a detached sandbox keeps its stderr open forever. Never the host's
        /dev/null: runsc chowns the stdio it hands the sandbox to the sandbox's user (it made the
        host's /dev/null nobody's)."""
        os.makedirs(root, mode=0o700, exist_ok=True)
        log = os.path.join(root, "runsc.err")
        with open(log, "wb") as err, private_null(root) as null:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(root, *args), stdin=stdio if stdio is not None else null,
                stdout=null if stdio is not None else subprocess.PIPE, stderr=err, cwd="/",
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        try:
            async with asyncio.timeout(timeout):
                out, _ = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise SandboxError(f"runsc {args[0]} did not finish within {timeout:g} s") from None
        if proc.returncode != 0:
            with open(log, errors="replace") as f:
                tail = f.read()[-1500:].strip()
            raise SandboxError(f"runsc {args[0]} failed ({proc.returncode}): {tail}")
        return (out or b"").decode(errors="replace")


def private_null(directory: str) -> BinaryIO:
    """An empty file of our own to stand for /dev/null in runsc's stdio (see Runsc.call)."""
    return open(os.path.join(directory, "stdio.null"), "w+b")  # noqa: SIM115 - the caller closes it
