"""Hostile code as the sandbox's root: the attacks of test_attacks.py again, and those root makes newly
interesting. Root is uid 0 of the sandbox's own user namespace with a bounded capability set; none of
this may reach the host, the agent or a neighbour (docs/security.md "Root inside a sandbox")."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import GUEST_KERNEL, GVISOR, MICROVM, REPO
from helpers import CONNECT_CODE, host_listener, sh

from agentcell import Sandbox
from agentcell.errors import SandboxNotRunningException

# Under gvisor (AGENTCELL_TEST_BACKEND=gvisor) the same attacks meet the same walls, made by the guest
# (gvisor/guest.py's mounts, gvisor/seccomp_extra.py); where the sentry's answer differs only in form
# (a prctl it does not implement, a /proc line it does not print, no OOM killer of its own) the
# assertion says what must hold on each backend.
PR_CAP_AMBIENT, PR_GET_NO_NEW_PRIVS = 47, 39
# sysctl exits 0 after a write refused as EROFS (the guest's read-only /proc/sys) where the host's
# kernel refuses with EPERM: on a guest kernel the attack must also have changed nothing
_CHANGED_HOSTNAME = ' && [ "$(cat /proc/sys/kernel/hostname)" = x ]'


@pytest.mark.skipif(not GVISOR, reason="the gvisor backend's variant of the tests above")
def test_gvisor_guest_root_leaves_the_host_alone(attacker: Sandbox) -> None:
    token = uuid.uuid4().hex[:10]
    host_name = Path("/proc/sys/kernel/hostname").read_text()
    for path in (f"/evil-{token}", f"/opt/agentcell/lib/agentcell/evil-{token}", f"/usr/bin/evil-{token}",
                 f"/dev/evil-{token}"):
        root(attacker, f"echo 1 > {path}")  # /usr/bin may be written: the sandbox's memory overlay
        assert not Path(path).exists(), path
    root(attacker, "echo pwned > /proc/sys/kernel/hostname; echo 3 > /proc/sys/vm/drop_caches; "
                   "chown 1000 /dev/null; rm -rf /opt/agentcell/lib/agentcell")
    assert Path("/proc/sys/kernel/hostname").read_text() == host_name
    assert os.stat("/dev/null").st_uid == 0
    assert Path(REPO / "agentcell" / "__init__.py").exists()


def root(sbx: Sandbox, cmd: str, timeout: float = 60) -> tuple[int, str, str]:
    return sh(sbx, cmd, timeout=timeout, user="root")


def py(sbx: Sandbox, code: str) -> str:
    """Python run as root (a command, not a context: contexts run as the user)."""
    sbx.files.write("/tmp/attack.py", code)
    code_, out, err = root(sbx, "python3 /tmp/attack.py")
    assert code_ == 0, err
    return out


@pytest.fixture(scope="module")
def attacker(server_url: str) -> Iterator[Sandbox]:
    sbx = Sandbox.create(api_url=server_url, timeout=300, limits={"memoryMB": 256, "pids": 64, "diskMB": 64})
    yield sbx
    sbx.kill()


@pytest.fixture(autouse=True)
def neighbour_unharmed(neighbour: Sandbox, server_url: str) -> Iterator[None]:
    yield
    assert neighbour.run_code("canary").text == "alive"
    assert sh(neighbour, "echo ok")[1] == "ok\n"



def test_root_cannot_read_host_files_or_processes(attacker: Sandbox, host_secret: Path) -> None:
    for path in (host_secret, Path("/root") / host_secret.name):
        code, out, _ = root(attacker, f"cat {path}")
        assert code != 0 and host_secret.read_text() not in out
    assert host_secret.name not in root(attacker, "ls -a /root /tmp 2>&1")[1]
    assert root(attacker, "cat /etc/shadow")[0] != 0
    pids = [int(p) for p in root(attacker, "ls /proc")[1].split() if p.isdigit()]
    assert max(pids) < 1000 and len(pids) < 20


def test_root_cannot_write_the_host_or_the_runtime(attacker: Sandbox) -> None:
    token = uuid.uuid4().hex[:10]
    for path in (f"/evil-{token}", f"/opt/agentcell/lib/agentcell/evil-{token}", f"/opt/agentcell/python/evil-{token}",
                 f"/dev/evil-{token}", "/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches",
                 # a microvm's root may crash its own VM (docs/microvm.md): tests/test_microvm.py's panic
                 "/proc/sys/kernel/modprobe", *(() if MICROVM else ("/proc/sysrq-trigger",))):
        code, _, err = root(attacker, f"echo 1 > {path}")
        assert code != 0, (path, err)
    assert not Path(f"/evil-{token}").exists()
    # the agent's code and interpreter: read-only binds, not overlays
    assert root(attacker, "rm -f /opt/agentcell/lib/agentcell/__init__.py")[0] != 0


def test_mounts_cannot_be_undone_or_made(attacker: Sandbox) -> None:
    for cmd in ("mount -o remount,rw /opt/agentcell/python", "mount -o remount,rw /", "mount -o remount,suid /tmp",
                "umount /proc/kallsyms", "umount -l /usr", "mkdir -p /mnt/p && mount -t proc proc /mnt/p",
                "mkdir -p /mnt/s && mount -t sysfs sysfs /mnt/s", "mount -t cgroup2 none /mnt",
                "mount -t tmpfs none /mnt", "mount --bind /usr /mnt"):
        code, _, err = root(attacker, cmd)
        assert code != 0, (cmd, err)
    # straight to the syscalls: seccomp answers EPERM before the kernel's own checks
    out = py(attacker, "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "print(libc.mount(b'proc', b'/mnt', b'proc', 0, None), ctypes.get_errno())\n"
             "print(libc.umount2(b'/proc/kallsyms', 2), ctypes.get_errno())\n")
    assert out.split() == ["-1", "1", "-1", "1"], out
    # what /proc covers stays covered
    assert root(attacker, "cat /proc/kallsyms | head -c 100")[1] == ""
    assert root(attacker, "ls -A /sys 2>/dev/null")[1].strip() == ""  # no sysfs: nothing of the host's devices


def test_namespaces_ptrace_and_agent_memory_denied(attacker: Sandbox) -> None:
    for cmd in ("unshare -U true", "unshare -r id", "unshare -m true", "unshare -n true", "unshare -p -f true",
                "unshare -i true", "nsenter -t 1 -m true", "strace -f true"):
        assert root(attacker, cmd)[0] != 0, cmd
    # the agent (pid 1): another host uid, not dumpable; root holds no CAP_SYS_PTRACE
    for path in ("/proc/1/mem", "/proc/1/environ", "/proc/1/maps", "/proc/1/fd/3"):
        code, out, err = root(attacker, f"head -c 64 {path}")
        assert code != 0 and out == "", (path, out)
    out = py(attacker, "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "print(libc.ptrace(16, 1, 0, 0), ctypes.get_errno())\n"  # PTRACE_ATTACH to the agent
             "buf = ctypes.create_string_buffer(8)\n"
             "print(libc.syscall(310, 1, 0, 0, 0, 0, 0), ctypes.get_errno())\n")  # process_vm_readv
    assert out.split() == ["-1", "1", "-1", "1"], out


def test_root_capabilities_stay_bounded(attacker: Sandbox) -> None:
    from agentcell.backends.linux.sandbox_init import ROOT_CAPS_MASK

    out = py(attacker, "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             f"print(libc.prctl({PR_CAP_AMBIENT}, 2, 21, 0, 0), ctypes.get_errno())\n"  # ambient raise CAP_SYS_ADMIN
             "print(libc.prctl(8, 1, 0, 0, 0))\n"
             "print(open('/proc/self/status').read().split('CapBnd:')[1].split()[0])\n")
    rc, err, _, bnd = out.split()
    # Linux: EPERM (not in the bounding set); the sentry has no ambient set at all: EINVAL to every
    # PR_CAP_AMBIENT, so nothing can be raised through it
    assert (rc, err) == ("-1", "22" if GVISOR else "1") and int(bnd, 16) == ROOT_CAPS_MASK
    # Docker's default set minus NET_RAW, MKNOD, AUDIT_WRITE, SYS_CHROOT, SETFCAP: never DAC_READ_SEARCH (2)
    assert int(bnd, 16) == sum(1 << c for c in (0, 1, 3, 4, 5, 6, 7, 8, 10)), bnd
    # no CAP_MKNOD: device nodes cannot be made (nodev would make them useless anyway)
    for target in ("/tmp/null", "/usr/local/sda", "/root/mem"):
        assert root(attacker, f"mknod {target} c 1 3")[0] != 0, target
        assert root(attacker, f"mknod {target}b b 8 0")[0] != 0, target
    # chown of what the host bound in: the host's own inodes (its root is not mapped) or read-only.
    # Under gvisor or in a microvm /dev's nodes are the guest kernel's own, not the host's: root may
    # chown those (its own sandbox's), and the host's stay as they are
    guest_nodes = ("/dev/null", "/dev/pts/ptmx")
    for target in ("/opt/agentcell/python", "/proc/1/environ", *(() if GUEST_KERNEL else guest_nodes)):
        assert root(attacker, f"chown 1000 {target}")[0] != 0, target
    if GUEST_KERNEL:
        root(attacker, f"chown 1000 {' '.join(guest_nodes)}")
    assert os.stat("/dev/null").st_uid == 0 and os.stat("/dev/pts/ptmx").st_uid == 0


def test_setuid_binaries_made_by_root_give_nothing(attacker: Sandbox) -> None:
    for d in ("/tmp", "/usr/local/bin", "/home/user", "/opt"):
        assert root(attacker, f"cp /bin/bash {d}/rootsh && chmod 4755 {d}/rootsh && stat -c %a {d}/rootsh")[1] == "4755\n"
        assert sh(attacker, f"{d}/rootsh -p -c 'id -u; grep CapEff /proc/self/status'")[1].split() == [
            "1000", "CapEff:", "0000000000000000"], d
    # no_new_privs holds for root too (the kernel's own answer; the sentry's status has no such line),
    # and the user cannot become root on its own
    nnp = f"import ctypes; print(ctypes.CDLL(None).prctl({PR_GET_NO_NEW_PRIVS}, 0, 0, 0, 0))"
    assert root(attacker, f'python3 -c "{nnp}"')[1] == "1\n"
    assert GVISOR or root(attacker, "grep NoNewPrivs /proc/self/status")[1].split() == ["NoNewPrivs:", "1"]
    assert sh(attacker, "python3 -c 'import os; os.setuid(0)'")[0] != 0
    assert sh(attacker, "su -c 'id -u' root </dev/null")[0] != 0


def test_exotic_socket_families_do_not_load_modules(attacker: Sandbox) -> None:
    out = py(attacker, "import socket, errno\n"
             "for fam, typ, proto in ((38, 5, 0), (17, 3, 0), (16, 3, 0), (40, 1, 0), (2, 3, 255), (2, 1, 132),"
             " (2, 2, 136), (31, 1, 0), (21, 5, 0)):\n"
             "    try:\n        socket.socket(fam, typ, proto).close(); print('open', fam)\n"
             "    except OSError as e:\n        print('refused', e.errno)\n")
    rows = [line.split() for line in out.splitlines()]
    assert all(r[0] == "refused" for r in rows), rows
    assert root(attacker, "cat /proc/modules")[1] == ""


def test_root_cannot_reach_another_sandboxs_files(attacker: Sandbox, server_url: str) -> None:
    token = uuid.uuid4().hex
    with Sandbox.create(api_url=server_url) as victim:
        victim.files.write("/home/user/secret", token)
        root(victim, f"echo {token} > /usr/local/secret && echo {token} > /root/secret")
        code, out, _ = root(attacker, f"grep -rl {token} /home /usr/local /root /tmp /var /opt /etc 2>/dev/null",
                            timeout=900 if MICROVM else 300)  # all of /opt's runtime (read under emulation on microvm)
        assert token not in out and out.strip() == ""
        assert victim.files.read("/home/user/secret") == token


def test_root_kills_what_it_may_and_the_agent_lives(server_url: str) -> None:
    with Sandbox.create(api_url=server_url, limits={"memoryMB": 256, "pids": 64}) as sbx:
        sbx.run_code("x = 41")
        root(sbx, "kill -9 1; kill -TERM 1; kill -HUP 1; kill -KILL -1")
        assert sh(sbx, "echo alive")[1] == "alive\n"  # pid 1 ignores signals from inside
        # the context that kill -1 took says so once, then comes back
        first = sbx.run_code("6 * 7")
        assert first.text == "42" or (first.error is not None and first.error.name == "UnexpectedEndOfExecution")
        assert sbx.run_code("6 * 7").text == "42"


def test_root_rm_rf_only_hurts_the_sandbox(server_url: str, host_secret: Path) -> None:
    with Sandbox.create(api_url=server_url) as sbx:
        root(sbx, "rm -rf --no-preserve-root / 2>/dev/null; true", timeout=120)
        assert host_secret.exists() and Path("/usr/bin/ls").exists() and Path("/etc/passwd").exists()
        assert Path("/var/lib/dpkg/status").stat().st_size > 0


def test_root_fork_bomb_and_memory_hog_are_contained(server_url: str) -> None:
    with Sandbox.create(api_url=server_url, limits={"memoryMB": 256, "pids": 64}) as sbx:
        out = py(sbx, "import os, time\nkids, err = [], None\n"
                 "try:\n    while len(kids) < 10000:\n        pid = os.fork()\n"
                 "        if pid == 0:\n            time.sleep(60); os._exit(0)\n        kids.append(pid)\n"
                 "except OSError as e:\n    err = e.errno\n"
                 "for k in kids: os.kill(k, 9)\nfor k in kids: os.waitpid(k, 0)\nprint(len(kids), err)\n")
        forked, err = out.split()
        assert err == "11" and 10 <= int(forked) < 64, out  # the pids cgroup holds root too
        try:
            code, _, _ = root(sbx, "python3 -c 'x = bytearray(600 << 20)'")
        except SandboxNotRunningException:
            # gvisor: the sentry has no OOM killer, the host's memory cgroup ends the sandbox whole (and
            # only it: the neighbour fixture checks the rest)
            assert GVISOR and not sbx.is_running()
            return
        assert code != 0  # OOM-killed inside the sandbox's memory cgroup
        assert sh(sbx, "echo alive")[1] == "alive\n"


def test_root_cannot_reach_the_host_or_change_the_network(attacker: Sandbox) -> None:
    """test_attacks' host-loopback probe again as root, and what root would try first: new routes,
    addresses, links, firewall rules, raw sockets, the host's sysctls (no NET_ADMIN, no NET_RAW)."""
    with host_listener() as (port, accepted):
        out = py(attacker, CONNECT_CODE.format(port=port) +
                 "try:\n    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); print('raw')\n"
                 "except OSError as e:\n    print('no raw', e.errno)\n"
                 "try:\n    socket.socket(socket.AF_PACKET, socket.SOCK_RAW); print('packet')\n"
                 "except OSError as e:\n    print('no packet', e.errno)\n")
        assert "connected" not in out and "raw\n" not in out and "packet\n" not in out, out
    assert accepted == []
    for cmd in ("ip route add 127.0.0.0/8 dev lo table 100", "ip addr add 192.0.2.99/32 dev lo",
                "ip link add x type dummy", "ip link set lo down", "nft flush ruleset",
                "sh -c 'echo 1 > /proc/sys/net/ipv4/ip_forward'", "sh -c 'echo 0 > /proc/sys/kernel/randomize_va_space'",
                "hostname other-name", "sysctl -w kernel.hostname=x" + (_CHANGED_HOSTNAME if GUEST_KERNEL else "")):
        code, _, _ = root(attacker, cmd + " 2>/dev/null")
        assert code != 0, f"root could run: {cmd}"
    assert root(attacker, "cat /proc/sys/kernel/hostname")[1].strip() == attacker.sandbox_id


def test_root_sees_no_more_of_the_host(attacker: Sandbox) -> None:
    """test_info_leaks again as root: the kernel log, symbols, /sys and the covered /proc files stay
    closed whatever root's capabilities (no SYSLOG, no SYS_ADMIN)."""
    assert root(attacker, "dmesg 2>/dev/null | head -1")[1] == ""
    _, out, _ = root(attacker, "head -3 /proc/kallsyms; cat /proc/cmdline /proc/keys")
    assert out.strip() == "" or set(out.split()) <= {"0000000000000000"}, out
    host_boot = open("/proc/sys/kernel/random/boot_id").read().strip()  # noqa: SIM115
    assert host_boot not in root(attacker, "cat /proc/sys/kernel/random/boot_id; umount /proc/sys/kernel/random/boot_id; "
                                           "cat /proc/sys/kernel/random/boot_id")[1]
    assert root(attacker, "ls /sys 2>/dev/null | wc -l")[1].strip() == "0"
    assert root(attacker, "cat /proc/1/environ /proc/1/cmdline 2>&1 | grep -c AGENTCELL || true")[1].strip() in ("", "0")
