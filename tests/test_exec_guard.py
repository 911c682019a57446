"""The exec guard (agentcell/policy/linux/exec_guard.py) with real sandboxes of the linux backend: the ELF
loader run as the main program and files on kernel-internal mounts (memfd) are killed before they run
anything, for guarded sandboxes only; everything else runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agentcell.backends.linux.backend import LinuxBackend
from agentcell.errors import BackendUnavailableError
from agentcell.policy.linux import exec_guard
from agentcell.policy.linux.exec_guard import ALLOW_INTERNAL, ALLOW_LOADER, ExecGuard, Kill
from tests.helpers import ProbeBox, probe_backend

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/self/ns/user"),
                                reason="the linux backend and the guard need root and user namespaces")

LOADER = "/lib64/ld-linux-x86-64.so.2"
MUSL_LOADER = "/lib/ld-musl-x86_64.so.1"
KILLED = -9  # the probe agent's exit code of a process killed by SIGKILL
# a copy of a program in a memfd, exec'd: by its /proc/self/fd path or by the fd (execveat AT_EMPTY_PATH)
MEMFD_EXEC = """
import os, sys
fd = os.memfd_create("copy")
os.write(fd, open(sys.argv[2], "rb").read())
argv = [sys.argv[2], *sys.argv[3:]]
if sys.argv[1] == "path":
    os.execv(f"/proc/self/fd/{fd}", argv)
os.execve(fd, argv, dict(os.environ))
"""


@pytest.fixture(scope="module")
def guard() -> Iterator[ExecGuard]:
    reason = exec_guard.available()
    if reason is not None:
        pytest.skip(reason)
    g = ExecGuard()
    yield g
    g.close()


@pytest.fixture(scope="module")
async def backend() -> AsyncIterator[LinuxBackend]:
    async with probe_backend() as be:
        yield be


async def new_box(backend: LinuxBackend) -> AsyncIterator[ProbeBox]:
    b = await ProbeBox.create(backend, prefix="guard")
    yield b
    await b.channel.close()
    await backend.kill(b.sandbox)


@pytest.fixture(scope="module")
async def guarded(backend: LinuxBackend, guard: ExecGuard) -> AsyncIterator[ProbeBox]:
    async for b in new_box(backend):
        guard.guard(b.sandbox.host_uids)
        yield b
        guard.unguard(b.sandbox.host_uids)


@pytest.fixture(scope="module")
async def plain(backend: LinuxBackend, guard: ExecGuard) -> AsyncIterator[ProbeBox]:
    async for b in new_box(backend):
        yield b


@pytest.fixture
async def fresh(backend: LinuxBackend, guard: ExecGuard) -> AsyncIterator[ProbeBox]:
    async for b in new_box(backend):
        yield b
        guard.unguard(b.sandbox.host_uids)


async def sh(box: ProbeBox, script: str) -> tuple[int, str, str]:
    return await box.run("sh", "-c", textwrap.dedent(script))


async def memfd_exec(box: ProbeBox, how: str, *argv: str) -> tuple[int, str, str]:
    return await box.run("python3", "-c", MEMFD_EXEC, how, *argv)


def kills_of(guard: ExecGuard, box: ProbeBox) -> list[Kill]:
    """The guard's kills since the last read, of this box's uids (a ring written before the exec returns)."""
    return [k for k in guard.read() if k.uid in box.sandbox.host_uids]


async def test_the_loader_as_main_program_is_killed_before_it_runs(guarded: ProbeBox, guard: ExecGuard) -> None:
    guard.read()
    assert await guarded.run(LOADER, "/bin/true") == (KILLED, "", "")
    # the program it was to load runs nothing: no file made, no byte written (the shell's redirection
    # opened the file before the exec)
    code, out, err = await sh(guarded, f"""
        rm -f /tmp/made /tmp/out
        {LOADER} /bin/touch /tmp/made; echo "touch: $?"
        {LOADER} /bin/echo hi > /tmp/out; echo "echo: $?"
        test -e /tmp/made && echo made
        wc -c < /tmp/out""")
    assert (code, out.split("\n")) == (0, ["touch: 137", "echo: 137", "0", ""]), err
    kills = kills_of(guard, guarded)
    assert len(kills) == 3
    k = kills[0]
    assert (k.reason, k.filename, k.name, k.signal_error) == ("loader", LOADER, "ld-linux-x86-64.so.2", 0)
    assert k.uid == guarded.sandbox.host_uids[0] and k.host_pid > 0 and k.comm == "ld-linux-x86-64"


async def test_the_loader_through_another_name_or_a_script_is_killed(guarded: ProbeBox, guard: ExecGuard) -> None:
    guard.read()
    code, out, err = await sh(guarded, f"""
        real=$(readlink -f {LOADER})
        $real /bin/true; echo "real: $?"
        ln -s $real /tmp/innocent; /tmp/innocent /bin/true; echo "symlink: $?"
        printf '#!{LOADER} /bin/rm\\n' > /tmp/script; chmod +x /tmp/script
        /tmp/script; echo "script: $?"
        test -e /tmp/script && echo "script kept" """)
    # a "#!" line naming the loader would have run `ld.so /bin/rm /tmp/script`
    assert (code, out.split("\n")) == (0, ["real: 137", "symlink: 137", "script: 137", "script kept", ""]), err
    assert [k.reason for k in kills_of(guard, guarded)] == ["loader"] * 3


async def test_musl_loader_is_killed(guarded: ProbeBox, guard: ExecGuard) -> None:
    code, _, _ = await guarded.run("test", "-e", MUSL_LOADER)
    if code != 0:
        pytest.skip(f"no musl loader in the sandbox ({MUSL_LOADER}: apt install musl)")
    guard.read()
    # Debian's musl loader is a link to its libc.so: the file run is named libc.so
    assert (await guarded.run(MUSL_LOADER, "/bin/true"))[0] == KILLED
    assert [(k.reason, k.name) for k in kills_of(guard, guarded)] == [("loader", "libc.so")]


@pytest.mark.parametrize("how", ["path", "fd"])
async def test_a_memfd_exec_is_killed_before_it_runs(guarded: ProbeBox, guard: ExecGuard, how: str) -> None:
    guard.read()
    assert (await memfd_exec(guarded, how, "/bin/true"))[0] == KILLED
    assert (await memfd_exec(guarded, how, "/bin/touch", f"/tmp/memfd-{how}"))[0] == KILLED
    assert (await guarded.run("test", "-e", f"/tmp/memfd-{how}"))[0] == 1  # the copy of touch ran nothing
    kills = kills_of(guard, guarded)
    assert [(k.reason, k.name) for k in kills] == [("internal", "memfd:copy")] * 2
    assert kills[0].filename == ("/proc/self/fd/3" if how == "path" else "/dev/fd/3")


async def test_ordinary_programs_run_in_a_guarded_sandbox(guarded: ProbeBox, guard: ExecGuard) -> None:
    guard.read()
    assert await guarded.run("/bin/echo", "dynamic") == (0, "dynamic\n", "")
    assert await sh(guarded, "printf '#!/bin/sh\\necho script\\n' > /tmp/s; chmod +x /tmp/s; /tmp/s") == \
        (0, "script\n", "")
    assert await guarded.run("python3", "-c", "print('python')") == (0, "python\n", "")
    # glibc's libc.so.6 runs as a program (it prints its version) through its interpreter: a shared
    # object's name, but not a loader
    code, out, _ = await guarded.run("/lib/x86_64-linux-gnu/libc.so.6")
    assert code == 0 and "GNU C Library" in out
    assert kills_of(guard, guarded) == []


async def test_a_static_program_runs(guarded: ProbeBox) -> None:
    code, out, _ = await guarded.run("sh", "-c", "ldd /bin/busybox 2>&1")
    if "not a dynamic executable" not in out:
        pytest.skip("no static busybox in the sandbox (apt install busybox-static)")
    assert await guarded.run("/bin/busybox", "echo", "static") == (0, "static\n", "")


async def test_unguarded_sandboxes_and_the_host_are_unaffected(plain: ProbeBox, guarded: ProbeBox,
                                                               guard: ExecGuard) -> None:
    assert await plain.run(LOADER, "/bin/echo", "loaded") == (0, "loaded\n", "")
    assert await memfd_exec(plain, "fd", "/bin/echo", "memfd") == (0, "memfd\n", "")
    host = subprocess.run([LOADER, "/bin/echo", "host"], capture_output=True, text=True)
    assert (host.returncode, host.stdout) == (0, "host\n")
    host = subprocess.run([sys.executable, "-c", MEMFD_EXEC, "path", "/bin/echo", "host memfd"],
                          capture_output=True, text=True)
    assert (host.returncode, host.stdout) == (0, "host memfd\n")
    assert kills_of(guard, plain) == []


async def test_unguard_lets_the_sandbox_run_them_again(fresh: ProbeBox, guard: ExecGuard) -> None:
    uids = fresh.sandbox.host_uids
    assert guard.flags(uids[0]) is None
    assert (await fresh.run(LOADER, "/bin/true"))[0] == 0
    guard.guard(uids)
    assert guard.flags(uids[0]) == 0 and guard.flags(uids[1]) == 0
    assert (await fresh.run(LOADER, "/bin/true"))[0] == KILLED
    guard.unguard(uids)
    assert guard.flags(uids[0]) is None
    assert (await fresh.run(LOADER, "/bin/true"))[0] == 0
    assert (await memfd_exec(fresh, "fd", "/bin/true"))[0] == 0


async def test_flags_allow_loaders_or_internal_files(fresh: ProbeBox, guard: ExecGuard) -> None:
    uids = fresh.sandbox.host_uids
    guard.guard(uids, ALLOW_LOADER)
    assert await fresh.run(LOADER, "/bin/echo", "loaded") == (0, "loaded\n", "")
    assert (await memfd_exec(fresh, "fd", "/bin/true"))[0] == KILLED
    guard.guard(uids, ALLOW_INTERNAL)  # replaces the flags
    assert (await fresh.run(LOADER, "/bin/true"))[0] == KILLED
    assert await memfd_exec(fresh, "fd", "/bin/echo", "memfd") == (0, "memfd\n", "")
    guard.guard(uids, ALLOW_LOADER | ALLOW_INTERNAL)
    assert (await fresh.run(LOADER, "/bin/true"))[0] == 0
    with pytest.raises(ValueError):
        guard.guard(uids, 4)


async def test_kills_over_the_budget_are_counted_not_written(fresh: ProbeBox, guard: ExecGuard) -> None:
    small = ExecGuard(budget=2)
    try:
        small.guard(fresh.sandbox.host_uids)
        code, out, _ = await sh(fresh, f"for i in 1 2 3 4 5; do {LOADER} /bin/true; echo $?; done")
        assert out.split() == ["137"] * 5  # every one killed
        assert len(kills_of(small, fresh)) == 2
        assert small.dropped(fresh.sandbox.host_uids[0]) == 3 and small.lost() == 0
    finally:
        small.close()


def test_unavailable_to_a_rootless_server_with_the_reason(tmp_path: Path) -> None:
    assert issubclass(exec_guard.ExecGuardUnavailable, BackendUnavailableError)
    got = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                          "from agentcell.policy.linux import exec_guard; print(exec_guard.available())"],
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert got.returncode == 0 and "needs the server to run as root" in got.stdout, got.stderr


def test_a_pid_namespace_init_is_killed_too(guard: ExecGuard) -> None:
    # (sandboxes cannot make namespaces: seccomp; a host process of a guarded uid can.) SIGKILL from
    # the kernel is forced: the init of a pid namespace, which ignores its own namespace's SIGKILL, dies
    uid = 3_600_201  # a uid no server of these tests uses
    guard.guard([uid])
    try:
        got = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "unshare", "--user",
                              "--map-root-user", "--pid", "--fork", "sh", "-c",
                              f"echo pid=$$; exec {LOADER} /bin/echo escaped"], capture_output=True, text=True, cwd="/")
        assert got.stdout == "pid=1\n", got.stderr
        assert [(k.uid, k.reason) for k in guard.read() if k.uid == uid] == [(uid, "loader")]
    finally:
        guard.unguard([uid])


async def test_every_one_of_many_parallel_loader_runs_is_killed(guarded: ProbeBox, guard: ExecGuard) -> None:
    # both CPUs exec'ing at once: each kill is sent (a refused signal would be signal_error != 0 and a file)
    guard.read()
    code, out, err = await sh(guarded, f"""
        rm -rf /tmp/many; mkdir /tmp/many
        for i in $(seq 200); do {LOADER} /bin/touch /tmp/many/$i 2>/dev/null & done; wait
        ls /tmp/many | wc -l""")
    assert (code, out) == (0, "0\n"), err
    kills = kills_of(guard, guarded)
    assert kills and all(k.signal_error == 0 and k.reason == "loader" for k in kills)
    assert len(kills) + guard.dropped(guarded.sandbox.host_uids[0]) >= 200
