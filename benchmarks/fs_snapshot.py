"""Filesystem snapshots of the linux backend: export and create-from-archive (needs root, like the server).

    .venv/bin/python benchmarks/fs_snapshot.py [--runs 5] [--home-mb 20] [--files 2000]

One sandbox (the probe agent: only the backend is measured) gets `--home-mb` of random data in
/home/user and a pip-installed-like tree (`--files` small files of 200 B - 8 KiB in 100 directories of
the venv's site-packages, through its overlay). Printed, p50 (min-max) over `--runs`:

* export: pause, LinuxBackend.export_files (the walk, in a thread), resume; and the archive's size;
* create from the archive (SandboxSpec.files: prepared on the request's path, extracted by the child);
* plain create on the same path (an explicit sandbox id: no standby), and a standby's claim.

All traffic stays on unix sockets; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentcell.backends import disk_archive  # noqa: E402
from agentcell.backends.base import Limits, SandboxSpec  # noqa: E402
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox  # noqa: E402
from agentcell.runtime.protocol import AgentChannel  # noqa: E402

PROBE = "agentcell.backends.linux.probe:serve"
TREE = """
import os, random, sysconfig
random.seed(1)
root = os.path.join(sysconfig.get_paths()["purelib"], "fakepkg")
for i in range({files}):
    d = os.path.join(root, f"mod{{i % 100}}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"f{{i}}.py"), "wb") as f:
        f.write(os.urandom(random.randint(200, 8192)))
"""


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} ms  ({min(values):.1f}-{max(values):.1f})"


async def run(channel: AgentChannel, *argv: str) -> str:
    h = (await channel.call("exec", argv=list(argv), timeout=120)).header
    if h["exit_code"] != 0:
        raise RuntimeError(f"{argv}: {h['stderr']}")
    return h["stdout"]


async def main(args: argparse.Namespace) -> None:
    disk_mb = max(256, args.home_mb * 3 + 64)
    limits = Limits(memory_mb=disk_mb + 256, disk_mb=disk_mb)
    be = LinuxBackend(entry_point=PROBE, max_sandboxes=50, standbys=2, standby_limits=limits)
    await be.start()
    work = Path(tempfile.mkdtemp(prefix="fs-snapshot-"))
    try:
        src = await be.create(SandboxSpec(limits=limits))
        assert isinstance(src, LinuxSandbox)
        channel = await AgentChannel.open(src.sock)
        await run(channel, "sh", "-c", f"head -c {args.home_mb << 20} /dev/urandom > ~/data.bin")
        await run(channel, "python3", "-c", TREE.format(files=args.files))
        archive = work / "disk.tar"
        exports = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            await be.pause(src)
            size = await be.export_files(src, str(archive), 1 << 40)
            await be.resume(src)
            exports.append((time.perf_counter() - t0) * 1000)
        with archive.open("rb") as f:
            summary = disk_archive.summary(f)
        await channel.close()
        await be.kill(src)
        print(f"archive: {size / (1 << 20):.1f} MiB, entries {summary['entries']}, "
              f"{summary['file_bytes'] / (1 << 20):.1f} MiB of file data")
        print(f"export (pause + walk + resume): {fmt(exports)}  = "
              f"{size / (1 << 20) / (statistics.median(exports) / 1000):.0f} MiB/s")

        async def timed(spec: SandboxSpec) -> float:
            t0 = time.perf_counter()
            sb = await be.create(spec)
            ms = (time.perf_counter() - t0) * 1000
            if spec.files:  # the files are really there
                channel = await AgentChannel.open(sb.sock)
                out = await run(channel, "sh", "-c", "stat -c %s ~/data.bin")
                assert int(out) == args.home_mb << 20, out
                await channel.close()
            await be.kill(sb)
            await asyncio.sleep(0.3)  # let the pool refill off the measured path
            return ms

        from_archive = [await timed(SandboxSpec(f"a{uuid.uuid4().hex[:12]}", limits=limits, files=str(archive)))
                        for _ in range(args.runs)]
        plain = [await timed(SandboxSpec(f"p{uuid.uuid4().hex[:12]}", limits=limits)) for _ in range(args.runs)]
        claims = [await timed(SandboxSpec(limits=limits)) for _ in range(args.runs)]
        print(f"create from the archive:        {fmt(from_archive)}")
        print(f"plain create (prepared for it): {fmt(plain)}")
        print(f"standby claim:                  {fmt(claims)}")
    finally:
        await be.close()
        for p in work.iterdir():
            p.unlink()
        work.rmdir()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--home-mb", type=int, default=20)
    parser.add_argument("--files", type=int, default=2000)
    if os.geteuid() != 0:
        sys.exit("run as root (the linux backend creates namespaces and cgroups)")
    asyncio.run(main(parser.parse_args()))
