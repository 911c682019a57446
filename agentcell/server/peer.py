"""Who is at the other end of a unix-socket connection: the kernel's SO_PEERCRED.

The system service (docs/system-service.md) tells its users apart by the uid the kernel reports for
the process that connected, not by anything the request says. The protocol (http_protocol.py) reads it
once per connection and puts it into every request's scope under PEER_EXTENSION.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Any

PEER_EXTENSION = "agentcell.peer"
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class PeerCredentials:
    """The connecting process's pid, uid and gid, as the kernel saw them at connect()."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket | None) -> PeerCredentials | None:
    """The credentials of a unix-socket peer; None for any other socket (TCP has no such thing)."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    return PeerCredentials(*_UCRED.unpack(raw))


def request_peer(scope: dict[str, Any]) -> PeerCredentials | None:
    """The peer of the connection a request came on (None: not a unix socket)."""
    peer = scope.get("extensions", {}).get(PEER_EXTENSION)
    return peer if isinstance(peer, PeerCredentials) else None
