"""The systemd units of the system service: a socket unit (root:agentcell 0660, so the group is the access
control, as with Docker's socket) and the service it activates (`agentcell serve --system`)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

SOCKET_UNIT = "agentcell.socket"
SERVICE_UNIT = "agentcell.service"
GROUP = "agentcell"
SOCKET_PATH = "/run/agentcell/agentcell.sock"


def socket_unit(socket_path: str = SOCKET_PATH, group: str = GROUP) -> str:
    return f"""# Written by `agentcell system install`; `agentcell system uninstall` removes it.
[Unit]
Description=agentcell sandbox service socket (members of group {group} may connect)
PartOf={SERVICE_UNIT}

[Socket]
ListenStream={socket_path}
SocketUser=root
SocketGroup={group}
SocketMode=0660
DirectoryMode=0755
RemoveOnStop=yes

[Install]
WantedBy=sockets.target
"""


def service_command(python: str, group: str = GROUP, extra: Sequence[str] = ()) -> list[str]:
    """The server the unit runs; the tests run this very command line (systemd is not PID 1 there)."""
    return [python, "-m", "agentcell", "serve", "--system", "--socket-group", group, *extra]


def service_unit(python: str, group: str = GROUP, extra: Sequence[str] = ()) -> str:
    command = shlex.join(service_command(python, group, extra))
    return f"""# Written by `agentcell system install`; `agentcell system uninstall` removes it.
[Unit]
Description=agentcell sandbox service (E2B-compatible sandboxes for the users of group {group})
Requires={SOCKET_UNIT}
After={SOCKET_UNIT} network-online.target
Wants=network-online.target

[Service]
Type=simple
ExecStart={command}
Environment=PYTHONUNBUFFERED=1
# SIGTERM to the server alone: it kills its sandboxes itself, then exits
KillMode=mixed
TimeoutStopSec=60
# the server makes each sandbox's cgroup and moves its processes there
Delegate=yes
LimitNOFILE=1048576
Restart=on-failure
RestartSec=2

[Install]
WantedBy=multi-user.target
Also={SOCKET_UNIT}
"""
