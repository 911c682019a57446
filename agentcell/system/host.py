"""What `agentcell system install` reads of the host (packages, the group, systemd) and the commands that
change it. Debian/Ubuntu only (apt); elsewhere the packages are listed for the operator to install."""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
from pathlib import Path

import agentcell

# What pip cannot bring (scripts/setup has the same list for a development checkout).
BASE_PACKAGES = (
    "libseccomp2",      # every sandbox's syscall filter (pyseccomp loads it)
    "nftables",         # the sandboxes' network fences and egress
    "iproute2",         # veth pairs and network namespaces
    "procps", "util-linux", "ca-certificates",
    "libbpf1",          # loads the behaviour record's kernel tracer
    "nodejs",           # JavaScript/TypeScript code contexts
    "skopeo",           # template imports from OCI registries, layouts and docker-archive tarballs
    "zstd",             # their zstd-compressed layers
)
BPF_BUILD_PACKAGES = ("clang", "libbpf-dev", "linux-libc-dev")  # to compile the tracer when no object is shipped
GVISOR_PACKAGE = "runsc"  # `--backend gvisor`: from bookworm-backports (bookworm's own is too old)
BACKPORTS_SOURCE = Path("/etc/apt/sources.list.d/agentcell-backports.sources")


class HostError(RuntimeError):
    """A change to the host failed; the message says which and how."""


def prebuilt_tracer() -> bool:
    """Whether the installed package ships the compiled kernel tracer (then no clang is needed)."""
    package = Path(agentcell.__file__).parent
    return any(package.glob("record/linux/bpf/*.bpf.o")) or any(package.glob("record/linux/bpf/*.o"))


def has_apt() -> bool:
    return shutil.which("apt-get") is not None and shutil.which("dpkg-query") is not None


def missing_packages(names: tuple[str, ...]) -> list[str]:
    """The packages of `names` dpkg does not have installed (a node on PATH counts as nodejs)."""
    missing = []
    for name in names:
        if name == "nodejs" and shutil.which("node"):
            continue
        done = subprocess.run(["dpkg-query", "-W", "-f=${Status}", name], capture_output=True, text=True)
        if done.returncode != 0 or "install ok installed" not in done.stdout:
            missing.append(name)
    return missing


def codename() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                return line.partition("=")[2].strip().strip('"') or "bookworm"
    except OSError:
        pass
    return "bookworm"


def backports_listed(suite: str) -> bool:
    sources = [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
    for path in sources:
        try:
            if suite in path.read_text():
                return True
        except OSError:
            continue
    return False


def backports_source(suite: str) -> str:
    return (f"Types: deb\nURIs: http://deb.debian.org/debian\nSuites: {suite}\nComponents: main\n"
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")


def group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def systemd_running() -> bool:
    """systemd is PID 1 (sd_booted(3)): only then can units be enabled and started."""
    return os.path.isdir("/run/systemd/system")


def run(argv: list[str]) -> None:
    """Run one command, its output going to the operator's terminal; HostError if it fails."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        done = subprocess.run(argv, env=env)
    except FileNotFoundError:
        raise HostError(f"`{argv[0]}` is not on this machine: run `{' '.join(argv)}` by other means") from None
    if done.returncode != 0:
        raise HostError(f"`{' '.join(argv)}` failed (exit {done.returncode}); fix that and run the install again "
                        "(every step it already made is skipped)")


def write_file(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
