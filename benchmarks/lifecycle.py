"""Pause, resume and snapshot figures of a real server, next to the floor they are judged against.

    .venv/bin/python benchmarks/lifecycle.py [--runs 30] [--backend linux] [--disk-mib 20]

Rows (p50 / p95 over --runs):
* pause / resume (SDK -> server -> freezer), and pause -> resume -> first run_code result;
  baseline: the same sandbox's freezer cgroup written directly (cgroup v1 freezer.state, or v2 cgroup.freeze),
  the least a pause can cost here;
* pause(mode="filesystem") and the cold resume after it; create_snapshot(mode="filesystem") of a sandbox
  holding --disk-mib MiB in /home/user, the archive's size, and create-from-snapshot -> first result,
  next to a plain create -> first result;
* CPU used by --idle paused sandboxes over 5 s vs the same sandboxes running idle.
On a backend with memory snapshots (--backend gvisor): create_snapshot(mode="full"), restore -> first
result, fork of 8 (wall).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from agentcell import Sandbox

FREEZER_ROOTS = ("/sys/fs/cgroup/freezer/agentcell", "/sys/fs/cgroup/agentcell")


def percentiles(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return f"p50 {statistics.median(ms):8.2f} ms   p95 {p95:8.2f} ms   (n={len(ms)})"


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def start_server(args: argparse.Namespace, state_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentcell", "serve", "--port", str(port), "--egress-uplink", "none",
         "--backend", args.backend, "--standbys", "0", "--state-dir", state_dir, "--max-paused", "1000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code < 500:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start within 120 s")


def sandbox_cgroups(server_pid: int) -> set[str]:
    """The freezer cgroup directories of the server's sandboxes (v1 freezer hierarchy, or v2)."""
    out = set()
    for root in FREEZER_ROOTS:
        for inst in Path(root).glob(f"{server_pid}-*"):
            out |= {str(d) for d in inst.iterdir() if d.is_dir()}
        if out:
            break
    return out


def raw_freeze(cgroup: str, frozen: bool) -> None:
    v1 = Path(cgroup, "freezer.state")
    if v1.exists():
        v1.write_text("FROZEN" if frozen else "THAWED")
        while v1.read_text().strip() != ("FROZEN" if frozen else "THAWED"):
            time.sleep(0.0002)
        return
    Path(cgroup, "cgroup.freeze").write_text("1" if frozen else "0")
    while ("frozen 1" in Path(cgroup, "cgroup.events").read_text()) != frozen:
        time.sleep(0.0002)


def cpu_seconds(cgroups: set[str]) -> float:
    """CPU time the cgroups used so far (v1: the cpuacct twin of each freezer directory; v2: cpu.stat)."""
    total = 0.0
    for d in cgroups:
        acct = Path(d.replace("/freezer/", "/cpuacct/"), "cpuacct.usage")
        if acct.exists():
            total += int(acct.read_text()) / 1e9
            continue
        for line in Path(d, "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec"):
                total += int(line.split()[1]) / 1e6
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--backend", default="linux")
    ap.add_argument("--disk-mib", type=int, default=20)
    ap.add_argument("--idle", type=int, default=20)
    args = ap.parse_args()
    state_dir = tempfile.mkdtemp(prefix="agentcell-bench-state-")
    proc, url = start_server(args, state_dir)
    rows: list[tuple[str, str]] = []
    try:
        before = sandbox_cgroups(proc.pid)
        sbx = Sandbox.create(api_url=url, timeout=1800)
        sbx.run_code("import numpy as np; state = np.arange(10)")
        mine = sandbox_cgroups(proc.pid) - before
        pause, resume, first, raw_f, raw_t = [], [], [], [], []
        for _ in range(args.runs):
            pause.append(timed(sbx.pause))
            resume.append(timed(sbx.connect))
            sbx.pause()
            first.append(timed(lambda: (sbx.connect(), sbx.run_code("int(state.sum())"))))
            if len(mine) == 1:
                cg = next(iter(mine))
                raw_f.append(timed(lambda cg=cg: raw_freeze(cg, True)))
                raw_t.append(timed(lambda cg=cg: raw_freeze(cg, False)))
        rows += [("pause (SDK -> server -> freezer)", percentiles(pause)),
                 ("resume (SDK connect)", percentiles(resume)),
                 ("pause -> resume -> first result", percentiles(first))]
        if raw_f:
            rows += [("  baseline: freezer write alone, freeze", percentiles(raw_f)),
                     ("  baseline: freezer write alone, thaw", percentiles(raw_t))]

        # filesystem: pause without memory, snapshot, create from it
        sbx.commands.run(f"head -c {args.disk_mib << 20} /dev/urandom > /home/user/blob && mkdir -p /home/user/pkg "
                         "&& for i in $(seq 200); do echo $i > /home/user/pkg/f$i.py; done")
        fs_pause, fs_resume = [], []
        for _ in range(max(3, args.runs // 5)):
            fs_pause.append(timed(lambda: sbx.pause(mode="filesystem")))
            fs_resume.append(timed(lambda: (sbx.connect(), sbx.run_code("1"))))
        rows += [(f"pause(mode=filesystem), {args.disk_mib} MiB disk", percentiles(fs_pause)),
                 ("  its cold resume -> first result", percentiles(fs_resume))]
        snap_t, sizes, from_snap, plain = [], [], [], []
        for _ in range(max(3, args.runs // 5)):
            t = time.perf_counter()
            snap = sbx.create_snapshot(mode="filesystem")
            snap_t.append(time.perf_counter() - t)
            sizes.append(next(s.size_bytes for s in Sandbox.list_snapshots(api_url=url).next_items()
                              if s.snapshot_id == snap.snapshot_id) or 0)
            t = time.perf_counter()
            child = Sandbox.create(snap.snapshot_id, api_url=url)
            child.run_code("1")
            from_snap.append(time.perf_counter() - t)
            child.kill()
            t = time.perf_counter()
            fresh = Sandbox.create(api_url=url)
            fresh.run_code("1")
            plain.append(time.perf_counter() - t)
            fresh.kill()
            Sandbox.delete_snapshot(snap.snapshot_id, api_url=url)
        rows += [("create_snapshot(mode=filesystem)", percentiles(snap_t)),
                 ("  snapshot size", f"{statistics.median(sizes) / (1 << 20):8.1f} MiB"),
                 ("create from snapshot -> first result", percentiles(from_snap)),
                 ("  baseline: plain create -> first result (no standbys)", percentiles(plain))]

        if args.backend != "linux":
            full_t, restore, fork8 = [], [], []
            for _ in range(max(3, args.runs // 10)):
                t = time.perf_counter()
                snap = sbx.create_snapshot(mode="full")
                full_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                child = Sandbox.create(snap.snapshot_id, api_url=url)
                child.run_code("int(state.sum())")
                restore.append(time.perf_counter() - t)
                child.kill()
                Sandbox.delete_snapshot(snap.snapshot_id, api_url=url)
                t = time.perf_counter()
                forks = sbx.fork(count=8)
                fork8.append(time.perf_counter() - t)
                for f in forks:
                    if isinstance(f, Sandbox):
                        f.kill()
            rows += [("create_snapshot(mode=full)", percentiles(full_t)),
                     ("restore (create from full snapshot) -> first result", percentiles(restore)),
                     ("fork(count=8), wall", percentiles(fork8))]
        sbx.kill()

        # CPU of idle sandboxes: running vs paused
        before = sandbox_cgroups(proc.pid)
        idle = [Sandbox.create(api_url=url, timeout=600) for _ in range(args.idle)]
        cgs = sandbox_cgroups(proc.pid) - before
        time.sleep(2)
        c0 = cpu_seconds(cgs)
        time.sleep(5)
        running_cpu = cpu_seconds(cgs) - c0
        for s in idle:
            s.pause()
        c0 = cpu_seconds(cgs)
        time.sleep(5)
        paused_cpu = cpu_seconds(cgs) - c0
        rows += [(f"CPU of {args.idle} idle sandboxes over 5 s, running", f"{running_cpu * 1000:8.2f} ms"),
                 (f"CPU of {args.idle} idle sandboxes over 5 s, paused", f"{paused_cpu * 1000:8.2f} ms")]
        for s in idle:
            s.kill()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(state_dir, ignore_errors=True)
    width = max(len(r[0]) for r in rows)
    print(f"agentcell lifecycle, backend {args.backend}")
    for label, value in rows:
        print(f"{label:<{width}}  {value}")


if __name__ == "__main__":
    main()
