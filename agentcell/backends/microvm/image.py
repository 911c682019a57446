"""The guest's root filesystem: one read-only squashfs image of the tree every gvisor sandbox gets.

The tree is gvisor/rootfs.py's (the host's /usr read-only, the runtime store at its neutral paths, a
generated /etc), built in a private mount namespace and packed with mksquashfs (lz4: fast to read under
emulation). Every VM reads the same file through the host's page cache, so it costs its memory once;
each sandbox's writes go to its own copy-on-write disk in the guest (initramfs.py).

Images are content-addressed, like the runtime store they are made from, and shared by every server of
the host in IMAGE_DIR: nothing of a tenant's is in them. A server holds a shared lock on the image it
uses; a build removes the images no server holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time

from agentcell.backends.linux import runtime_store

IMAGE_DIR = "/var/lib/agentcell/microvm-images"
FORMAT = 1  # bump when the tree's shape changes


def key(store: runtime_store.Store) -> str:
    """What the image holds: the runtime store's parts (their names are content hashes), the host's
    packages (dpkg's status), the tree's code."""
    h = hashlib.sha256(json.dumps([FORMAT, sorted(map(list, store.mounts))]).encode())
    for path in ("/var/lib/dpkg/status",):
        with contextlib.suppress(OSError):
            st = os.stat(path)
            h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


class Image:
    """A built image, held (shared flock) for as long as this object is open."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(self.fd, fcntl.LOCK_SH)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def ensure(store: runtime_store.Store, log: bool = True, directory: str = IMAGE_DIR) -> Image:
    """The image for `store`, built now if no server built it before (a minute or two: mksquashfs)."""
    os.makedirs(directory, mode=0o755, exist_ok=True)
    path = os.path.join(directory, f"root-{key(store)}.sqfs")
    lock = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            t0 = time.monotonic()
            _build(path)
            if log:
                print(f"agentcell: microvm root image built in {time.monotonic() - t0:.0f} s "
                      f"({os.path.getsize(path) >> 20} MiB): {path}", file=sys.stderr)
            _remove_unused(directory, keep=path)
        return Image(path)
    finally:
        os.close(lock)


def _build(path: str) -> None:
    tmp = path + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    import tempfile

    import agentcell

    root = tempfile.mkdtemp(prefix="agentcell-vmroot-")
    # the child packs the agentcell this process runs (-P: not the cwd's; an editable install's finder
    # would otherwise give it another checkout's, whose store parts the image's key does not name)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(agentcell.__file__)))}
    try:  # the tree's mounts exist only in this child's private mount namespace, gone with it
        subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-s", "-P", "-m",
                        "agentcell.backends.microvm.image", "build", root, tmp], check=True, env=env)
    finally:
        os.rmdir(root)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _remove_unused(directory: str, keep: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if path == keep or not name.startswith("root-"):
            continue
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no server holds it
        except BlockingIOError:
            continue
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _build_here(root: str, dest: str) -> None:
    """In the private mount namespace: the tree at `root`, packed into `dest`."""
    from agentcell.backends.gvisor import rootfs

    store = runtime_store.ensure()
    rootfs.build(root, store)
    subprocess.run(["mksquashfs", root, dest, "-comp", "lz4", "-noappend", "-quiet", "-no-progress",
                    "-no-xattrs", "-no-exports"], check=True, stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "build":
        _build_here(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m agentcell.backends.microvm.image build ROOT DEST")
