"""Kills a gvisor backend's sandboxes once its server is gone, whatever way it went.

The backend starts it with a pipe on stdin and keeps the other end; the kernel closes that end when
the server exits (or is killed), and the watchdog then kills every task in the instance's cgroups
(frozen ones thawed first: paused sandboxes would never notice their closed socket), removes the
cgroups, detaches the root tree and removes the state directory. Run as
``python -m agentcell.backends.gvisor.watchdog <cgroup rel> <state dir>``.
"""

from __future__ import annotations

import os
import subprocess
import sys

from agentcell.backends.gvisor import rootfs
from agentcell.backends.linux import watchdog


def main(rel: str, state: str) -> int:
    watchdog.wait_for_server()
    watchdog.clear(rel)
    rootfs.remove(os.path.join(state, "root"))
    subprocess.run(["rm", "-rf", "--one-file-system", state], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
