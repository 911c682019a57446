"""`agentcell serve --rootless` (the default for a user who is not root): re-execute the same command
inside a user namespace the user owns (backends/linux/userns.py), then, inside, turn the options a
rootless server cannot honour into what it can (rootless.py, docs/rootless.md)."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from agentcell import rootless

ROOT_STATE_DIR = "/var/lib/agentcell"  # serve's --state-dir default: root's


def reexec_if_needed(flag: bool | None) -> None:
    """Outside the namespace: exec this `agentcell serve` inside one if rootless mode is asked for
    (`flag`) or, by default, if this user is not root. Returns only when the server runs as it is."""
    if rootless.active():
        return
    if flag is None:
        flag = rootless.wanted()
    if not flag:
        return
    if os.geteuid() == 0:
        raise click.ClickException("--rootless is for ordinary users; root runs the full server (leave it out)")
    from agentcell.backends.linux import cgroup_delegation, cgroups, userns
    from agentcell.runtime import statedir

    try:
        # checked here, as the real user: inside, host root's directories show as the overflow id
        for path in (rootless.runtime_store_dir(), rootless.uid_lock_dir()):
            statedir.private_dir(path)
        argv = [sys.executable, "-m", "agentcell", "serve", *_serve_args()]
        # this process stays outside as the server's parent (userns._relay): its pid is the server's for the user
        env = {**os.environ, rootless.ENV: "1", rootless.OUTSIDE_PID_ENV: str(os.getpid())}
        env.pop(cgroups.DELEGATED_ENV, None)  # only ever what the check below found
        env.update(cgroup_delegation.launch_env())  # a delegated cgroup v2 directory: entered from here
        click.echo("agentcell: rootless mode (you are not root): sandboxes run in a user namespace of yours, with "
                   "weaker limits; `agentcell doctor` lists what holds", err=True)
        userns.exec_inside(argv, env)
    except userns.RootlessUnavailableError as e:
        raise click.ClickException(f"{e}. Or run the server as root, or use the system service if one is installed "
                                   "(`agentcell doctor` checks this host)") from None
    except statedir.UnsafeDirectoryError as e:
        raise click.ClickException(str(e)) from None


def adjust(opts: dict[str, Any]) -> None:
    """Inside the namespace: what this server cannot do is turned off, loudly where it was asked for."""
    if not rootless.active():
        if opts["egress_uplink"] == "usermode":
            raise click.ClickException("--egress-uplink usermode is rootless mode's uplink: root uses host or netns:PATH")
        return
    if opts["state_dir"] == ROOT_STATE_DIR:
        opts["state_dir"] = rootless.default_state_dir()
    _choose_uplink(opts)
    opts["host_sysctls"] = False  # an ordinary user cannot raise them: said in the log as NOT PROTECTED
    for other in ("gvisor",):
        if opts["backend"] == other or any(b == other for b in opts["create_backends"]):
            raise click.ClickException("rootless mode runs the linux backend only")


def _choose_uplink(opts: dict[str, Any]) -> None:
    """host (the default) becomes user-mode networking where it can run (network/usermode.py), none where not."""
    from agentcell.network import usermode

    uplink = opts["egress_uplink"]
    if uplink == "none":
        return
    if uplink not in ("host", "usermode"):
        raise click.ClickException("rootless mode's uplink is user-mode networking: --egress-uplink usermode (or none)")
    reason = usermode.unavailable_reason()
    if reason is None:
        opts["egress_uplink"] = "usermode"
        click.echo("agentcell: rootless mode: sandboxes reach the internet through user-mode networking "
                   f"({usermode.TOOL}), under the same egress policy as a root server's", err=True)
    elif uplink == "usermode":
        raise click.ClickException(f"--egress-uplink usermode: {reason}")
    else:
        click.echo(f"agentcell: rootless mode: sandboxes get no internet: {reason}", err=True)
        opts["egress_uplink"] = "none"


def _serve_args() -> list[str]:
    """This process's serve options: after `serve` (`agentcell serve ...`, `python -m agentcell serve ...`),
    or all of them (`python -m agentcell.server ...`)."""
    args = sys.argv[1:]
    return args[1:] if args[:1] == ["serve"] else args
