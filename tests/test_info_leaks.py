"""What a sandbox can learn about its host, for real: every probe runs inside a sandbox.

Host details a sandbox must not see: where the Python runtime and the agentcell checkout live on the
host (mountinfo, maps, sys.path, tracebacks, file contents, memory), the kernel's boot command line
and configuration, the host's /etc, and state the zygote shares with every fork (PRNG seeds, the
cached host name).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import socket
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import GUEST_KERNEL, GVISOR, MICROVM, REPO
from helpers import memory_scan_code, sh

from agentcell import Sandbox


def _host_paths() -> list[str]:
    """Host directories whose names must not reach a sandbox (system dirs under /usr are fine)."""
    paths = set()
    for p in (str(REPO), sys.prefix, sys.base_prefix):
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if q != "/usr" and not q.startswith("/usr/"):
                paths.add(q)
    return sorted(paths, key=len, reverse=True)


HOST_PATHS = _host_paths()
# A sandbox has a /root of its own (its root's empty home): what must not show is the host's.
HOST_ROOT_HOME = sorted(f"/root/{name}" for name in os.listdir("/root")) if os.path.isdir("/root") else []
NEEDLES = [*HOST_PATHS, *HOST_ROOT_HOME, ".pyenv"]


# A host path as a path: not followed by more of a file name ("/tmp/x" must not match "/tmp/xxx",
# which the standard library's own test data holds, when the checkout is at /tmp/x).
_AFTER = r"(?![A-Za-z0-9_.-])"


def leaks(text: str) -> list[str]:
    return [n for n in NEEDLES if re.search(re.escape(n) + _AFTER, text)]


@pytest.fixture(scope="module")
def sbx(server_url: str) -> Iterator[Sandbox]:
    with Sandbox.create(api_url=server_url, timeout=600) as s:
        yield s


PROCESS_VIEW = """
import json, os, sys, traceback
import numpy, pandas, agentcell
out = {}
for name in ("mountinfo", "maps", "environ", "cmdline", "mounts"):
    with open(f"/proc/self/{name}", "rb") as f:
        out[name] = f.read().decode(errors="replace")
out["exe"] = os.readlink("/proc/self/exe")
out["sys"] = repr((sys.path, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.executable,
                   getattr(sys, "_base_executable", ""), numpy.__file__, pandas.__file__, agentcell.__file__,
                   json.__file__, os.environ.get("PATH")))
try:
    json.loads("{")
except ValueError:
    out["tb_json"] = traceback.format_exc()
try:
    pandas.DataFrame({"a": [1]}).loc["missing"]
except KeyError:
    out["tb_pandas"] = traceback.format_exc()
"""


def test_process_views_name_no_host_path(sbx: Sandbox) -> None:
    # The code context (a fork of the zygote) ...
    r = sbx.run_code(PROCESS_VIEW + "out")
    assert r.error is None, r.error
    views = eval(r.text)  # a dict of str
    for name, text in views.items():
        assert not leaks(text), (name, leaks(text), text[:3000])
    assert "/opt/agentcell/" in views["sys"]  # the runtime is there, at its neutral path
    # ... and the files the zygote mapped are named by the paths a sandbox has (not by their bare
    # paths inside a mount that is gone): /proc/self/exe is the interpreter sys.executable names.
    exe = sbx.run_code("import os, sys; os.readlink('/proc/self/exe'), os.path.realpath(sys.executable)").text
    assert eval(exe)[0] == eval(exe)[1], exe
    # ... an IPython traceback through library code ...
    err = sbx.run_code("import pandas; pandas.DataFrame({'a': [1]}).loc['missing']").error
    assert err is not None and "pandas" in err.traceback and not leaks(err.traceback), err.traceback
    # ... and processes that commands start, the agent's command line, the shell's PATH.
    code, out, errout = sh(sbx, "cat /proc/self/mountinfo /proc/1/cmdline /proc/self/environ; echo; "
                                "python3 -c 'import sys, numpy; print(sys.path, sys.prefix, sys.executable, "
                                "numpy.__file__); print(open(\"/proc/self/maps\").read())'; bash -lc 'echo $PATH'")
    assert code == 0, errout
    assert not leaks(out), (leaks(out), out[:3000])


def _scan_code(needles: list[str]) -> str:
    """Code that scans the context's whole readable memory for any of `needles`. Every letter of the
    pattern is a one-letter class, so neither the code nor the compiled pattern contains a needle."""
    pattern = "|".join("".join(f"[{c}]" if c.isalnum() else re.escape(c) for c in n) for n in needles)
    return memory_scan_code(
        f"import re\npattern = re.compile({pattern!r}.encode())\nfound = set()",
        "found.update(line.split(None, 5)[-1].strip() + ' ' + str(len(m.group())) for m in pattern.finditer(data))",
        "(sorted(found)[:20], scanned > 50_000_000)",
    )


def test_context_memory_holds_no_host_path(sbx: Sandbox) -> None:
    # The zygote's memory is every sandbox's memory: it must never have held a host path (or the
    # host's name).
    needles = [p for p in HOST_PATHS if len(p) >= 8]
    host_name = socket.gethostname()
    if len(host_name) >= 6 and host_name not in ("localhost", "agentcell"):  # too short: found by chance
        needles.append(host_name)
    if not needles:
        pytest.skip("the host's runtime paths are too short to search memory for")
    r = sbx.run_code(_scan_code(needles), timeout=120)
    assert r.error is None, r.error
    found, scanned_enough = eval(r.text)
    assert scanned_enough and found == [], found


def test_runtime_files_name_no_host_path(sbx: Sandbox) -> None:
    # Scripts' shebangs, pyvenv.cfg, .pth files, sysconfig data, .pyc files, ELF RUNPATHs ...
    dirs = sbx.run_code(
        "import os, sys, agentcell\n"
        "sorted({d for d in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(agentcell.__file__)))"
        " if d != '/usr' and not d.startswith('/usr/')})"
    )
    assert dirs.error is None, dirs.error
    # grep -E has no lookahead: a needle followed by a non-name byte or the end of a line
    patterns = " ".join(shlex.quote(f"-e{re.escape(n)}([^A-Za-z0-9_.-]|$)") for n in HOST_PATHS + ["/root/.pyenv"])
    code, out, err = sh(sbx, f"grep -rlsaE {patterns} {' '.join(eval(dirs.text))} | head -20", timeout=300)
    assert code == 0 and out == "", out


def test_checkout_and_host_prefixes_are_absent(sbx: Sandbox) -> None:
    for path in [*HOST_PATHS, str(REPO / ".git")]:
        assert sh(sbx, f"test -e {path}")[0] != 0, path
    assert sh(sbx, "ls -A /root", user="root")[1] == ""  # the sandbox's root's own home, empty
    # Only the package is in the sandbox, not the repository around it (tests, .git, .venv).
    assert sh(sbx, "ls -A /opt/agentcell/lib")[1].split() == ["agentcell"]
    code, out, _ = sh(sbx, "find /opt/agentcell -name .git -o -name tests -path '*/lib/agentcell/*' | head")
    assert out == ""


def test_template_tools_still_work(sbx: Sandbox) -> None:
    prefix = sbx.run_code("import sys; sys.prefix").text.strip("'")
    code, out, err = sh(sbx, "python3 -c 'import numpy, pandas, matplotlib, IPython; print(\"ok\")' && "
                             "pip --version && ipython --version && bash -lc 'command -v python3 pip ipython'")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "ok" and lines[1].startswith("pip ") and not leaks(out), out
    assert all(p.startswith(prefix + "/bin/") for p in lines[3:6]), out
    # The .pyc files are valid for the files beside them: imports in a sandbox never compile (the
    # runtime is read-only, so a stale .pyc would cost a full compile on every start).
    check = (
        "import importlib.util, sys, os, numpy, pandas, pandas.core.frame, json.decoder, IPython.core.interactiveshell\n"
        "bad = []\n"
        "for m in ('os', 'json.decoder', 'numpy', 'pandas.core.frame', 'IPython.core.interactiveshell'):\n"
        "    src = sys.modules[m].__file__; pyc = importlib.util.cache_from_source(src)\n"
        "    data = open(pyc, 'rb').read(16); st = os.stat(src)\n"
        "    ok = data[:4] == importlib.util.MAGIC_NUMBER and int.from_bytes(data[8:12], 'little') == "
        "int(st.st_mtime) & 0xFFFFFFFF and int.from_bytes(data[12:16], 'little') == st.st_size & 0xFFFFFFFF\n"
        "    ok or bad.append(m)\n"
        "print(bad)\n"
    )
    assert sh(sbx, f"python3 -c \"{check}\"")[1].strip() == "[]"


MASKED = ("/proc/cmdline", "/proc/config.gz", "/proc/kallsyms", "/proc/keys", "/proc/key-users", "/proc/modules",
          "/proc/sched_debug", "/proc/timer_list", "/proc/interrupts",
          "/proc/partitions", "/proc/swaps")


def test_proc_hides_kernel_and_host_details(sbx: Sandbox) -> None:
    sid = sbx.sandbox_id
    # boot_id: the sandbox's own (a fresh one at each start), never the host's
    host_boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    boot = sh(sbx, "cat /proc/sys/kernel/random/boot_id")[1].strip()
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", boot) and boot != host_boot
    assert sh(sbx, "echo x > /proc/sys/kernel/random/boot_id; echo $?", user="root")[1].strip() != "0"
    for path in MASKED:
        if os.path.exists(path):
            code, out, _ = sh(sbx, f"cat {path} | head -c 200")
            if GUEST_KERNEL:  # the sentry's or the VM's own kernel's /proc: never the host's
                host = Path(path).read_bytes()[:200].decode(errors="replace") if path != "/proc/kallsyms" else ""
                assert not host.strip() or host not in out, (path, out)
            else:
                assert out == "", (path, out)
    listed = sh(sbx, "ls /proc/acpi /proc/bus /proc/scsi /proc/irq /proc/fs 2>/dev/null")[1].split()
    if GVISOR:  # the sentry's: absent, or empty directories
        assert all(word.endswith(":") for word in listed), listed
    elif not GUEST_KERNEL:
        assert listed == [p + ":" for p in ("/proc/acpi", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/scsi")
                          if os.path.exists(p)]
    # What programs need stays: their own process, the machine's load and memory, their own network.
    pid_max = "" if GVISOR else " /proc/sys/kernel/pid_max"  # the sentry has none
    code, out, err = sh(sbx, "head -c 100 /proc/self/status /proc/cpuinfo /proc/meminfo /proc/stat /proc/loadavg "
                             f"/proc/uptime /proc/version /proc/net/dev{pid_max} >/dev/null && "
                             "cat /proc/sys/kernel/hostname && python3 -c 'import os; print(os.cpu_count() > 0)'")
    assert code == 0 and out.split() == [sid, "True"], err
    assert sh(sbx, "echo 1 > /proc/sys/kernel/hostname")[0] != 0
    # The masks are mounts the sandbox cannot remove, and it cannot mount anything over them either.
    for cmd in ("umount /proc/cmdline", "umount -l /proc/cmdline", "umount -l /proc",
                "mount --bind /proc/version /proc/cmdline", "mount -t proc proc /tmp"):
        assert sh(sbx, cmd)[0] != 0, cmd
    # a VM's is its own kernel's command line, which the host wrote and which holds nothing of it
    assert GUEST_KERNEL or sh(sbx, "cat /proc/cmdline")[1] == ""


def test_proc_masks_resist_the_sandbox_namespace_root() -> None:
    """Seccomp aside: even with every capability in the sandbox's own user namespace (what host root
    gets by joining it), the masks cannot be unmounted, because host root made them."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    from agentcell.backends.base import SandboxSpec
    from agentcell.backends.linux.backend import LinuxBackend

    async def scenario() -> dict[str, object]:
        be = LinuxBackend(entry_point="agentcell.backends.linux.probe:serve", max_sandboxes=2)
        await be.start()
        try:
            sb = await be.create(SandboxSpec("m" + uuid.uuid4().hex[:12]))
            pid = sb.host_pid  # type: ignore[attr-defined]
            script = (
                "import json, os\n"
                "from agentcell.backends.linux import syscalls as sc\n"
                f"mounts = [l.split()[4] for l in open('/proc/{pid}/mountinfo')]\n"
                f"for ns, flag in (('user', sc.CLONE_NEWUSER), ('mnt', sc.CLONE_NEWNS)):\n"
                f"    sc.setns(os.open(f'/proc/{pid}/ns/{{ns}}', os.O_RDONLY), flag)\n"
                "errors = {}\n"
                "for target, flags in (('/proc/cmdline', 0), ('/proc/cmdline', sc.MNT_DETACH), ('/proc', sc.MNT_DETACH)):\n"
                "    try:\n"
                "        sc.umount2(target, flags); errors[f'{target} {flags}'] = 0\n"
                "    except OSError as e:\n"
                "        errors[f'{target} {flags}'] = e.errno\n"
                "print(json.dumps({'mounts': mounts, 'errors': errors, 'cmdline': open('/proc/cmdline').read()}))\n"
            )
            p = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", script], cwd=REPO,
                                        capture_output=True, text=True, timeout=60)
            assert p.returncode == 0, p.stderr
            return json.loads(p.stdout)
        finally:
            await be.close()

    result = asyncio.run(scenario())
    assert "/proc/cmdline" in result["mounts"] and "/proc/sys" in result["mounts"], result["mounts"]
    assert all(err != 0 for err in result["errors"].values()), result["errors"]  # type: ignore[union-attr]
    assert result["cmdline"] == ""


ETC_ALLOWED = {
    # bound or copied from the host: what programs read
    "alternatives", "ca-certificates", "debian_version", "fonts", "gai.conf", "host.conf", "inputrc",
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "locale.alias", "localtime", "magic", "magic.mime",
    "mime.types", "os-release", "protocols", "services", "shells", "ssl", "terminfo", "timezone",
    "R",  # Debian's R conf for R contexts, without the operator's Renviron.site / Rprofile.site
    # generated
    "bash.bashrc", "group", "hostname", "hosts", "mtab", "nsswitch.conf", "passwd", "profile", "resolv.conf",
}


def test_etc_holds_only_what_programs_need(sbx: Sandbox) -> None:
    names = set(sh(sbx, "ls -A /etc")[1].split())
    jdk_conf = {n for n in names if re.fullmatch(r"java-\d+-openjdk", n)}  # a host JDK's conf (Java contexts)
    # a VM's own machine id (drawn at each clone's identity, as a VM's is): nothing of the host's
    own = {"machine-id"} if MICROVM else set()
    assert names - jdk_conf - own <= ETC_ALLOWED, names - jdk_conf - own - ETC_ALLOWED
    assert "passwd" in names and "ssl" in names and "ld.so.cache" in names
    assert sh(sbx, "test -e /etc/ssl/private")[0] != 0  # the host's private keys: not even the directory
    assert sh(sbx, "ls -A /etc/R 2>/dev/null | grep -c -e Renviron.site -e Rprofile.site")[1].strip() in ("", "0")
    nss = sh(sbx, "cat /etc/nsswitch.conf")[1]
    assert "passwd:" in nss and "systemd" not in nss and "sss" not in nss and "ldap" not in nss
    # and everything still works: TLS roots, users, time zone, the shell's start-up files
    code, out, err = sh(sbx, "python3 -c 'import ssl; print(len(ssl.create_default_context().get_ca_certs()) >= 0)'"
                             " && id -un && date +%Z >/dev/null && bash -lic true && getent hosts localhost")
    assert code == 0 and "user" in out, err


@pytest.mark.skipif(GUEST_KERNEL, reason="the linux backend's zygote state dir on the host: a gvisor or microvm "
                    "sandbox's caches are made in its own guest kernel")
def test_zygote_state_dir_is_private(server_url: str) -> None:
    with Sandbox.create(api_url=server_url) as s:
        r = s.run_code("import matplotlib; (matplotlib.get_cachedir(), get_ipython().ipython_dir)")
    cache, ipython = eval(r.text)
    for path in (cache, ipython):
        assert not path.startswith(tempfile.gettempdir()) and not path.startswith("/tmp"), path
        state = os.path.dirname(path)
        st = os.lstat(state)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700, state
    # It is created safely: never through a symlink, never taken over from another owner or mode.
    from agentcell.runtime import statedir

    base = tempfile.mkdtemp(dir="/run")
    try:
        good = os.path.join(base, "a", "state")
        assert statedir.private_dir(good) == good and stat.S_IMODE(os.lstat(good).st_mode) == 0o700
        os.symlink(good, os.path.join(base, "link"))
        os.mkdir(os.path.join(base, "loose"), 0o755)
        os.chmod(os.path.join(base, "loose"), 0o755)
        os.mkdir(os.path.join(base, "foreign"), 0o700)
        os.chown(os.path.join(base, "foreign"), 12345, 12345)
        os.mkdir(os.path.join(base, "open"), 0o777)
        os.chmod(os.path.join(base, "open"), 0o777)
        for bad in ("link", "loose", "foreign", "open/state"):
            with pytest.raises(statedir.UnsafeDirectoryError):
                statedir.private_dir(os.path.join(base, bad))
    finally:
        subprocess.run(["rm", "-rf", base], check=True)


RANDOM_STATE = ("import random, numpy, platform, socket, tempfile\n"
                "(numpy.random.rand(), numpy.random.randint(1 << 30), random.random(), "
                "next(tempfile._get_candidate_names()), platform.node(), socket.gethostname())")


def test_random_state_differs_between_sandboxes(server_url: str) -> None:
    seen = []
    for _ in range(2):
        with Sandbox.create(api_url=server_url) as s:
            values = eval(s.run_code(RANDOM_STATE).text)
            assert values[4] == values[5] == s.sandbox_id  # not the host's name, cached by the zygote
            seen.append(values[:4])
    for a, b in zip(*seen, strict=True):
        assert a != b, seen


def test_runtime_store_is_reused_and_holds_only_the_runtime() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    from agentcell.backends.linux import runtime_store

    first = runtime_store.ensure(collect="never")  # the server built it already: this only checks it
    try:
        # reused, not rebuilt: the same parts, and nothing new in the store (its speed: benchmarks/startup.py)
        before = sorted(os.listdir(runtime_store.store_dir()))
        again = runtime_store.ensure(collect="never")
        again.close()
        assert sorted(again.mounts) == sorted(first.mounts)
        assert sorted(os.listdir(runtime_store.store_dir())) == before
        parts = {target: src for src, target in first.mounts}
        assert runtime_store.NEUTRAL_ROOT + "/lib/agentcell" in parts
        for src in parts.values():
            st = os.lstat(src)
            assert st.st_uid == 0 and not stat.S_IMODE(st.st_mode) & 0o022, src
            for dirpath, dirnames, filenames in os.walk(src):
                assert ".git" not in dirnames and "__editable__" not in " ".join(filenames), dirpath
        pkg = Path(parts[runtime_store.NEUTRAL_ROOT + "/lib/agentcell"])
        assert (pkg / "__init__.py").exists() and not (pkg / "tests").exists() and not (pkg.parent / ".venv").exists()
    finally:
        first.close()
