"""Where the system service listens (`agentcell serve --system`, docs/system-service.md).

- The unix socket: handed over by systemd (socket activation: LISTEN_PID/LISTEN_FDS, agentcell.socket
  made it root:agentcell 0660), else bound here with the same owner and mode. Only root and members of
  the group can connect; the server tells them apart by their uid (peer.py, tenancy.py).
- A TCP listener only when asked (`--system-tcp`), and then only with an API key: on a TCP port every
  local user could otherwise drive the service without being in the group, and nobody's uid is known.
"""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat

from agentcell.server.config import ServerConfig

SYSTEM_SOCKET = "/run/agentcell/agentcell.sock"
SOCKET_MODE = 0o660
LISTEN_FDS_START = 3  # sd_listen_fds(3): the first passed descriptor


class ListenError(RuntimeError):
    """The service cannot listen where it should; the message says why and what to do."""


def check(config: ServerConfig) -> None:
    """Refuse, before anything starts, a system service whose TCP listener would have no key."""
    if config.system_tcp and not config.api_key:
        raise ListenError("--system-tcp needs --api-key (or AGENTCELL_SERVER_API_KEY): on a TCP port any local "
                          "user could reach the service, and the server cannot tell who they are")


def activated_sockets() -> list[socket.socket]:
    """The sockets systemd passed this process (sd_listen_fds), [] when it passed none."""
    try:
        pid, count = int(os.environ.get("LISTEN_PID", "")), int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    if pid != os.getpid() or count < 1:
        return []
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)  # they are for this process, not its children
    socks = []
    for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + count):
        os.set_inheritable(fd, False)  # no sandbox may inherit the listening socket
        socks.append(socket.socket(fileno=fd))
    return socks


def _group_id(name: str) -> int:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ListenError(f"the group {name!r} does not exist: `sudo agentcell system install` creates it (or pass "
                          "--socket-group GROUP)") from None


def _remove_stale(path: str) -> None:
    """A socket a previous run left behind (nobody accepts on it) is removed; anything else is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ListenError(f"{path} exists and is not a socket: remove it or pass --uds PATH")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise ListenError(f"another server listens on {path} already (the system service? `systemctl status agentcell`)")


def bind_unix(path: str, group: str) -> socket.socket:
    """A unix socket at `path`, root:`group` 0660, its directory made 0755 if missing."""
    gid = _group_id(group)
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # born 0600: no moment in which others may connect
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chown(path, 0, gid)
    os.chmod(path, SOCKET_MODE)
    sock.listen(2048)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


def sockets(config: ServerConfig) -> list[socket.socket]:
    """The system service's listening sockets: systemd's (or the unix socket bound here), then TCP if asked."""
    socks = activated_sockets()
    if any(s.family != socket.AF_UNIX for s in socks) and not config.api_key:
        for s in socks:
            s.close()
        raise ListenError("systemd passed a TCP socket (agentcell.socket has a ListenStream= address): that needs "
                          "--api-key; or listen on the unix socket only")
    if not socks:
        socks = [bind_unix(config.uds or SYSTEM_SOCKET, config.socket_group)]
    if config.system_tcp:
        try:
            socks.append(bind_tcp(config.host, config.port))
        except ListenError:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.close()
            raise
    return socks


def describe(socks: list[socket.socket]) -> str:
    """Where the service listens, for its log."""
    names = []
    for s in socks:
        name = s.getsockname()
        names.append(f"unix:{name}" if s.family == socket.AF_UNIX else f"tcp:{name[0]}:{name[1]}")
    return ", ".join(names)
