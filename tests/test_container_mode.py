"""Container mode: `agentcell serve` as a privileged Kubernetes DaemonSet pod runs it.

The server runs under an OCI runtime (runc, else crun) the way a kubelet would start the cell's pod:
all capabilities, no seccomp or AppArmor, /sys/fs/cgroup mounted read-write in a private cgroup
namespace, its own pid namespace, and its own (empty) network namespace: nothing of it touches the
host's network; the test reaches it through a unix socket in a bind-mounted directory. Its root is
read-only, made of the host's /usr, /etc, /opt, /var, Python, venv and checkout bound read-only
(the image's stand-in), with tmpfs over /run, /tmp and /var/lib/agentcell, and the host's runtime
store bound in (what the DaemonSet's hostPath holds), so the server does not copy the venv.

Then: a sandbox is created and runs code through the SDK over that socket; the container is
stopped; no process and no cgroup of it is left on any hierarchy.

A second test checks the cgroup v2 leaf move (`cgroups.enter_container_leaf`) in a container whose
/sys/fs/cgroup is a cgroup2 mount of its own cgroup namespace (this host's v2 hierarchy has no
controllers, so only the move is checked there, not the limits).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUNTIME_STORE = "/var/lib/agentcell/runtime"
UIDS = "/run/agentcell/uids"
POD_MEMORY = 3 << 30
POD_PIDS = 4096
# every capability, in bit order (a privileged pod gets all its runtime has: see _held_caps)
_CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
         "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
         "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
         "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
         "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
         "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG",
         "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE"]


def _held_caps() -> list[str]:
    """The capabilities in our bounding set: all of them on a plain host; a host that is itself a
    container may lack some (here CAP_SYS_RESOURCE), and asking for one fails the start."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            mask = int(line.split()[1], 16)
            return [name for bit, name in enumerate(_CAPS) if mask >> bit & 1]
    return list(_CAPS)


def _runtime() -> str | None:
    # runc first: crun refuses a hybrid host whose cgroup2 holds a controller (here: hugetlb)
    for name in ("runc", "crun"):
        path = shutil.which(name)
        if path:
            return path
    return None


RUNTIME = _runtime()
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="an OCI runtime needs root here"),
    pytest.mark.skipif(RUNTIME is None, reason="neither crun nor runc is installed (apt-get install crun)"),
]


def _tmpfs(dest: str, mode: str = "755", size: str = "256m") -> dict:
    return {"destination": dest, "type": "tmpfs", "source": "tmpfs",
            "options": ["nosuid", "nodev", f"mode={mode}", f"size={size}"]}


def _bind(src: str, dest: str, ro: bool = False) -> dict:
    return {"destination": dest, "type": "bind", "source": src,
            "options": ["rbind", "ro" if ro else "rw", "rprivate"]}


def image_paths() -> list[str]:
    """What the cell's image would hold, bound read-only from the host: the system, the Python
    interpreter, the venv and the checkout (each once: a path inside another is left out)."""
    wanted = ["/usr", "/etc", "/opt", "/var", sys.base_prefix, sys.prefix, str(REPO)]
    wanted = sorted({os.path.realpath(p) for p in wanted if os.path.isdir(p)})
    return [p for p in wanted if not any(p != q and p.startswith(q + "/") for q in wanted)]


def make_rootfs(path: str) -> None:
    """An empty root with Debian's merged-/usr links; the runtime creates the mount points."""
    os.mkdir(path, 0o755)
    for name in ("bin", "sbin", "lib", "lib64"):
        if os.path.islink(f"/{name}"):
            os.symlink(os.readlink(f"/{name}"), os.path.join(path, name))


def pod_spec(rootfs: str, args: list[str], env: dict[str, str], sock_dir: str, cgroups_path: str,
             cgroup_mount: dict | None = None) -> dict:
    """An OCI runtime spec like a privileged DaemonSet pod's container, minus the host network."""
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "rw"]},
        cgroup_mount or {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
                         "options": ["nosuid", "noexec", "nodev", "relatime", "rw"]},
        # /run and /tmp first: a checkout (or venv) that lives under /tmp is bound on top of them
        _tmpfs("/run"), _tmpfs("/tmp", "1777"),
        *[_bind(p, p, ro=True) for p in image_paths()],
        _tmpfs("/var/lib/agentcell", "755"),
        _bind(RUNTIME_STORE, RUNTIME_STORE),  # the hostPath's runtime store: built once, shared
        _bind(UIDS, UIDS),  # the hostPath of uid reservations: a range apart from the host servers''
        _bind(sock_dir, "/agentcell-sock"),
    ]
    caps = _held_caps()
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False, "user": {"uid": 0, "gid": 0}, "args": args, "cwd": "/",
            "env": [f"{k}={v}" for k, v in env.items()],
            "capabilities": {k: caps for k in ("bounding", "effective", "inheritable", "permitted", "ambient")},
            "noNewPrivileges": False,
        },
        "root": {"path": rootfs, "readonly": True},
        "hostname": "cell",
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")],
            "cgroupsPath": cgroups_path,
            # a Guaranteed pod's limits: the server's budget must come from them, not from the host's size
            "resources": {"devices": [{"allow": True, "access": "rwm"}],
                          "memory": {"limit": POD_MEMORY}, "pids": {"limit": POD_PIDS}},
            "rootfsPropagation": "rprivate",
        },
    }


class PodContainer:
    """One container run detached by the OCI runtime, from a bundle in a temporary directory."""

    def __init__(self, spec: dict, bundle: str, name: str) -> None:
        self.bundle, self.name = bundle, name
        with open(os.path.join(bundle, "config.json"), "w") as f:
            json.dump(spec, f)
        self.log = open(os.path.join(bundle, "output.log"), "w+b")  # noqa: SIM115 (closed in delete)

    def start(self) -> None:
        r = subprocess.run([RUNTIME, "run", "--detach", "--bundle", self.bundle, self.name],
                           stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"{RUNTIME} run failed ({r.returncode}):\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def state(self) -> dict | None:
        r = subprocess.run([RUNTIME, "state", self.name], capture_output=True, text=True)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` s (the kubelet's order), then delete."""
        if self.state() is None:
            return
        if grace > 0:
            subprocess.run([RUNTIME, "kill", self.name, "TERM"], capture_output=True)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            st = self.state()
            if st is None or st.get("status") == "stopped":
                break
            time.sleep(0.2)
        subprocess.run([RUNTIME, "kill", "--all", self.name, "KILL"], capture_output=True)
        for _ in range(50):
            st = self.state()
            if st is None or st.get("status") == "stopped":
                break
            time.sleep(0.1)
        subprocess.run([RUNTIME, "delete", "--force", self.name], capture_output=True)
        self.log.close()


def _cgroup_dirs(rel: str) -> list[str]:
    """The container's cgroup directory on every hierarchy of this host that holds it."""
    root = "/sys/fs/cgroup"
    bases = [root] if os.path.exists(f"{root}/cgroup.controllers") else [
        e.path for e in os.scandir(root) if e.is_dir() and not e.is_symlink()]
    return [os.path.join(b, rel.lstrip("/")) for b in bases if os.path.isdir(os.path.join(b, rel.lstrip("/")))]


def _tasks_below(dirs: list[str]) -> set[int]:
    pids = set()
    for d in dirs:
        for dirpath, _dirs, _files in os.walk(d):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in Path(dirpath, "cgroup.procs").read_text().split())
    return pids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _host_dirs() -> None:
    """The bind sources a fresh host lacks, made as the server makes them."""
    from agentcell.runtime import statedir

    os.makedirs(UIDS, mode=0o700, exist_ok=True)
    statedir.private_dir(RUNTIME_STORE)


@contextlib.contextmanager
def _pod(args: list[str], env: dict[str, str], cgroup_mount: dict | None = None,
         grace: float = 10.0) -> Iterator[tuple[PodContainer, str, str]]:
    name = f"agentcell-ct-{uuid.uuid4().hex[:10]}"
    cgroups_path = f"/{name}"
    with tempfile.TemporaryDirectory(prefix="agentcell-ct-") as tmp:
        sock_dir = os.path.join(tmp, "sock")
        bundle = os.path.join(tmp, "bundle")
        os.mkdir(sock_dir, 0o700)
        os.mkdir(bundle)
        rootfs = os.path.join(bundle, "rootfs")
        make_rootfs(rootfs)
        _host_dirs()
        c = PodContainer(pod_spec(rootfs, args, env, sock_dir, cgroups_path, cgroup_mount), bundle, name)
        try:
            c.start()
            yield c, sock_dir, cgroups_path
        finally:
            c.stop(grace)


def _env() -> dict[str, str]:
    return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
            "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "AGENTCELL_EGRESS_UPLINK": "none"}


def _wait_for_socket(c: PodContainer, path: str, timeout: float = 300.0) -> None:
    """Until /health answers. A start waits for the runtime store's build lock, which every server
    on this host shares: a long wait here is usually another server building its parts."""
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://localhost", timeout=5) as client:
        while time.monotonic() < deadline:
            st = c.state()
            if st is None or st.get("status") == "stopped":
                pytest.fail(f"the server in the container exited:\n{c.output()}")
            if os.path.exists(path):
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/health").status_code == 200:
                        return
            time.sleep(0.3)
    pytest.fail(f"the server in the container was not ready after {timeout:g} s:\n{c.output()}")


def _sdk_sandbox(sock: str):
    """agentcell's SDK on a server behind a unix socket: the public entry points take a URL only, so
    the connection is built as the embedded server's is (same Endpoint with a socket)."""
    from agentcell.sdk import api
    from agentcell.sdk.config import ConnectionConfig, Endpoint, SandboxConnection
    from agentcell.sdk.sandbox_sync import Sandbox

    config = ConnectionConfig(Endpoint("http://localhost", sock), None, 60.0)
    r = api.call(config, "POST", "/v2/sandboxes", json={"templateID": "base", "timeout": 120}, ok=(201, 200))
    body = r.json()
    return Sandbox(SandboxConnection(config, body["sandboxID"], body.get("envdAccessToken"),
                                     **api.sandbox_extras(body)))


@pytest.mark.parametrize("grace", [10.0, 0.0], ids=["sigterm", "sigkill"])
def test_cell_runs_sandboxes_in_a_privileged_container(grace: float) -> None:
    """grace 0: the kubelet's SIGKILL once the grace period is over (no shutdown of the server's own)."""
    _host_dirs()
    ranges_before = set(os.listdir(UIDS))
    args = [sys.executable, "-m", "agentcell", "serve", "--uds", "/agentcell-sock/agentcell.sock",
            "--insecure-no-auth", "--max-sandboxes", "4", "--standbys", "0", "--no-host-sysctls",
            "--egress-uplink", "none"]
    with _pod(args, _env(), grace=grace) as (c, sock_dir, cgroups_path):
        sock = os.path.join(sock_dir, "agentcell.sock")
        _wait_for_socket(c, sock)
        # its host uid range is reserved where the host's servers reserve theirs: disjoint from them
        assert set(os.listdir(UIDS)) - ranges_before, "the cell reserved no uid range on the host"
        # the budget is the pod's: 3 GiB less the 1 GiB reserve, and 4096 tasks less 1024
        budget = [ln for ln in c.output().splitlines() if "all sandboxes of this server together" in ln]
        assert budget and "3072 tasks" in budget[0], c.output()
        assert ("memory 2.0 GiB" in budget[0] or "memory 1.8 GiB + socket buffers 0.2 GiB" in budget[0]), budget
        sbx = _sdk_sandbox(sock)
        try:
            ex = sbx.run_code("import os; print(sum(range(10)), os.getuid())")
            assert ex.error is None, ex.error
            assert ex.logs.stdout[0].split()[0] == "45"
            cmd = sbx.commands.run("cat /proc/self/cgroup")
            assert cmd.exit_code == 0
        finally:
            sbx.kill()
        # a second sandbox after the first is gone: the cell keeps working
        sbx = _sdk_sandbox(sock)
        assert sbx.run_code("1 + 1").text == "2"
        dirs = _cgroup_dirs(cgroups_path)
        assert dirs, "the container's cgroup is on no hierarchy"
        nested = [d for d in dirs if os.path.isdir(os.path.join(d, "agentcell"))]
        assert nested, f"the sandboxes' cgroups are not inside the container's cgroup ({dirs})"
        tasks = _tasks_below(dirs)
        assert len(tasks) > 2  # the server, its zygote, the live sandbox
        # the container stops with a sandbox alive: the pod's end takes everything with it
    time.sleep(0.2)
    assert not [p for p in tasks if _alive(p)], "processes of the container outlived it"
    assert not _cgroup_dirs(cgroups_path), "cgroups of the container are left"


def test_v2_leaf_move_in_a_private_cgroup_namespace() -> None:
    """On cgroup v2 the container's root cgroup holds its processes: the leaf move empties it."""
    probe = (
        "import os, json\n"
        "from agentcell.backends.linux import cgroups\n"
        "before = cgroups.in_container_root()\n"
        "moved = cgroups.enter_container_leaf()\n"
        "print(json.dumps({'container': before, 'moved': moved, 'me': os.getpid(),\n"
        "  'root_procs': open('/sys/fs/cgroup/cgroup.procs').read().split(),\n"
        "  'leaf_procs': open('/sys/fs/cgroup/agentcell-server/cgroup.procs').read().split(),\n"
        "  'self': open('/proc/self/cgroup').read().strip(),\n"
        "  'again': cgroups.enter_container_leaf()}), flush=True)\n"
    )
    mount = {"destination": "/sys/fs/cgroup", "type": "cgroup2", "source": "cgroup2",
             "options": ["nosuid", "noexec", "nodev", "rw"]}
    unified = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"
    if not os.path.exists(f"{unified}/cgroup.procs"):
        pytest.skip("this host has no cgroup v2 hierarchy")
    args = ["/bin/sh", "-c", f"sleep 30 & exec {sys.executable} -c \"$PROBE\""]
    env = _env() | {"PROBE": probe}
    with _pod(args, env, mount) as (c, _sock_dir, _path):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "}" not in c.output():
            time.sleep(0.2)
        out = c.output()
    line = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert line, out
    got = json.loads(line[-1])
    assert got["container"] is True
    assert got["me"] == 1 and 1 in got["moved"] and len(got["moved"]) == 2  # itself and the sleep
    assert got["root_procs"] == []
    assert sorted(int(p) for p in got["leaf_procs"]) == sorted(got["moved"])
    assert "0::/agentcell-server" in got["self"].splitlines()  # the v2 line (a hybrid host lists v1 too)
    assert got["again"] == []
