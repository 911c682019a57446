"""The guest's initramfs: busybox, the kernel modules the guest needs, and an /init that mounts the root.

Debian's cloud kernel builds virtio, squashfs and overlayfs as modules, so the first userspace is a
small cpio (newc) made here, not by initramfs-tools: /init loads the modules in a fixed order (the
package ships no modules.dep), mounts the read-only root image (/dev/vda, squashfs) under a
copy-on-write tmpfs (overlayfs; the tmpfs is the sandbox's disk, sized by the disk limit in guest.py)
and switches to the root's agentcell guest init (guest.py).
"""

from __future__ import annotations

import gzip
import io
import os
import stat

# load order: each after what it needs (virtio uses virtio_ring's virtio_break_device)
MODULES = (
    "kernel/drivers/virtio/virtio_ring.ko",
    "kernel/drivers/virtio/virtio.ko",
    "kernel/drivers/virtio/virtio_mmio.ko",
    "kernel/net/core/failover.ko",  # virtio_net needs net_failover, which needs failover
    "kernel/drivers/net/net_failover.ko",
    "kernel/drivers/net/virtio_net.ko",
    "kernel/drivers/block/virtio_blk.ko",
    "kernel/drivers/char/virtio_console.ko",
    "kernel/drivers/char/hw_random/virtio-rng.ko",
    "kernel/drivers/virtio/virtio_balloon.ko",
    "kernel/fs/squashfs/squashfs.ko",
    "kernel/fs/overlayfs/overlay.ko",
)

BUSYBOX = "/bin/busybox"  # Debian's busybox-static (a static binary: the initramfs has no libc)

# Runs as pid 1 in the initramfs. The root image is read-only; everything the sandbox writes goes to
# the tmpfs under the overlay. A failure powers the VM off: the host sees the VMM exit, never a shell.
INIT = """#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /lower /upper /newroot
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox mount -t proc proc /proc
for m in /modules/*.ko; do /bin/busybox insmod "$m" || { echo "agentcell-init: insmod $m failed"; /bin/busybox dmesg | /bin/busybox tail -5; /bin/busybox poweroff -f; }; done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 500 ]; do /bin/busybox usleep 2000; i=$((i+1)); done
/bin/busybox mount -t squashfs -o ro /dev/vda /lower || { echo "agentcell-init: no root image"; /bin/busybox poweroff -f; }
/bin/busybox mount -t tmpfs -o mode=0755,size=__DISK__ disk /upper
/bin/busybox mkdir -p /upper/root /upper/work
/bin/busybox mount -t overlay -o lowerdir=/lower,upperdir=/upper/root,workdir=/upper/work,redirect_dir=off,index=off overlay /newroot || /bin/busybox poweroff -f
/bin/busybox mkdir -p /newroot/run/agentcell-disk
/bin/busybox mount --move /upper /newroot/run/agentcell-disk
/bin/busybox umount /proc
/bin/busybox mount --move /dev /newroot/dev
exec /bin/busybox switch_root /newroot __PYTHON__ -s -P -m agentcell.backends.microvm.guest
"""


def _entry(out: io.BytesIO, ino: int, name: str, mode: int, data: bytes = b"") -> None:
    """One newc record (the kernel's initramfs format: ASCII hex fields, 4-byte alignment)."""
    encoded = name.encode() + b"\0"
    fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
    out.write(b"070701" + b"".join(b"%08X" % v for v in fields) + encoded)
    out.write(b"\0" * (-(110 + len(encoded)) % 4))
    out.write(data)
    out.write(b"\0" * (-len(data) % 4))


def build(modules_dir: str, python: str, dest: str, disk: str = "__DISK__") -> None:
    """Write the gzipped initramfs to `dest`: /init runs `python -m agentcell.backends.microvm.guest` in
    the root. `disk` stays a placeholder by default: the disk's size is set per sandbox at its claim
    (a remount), so one initramfs serves every sandbox of a backend."""
    out = io.BytesIO()
    ino = 1
    for directory in ("bin", "modules", "dev", "proc", "sys"):
        _entry(out, ino, directory, stat.S_IFDIR | 0o755)
        ino += 1
    with open(BUSYBOX, "rb") as f:
        _entry(out, ino, "bin/busybox", stat.S_IFREG | 0o755, f.read())
    ino += 1
    for i, rel in enumerate(MODULES):
        with open(os.path.join(modules_dir, rel), "rb") as f:
            _entry(out, ino, f"modules/{i:02d}-{os.path.basename(rel)}", stat.S_IFREG | 0o644, f.read())
        ino += 1
    script = INIT.replace("__PYTHON__", python).replace("__DISK__", disk if disk != "__DISK__" else "64m")
    _entry(out, ino, "init", stat.S_IFREG | 0o755, script.encode())
    _entry(out, 0, "TRAILER!!!", 0)
    tmp = dest + ".tmp"
    with open(tmp, "wb") as f:
        f.write(gzip.compress(out.getvalue(), compresslevel=1))
    os.replace(tmp, dest)
