"""The microvm backend, for real: jailed QEMU VMs under TCG (this host's /dev/kvm is PVM), attacked from
the guest and inspected from the host.

What is the backend's own: a guest that panics its kernel, fork-bombs it or eats its memory ends (or
stays inside) its own VM while a neighbour keeps its state and serves; the VMM's jail read from /proc
(own uid, no capabilities, seccomp, own namespaces, no host files); the template's RAM file, which every
clone maps, is written by none of them; each clone has its own identity and the host's clock; TCG is
labelled as emulated; the limits are the guest's; --accel auto refuses PVM; a VMM killed from the host
is noticed. One server for the module; sandboxes with the default limits come from its standbys.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import math
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentcell import CommandExitException, Sandbox
from agentcell.backends.base import LIMIT_RANGES
from agentcell.backends.microvm import backend as microvm_backend
from agentcell.backends.microvm import kernel, vmm
from agentcell.errors import SandboxException
from tests.helpers import wait_until
from tests.servers import ServerProcess

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("qemu-system-x86_64") is None
    or not os.path.isdir(os.path.join(kernel.KERNEL_DIR, "current")),
    reason="the microvm backend needs root, qemu-system-x86_64 and the guest kernel in "
           f"{kernel.KERNEL_DIR}/current (scripts/setup installs both)")

QEMU = "qemu-system-x86_64"
ARGS = ("--backend", "microvm", "--accel", "tcg", "--standbys", "2", "--egress-uplink", "none",
        "--max-pids", str(int(LIMIT_RANGES["pids"][1])))  # the fork bomb's sandbox has the highest limit
SLOW = 240  # seconds: a busy host under TCG


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("microvm") / "server.log"
    # the start checks the root image (built once per agentcell version) and boots the template: on a host
    # crowded with other VMs under TCG that boot takes minutes (the backend allows 600 s)
    srv = ServerProcess(log, *ARGS, start_timeout=900, stop_timeout=60).started()
    yield srv
    srv.stop()


def create(server: ServerProcess, **kwargs: Any) -> Sandbox:
    return Sandbox.create(api_url=server.url, timeout=900, request_timeout=SLOW, **kwargs)


@pytest.fixture(scope="module")
def neighbour(server: ServerProcess) -> Iterator[Sandbox]:
    """A sandbox with state of its own that every attack below must leave alone."""
    sbx = create(server)
    sbx.run_code("kept = 'neighbour-state'")
    sbx.files.write("/tmp/kept", "neighbour-file")
    yield sbx
    sbx.kill()


def assert_neighbour_intact(sbx: Sandbox) -> None:
    assert sbx.run_code("kept == 'neighbour-state'", request_timeout=120).text == "True"
    assert sbx.files.read("/tmp/kept", request_timeout=120) == "neighbour-file"


@pytest.fixture(scope="module")
def pair(server: ServerProcess) -> Iterator[tuple[Sandbox, Sandbox, list[dict[str, Any]]]]:
    """Two clones of the template from the standbys, and what each said at its very first run."""
    clones = [create(server), create(server)]
    first = [c.run_code("import os, numpy, socket\n(os.urandom(16).hex(), float(numpy.random.rand()), "
                        "socket.gethostname())").text for c in clones]
    yield clones[0], clones[1], [dict(zip(("urandom", "numpy", "hostname"), ast.literal_eval(f), strict=True)) for f in first]
    for c in clones:
        c.kill()


# -- reading the host -------------------------------------------------------------------------------

def cgroup_dirs(sandbox_id: str) -> list[str]:
    """The sandbox's VMM cgroup in every hierarchy (v1 controllers and/or the unified one)."""
    return glob.glob(f"/sys/fs/cgroup/*/agentcell/*/{sandbox_id}") + glob.glob(f"/sys/fs/cgroup/agentcell/*/{sandbox_id}")


def cgroup_file(sandbox_id: str, name: str) -> str:
    for d in cgroup_dirs(sandbox_id):
        if os.path.exists(os.path.join(d, name)):
            return Path(d, name).read_text().strip()
    raise AssertionError(f"no {name} in the cgroups of {sandbox_id}: {cgroup_dirs(sandbox_id)}")


def vmm_pid(sandbox_id: str) -> int:
    """The sandbox's QEMU (its cgroup also holds bubblewrap's two processes)."""
    for d in cgroup_dirs(sandbox_id):
        for pid in Path(d, "cgroup.procs").read_text().split():
            try:
                if os.path.basename(os.readlink(f"/proc/{pid}/exe")) == QEMU:
                    return int(pid)
            except OSError:
                continue
    raise AssertionError(f"no {QEMU} in the cgroups of {sandbox_id}")


def host_memory(sandbox_id: str) -> tuple[int, int]:
    """The VMM cgroup's peak memory use and its limit, in bytes (cgroup v1 or v2)."""
    try:
        return (int(cgroup_file(sandbox_id, "memory.max_usage_in_bytes")),
                int(cgroup_file(sandbox_id, "memory.limit_in_bytes")))
    except AssertionError:
        return int(cgroup_file(sandbox_id, "memory.peak")), int(cgroup_file(sandbox_id, "memory.max"))


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def template_ram_of(pid: int) -> str:
    """The template RAM file the VMM `pid` maps (its server's instance)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.endswith("/template/ram"):
            return line.split(None, 5)[5]
    raise AssertionError(f"VMM {pid} maps no template RAM file")


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def gone(server: ServerProcess, sbx: Sandbox) -> bool:
    return httpx.get(f"{server.url}/sandboxes/{sbx.sandbox_id}", timeout=30).status_code == 404


def assert_ends_cleanly(server: ServerProcess, sbx: Sandbox, within: float = 90) -> None:
    """The VM is gone: the server says 404 and a run fails with an error, quickly, not a hang."""
    wait_until("the server to report the sandbox gone", lambda: gone(server, sbx), timeout=within, interval=1)
    t0 = time.monotonic()
    with pytest.raises(SandboxException) as failure:
        sbx.run_code("1", request_timeout=60)
    assert time.monotonic() - t0 < 30, "a run on the dead sandbox hung"
    assert sbx.sandbox_id in str(failure.value) and "gone" in str(failure.value), failure.value
    wait_until("its cgroups to be removed", lambda: not cgroup_dirs(sbx.sandbox_id), timeout=30)


# -- a guest that breaks its own kernel ---------------------------------------------------------------

def test_a_guest_kernel_panic_ends_that_sandbox_only(server: ServerProcess, neighbour: Sandbox) -> None:
    victim = create(server)
    try:
        victim.run_code("x = 1")
        pid = vmm_pid(victim.sandbox_id)
        victim.commands.run("sudo sh -c 'echo c > /proc/sysrq-trigger'", background=True)
        wait_until("the VMM to exit after the panic", lambda: not os.path.exists(f"/proc/{pid}/exe")
                   or not os.readlink(f"/proc/{pid}/exe").endswith(QEMU), timeout=60, interval=0.5)
        assert_ends_cleanly(server, victim)
        assert_neighbour_intact(neighbour)
    finally:
        victim.kill()


def test_a_fork_bomb_stays_in_its_guest(server: ServerProcess, neighbour: Sandbox) -> None:
    victim = create(server)
    try:
        # as the user: its process limit stops it; the guest recovers once the bomb is killed
        bomb = victim.commands.run("timeout -s KILL 15 bash -c 'b(){ b | b; }; b' 2>/tmp/bomb.err", background=True,
                                   timeout=120, request_timeout=SLOW)
        time.sleep(5)
        assert_neighbour_intact(neighbour)
        with pytest.raises(CommandExitException) as killed:
            bomb.wait()
        assert killed.value.exit_code in (137, -1), killed.value
        refused = victim.commands.run("grep -c 'fork: .*Resource temporarily unavailable' /tmp/bomb.err",
                                      request_timeout=SLOW).stdout
        assert int(refused) > 0, "the bomb never hit a limit"
        # as the guest's root, the sandbox's pids limit the highest there is: only the guest kernel is at stake
        victim.kill()
        victim = create(server, limits={"pids": int(LIMIT_RANGES["pids"][1])})
        victim.commands.run("sudo bash -c 'ulimit -u unlimited; b(){ b | b; }; b' 2>/dev/null", background=True,
                            timeout=0)
        host_max = int(cgroup_file(victim.sandbox_id, "pids.max"))
        assert host_max == 512
        for _ in range(3):
            time.sleep(4)
            assert int(cgroup_file(victim.sandbox_id, "pids.current")) <= host_max
            t0 = time.monotonic()
            subprocess.run(["true"], check=True)
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            assert time.monotonic() - t0 < 5, "the host slowed down"
            assert_neighbour_intact(neighbour)
    finally:
        victim.kill()
    wait_until("the bombed VM's cgroups to be removed", lambda: not cgroup_dirs(victim.sandbox_id), timeout=30)


def rss_kib(pid: int) -> int:
    return int(proc_status(pid)["VmRSS"].split()[0])


def test_a_memory_hog_is_killed_by_the_guest_oom_killer(server: ServerProcess, neighbour: Sandbox) -> None:
    rss_before = rss_kib(server.pid)
    victim = create(server)  # memory_mb 512: the hog asks for 2 GiB, touching every page
    try:
        hog = victim.commands.run("python3 -c 'x = []\nfor _ in range(64): x.append(b\"x\" * (32 << 20))'",
                                  background=True, timeout=180, request_timeout=SLOW)
        time.sleep(5)
        assert_neighbour_intact(neighbour)
        with pytest.raises(SandboxException) as ended:
            hog.wait()
        if not gone(server, victim):  # the guest lived on: its OOM killer took the hog (in the guest cgroup)
            assert isinstance(ended.value, CommandExitException) and ended.value.exit_code in (137, -1), ended.value
            assert victim.run_code("1 + 1", request_timeout=SLOW).text == "2"
            peak, limit = host_memory(victim.sandbox_id)
            assert peak <= limit == (512 + microvm_backend.GUEST_OVERHEAD_MB + vmm.VMM_OVERHEAD_MB) << 20, (peak, limit)
        assert_neighbour_intact(neighbour)
    finally:
        victim.kill()
    assert rss_kib(server.pid) - rss_before < 64 * 1024, "the server's memory grew with the guest's"


# -- the VMM's jail, read from the host ---------------------------------------------------------------

def namespaces(pid: int) -> dict[str, str]:
    return {ns: os.readlink(f"/proc/{pid}/ns/{ns}") for ns in ("mnt", "pid", "net", "ipc", "uts")}


def test_the_vmm_is_jailed(server: ServerProcess, neighbour: Sandbox,
                           pair: tuple[Sandbox, Sandbox, list[dict[str, Any]]]) -> None:
    pids = [vmm_pid(neighbour.sandbox_id), vmm_pid(pair[0].sandbox_id)]
    uids = []
    for pid in pids:
        st = proc_status(pid)
        uid, gid = st["Uid"].split(), st["Gid"].split()
        assert len(set(uid)) == 1 and uid[0] != "0" and len(set(gid)) == 1 and gid[0] != "0", st
        assert st["Groups"] == ""
        uids.append(uid[0])
        assert st["CapEff"] == st["CapPrm"] == st["CapBnd"] == st["CapInh"] == st["CapAmb"] == "0" * 16, st
        assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2", st
        ours = namespaces(server.pid)
        theirs = namespaces(pid)
        assert all(theirs[ns] != ours[ns] for ns in ours), (ours, theirs)
        root = f"/proc/{pid}/root"
        for path in ("var/lib/agentcell", "root", "home", "etc", "work"):
            assert not os.path.exists(os.path.join(root, path)), f"the VMM sees /{path}"
        assert os.path.isdir(os.path.join(root, "usr/bin"))
    assert uids[0] != uids[1], "two VMMs share a uid"


# -- the template's RAM file: shared by every clone, written by none ---------------------------------

def fd_of(pid: int, path: str) -> str:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                return fd
        except OSError:
            continue
    raise AssertionError(f"VMM {pid} has no fd on {path}")


def as_uid(uid: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv],
                          capture_output=True, text=True, timeout=60)


OPEN_RW = "import os, sys; os.open(sys.argv[1], os.O_RDWR)"


def test_no_clone_can_write_the_template_memory(server: ServerProcess,
                                                pair: tuple[Sandbox, Sandbox, list[dict[str, Any]]]) -> None:
    a, b, _ = pair
    pid = vmm_pid(a.sandbox_id)
    ram = template_ram_of(pid)
    assert os.stat(ram).st_uid == 0 and os.stat(ram).st_mode & 0o777 == 0o444
    private = [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if line.endswith(ram)]
    assert private and all(line.split()[1].endswith("p") for line in private), private  # copy-on-write
    before = sha256(ram)
    uid = proc_status(pid)["Uid"].split()[0]
    # the VMM's uid, from the host: the file by its path, and the VMM's own fd on it, refused
    for path in (ram, f"/proc/{pid}/fd/{fd_of(pid, ram)}"):
        tried = as_uid(uid, "/usr/bin/python3", "-c", OPEN_RW, path)
        assert tried.returncode != 0 and "PermissionError" in tried.stderr, (path, tried.stderr)
    # inside the jail the path does not exist
    inside = subprocess.run(["nsenter", "-t", str(pid), "-m", "ls", ram], capture_output=True, text=True, timeout=30)
    assert inside.returncode != 0 and "No such file" in inside.stderr, inside
    # a clone's writes go to its own copy: B sees none of A's, nor does the file
    marker = f"marker-{uuid.uuid4().hex}"
    a.run_code(f"secret = {marker!r} * 1000")
    a.files.write("/tmp/marker", marker * 1000)
    b.run_code("b_was_here = 'b' * 100000")
    assert b.run_code("'secret' in globals()").text == "False"
    assert not b.files.exists("/tmp/marker")
    assert b.commands.run(f"grep -rl {marker} /tmp /home/user /dev/shm || true").stdout == ""
    assert sha256(ram) == before, "the template's RAM file changed"
    with open(ram, "rb") as f:
        assert all(marker.encode() not in chunk for chunk in iter(lambda: f.read(1 << 24), b""))


# -- each clone its own identity, the host's clock ---------------------------------------------------

def guest_clock_offset(sbx: Sandbox) -> float:
    """How far the guest's wall clock is from the host's (the request's own time allowed for)."""
    t0 = time.time()
    guest = float(sbx.run_code("import time; time.time()", request_timeout=SLOW).text)
    t1 = time.time()
    return 0.0 if t0 <= guest <= t1 else min(abs(guest - t0), abs(guest - t1))


def test_each_clone_has_its_own_identity(pair: tuple[Sandbox, Sandbox, list[dict[str, Any]]]) -> None:
    a, b, first = pair
    assert [f["hostname"] for f in first] == [a.sandbox_id, b.sandbox_id]
    assert first[0]["urandom"] != first[1]["urandom"]
    assert first[0]["numpy"] != first[1]["numpy"]
    ids = [c.commands.run("cat /etc/machine-id /proc/sys/kernel/random/boot_id").stdout.split() for c in (a, b)]
    assert all(len(i) == 2 for i in ids), ids
    assert ids[0][0] != ids[1][0], "two clones share /etc/machine-id"
    assert ids[0][1] != ids[1][1], "two clones share the boot_id"


def test_a_clone_keeps_the_host_clock_across_pause(server: ServerProcess) -> None:
    sbx = create(server)
    try:
        assert guest_clock_offset(sbx) < 2
        assert sbx.pause() is True
        time.sleep(5)
        sbx.connect()
        assert guest_clock_offset(sbx) < 2
    finally:
        sbx.kill()


def test_a_resume_from_files_takes_a_standby_under_its_own_id(server: ServerProcess) -> None:
    """pause(mode="filesystem") then connect(): the files come back in a standby renamed to the sandbox's
    id (a new boot), its archive streamed in chunks over the control port: more than one frame arrives in
    one read there, each must be served (a last chunk and its "import" once waited forever)."""
    sbx = create(server)
    try:
        sbx.files.write("/home/user/kept.bin", os.urandom(3 << 20))  # a few chunks of the archive
        sbx.files.write("/tmp/note", "persisted")
        boot = sbx.files.read("/proc/sys/kernel/random/boot_id")
        sbx.run_code("x = 1")
        assert sbx.pause(mode="filesystem") is True
        sbx.connect(request_timeout=SLOW)
        # a standby's VMM keeps its cgroup's name (docs/microvm.md); a VM booted for it would have the id's
        assert cgroup_dirs(sbx.sandbox_id) == [], "the resume booted a VM instead of taking a standby"
        assert sbx.files.read("/tmp/note") == "persisted"
        assert len(sbx.files.read("/home/user/kept.bin", format="bytes")) == 3 << 20
        assert sbx.commands.run("hostname").stdout.strip() == sbx.sandbox_id
        assert sbx.files.read("/proc/sys/kernel/random/boot_id") != boot  # a fresh start: a new boot
        assert "NameError" in str(sbx.run_code("x").error)
    finally:
        sbx.kill()


# -- labels: TCG is emulation, and says so ------------------------------------------------------------

def test_tcg_is_labelled_emulated(server: ServerProcess, neighbour: Sandbox) -> None:
    health = httpx.get(f"{server.url}/health", timeout=30).json()
    assert "emulated — no hardware isolation claim" in health["isolation"]["microvm"], health
    info = httpx.get(f"{server.url}/sandboxes/{neighbour.sandbox_id}", timeout=30).json()
    assert "TCG" in info["isolation"] and "emulated" in info["isolation"], info
    banner = [line for line in server.log().splitlines() if line.strip().startswith("microvm:")]
    assert banner and "emulated" in banner[0], banner


# -- limits: the guest's own ----------------------------------------------------------------------------

def test_limits_are_the_guests(server: ServerProcess, neighbour: Sandbox) -> None:
    memory_mb, cpus, disk_mb = 768, 1.5, 64  # not the standbys': this one boots (tens of seconds here)
    sbx = create(server, limits={"memoryMB": memory_mb, "cpuCount": cpus, "diskMB": disk_mb})
    try:
        # the VM's RAM: the memory limit and the guest's own; the tenant is held to the limit (+ the agent's
        # baseline) by the guest cgroup
        ram_mb = memory_mb + microvm_backend.GUEST_OVERHEAD_MB
        total_kib = int(sbx.commands.run("grep MemTotal /proc/meminfo").stdout.split()[1])
        assert 0.85 * ram_mb * 1024 <= total_kib <= ram_mb * 1024, total_kib
        assert sbx.commands.run("nproc").stdout.strip() == str(math.ceil(cpus))
        assert host_memory(sbx.sandbox_id)[1] == (ram_mb + vmm.VMM_OVERHEAD_MB) << 20  # the guest's RAM + QEMU's
        with pytest.raises(CommandExitException) as full:
            sbx.commands.run(f"dd if=/dev/zero of=/tmp/fill bs=1M count={2 * disk_mb}", request_timeout=SLOW)
        assert "No space left on device" in full.value.stderr, full.value.stderr
        sbx.commands.run("rm /tmp/fill")
        assert sbx.run_code("21 * 2").text == "42"
        assert_neighbour_intact(neighbour)
    finally:
        sbx.kill()


def test_a_claims_memory_limit_holds_below_the_vms_ram(server: ServerProcess, neighbour: Sandbox) -> None:
    """A standby's RAM is the template's (512 MiB + the guest's own); a claim of 256 MiB is held to it by
    the guest cgroup (tenant and agent: 256 + 128 MiB, which the tenant cannot read: no /sys), far below
    what the guest kernel has free."""
    sbx = create(server, limits={"memoryMB": 256})
    try:
        assert sbx.commands.run("python3 -c 'x = b\"x\" * (150 << 20)'", request_timeout=SLOW).exit_code == 0
        with pytest.raises(CommandExitException) as killed:
            sbx.commands.run("python3 -c 'x = b\"x\" * (450 << 20)'", request_timeout=SLOW)
        assert killed.value.exit_code in (137, -1), killed.value
        total_kib = int(sbx.commands.run("grep MemTotal /proc/meminfo").stdout.split()[1])
        assert total_kib > 600 << 10  # the guest had room for it: its cgroup said no
        assert sbx.run_code("21 * 2").text == "42"
        assert_neighbour_intact(neighbour)
    finally:
        sbx.kill()


# -- --accel auto: KVM only when a VM really boots under it ---------------------------------------------

def test_accel_auto_uses_kvm_or_refuses_naming_tcg(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "auto.log", "--backend", "microvm", "--accel", "auto", "--standbys", "0",
                        "--egress-uplink", "none", stop_timeout=60)
    try:
        outcome = wait_until("the --accel auto server to start or refuse",
                             lambda: "exited" if srv.proc.poll() is not None else "up" if srv.answers() else "",
                             timeout=300, interval=0.5)
        if outcome == "up":  # a host with working hardware virtualization
            isolation = httpx.get(f"{srv.url}/health", timeout=30).json()["isolation"]["microvm"]
            assert "KVM" in isolation and "emulated" not in isolation, isolation
        else:
            assert srv.proc.returncode != 0 and "--accel tcg" in srv.log(), srv.log()[-2000:]
    finally:
        srv.stop()


# -- a VMM killed from the host -------------------------------------------------------------------------

def test_a_vmm_killed_from_the_host_is_noticed(server: ServerProcess, neighbour: Sandbox) -> None:
    victim = create(server)
    try:
        victim.run_code("x = 1")
        os.kill(vmm_pid(victim.sandbox_id), signal.SIGKILL)
        assert_ends_cleanly(server, victim)
        assert_neighbour_intact(neighbour)
    finally:
        victim.kill()
