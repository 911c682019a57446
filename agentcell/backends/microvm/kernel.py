"""The guest kernel: Debian's cloud kernel, unpacked from its package into a directory of agentcell's.

The package is never installed on the host (it would add a host kernel, initramfs hooks and a boot
entry): `scripts/setup` (or `python -m agentcell.backends.microvm.kernel install`) downloads
linux-image-*-cloud-amd64 with apt and unpacks only `vmlinuz` and the modules the guest loads
(initramfs.MODULES) into KERNEL_DIR/<version>/, with KERNEL_DIR/current naming the one in use.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from agentcell.backends.microvm import initramfs

KERNEL_DIR = "/var/lib/agentcell/microvm-kernel"
PACKAGE = "linux-image-cloud-amd64"


@dataclass(frozen=True)
class GuestKernel:
    version: str
    vmlinuz: str
    modules: str  # the lib/modules/<version> directory


class KernelMissingError(Exception):
    pass


def find(base: str | None = None) -> GuestKernel:
    base = base or os.environ.get("AGENTCELL_MICROVM_KERNEL") or KERNEL_DIR
    current = os.path.join(base, "current")
    if not os.path.isdir(current):
        raise KernelMissingError(
            f"no guest kernel in {base}: run `python -m agentcell.backends.microvm.kernel install` as root "
            f"(it unpacks Debian's {PACKAGE} there without installing it), or scripts/setup")
    version = os.path.basename(os.path.realpath(current))
    kernel = GuestKernel(version, os.path.join(current, "vmlinuz"), os.path.join(current, "modules"))
    for rel in initramfs.MODULES:
        if not os.path.exists(os.path.join(kernel.modules, rel)):
            raise KernelMissingError(f"the guest kernel in {current} lacks {rel}: install it again")
    return kernel


def install(base: str = KERNEL_DIR) -> GuestKernel:
    """Download Debian's cloud kernel package and unpack what the guest needs under `base`."""
    with tempfile.TemporaryDirectory() as tmp:
        meta = subprocess.run(["apt-cache", "depends", PACKAGE], capture_output=True, text=True, check=True).stdout
        image = next(line.split()[-1] for line in meta.splitlines() if "Depends: linux-image-" in line)
        subprocess.run(["apt-get", "download", image], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        deb = glob.glob(os.path.join(tmp, "*.deb"))[0]
        unpacked = os.path.join(tmp, "x")
        subprocess.run(["dpkg-deb", "-x", deb, unpacked], check=True)
        vmlinuz = glob.glob(os.path.join(unpacked, "boot", "vmlinuz-*"))[0]
        version = os.path.basename(vmlinuz)[len("vmlinuz-"):]
        dest = os.path.join(base, version)
        staging = dest + ".tmp"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging, mode=0o755)
        shutil.copy2(vmlinuz, os.path.join(staging, "vmlinuz"))
        src_modules = os.path.join(unpacked, "lib", "modules", version)
        for rel in initramfs.MODULES:
            os.makedirs(os.path.dirname(os.path.join(staging, "modules", rel)), exist_ok=True)
            shutil.copy2(os.path.join(src_modules, rel), os.path.join(staging, "modules", rel))
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(staging, dest)
    link = os.path.join(base, "current.tmp")
    with __import__("contextlib").suppress(FileNotFoundError):
        os.unlink(link)
    os.symlink(version, link)
    os.replace(link, os.path.join(base, "current"))
    return find(base)


if __name__ == "__main__":
    if sys.argv[1:] == ["install"]:
        k = install()
        print(f"guest kernel {k.version} in {os.path.dirname(k.vmlinuz)}")
    else:
        print("usage: python -m agentcell.backends.microvm.kernel install", file=sys.stderr)
        sys.exit(2)
