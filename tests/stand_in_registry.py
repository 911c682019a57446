"""A loopback registry serving a stand-in for the Docker Hub images E2B's template tests build from
(`ubuntu:22.04`), for `scripts/compat-suites python-templates` with `serve --registry-mirror
docker.io=<this registry>`: nothing reaches Docker Hub.

The stand-in is not Ubuntu: one layer of this host's static busybox (sh, ls, cat, whoami, ln,
readlink, sleep ...) with /bin -> usr/bin, an /etc/passwd with root and user (1000), and /home/user.
It is what those tests run (`ls -l`, `whoami`, `cat`, `ln -s`, `readlink`, `sleep`).

    python -m tests.stand_in_registry DIR     starts the registry, prints its address, runs until killed
"""

from __future__ import annotations

import signal
import sys
import tarfile
from pathlib import Path

from tests.oci_images import Registry, entry, tar_bytes, write_layout

APPLETS = ("sh", "ls", "cat", "whoami", "ln", "readlink", "sleep", "echo", "test", "id", "rm", "mv",
           "mkdir", "env", "true", "false", "pwd", "touch", "chmod", "grep", "head", "tail")
STAND_INS = ("library/ubuntu:22.04", "library/ubuntu:latest")


def busybox_layer() -> bytes:
    passwd = b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"
    return tar_bytes([
        entry("usr/", tarfile.DIRTYPE, mode=0o755),
        entry("usr/bin/", tarfile.DIRTYPE, mode=0o755),
        entry("usr/bin/busybox", data=Path("/bin/busybox").read_bytes(), mode=0o755),
        *[entry(f"usr/bin/{a}", tarfile.SYMTYPE, linkname="busybox") for a in APPLETS],
        entry("bin", tarfile.SYMTYPE, linkname="usr/bin"),
        entry("etc/", tarfile.DIRTYPE, mode=0o755),
        entry("etc/passwd", data=passwd),
        entry("etc/group", data=b"root:x:0:\nuser:x:1000:\n"),
        entry("root/", tarfile.DIRTYPE, mode=0o700),
        entry("tmp/", tarfile.DIRTYPE, mode=0o1777),
        entry("home/", tarfile.DIRTYPE, mode=0o755),
        entry("home/user/", tarfile.DIRTYPE, mode=0o755, uid=1000, gid=1000),
    ])


def start(root: Path) -> Registry:
    write_layout(root / "layout", [busybox_layer()], tag="stand-in",
                 config={"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]})
    reg = Registry(root / "registry")
    for name in STAND_INS:
        reg.push(f"oci:{root / 'layout'}:stand-in", name)
    return reg


def main() -> None:
    root = Path(sys.argv[1])
    root.mkdir(parents=True, exist_ok=True)
    reg = start(root)
    print(reg.address, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (reg.stop(), sys.exit(0)))
    reg.proc.wait()


if __name__ == "__main__":
    main()
