"""User-mode networking: the uplink of a rootless server's egress router (docs/rootless.md).

Inside its user namespace a rootless server owns the network namespaces it creates, so it builds the
same router namespace as root does (network/router.py: nftables, resolver, proxy), only not under
/run/netns (host root's): the namespace is bind-mounted on a file of the user's, in the server's own
mount namespace (router.Router.create with `netns_dir`), so it is gone with the server.

Its uplink is slirp4netns: a TAP `up0` in the router namespace, whose connections slirp4netns makes
again as ordinary sockets of the user's in the namespace the server runs in (the host's). Nothing of
the host changes: no interface, route, rule or sysctl. slirp4netns runs with
- `--disable-host-loopback`: the router cannot reach the host's 127.0.0.1 through slirp's gateway;
- `--cidr` in agentcell's uplink range (100.127.0.0/16): the router's never-list refuses it to
  sandboxes, so slirp's gateway and DNS addresses are out of their reach too;
- `--exit-fd`: it exits when the server does, however the server ends.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time

from agentcell.network.router import UPLINK, EgressError, Router

TOOL = "slirp4netns"
CIDR = "100.127.0.0/24"  # the router is .100, slirp's gateway .2 (its DNS .3 is not used)
MTU = 65520  # slirp4netns' recommended: fewer, larger packets through the user-space stack
READY_TIMEOUT_S = 10.0
TUN = "/dev/net/tun"


class UsermodeUnavailableError(EgressError):
    """slirp4netns cannot run here; the message says what is missing and the fix."""


def missing() -> tuple[str, str] | None:
    """(what is missing, its fix) for user-mode networking in this process; None: it can run."""
    if shutil.which(TOOL) is None:
        return f"{TOOL} is not installed", "apt-get install slirp4netns (as root)"
    if not os.access(TUN, os.R_OK | os.W_OK):
        return (f"{TUN} is not usable by this user",
                f"chmod 0666 {TUN} (udev's default mode), as root; a container needs --device {TUN}")
    return None


def unavailable_reason() -> str | None:
    """Why user-mode networking cannot run for this process, with the fix (None: it can)."""
    found = missing()
    return None if found is None else f"{found[0]} ({found[1]})"


class SlirpUplink:
    """slirp4netns serving `router`'s up0; close() stops it."""

    def __init__(self, router: Router) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise UsermodeUnavailableError(f"user-mode networking: {reason}")
        ready_r, ready_w = os.pipe()
        self._exit_r, self._exit_w = os.pipe()  # slirp4netns exits once the write end closes
        os.set_inheritable(self._exit_w, False)
        try:
            self.process = subprocess.Popen(
                [TOOL, "--configure", f"--mtu={MTU}", "--disable-host-loopback", f"--cidr={CIDR}",
                 "--enable-seccomp", f"--ready-fd={ready_w}", f"--exit-fd={self._exit_r}",
                 "--netns-type=path", router.path, UPLINK],
                pass_fds=(ready_w, self._exit_r), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE)
        except OSError as e:
            for fd in (ready_r, ready_w, self._exit_r, self._exit_w):
                os.close(fd)
            raise UsermodeUnavailableError(f"cannot start {TOOL}: {e}") from e
        os.close(ready_w)
        os.close(self._exit_r)
        try:
            self._wait_ready(ready_r)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(ready_r)

    def _wait_ready(self, ready_r: int) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if select.select([ready_r], [], [], 0.1)[0] and os.read(ready_r, 1) == b"1":
                return
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace").strip() if self.process.stderr else ""
                raise EgressError(f"{TOOL} exited with {self.process.returncode}: {err[-500:]}")
        raise EgressError(f"{TOOL} did not configure {UPLINK} within {READY_TIMEOUT_S:.0f} s")

    def close(self) -> None:
        if self._exit_w >= 0:
            os.close(self._exit_w)
            self._exit_w = -1
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()
