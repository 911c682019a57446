"""The machine's agentcell system service, found by its unix socket (docs/system-service.md).

With neither `api_url` nor AGENTCELL_URL, the SDK uses the system service when its socket
(/run/agentcell/agentcell.sock, or AGENTCELL_SYSTEM_SOCKET) accepts this user's connection: no server to
start, no URL to set. Otherwise root gets the embedded server (embedded.py), and anyone else an error
that says what to ask for.
"""

from __future__ import annotations

import errno
import logging
import os
import socket

from agentcell.errors import NoLocalServerError
from agentcell.sdk.config import Endpoint

SYSTEM_SOCKET = "/run/agentcell/agentcell.sock"
SOCKET_ENV = "AGENTCELL_SYSTEM_SOCKET"
GROUP = "agentcell"


def socket_path() -> str:
    return os.environ.get(SOCKET_ENV) or SYSTEM_SOCKET


def probe(path: str) -> int | None:
    """None if a server accepts a connection on `path`, else the errno of the failure."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2)
    try:
        sock.connect(path)
    except OSError as e:
        return e.errno or errno.EIO
    finally:
        sock.close()
    return None


def _embedded_possible() -> bool:
    """Root runs the embedded server as always; anyone else runs it rootless where this host allows that
    (subordinate ids, newuidmap, user namespaces: docs/rootless.md)."""
    if os.geteuid() == 0:
        return True
    return _rootless_problem() is None


def _rootless_problem() -> str | None:
    """Why rootless mode cannot run for this user, or None."""
    from agentcell.backends.linux.userns import RootlessUnavailableError, check_kernel, plan

    try:
        plan()
        check_kernel()
    except RootlessUnavailableError as e:
        return str(e)
    return None


def _socket_group(path: str) -> str:
    """The group the socket lets in (agentcell unless the service was told otherwise)."""
    import grp

    try:
        return grp.getgrgid(os.stat(path).st_gid).gr_name
    except (OSError, KeyError):
        return GROUP


def _problem(path: str, failure: int) -> str:
    user = _user()
    if failure in (errno.EACCES, errno.EPERM):
        group = _socket_group(path)
        return (f"you ({user}) may not connect to the agentcell system service at {path}: only members of group "
                f"'{group}' may. Ask an administrator to run `sudo usermod -aG {group} {user}`, then log in again "
                f"(or run `newgrp {group}` in this shell).")
    if failure == errno.ECONNREFUSED:
        return (f"the agentcell system service is not running (nothing accepts on {path}). Ask an administrator "
                "to run `sudo systemctl start agentcell.socket` (`systemctl status agentcell` says why it stopped).")
    return (f"there is no agentcell server for you to use: no api_url or AGENTCELL_URL is set, no system service "
            f"listens on {path}, and the embedded server needs root. Ask an administrator to run "
            f"`sudo agentcell system install` and to add you to group '{GROUP}' (`sudo usermod -aG {GROUP} {user}`), "
            f"or point AGENTCELL_URL at a server you may use. Rootless mode cannot run here: {_rootless_problem()} "
            "(`agentcell doctor` says what this host offers).")


def _user() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def local_endpoint() -> Endpoint:
    """The system service's endpoint if this user can reach it; else the embedded server (root); else
    NoLocalServerError naming the fix. An AGENTCELL_SYSTEM_SOCKET that cannot be reached is an error for
    root too: it was asked for."""
    path = socket_path()
    failure = probe(path)
    if failure is None:
        return Endpoint("http://localhost", path)
    if _embedded_possible() and not os.environ.get(SOCKET_ENV):
        from agentcell.sdk.embedded import ensure_server

        if failure != errno.ENOENT and os.geteuid() != 0:  # a service is there but not for us: say so
            logging.getLogger("agentcell").warning("%s Running a rootless embedded server instead "
                                                   "(weaker limits: docs/rootless.md).", _problem(path, failure))
        return ensure_server()
    raise NoLocalServerError(_problem(path, failure))
