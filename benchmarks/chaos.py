"""Chaos: scripted faults against real servers, each with an assertion of what survives.

    .venv/bin/python benchmarks/chaos.py                     # every fault
    .venv/bin/python benchmarks/chaos.py --only server-kill9,zygote-kill9
    .venv/bin/python benchmarks/chaos.py --list

Each fault starts its own server(s) on a fresh state dir, sets up what must survive, injects the fault,
and checks what is left: what the users see (sandboxes, snapshots, volumes, records) and what the host
holds (benchmarks/census.py: processes, cgroups, namespaces, mounts, nft state, uids), which must be back
at the baseline taken before the fault's first server started, once its last server stops. A fault prints
PASS or FAIL with its figures; the exit status is 1 when one failed. Nothing leaves the machine (the egress
uplink is a namespace with no route anywhere, see soak.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import census
import httpx
import lose_unsynced
from soak import Server, routeless_uplink, start_gateway, start_server

from agentcell import Sandbox
from agentcell.sdk.volume import Volume

# --- what the faults share ------------------------------------------------------------------------------


class Failed(AssertionError):
    pass


@dataclass
class Fault:
    name: str
    work: Path
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    items: dict[str, set[str]] = field(default_factory=dict)  # what the baseline's counts counted

    def note(self, text: str) -> None:
        self.lines.append(text)
        print(f"  {text}", flush=True)

    def check(self, condition: bool, what: str) -> bool:
        if not condition:
            self.failures.append(what)
            print(f"  FAILED: {what}", flush=True)
        return condition


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_tree(root: int) -> dict[int, int | None]:
    """The server's processes as {pid: start time}: a pid reused later is not mistaken for one of them."""
    return {pid: _start_ticks(pid) for pid in census.descendants(root, census._pids())}


def still_alive(tree: dict[int, int | None]) -> list[int]:
    """Those of `tree` still running (a zombie is dead: only its parent's wait is missing)."""
    return [pid for pid, start in tree.items()
            if start is not None and _start_ticks(pid) == start and not census.zombie(pid)]


def wait_until(condition: Callable[[], bool], timeout: float, step: float = 0.2) -> float | None:
    """Seconds until `condition` held, or None if it did not within `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if condition():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def cgroup_dirs_of(instance_prefix: str) -> list[str]:
    """The directories named agentcell/<instance_prefix>* in every cgroup hierarchy."""
    found = []
    for root in census._cgroup_roots():
        top = root / "agentcell"
        with contextlib.suppress(OSError):
            found += [str(d) for d in top.iterdir() if d.is_dir() and d.name.startswith(instance_prefix)]
    return found


def back_to_baseline(fault: Fault, baseline: dict[str, int], timeout: float = 60) -> None:
    ignore = {"host_procs", "uid_locks"}  # a dead server's unlocked range file stays (harmless, reused)
    now: dict[str, int] = {}

    def settled() -> bool:
        nonlocal now
        now = census.census()
        return not census.differences(baseline, now, ignore)

    took = wait_until(settled, timeout, step=2)
    if took is None:  # name what is left over, and who holds it (another server on this host, or a leak)
        extra = census.new_items(fault.items, census.items())
        fault.check(False, f"host counts back at baseline: {census.differences(baseline, now, ignore)}; "
                           f"new since the baseline: {extra}")
    else:
        fault.note(f"host counts back at baseline ({len(baseline)} counts) after the last server stopped")


def take_baseline(fault: Fault) -> dict[str, int]:
    fault.items = census.items()
    return census.census()


@contextlib.contextmanager
def server(fault: Fault, name: str, state: Path, uplink: list[str], *extra: str, standbys: int = 2) -> Iterator[Server]:
    srv = start_server(name, fault.work, "linux", standbys, 60, [*uplink, *extra], state_dir=state)
    try:
        t0 = time.monotonic()
        srv.wait_ready()
        fault.note(f"{name} answered {time.monotonic() - t0:.1f} s after its start")
        yield srv
    finally:
        srv.stop()


def sandbox_gone(url: str, sandbox_id: str) -> tuple[int, str]:
    r = httpx.get(f"{url}/sandboxes/{sandbox_id}", timeout=30)
    return r.status_code, r.text


# --- the faults -----------------------------------------------------------------------------------------


def server_kill9(fault: Fault, uplink: list[str]) -> None:
    """kill -9 of the server mid-burst, then a restart on the same state dir."""
    state = fault.work / "state"
    baseline = take_baseline(fault)
    with server(fault, "first", state, uplink) as srv:
        url = srv.url
        vol = Volume.create("chaos-kept", api_url=url)
        vol.write_file("/kept.txt", "volume data")
        with Sandbox.create(api_url=url) as a:
            a.files.write("/home/user/snap.txt", "snapshot data")
            snap = a.create_snapshot(mode="filesystem")
        on_disk = Sandbox.create(api_url=url, timeout=600)
        on_disk.files.write("/home/user/disk.txt", "paused on disk")
        on_disk.pause(mode="filesystem")
        in_memory = Sandbox.create(api_url=url, timeout=600)
        in_memory.files.write("/home/user/mem.txt", "paused in memory")
        in_memory.run_code("kept = 7")
        in_memory.pause()
        running = [Sandbox.create(api_url=url, timeout=600) for _ in range(3)]
        for i, sbx in enumerate(running):
            sbx.run_code(f"print('before the crash {i}')")
        burst_ids: list[str] = []
        burst_errors: list[str] = []

        def one_create() -> None:
            try:
                sbx = Sandbox.create(api_url=url, timeout=600, request_timeout=30)
                burst_ids.append(sbx.sandbox_id)
                sbx.run_code("1")
            except Exception as e:  # noqa: BLE001 - the crash cuts some creates off: counted, not fatal
                burst_errors.append(type(e).__name__)

        threads = [threading.Thread(target=one_create) for _ in range(16)]
        for t in threads:
            t.start()
        time.sleep(0.25)  # some creates answered, some under way
        tree = process_tree(srv.proc.pid)
        instance = f"{srv.proc.pid}-"
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
        for t in threads:
            t.join(60)
        fault.note(f"killed the server (and {len(tree) - 1} processes under it) mid-burst: "
                   f"{len(burst_ids)} creates answered, {len(burst_errors)} cut off")
        died = wait_until(lambda: not still_alive(tree), 30)
        fault.check(died is not None, "every process of the dead server ended: still "
                    + "; ".join(f"{pid} {census._cmdline(pid)} (uid {census._uid(pid)})" for pid in still_alive(tree)))
        if died is not None:
            fault.note(f"the dead server's processes all ended within {died:.1f} s")
    with server(fault, "second", state, uplink) as srv2:
        url = srv2.url
        fault.check(cgroup_dirs_of(instance) == [], f"the dead server's cgroups are removed: {cgroup_dirs_of(instance)}")
        back = Sandbox.connect(on_disk.sandbox_id, api_url=url)
        fault.check(back.files.read("/home/user/disk.txt") == "paused on disk", "a sandbox paused on disk resumes")
        back.kill()
        try:
            mem = Sandbox.connect(in_memory.sandbox_id, api_url=url)
            fault.check(mem.files.read("/home/user/mem.txt") == "paused in memory",
                        "a sandbox paused in memory resumes with its files")
            fault.note("a sandbox paused in memory came back with its files (its memory is lost with its server)")
            mem.kill()
        except Exception as e:  # noqa: BLE001
            fault.check(False, f"a sandbox paused in memory is lost: {type(e).__name__}: {e}")
        with Sandbox.create(snap.snapshot_id, api_url=url) as child:
            fault.check(child.files.read("/home/user/snap.txt") == "snapshot data", "a snapshot survives")
        Sandbox.delete_snapshot(snap.snapshot_id, api_url=url)
        kept = Volume.connect(vol.volume_id, api_url=url)
        fault.check(kept.read_file("/kept.txt") == "volume data", "a volume's data survives")
        Volume.destroy(vol.volume_id, api_url=url)
        for sid in [s.sandbox_id for s in running] + burst_ids:
            status, text = sandbox_gone(url, sid)
            fault.check(status == 404, f"a sandbox running at the crash is not running after it: {status} {text}")
            r = httpx.get(f"{url}/sandboxes/{sid}/events", timeout=30)
            fault.check(r.status_code == 200, f"its record is kept: {r.status_code} {r.text[:200]}")
            if sid in [s.sandbox_id for s in running]:
                fault.check("before the crash" in r.text, f"its record has what it did: {r.text[:300]}")
            ended = _ended_event(r)
            fault.check(ended is not None, f"its record says it ended with its server: {r.text[-400:]}")
        fault.note(f"{len(running) + len(burst_ids)} sandboxes running at the crash: 404 now, their records kept "
                   "and closed")
    back_to_baseline(fault, baseline)


def _ended_event(r: httpx.Response) -> dict[str, Any] | None:
    for line in r.text.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if event.get("kind") == "sandbox.killed" and "without ending it" in event.get("reason", ""):
                return event
    return None


def child_of(server_pid: int, module: str) -> int | None:
    """The server's child process that runs `python -m module` (the zygote, the record or egress process)."""
    for pid in census._pids():
        if census._ppid(pid) != server_pid:
            continue
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if module.encode() in f.read().split(b"\0"):
                return pid
    return None


def kill_child(fault: Fault, srv: Server, module: str, what: str) -> tuple[int, float | None]:
    """SIGKILL the server's `module` child; the seconds until the server runs a new one (None: never)."""
    old = child_of(srv.proc.pid, module)
    if not fault.check(old is not None, f"the server has a {what} to kill"):
        raise Failed(f"no {what}")
    assert old is not None
    os.kill(old, signal.SIGKILL)
    again = wait_until(lambda: child_of(srv.proc.pid, module) not in (None, old), 60, step=0.05)
    fault.check(again is not None, f"the server runs a new {what} after the old one was killed")
    fault.check(srv.proc.poll() is None, "the server lives on")
    if again is not None:
        fault.note(f"killed the {what} ({old}); a new one ran {again:.2f} s later")
    return old, again


PROBE = ("import socket\ns = socket.socket(); s.settimeout(2)\n"
         "try:\n    s.connect(('{ip}', 80)); print('reached')\nexcept OSError as e:\n    print('refused', e)")


def zygote_kill9(fault: Fault, uplink: list[str]) -> None:
    """kill -9 of the zygote: sandboxes it forked go on, creates go on with a new one."""
    baseline = take_baseline(fault)
    with server(fault, "server", fault.work / "state", uplink) as srv:
        before = Sandbox.create(api_url=srv.url, timeout=300)
        before.run_code("z = 1")
        kill_child(fault, srv, "agentcell.backends.linux.zygote", "zygote")
        fault.check(before.run_code("z + 1").text == "2", "a sandbox the old zygote forked runs on, its state kept")
        t0 = time.monotonic()
        made = []
        for _ in range(5):  # past the standbys prepared before: the new zygote forks the rest
            sbx = Sandbox.create(api_url=srv.url, timeout=300, request_timeout=120)
            fault.check(sbx.run_code("6 * 7").text == "42", "a sandbox made after the kill runs code")
            made.append(sbx)
        fault.note(f"5 creates after the kill (past the 2 standbys) took {time.monotonic() - t0:.1f} s")
        for sbx in [before, *made]:
            sbx.kill()
    back_to_baseline(fault, baseline)


def record_kill9(fault: Fault, uplink: list[str]) -> None:
    """kill -9 of the record process: the server goes on, a new one records, the gap is flagged."""
    baseline = take_baseline(fault)
    with server(fault, "server", fault.work / "state", uplink) as srv:
        during = Sandbox.create(api_url=srv.url, timeout=300)
        kill_child(fault, srv, "agentcell.record.linux.process", "record process")
        time.sleep(1)
        after = Sandbox.create(api_url=srv.url, timeout=300)
        after.commands.run("/bin/true && ls /home/user > /dev/null")
        time.sleep(2)
        events = httpx.get(f"{srv.url}/sandboxes/{after.sandbox_id}/events", timeout=30).text
        fault.check('"process.exec"' in events, f"a sandbox made after the kill has its execs recorded: {events[-500:]}")
        during.commands.run("/bin/true")
        time.sleep(1)
        report = httpx.get(f"{srv.url}/sandboxes/{during.sandbox_id}/report", timeout=30).json()
        flags = {f.get("flag") for f in report.get("flags", [])}
        fault.note(f"the sandbox that lived through the kill: flags {sorted(f for f in flags if f)}")
        fault.check("record-incomplete" in flags, f"the record of a sandbox that lived through the kill says it has a gap: {flags}")
        during.kill()
        after.kill()
    back_to_baseline(fault, baseline)


def egress_kill9(fault: Fault, uplink: list[str]) -> None:
    """kill -9 of the egress proxy process: a new one serves, every sandbox's network policy still holds."""
    baseline = take_baseline(fault)
    with server(fault, "server", fault.work / "state", uplink) as srv:
        sbx = Sandbox.create(api_url=srv.url, timeout=300, allow_internet_access=True,
                             network={"deny_out": ["0.0.0.0/0"], "allow_out": ["198.51.100.7"]})
        kill_child(fault, srv, "agentcell.network.proxy_process", "egress proxy process")
        for ip in ("198.51.100.7", "10.0.0.1", "169.254.169.254"):
            fault.check("refused" in sbx.run_code(PROBE.format(ip=ip)).logs.stdout[0], f"{ip} is not reached")
        sbx.update_network({"deny_out": ["0.0.0.0/0"], "allow_out": ["203.0.113.0/24"]})
        with Sandbox.create(api_url=srv.url, timeout=300, allow_internet_access=True,
                            network={"deny_out": ["0.0.0.0/0"]}) as other:
            fault.check("refused" in other.run_code(PROBE.format(ip="198.51.100.7")).logs.stdout[0],
                        "a sandbox made after the kill is fenced too")
        sbx.kill()
    back_to_baseline(fault, baseline)


def _runsc_process(sandbox_id: str, part: str) -> int | None:
    """The pid of a gvisor sandbox's runsc `part` ("boot": its Sentry; "gofer"), None if it has none."""
    for pid in census._pids():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
            if part in argv and any(sandbox_id in a for a in argv) and "runsc" in argv[0]:
                return pid
    return None


def runsc_kill9(fault: Fault, uplink: list[str]) -> None:
    """kill -9 of a gvisor sandbox's runsc (its Sentry; another's gofer): the sandbox is reported ended
    (or, without its gofer, runs on), its neighbours run on, creates go on, nothing of it stays on the host."""
    if not shutil.which("runsc"):
        fault.check(False, "runsc is not installed (scripts/setup installs it)")
        return
    baseline = take_baseline(fault)
    srv = start_server("server", fault.work, "gvisor", 1, 8, ["--egress-uplink", "none"],
                       state_dir=fault.work / "state")
    try:
        srv.wait_ready()
        neighbour = Sandbox.create(api_url=srv.url, timeout=300)
        neighbour.run_code("n = 5")
        for part in ("boot", "gofer"):
            victim = Sandbox.create(api_url=srv.url, timeout=300)
            victim.run_code("v = 1")
            pid = _runsc_process(victim.sandbox_id, part)
            if part == "gofer" and pid is None:
                fault.note("a gvisor sandbox here has no gofer process to kill")
                victim.kill()
                continue
            if not fault.check(pid is not None, f"the sandbox has a runsc {part} process"):
                break
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            if part == "gofer":  # the Sentry may go on without it (its root is in memory): either is fine,
                try:             # a hang is not
                    fine = victim.run_code("v + 1", timeout=30, request_timeout=40).text == "2"
                except Exception:  # noqa: BLE001
                    fine = False
                if fine:
                    fault.note("killed a sandbox's runsc gofer: the sandbox runs on without it")
                    victim.kill()
                    continue
            ended = wait_until(lambda s=victim.sandbox_id: sandbox_gone(srv.url, s)[0] == 404, 60)
            fault.check(ended is not None, f"the sandbox whose runsc {part} was killed is reported ended")
            events = httpx.get(f"{srv.url}/sandboxes/{victim.sandbox_id}/events", timeout=30).text
            fault.check('"sandbox.killed"' in events, f"its record ends with its death: {events[-400:]}")
            gone = wait_until(lambda s=victim.sandbox_id: _runsc_process(s, "boot") is None
                              and _runsc_process(s, "gofer") is None, 30)
            fault.check(gone is not None, f"none of its runsc processes is left (killed its {part})")
            if ended is not None:
                fault.note(f"killed a sandbox's runsc {part}: reported ended {ended:.1f} s later, record closed")
        fault.check(neighbour.run_code("n + 1").text == "6", "a neighbour runs on, its state kept")
        with Sandbox.create(api_url=srv.url, timeout=300) as after:
            fault.check(after.run_code("6 * 7").text == "42", "a sandbox made after runs code")
        neighbour.kill()
    finally:
        srv.stop()
    back_to_baseline(fault, baseline)


def disk_full(fault: Fault, uplink: list[str]) -> None:
    """The state dir's filesystem full: writes to it fail with a clear error, running sandboxes go on,
    nothing kept is torn, and everything works again once there is room."""
    state = fault.work / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "chaos-state", str(state)], check=True)
    try:
        baseline = take_baseline(fault)
        with server(fault, "server", state, uplink) as srv:
            keep = Sandbox.create(api_url=srv.url, timeout=300)
            keep.files.write("/home/user/kept.txt", "kept")
            keep.pause(mode="filesystem")  # on disk before the disk fills
            sbx = Sandbox.create(api_url=srv.url, timeout=300)
            sbx.files.write("/home/user/big.bin", os.urandom(8 << 20))
            filler = state / "filler"
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True)
            fault.note(f"filled the state dir: {shutil.disk_usage(state).free} bytes free")
            for what, call in (("a pause to disk", lambda: sbx.pause(mode="filesystem")),
                               ("a snapshot", lambda: sbx.create_snapshot(mode="filesystem"))):
                try:
                    call()
                    fault.check(False, f"{what} on a full disk succeeded")
                except Exception as e:  # noqa: BLE001
                    text = str(e)
                    fault.check(type(e).__name__ == "NotEnoughSpaceException" and "disk is full" in text,
                                f"{what} on a full disk is refused with a clear error: {type(e).__name__}: {text[:300]}")
                    fault.note(f"{what} on a full disk: {type(e).__name__}: {text[:160]}")
            fault.check(sbx.run_code("6 * 7").text == "42", "the sandbox runs on after the refused writes")
            fault.check(sbx.files.read("/home/user/big.bin", format="bytes")[:1] != b"", "its files are whole")
            with Sandbox.create(api_url=srv.url, timeout=300) as other:
                fault.check(other.run_code("1 + 1").text == "2", "a create on a full state disk works")
            fault.check(httpx.get(srv.url + "/health", timeout=10).status_code == 200, "the server answers")
            filler.unlink()
            fault.check(sbx.pause(mode="filesystem"), "a pause to disk works once there is room")
            back = Sandbox.connect(sbx.sandbox_id, api_url=srv.url)
            fault.check(len(back.files.read("/home/user/big.bin", format="bytes")) == 8 << 20, "and its resume")
            back.kill()
        with server(fault, "restarted", state, uplink) as srv:
            again = Sandbox.connect(keep.sandbox_id, api_url=srv.url)
            fault.check(again.files.read("/home/user/kept.txt") == "kept", "what was kept before the disk filled")
            again.kill()
            snaps = httpx.get(srv.url + "/snapshots", timeout=30).json()
            fault.check(snaps == [], f"no snapshot half-made on the full disk is listed: {snaps}")
        back_to_baseline(fault, baseline)
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def _memory_cgroup(name: str, limit: int) -> Path:
    path = Path("/sys/fs/cgroup/memory") / name
    if not path.parent.is_dir():  # cgroup v2
        path = Path("/sys/fs/cgroup") / name
        path.mkdir()
        (path / "memory.max").write_text(str(limit))
        (path / "memory.swap.max").write_text("0")
        return path
    path.mkdir()
    (path / "memory.limit_in_bytes").write_text(str(limit))
    return path


def _oom_kills(cg: Path) -> int:
    for name in ("memory.oom_control", "memory.events"):
        with contextlib.suppress(OSError):
            for line in (cg / name).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    return 0


def memory_pressure(fault: Fault, uplink: list[str]) -> None:
    """The server (and its helpers) in a cgroup with little memory to spare, under big uploads,
    downloads and outputs at once: it stays within it, nothing of it is OOM-killed, it answers throughout."""
    baseline = take_baseline(fault)
    probe = start_server("probe", fault.work, "linux", 1, 60, uplink)
    probe.wait_ready()
    tree_kib = sum(census.status_field(p, "VmRSS") for p in census.descendants(probe.proc.pid, census._pids()))
    probe.stop()
    limit = (tree_kib << 10) + (256 << 20)
    cg = _memory_cgroup(f"agentcell-chaos-{os.getpid()}", limit)
    fault.note(f"the server's processes use {tree_kib >> 10} MiB at rest; their cgroup allows {limit >> 20} MiB")
    try:
        srv = start_server("server", fault.work, "linux", 1, 60, uplink,
                           prefix=["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh"])
        try:
            srv.wait_ready()
            sandboxes = [Sandbox.create(api_url=srv.url, timeout=600) for _ in range(4)]
            blob = os.urandom(64 << 20)
            errors: list[str] = []
            health: list[float] = []
            stop = threading.Event()

            def load(sbx: Sandbox, i: int) -> None:
                try:
                    sbx.files.write(f"/home/user/blob{i}", blob)
                    if sbx.files.read(f"/home/user/blob{i}", format="bytes") != blob:
                        errors.append("a download differs from its upload")
                    out = sbx.commands.run("head -c 50000000 /dev/zero | tr '\\0' x", timeout=300)
                    if len(out.stdout) != 50_000_000:
                        errors.append(f"an output of 50 MB came back as {len(out.stdout)} bytes")
                except Exception as e:  # noqa: BLE001
                    errors.append(f"{type(e).__name__}: {str(e)[:200]}")

            def watch() -> None:
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        httpx.get(srv.url + "/health", timeout=30)
                        health.append(time.monotonic() - t0)
                    except httpx.HTTPError:
                        health.append(float("inf"))
                    time.sleep(0.5)

            watcher = threading.Thread(target=watch)
            watcher.start()
            workers = [threading.Thread(target=load, args=(sbx, i)) for i, sbx in enumerate(sandboxes) for _ in (0, 1)]
            for t in workers:
                t.start()
            for t in workers:
                t.join(600)
            stop.set()
            watcher.join()
            peak = 0
            for name in ("memory.max_usage_in_bytes", "memory.peak"):
                with contextlib.suppress(OSError, ValueError):
                    peak = int((cg / name).read_text())
            fault.note(f"8 clients moving 64 MiB up, down and 50 MB of output each: peak {peak >> 20} MiB of "
                       f"{limit >> 20}; /health worst {max(health):.2f} s over {len(health)} probes")
            fault.check(not errors, f"every transfer whole: {errors[:5]}")
            fault.check(_oom_kills(cg) == 0, f"nothing of the server OOM-killed ({_oom_kills(cg)} kills)")
            fault.check(srv.proc.poll() is None, "the server lives")
            fault.check(max(health) < 5, f"the server answered /health within 5 s throughout: worst {max(health):.1f} s")
            for sbx in sandboxes:
                sbx.kill()
        finally:
            srv.stop()
    finally:
        wait_until(lambda: not (cg / "cgroup.procs").read_text().strip(), 30)
        with contextlib.suppress(OSError):
            cg.rmdir()
    back_to_baseline(fault, baseline)


def _set_wall_clock(seconds: float) -> None:
    subprocess.run(["date", "-s", f"@{seconds:.3f}"], check=True, capture_output=True)


def clock_step(fault: Fault, uplink: list[str]) -> None:
    """The host's clock stepped an hour forward, then back: timeouts keep counting real time."""
    baseline = take_baseline(fault)
    with server(fault, "server", fault.work / "state", uplink) as srv:
        long = Sandbox.create(api_url=srv.url, timeout=120)
        short = Sandbox.create(api_url=srv.url, timeout=12)
        created = time.monotonic()
        paused = Sandbox.create(api_url=srv.url, timeout=120)
        paused.pause()
        wall0, mono0 = time.time(), time.monotonic()
        try:
            _set_wall_clock(wall0 + 3600)
            time.sleep(3)
            fault.check(long.run_code("1").text == "1", "a sandbox with 2 minutes left lives on after a step of +1 h")
            fault.check(Sandbox.connect(paused.sandbox_id, api_url=srv.url).run_code("2").text == "2",
                        "a paused sandbox is kept and resumes")
            _set_wall_clock(time.time() - 7200)  # an hour behind real time now
            time.sleep(1)
            fault.check(long.run_code("3").text == "3", "and after a step back")
            gone = wait_until(lambda: sandbox_gone(srv.url, short.sandbox_id)[0] == 404, 40, step=0.25)
            lived = time.monotonic() - created
            fault.check(gone is not None and 11 < lived < 16,
                        f"a sandbox with a 12 s timeout ends after about 12 s of real time, steps or not: {lived:.1f} s")
            fault.note(f"the host's clock stepped +1 h, then -2 h: a 120 s sandbox lived on; a 12 s one ended "
                       f"{lived:.1f} s after its create")
        finally:
            _set_wall_clock(wall0 + (time.monotonic() - mono0))
        fault.check(abs(time.time() - (wall0 + time.monotonic() - mono0)) < 1, "the host's clock is put back")
        for sbx in (long, paused):
            with contextlib.suppress(Exception):
                sbx.kill()
    back_to_baseline(fault, baseline)


def cell_lost(fault: Fault, uplink: list[str]) -> None:
    """A cell behind the gateway lost (stopped, then killed) and returned: the gateway routes around it,
    fails its sandboxes' requests fast and clearly, and serves them again once it is back."""
    baseline = take_baseline(fault)
    cells = [start_server(f"cell{n}", fault.work, "linux", 1, 60, [*uplink, "--cell-id", f"chaosce{n}"],
                          state_dir=fault.work / f"cell{n}-state") for n in (1, 2)]
    gateway = None
    try:
        for c in cells:
            c.wait_ready()
        gateway = start_gateway(fault.work, cells)
        gateway.wait_ready()
        url = gateway.url

        def up(cell_id: str) -> bool | None:
            for c in httpx.get(url + "/v1/cells", timeout=10).json():
                if c.get("cellId") == cell_id:
                    return bool(c.get("up"))
            return None

        wait_until(lambda: up("chaosce1") and up("chaosce2"), 30)
        mine = []
        while not any(s.sandbox_id.startswith("chaosce1") for s in mine) or len(mine) < 2:
            mine.append(Sandbox.create(api_url=url, timeout=600))
            if len(mine) > 12:
                break
        on1 = [s for s in mine if s.sandbox_id.startswith("chaosce1")]
        fault.check(bool(on1), f"a sandbox landed on cell 1: {[s.sandbox_id for s in mine]}")
        on1[0].run_code("lived = 'through it'")
        on1[0].pause()  # paused: kept across the cell's restart below
        cells[0].proc.send_signal(signal.SIGSTOP)
        noticed = wait_until(lambda: up("chaosce1") is False, 60)
        fault.check(noticed is not None, "the gateway marks a stopped cell down")
        t0 = time.monotonic()
        made = [Sandbox.create(api_url=url, timeout=300, request_timeout=60) for _ in range(3)]
        fault.check(all(s.sandbox_id.startswith("chaosce2") for s in made), "creates go to the cell that is up")
        fault.note(f"cell 1 stopped: marked down in {noticed or -1:.1f} s; 3 creates through the gateway took "
                   f"{time.monotonic() - t0:.1f} s, all on cell 2")
        t0 = time.monotonic()
        r = httpx.post(f"{url}/sandboxes/{on1[0].sandbox_id}/connect", json={"timeout": 60}, timeout=60)
        took = time.monotonic() - t0
        fault.check(r.status_code in (502, 503, 504) and took < 15,
                    f"a request for a sandbox on the lost cell fails fast and clearly: {r.status_code} in {took:.1f} s {r.text[:200]}")
        fault.note(f"a request for a sandbox on the lost cell: {r.status_code} in {took:.2f} s: {r.text[:120]}")
        cells[0].proc.send_signal(signal.SIGKILL)
        cells[0].proc.wait()
        port = int(cells[0].url.rsplit(":", 1)[1])
        cells[0] = start_server("cell1-again", fault.work, "linux", 1, 60, [*uplink, "--cell-id", "chaosce1"],
                                state_dir=fault.work / "cell1-state", port=port)
        cells[0].wait_ready()
        back = wait_until(lambda: up("chaosce1") is True, 60)
        fault.check(back is not None, "the gateway marks the returned cell up")
        again = Sandbox.connect(on1[0].sandbox_id, api_url=url)
        fault.check(again.run_code("1 + 1").text == "2", "a sandbox paused on the lost cell resumes through the gateway")
        fault.note(f"cell 1 back (killed and restarted on its state dir): up again in {back or -1:.1f} s; its paused "
                   "sandbox resumes through the gateway")
        for s in [*mine, *made]:
            with contextlib.suppress(Exception):
                Sandbox.connect(s.sandbox_id, api_url=url).kill()
    finally:
        if gateway is not None:
            gateway.stop()
        for c in cells:
            with contextlib.suppress(Exception):
                c.proc.send_signal(signal.SIGCONT)
            c.stop()
    back_to_baseline(fault, baseline)


def ceiling(fault: Fault, uplink: list[str], count: int = 1000, minutes: float = 10.0) -> None:
    """The sandbox ceiling reached and held with steady run_code traffic: every sandbox answers, one more
    is refused clearly, and all of it goes away after."""
    count = int(os.environ.get("CHAOS_CEILING_COUNT", count))
    minutes = float(os.environ.get("CHAOS_CEILING_MINUTES", minutes))
    baseline = take_baseline(fault)
    with server(fault, "server", fault.work / "state", uplink, "--max-sandboxes", str(count), standbys=4) as srv:
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            made = list(pool.map(lambda _: Sandbox.create(api_url=srv.url, timeout=3600, request_timeout=300),
                                 range(count)))
        fault.note(f"{count} sandboxes made in {time.monotonic() - t0:.0f} s")
        try:
            Sandbox.create(api_url=srv.url, timeout=60, request_timeout=60)
            fault.check(False, "one sandbox past the ceiling is refused")
        except Exception as e:  # noqa: BLE001
            fault.check("maximum" in str(e) or "at most" in str(e), f"one past the ceiling is refused clearly: {e}")
            fault.note(f"one past the ceiling: {e}")
        latencies: list[float] = []
        failures: list[str] = []
        end = time.monotonic() + minutes * 60
        rng = random.Random(3)

        def traffic() -> None:
            while time.monotonic() < end:
                sbx = rng.choice(made)
                t = time.monotonic()
                try:
                    if sbx.run_code("21 * 2").text != "42":
                        failures.append(f"{sbx.sandbox_id}: wrong answer")
                    latencies.append(time.monotonic() - t)
                except Exception as e:  # noqa: BLE001
                    failures.append(f"{sbx.sandbox_id}: {type(e).__name__}: {str(e)[:120]}")

        with ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(traffic) for _ in range(4)]:
                f.result()
        latencies.sort()
        n = len(latencies)
        fault.note(f"held {count} for {minutes:g} min: {n} run_code calls, p50 {latencies[n // 2] * 1000:.0f} ms, "
                   f"p99 {latencies[min(n - 1, n * 99 // 100)] * 1000:.0f} ms, {len(failures)} failed")
        fault.check(not failures, f"every run_code at the ceiling answered: {failures[:5]}")
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda s: s.kill(), made))
        fault.note(f"{count} kills in {time.monotonic() - t0:.0f} s")
    back_to_baseline(fault, baseline, timeout=300)


def power_cut(fault: Fault, uplink: list[str]) -> None:
    """A power cut at every step of a pause to disk and of a snapshot: the state dir on a filesystem that
    keeps only what was fsynced (benchmarks/lose_unsynced.py). A server started on what the disk holds
    finds the paused sandbox or snapshot whole or not at all (an archive without its record set aside,
    said so), never torn; what the API had answered for is always there."""
    points = int(os.environ.get("CHAOS_POWER_CUT_POINTS", "0"))  # 0: every step; CI takes a few
    baseline = take_baseline(fault)
    with lose_unsynced.mounted(fault.work / "fs") as fs:
        for what, under in (("pause", "paused"), ("snapshot", "snapshots")):
            t0 = time.monotonic()
            dry = _cut_and_restart(fault, fs, what, under, uplink, 0)  # the cut after the API's first answer
            total = dry["steps"]
            fault.check(dry["answered"] and dry["outcome"] == "new" and total > 3,
                        f"{what}: answered, then a cut: still there ({dry})")
            cuts = list(range(1, total + 1))
            if 0 < points < total:
                cuts = sorted({cuts[round(i * (total - 1) / max(points - 1, 1))] for i in range(points)})
            outcomes: Counter[str] = Counter()
            for n in cuts:
                outcomes[_cut_and_restart(fault, fs, what, under, uplink, n)["outcome"]] += 1
            fault.check(outcomes["old"] > 0, f"{what}: a cut before its first step leaves the old state ({dict(outcomes)})")
            fault.note(f"{what}: {total} steps under {under}/ ({', '.join(sorted({op for op, _ in dry['log']}))});"
                       f" a cut before {len(cuts)} of them and one after the answer: {dict(outcomes)}, nothing torn"
                       f" ({time.monotonic() - t0:.0f} s)")
    back_to_baseline(fault, baseline)


def _cut_and_restart(fault: Fault, fs: lose_unsynced.Mounted, what: str, under: str, uplink: list[str],
                     n: int) -> dict[str, Any]:
    """A server on the filesystem pauses (or snapshots) a sandbox, the power cut at the n-th step under
    `under` (n 0: after the answer, nothing synced since the server started on an empty state dir); a server started on what the disk holds must find it whole or not at
    all. Returns the outcome (old, new, orphan: an archive set aside), the steps and whether it answered."""
    name = f"{what}-{n}"
    (fs.path / name).mkdir()
    fs.control("settle")  # the operator's empty state dir, on disk
    srv = start_server(name, fault.work, "linux", 0, 8, uplink, state_dir=fs.path / name)
    answered = False
    try:
        srv.wait_ready()
        sbx = Sandbox.create(api_url=srv.url, timeout=300)
        sbx.files.write("/home/user/kept.txt", "still here")
        if n:  # what came before is on disk (the kernel's writeback had time); n 0: a server's first
            fs.control("settle")  # minutes, nothing on disk but what it fsynced
        fs.control(f"arm {n} /{name}/{under}")
        with contextlib.suppress(httpx.HTTPError):
            if what == "pause":
                r = httpx.post(f"{srv.url}/sandboxes/{sbx.sandbox_id}/pause", json={"memory": False}, timeout=120)
            else:
                r = httpx.post(f"{srv.url}/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": "s"}, timeout=120)
            answered = r.is_success
        cut, steps, log = fs.control("cut"), int(fs.control("steps")), fs.control("log")
        srv.proc.kill()  # the power is off: nothing more is written
        srv.proc.wait(30)
        disk = fault.work / f"{name}-disk"
        fs.control(f"image {disk} /{name}")
        fs.control("arm 0 /-")  # the power is back, for the next run
    finally:
        srv.stop()
    after = start_server(f"{name}-after", fault.work, "linux", 0, 8, uplink, state_dir=disk)
    try:
        try:
            after.wait_ready()
        except SystemExit as e:  # a state dir the server cannot start on is the fault's finding
            raise Failed(f"{name} (cut: {cut}): no server starts on what the disk holds: {e}: "
                         f"{after.log.read_text(errors='replace')[-1500:]}") from None
        api = httpx.Client(base_url=after.url, timeout=120)
        if what == "pause":
            got = [s["sandboxID"] for s in api.get("/v2/sandboxes", params={"state": "paused"}).json()]
            want = [sbx.sandbox_id]
        else:
            got = [s["snapshotID"] for s in api.get("/snapshots").json()]
            want = ["s:default"]
        fault.check(got in ([], want), f"{name} (cut: {cut}): the state is the old or the new one: {got}")
        if got:
            back = Sandbox.connect(sbx.sandbox_id, api_url=after.url) if what == "pause" else \
                Sandbox.create("s:default", api_url=after.url)
            fault.check(back.files.read("/home/user/kept.txt") == "still here", f"{name}: its files are whole")
            back.kill()
    finally:
        after.stop()
    text = after.log.read_text(errors="replace")
    fault.check("is damaged (" not in text and "Traceback" not in text,
                f"{name} (cut: {cut}): nothing torn, nothing failed at the restart: {text[-2000:]}")
    aside = sorted(p.name for p in (disk / "paused" / "damaged").glob("*"))
    if aside:  # a cut after the archive, before its record: set aside, said so
        fault.check(not got and aside == [f"{sbx.sandbox_id}.tar"] and "has no record" in text,
                    f"{name}: only an archive without its record is set aside: {aside}")
    if answered:
        fault.check(bool(got), f"{name} (cut: {cut}): the API answered for the {what}, and it is gone")
    shutil.rmtree(disk, ignore_errors=True)
    outcome = "new" if got else "orphan" if aside else "old"
    return {"outcome": outcome, "steps": steps, "answered": answered, "cut": cut,
            "log": [tuple(line.split(" ", 1)) for line in log.splitlines() if line]}


FAULTS: dict[str, Callable[[Fault, list[str]], None]] = {
    "server-kill9": server_kill9,
    "zygote-kill9": zygote_kill9,
    "record-kill9": record_kill9,
    "egress-kill9": egress_kill9,
    "runsc-kill9": runsc_kill9,
    "disk-full": disk_full,
    "power-cut": power_cut,
    "memory-pressure": memory_pressure,
    "clock-step": clock_step,
    "cell-lost": cell_lost,
    "ceiling": ceiling,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated fault names")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work dirs (logs, state dirs)")
    a = ap.parse_args()
    if a.list:
        for name, fn in FAULTS.items():
            print(f"{name:<20} {(fn.__doc__ or '').strip()}")
        return 0
    if os.geteuid() != 0:
        raise SystemExit("chaos.py starts servers with the root backends: run it as root")
    names = a.only.split(",") if a.only else list(FAULTS)
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise SystemExit(f"unknown fault(s) {unknown}; --list shows them")
    results = []
    for name in names:
        work = Path(tempfile.mkdtemp(prefix=f"agentcell-chaos-{name}-"))
        fault = Fault(name, work)
        print(f"{name}: {(FAULTS[name].__doc__ or '').strip()}  (logs in {work})", flush=True)
        t0 = time.monotonic()
        try:
            with routeless_uplink("linux") as uplink:
                FAULTS[name](fault, uplink)
        except Exception as e:  # noqa: BLE001 - one fault's crash is its failure, the others still run
            fault.check(False, f"the fault's script stopped: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        ok = not fault.failures
        print(f"{'PASS' if ok else 'FAIL'} {name} ({time.monotonic() - t0:.0f} s)\n", flush=True)
        results.append((name, ok))
        if ok and not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("chaos:", ", ".join(f"{n} {'PASS' if ok else 'FAIL'}" for n, ok in results))
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
