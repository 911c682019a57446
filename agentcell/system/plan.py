"""The steps of `agentcell system install` and `uninstall`, in order. Each step says what it changes
before it changes it; a dry run prints the same lines and changes nothing. Steps already done (a
package installed, the group there, the same unit file) are left out, so the install can be run again."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agentcell.system import host, units

UNIT_DIR = Path("/etc/systemd/system")


@dataclass(frozen=True)
class Step:
    """One change to the host: what it is (said first), the command or file that makes it."""

    says: str
    apply: Callable[[], None]
    detail: str = ""  # shown under `says` (a unit file's text, with --dry-run)


@dataclass
class InstallOptions:
    root: Path | None = None  # write the unit files under this directory only: no packages, group or systemctl
    packages: bool = True
    gvisor: bool = False
    group: str = units.GROUP
    users: Sequence[str] = ()  # added to the group
    python: str = field(default_factory=lambda: sys.executable)
    serve_args: Sequence[str] = ()  # more `agentcell serve` options for the unit's command line
    start: bool = True  # enable and start the socket where systemd runs


def _unit_dir(root: Path | None) -> Path:
    return root / UNIT_DIR.relative_to("/") if root is not None else UNIT_DIR


def _file_step(path: Path, text: str) -> Step | None:
    try:
        if path.read_text() == text:
            return None  # already this
    except OSError:
        pass
    return Step(f"write {path}", lambda: host.write_file(path, text), detail=text)


def install_steps(opts: InstallOptions) -> tuple[list[Step], list[str]]:
    """The steps, and notes on what is left to the operator (said at the end)."""
    steps: list[Step] = []
    notes: list[str] = []
    system = opts.root is None
    if system and opts.packages:
        wanted = [*host.BASE_PACKAGES, *(() if host.prebuilt_tracer() else host.BPF_BUILD_PACKAGES)]
        if not host.has_apt():
            notes.append(f"no apt here: install these yourself (or their equivalents): {' '.join(wanted)}"
                         + (f" {host.GVISOR_PACKAGE}" if opts.gvisor else ""))
        else:
            missing = host.missing_packages(tuple(wanted))
            if missing:
                steps.append(Step(f"install Debian packages: {' '.join(missing)}",
                                  lambda: (host.run(["apt-get", "update", "-qq"]),
                                           host.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                                                     *missing]))))
            if opts.gvisor and host.missing_packages((host.GVISOR_PACKAGE,)):
                suite = f"{host.codename()}-backports"
                if not host.backports_listed(suite):
                    text = host.backports_source(suite)
                    steps.append(Step(f"add the apt source {suite} ({host.BACKPORTS_SOURCE}; only runsc is taken "
                                      "from it)", lambda: host.write_file(host.BACKPORTS_SOURCE, text), detail=text))
                steps.append(Step(f"install runsc from {suite} (the gvisor backend)",
                                  lambda: (host.run(["apt-get", "update", "-qq"]),
                                           host.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                                                     f"{host.GVISOR_PACKAGE}/{suite}"]))))
    if system and not host.group_exists(opts.group):
        steps.append(Step(f"create the system group '{opts.group}' (its members may use the service)",
                          lambda: host.run(["groupadd", "--system", opts.group])))
    for user in opts.users if system else ():
        steps.append(Step(f"add user '{user}' to group '{opts.group}' (effective at their next login)",
                          lambda user=user: host.run(["usermod", "-aG", opts.group, user])))
    unit_dir = _unit_dir(opts.root)
    for name, text in ((units.SOCKET_UNIT, units.socket_unit(group=opts.group)),
                       (units.SERVICE_UNIT, units.service_unit(opts.python, opts.group, opts.serve_args))):
        step = _file_step(unit_dir / name, text)
        if step is not None:
            steps.append(step)
    if system and host.systemd_running():
        steps.append(Step("reload systemd's units (systemctl daemon-reload)",
                          lambda: host.run(["systemctl", "daemon-reload"])))
        if opts.start:
            steps.append(Step(f"enable and start {units.SOCKET_UNIT} (the service starts on its first connection)",
                              lambda: host.run(["systemctl", "enable", "--now", units.SOCKET_UNIT])))
    elif system:
        command = " ".join(units.service_command(opts.python, opts.group, opts.serve_args))
        notes.append(f"systemd is not running here (not PID 1): nothing enabled. Run the service yourself: {command}")
    else:
        notes.append(f"--root: only the unit files were written, under {opts.root}; no packages, group or systemctl")
    if not opts.users:
        notes.append(f"let a user in: sudo usermod -aG {opts.group} USER (then they log in again)")
    return steps, notes


def uninstall_steps(root: Path | None = None, group: str = units.GROUP, remove_group: bool = False) -> list[Step]:
    steps: list[Step] = []
    system = root is None
    if system and host.systemd_running():
        steps.append(Step(f"stop and disable {units.SERVICE_UNIT} and {units.SOCKET_UNIT} (their sandboxes are killed)",
                          lambda: host.run(["systemctl", "disable", "--now", units.SOCKET_UNIT, units.SERVICE_UNIT])))
    for name in (units.SOCKET_UNIT, units.SERVICE_UNIT):
        path = _unit_dir(root) / name
        if path.exists():
            steps.append(Step(f"remove {path}", path.unlink))
    if system and host.systemd_running():
        steps.append(Step("reload systemd's units (systemctl daemon-reload)",
                          lambda: host.run(["systemctl", "daemon-reload"])))
    if system and remove_group and host.group_exists(group):
        steps.append(Step(f"remove the group '{group}'", lambda: host.run(["groupdel", group])))
    return steps


def carry_out(steps: list[Step], dry_run: bool, say: Callable[[str], None], show_detail: bool = False) -> None:
    """Say each step, then make it (unless dry_run)."""
    for step in steps:
        say(("would " if dry_run else "") + step.says)
        if step.detail and (dry_run or show_detail):
            say("    " + step.detail.rstrip("\n").replace("\n", "\n    "))
        if not dry_run:
            step.apply()
