"""Loaded by every Python process of the integration tests (PYTHONPATH): refuses, and writes down in
$AGENTCELL_NET_GUARD, any connection or name lookup that is not of this machine's loopback, so a
framework that phones home (a model API, telemetry, a model hub) fails the test instead of leaving."""

import ipaddress
import os
import sys

_LOG = os.environ.get("AGENTCELL_NET_GUARD")


def _local(host: object) -> bool:
    if host is None or isinstance(host, bytes | bytearray):
        host = host.decode() if host else None
    if host in (None, "", "localhost"):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return str(host).endswith(".localhost")


def _guard(event: str, args: tuple) -> None:
    if event == "socket.getaddrinfo":
        host = args[0]
    elif event in ("socket.connect", "socket.sendto"):
        address = args[1]
        if not isinstance(address, tuple):  # a unix socket
            return
        host = address[0]
    else:
        return
    if _local(host):
        return
    with open(_LOG, "a") as log:
        log.write(f"{os.getpid()} {sys.argv[0]} {event} {host!r}\n")
    raise ConnectionRefusedError(f"the integration tests' network guard refused {event} to {host!r}")


if _LOG:
    sys.addaudithook(_guard)
