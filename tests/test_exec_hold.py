"""The exec hold (agentcell/policy/linux/exec_hold.py), for real: execs in real sandboxes of the linux
backend wait in the kernel (fanotify FAN_OPEN_EXEC_PERM) while `ask` waits, and go on after.

The sandboxes run the backend's probe agent, which runs one command at a time and waits for it: a
command whose exec is held is started in the background of a shell (or as a task of the test), the
way the real agent must start them while execs can be held (it forks then, not vfork: see
test_vfork_spawner_freezes_fork_does_not). Run as root on Linux.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from helpers import ProbeBox, probe_backend

from agentcell.backends.linux.backend import LinuxBackend
from agentcell.policy.linux import exec_hold
from agentcell.policy.linux.exec_hold import ExecHold, HeldExec

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/self/ns/user"),
                                reason="the linux backend needs root and user namespaces")

HELD = "/home/user/held"  # a copy of /bin/echo in the sandbox: the program whose execs are asked about
LOADER = "ld-linux"


@pytest.fixture(scope="module")
async def backend() -> AsyncIterator[LinuxBackend]:
    async with probe_backend() as be:
        yield be


async def _box(backend: LinuxBackend) -> AsyncIterator[ProbeBox]:
    b = await ProbeBox.create(backend, prefix="h")
    assert (await b.run("cp", "/bin/echo", HELD))[0] == 0
    yield b
    await b.channel.close()
    await backend.kill(b.sandbox)


@pytest.fixture(scope="module")
async def box(backend: LinuxBackend) -> AsyncIterator[ProbeBox]:
    async for b in _box(backend):
        yield b


@pytest.fixture(scope="module")
async def other(backend: LinuxBackend) -> AsyncIterator[ProbeBox]:
    async for b in _box(backend):
        yield b


class Asker:
    """The caller's side: which files need asking (by identity), and an ask that waits for `gate`."""

    def __init__(self, box: ProbeBox, *paths: str, everything: bool = False, delay: float | None = None) -> None:
        root = f"/proc/{box.sandbox.host_pid}/root"
        self.targets = {_identity(os.stat(root + p)) for p in paths}
        self.everything = everything
        self.delay = delay  # answer after this long, or when `gate` is set (None)
        self.gate = asyncio.Event()
        self.asked: list[HeldExec] = []
        self.cancelled: list[HeldExec] = []
        self.checked = 0

    def needs_asking(self, fd: int) -> bool:
        self.checked += 1
        return self.everything or _identity(os.fstat(fd)) in self.targets

    async def ask(self, held: HeldExec) -> None:
        assert held.fd >= 0 and _identity(os.fstat(held.fd))  # the exact file, open while asked about
        self.asked.append(held)
        try:
            if self.delay is not None:
                await asyncio.sleep(self.delay)
            else:
                await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(held)
            raise


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


async def until(what: str, check: Callable[[], Any], timeout: float = 10) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return got


def in_box(box: ProbeBox, path: str) -> str:
    return f"/proc/{box.sandbox.host_pid}/root{path}"


def exists(box: ProbeBox, path: str) -> bool:
    return os.path.exists(in_box(box, path))


async def background(box: ProbeBox, script: str) -> None:
    """Run `script` in the background of a shell in the sandbox (the probe returns at once)."""
    code, _, err = await box.run("sh", "-c", f"({script}) >/dev/null 2>&1 &")
    assert code == 0, err


def held_fds(held: HeldExec, ident: tuple[int, int]) -> list[int]:
    """Our fds still open on the held file (event fds left behind)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if _identity(os.stat(f"/proc/self/fd/{name}")) == ident:
                out.append(int(name))
        except OSError:
            pass
    return out


def alive(host_pid: int) -> bool:
    try:
        with open(f"/proc/{host_pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_exec_waits_for_ask_and_goes_on_after(box: ProbeBox) -> None:
    asker = Asker(box, HELD)
    async with ExecHold(box.sandbox.host_pid, asker.needs_asking, asker.ask, ask_timeout=30) as hold:
        await box.run("rm", "-f", "/tmp/out")
        t0 = time.monotonic()
        await background(box, f"{HELD} hello > /tmp/out")
        await until("the exec to be held", lambda: asker.asked)
        # held: the program has not run, and the sandbox goes on meanwhile (the shell ran it in the background)
        await asyncio.sleep(0.5)
        assert not exists(box, "/tmp/out") or open(in_box(box, "/tmp/out")).read() == ""
        assert (await box.run("echo", "meanwhile"))[1] == "meanwhile\n"
        assert hold.pending == asker.asked and asker.asked[0].outcome == "pending"
        asker.gate.set()
        await until("the program to run", lambda: exists(box, "/tmp/out")
                    and open(in_box(box, "/tmp/out")).read() == "hello\n")
        print(f"held for {time.monotonic() - t0:.2f} s")
        assert asker.asked[0].outcome == "asked" and asker.asked[0].fd == -1 and not hold.pending
        # asked once: the loader (ld.so) opened by the approved exec was not (needs_asking said no)
        assert hold.stats.asked == 1 and hold.stats.events >= 2 and asker.checked == hold.stats.events


async def test_not_asked_costs_little(box: ProbeBox) -> None:
    n, rounds = 500, 5
    script = f"i=0; while [ $i -lt {n} ]; do /bin/true; i=$((i+1)); done"

    async def timed() -> float:
        t0 = time.perf_counter()
        code, _, err = await box.run("sh", "-c", script)
        assert code == 0, err
        return time.perf_counter() - t0

    await timed()  # warm
    without, with_hold = [], []
    asker = Asker(box)
    for _ in range(rounds):  # alternated: the machine's other load weighs on both alike
        without.append(await timed())
        async with ExecHold(box.sandbox.host_pid, asker.needs_asking, asker.ask, ask_timeout=30) as hold:
            with_hold.append(await timed())
            # every exec was seen (the program, then its loader) and none waited
            assert hold.stats.events >= 2 * n and hold.stats.asked == 0 and not asker.asked
    per_exec_us = (min(with_hold) - min(without)) / n * 1e6
    print(f"{n} execs of /bin/true from sh, best of {rounds}: {min(without) * 1000:.0f} ms without the hold, "
          f"{min(with_hold) * 1000:.0f} ms with it (nothing asked): {per_exec_us:+.0f} µs per exec (2 events: "
          f"the program and ld.so); {hold.marked} mounts marked")
    assert per_exec_us < 2000


async def test_argv_and_tree(box: ProbeBox) -> None:
    asker = Asker(box, HELD)
    script = f'echo $$; {HELD} one "two words"; echo $?'
    async with ExecHold(box.sandbox.host_pid, asker.needs_asking, asker.ask, ask_timeout=30):
        run = asyncio.create_task(box.run("sh", "-c", script))
        held = (await until("the exec to be held", lambda: asker.asked))[0]
        asker.gate.set()
        code, out, _ = await run
    shell_pid = int(out.split()[0])
    assert out.split()[1:] == ["one", "two", "words", "0"]
    assert held.path == HELD and held.filename == HELD and held.argv == [HELD, "one", "two words"]
    me, shell, *rest = held.tree
    # the exec'ing process (still the shell's fork: its name and command line are the shell's), the
    # shell, then up to the sandbox's init (pid 1, the probe), nothing of the host's
    assert held.pid == me.pid and held.pid not in (None, 1, shell_pid) and me.host_pid == held.host_pid
    assert (shell.pid, shell.comm, shell.argv) == (shell_pid, "sh", ["sh", "-c", script])
    assert rest and rest[-1].pid == 1 and all(p.pid is not None for p in held.tree)
    assert held.to_json()["tree"][1] == {"pid": shell_pid, "comm": "sh", "argv": ["sh", "-c", script]}


async def test_execveat_argv(box: ProbeBox) -> None:
    """fexecve (execveat(fd, "", AT_EMPTY_PATH)): the same file, the claim read from execveat's arguments."""
    asker = Asker(box, HELD)
    code = f"import os; fd = os.open({HELD!r}, os.O_RDONLY); os.execve(fd, ['renamed', 'x'], {{}})"
    async with ExecHold(box.sandbox.host_pid, asker.needs_asking, asker.ask, ask_timeout=30):
        run = asyncio.create_task(box.run("python3", "-c", code))
        held = (await until("the exec to be held", lambda: asker.asked))[0]
        asker.gate.set()
        assert (await run)[:2] == (0, "x\n")
    assert held.path == HELD and held.filename == "" and held.argv == ["renamed", "x"]
    assert held.tree[0].comm.startswith("python")


async def test_exec_from_a_thread(box: ProbeBox) -> None:
    """An exec from a thread other than the main one: the claim is read from that thread's syscall."""
    asker = Asker(box, HELD)
    code = (f"import os, threading, time\n"
            f"threading.Thread(target=os.execv, args=({HELD!r}, ['from-thread', 'y'])).start()\ntime.sleep(30)")
    async with ExecHold(box.sandbox.host_pid, asker.needs_asking, asker.ask, ask_timeout=30):
        run = asyncio.create_task(box.run("python3", "-c", code))
        held = (await until("the exec to be held", lambda: asker.asked))[0]
        asker.gate.set()
        assert (await run)[:2] == (0, "y\n")
    assert held.argv == ["from-thread", "y"] and held.filename == HELD
    assert held.tree[0].host_pid != held.host_pid  # the thread's id, its process's in the tree
    assert held.pid is not None and held.tree[0].pid is not None and held.pid != held.tree[0].pid


async def test_script_and_loader_do_not_deadlock(box: ProbeBox) -> None:
    """Every exec open asked about, the loader's and a script interpreter's too (each opened during an
    exec already let on): each waits its turn, is described in full, and the command finishes."""
    await box.run("sh", "-c", f"printf '#!/bin/sh\\n{HELD} from-script \"$@\"\\n' > /tmp/s.sh && chmod +x /tmp/s.sh")
    asker = Asker(box, everything=True, delay=0.05)
    async with ExecHold(box.sandbox.host_pid, asker.needs_asking, asker.ask, ask_timeout=30) as hold:
        t0 = time.monotonic()
        code, out, err = await asyncio.wait_for(box.run("/tmp/s.sh", "arg"), 20)
        assert (code, out) == (0, "from-script arg\n"), err
        print(f"script with every exec open asked ({len(asker.asked)}): {time.monotonic() - t0:.2f} s")
    paths = [h.path for h in asker.asked]
    script = paths.index("/tmp/s.sh")
    # the script, its interpreter (dash), the loader of the interpreter, then the program and its loader
    assert paths[script + 1] == "/usr/bin/dash" and LOADER in paths[script + 2], paths
    assert paths[script + 3] == HELD and LOADER in paths[script + 4], paths
    # the interpreter's and the loader's events belong to the script's exec: its argv, read during them
    for h in asker.asked[script:script + 3]:
        assert h.argv == ["/tmp/s.sh", "arg"] and h.filename == "/tmp/s.sh", h
    assert asker.asked[script + 4].argv == [HELD, "from-script", "arg"]
    assert hold.stats.timeouts == hold.stats.errors == 0


async def test_held_process_can_be_killed(box: ProbeBox) -> None:
    asker = Asker(box, HELD)
    ident = _identity(os.stat(in_box(box, HELD)))
    async with ExecHold(box.sandbox.host_pid, asker.needs_asking, asker.ask, ask_timeout=30) as hold:
        await background(box, f"{HELD} never")
        held = (await until("the exec to be held", lambda: asker.asked))[0]
        pid = held.tree[0].host_pid
        assert alive(pid) and held_fds(held, ident)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        await until("the killed process to die", lambda: not alive(pid), timeout=5)
        print(f"SIGKILL of a held process: dead in {(time.monotonic() - t0) * 1000:.1f} ms")
        await until("its ask to be cancelled", lambda: asker.cancelled)
        assert held.outcome == "exited" and hold.stats.exited == 1 and not hold.pending
        assert not held_fds(held, ident)  # its event fd closed
        # the sandbox goes on, and the next exec of the same program is held again
        await background(box, f"{HELD} again > /tmp/again")
        await until("the next exec to be held", lambda: len(asker.asked) == 2)
        asker.gate.set()
        await until("it to run", lambda: exists(box, "/tmp/again"))


async def test_flood_is_bounded(box: ProbeBox) -> None:
    asker = Asker(box, HELD)
    n, bound = 10, 3
    await box.run("sh", "-c", "rm -rf /tmp/flood && mkdir /tmp/flood")
    async with ExecHold(box.sandbox.host_pid, asker.needs_asking, asker.ask, ask_timeout=30,
                        max_pending=bound) as hold:
        await background(box, f"for i in $(seq {n}); do {HELD} x > /tmp/flood/$i & done; wait")
        # `bound` wait; the others were let on at once, without asking (BPF refuses them)
        await until("the others to run", lambda: sum(
            open(in_box(box, f"/tmp/flood/{i}")).read() == "x\n" for i in range(1, n + 1)
            if exists(box, f"/tmp/flood/{i}")) == n - bound)
        assert len(asker.asked) == len(hold.pending) == bound and hold.stats.overflowed == n - bound
        asker.gate.set()
        await until("all to run", lambda: all(exists(box, f"/tmp/flood/{i}") and open(
            in_box(box, f"/tmp/flood/{i}")).read() == "x\n" for i in range(1, n + 1)))
        assert hold.stats.asked == bound


async def test_timeout_lets_on(box: ProbeBox) -> None:
    asker = Asker(box, HELD)
    async with ExecHold(box.sandbox.host_pid, asker.needs_asking, asker.ask, ask_timeout=0.5) as hold:
        t0 = time.monotonic()
        code, out, _ = await box.run(HELD, "late")  # the probe waits for it: it waits for the timeout
        waited = time.monotonic() - t0
    assert (code, out) == (0, "late\n") and 0.5 <= waited < 5, waited
    assert asker.asked[0].outcome == "timeout" and asker.cancelled and hold.stats.timeouts == 1


async def test_other_sandboxes_and_host_are_not_seen(box: ProbeBox, other: ProbeBox) -> None:
    asker = Asker(box, everything=True, delay=0)
    async with ExecHold(box.sandbox.host_pid, asker.needs_asking, asker.ask, ask_timeout=30) as hold:
        assert (await other.run(HELD, "other"))[1] == "other\n"
        assert (await other.run("sh", "-c", "true; /bin/true"))[0] == 0
        proc = await asyncio.create_subprocess_exec("/bin/true")
        assert await proc.wait() == 0
        await asyncio.sleep(0.2)
        assert hold.stats.events == 0 and not asker.asked
        # the host reaching into the sandbox's files is seen (its mounts are marked) but never held
        # (from a thread: the loop that answers must not itself wait for that exec to be through)
        r = await asyncio.to_thread(subprocess.run, [in_box(box, HELD), "host"], capture_output=True, timeout=10)
        assert r.stdout == b"host\n"
        assert hold.stats.events >= 1 and hold.stats.foreign >= 1 and not asker.asked
        # ... and the sandbox's own execs are
        assert (await box.run(HELD, "own"))[1] == "own\n"
        assert asker.asked and hold.stats.asked >= 1


async def test_close_lets_everything_on(box: ProbeBox) -> None:
    asker = Asker(box, HELD)
    ident = _identity(os.stat(in_box(box, HELD)))
    await box.run("sh", "-c", "rm -f /tmp/c1 /tmp/c2")
    hold = ExecHold(box.sandbox.host_pid, asker.needs_asking, asker.ask, ask_timeout=30)
    hold.start()
    group = hold._group
    await background(box, f"{HELD} one > /tmp/c1 & {HELD} two > /tmp/c2")
    await until("both execs to be held", lambda: len(asker.asked) == 2)
    await asyncio.sleep(0.3)
    assert not exists(box, "/tmp/c1") or open(in_box(box, "/tmp/c1")).read() == ""
    await hold.close()
    await until("both to run", lambda: all(
        exists(box, f) and open(in_box(box, f)).read() for f in ("/tmp/c1", "/tmp/c2")))
    assert len(asker.cancelled) == 2 and {h.outcome for h in asker.asked} == {"closed"}
    assert not held_fds(asker.asked[0], ident) and not hold.pending
    assert not os.path.exists(f"/proc/self/fd/{group}") or os.readlink(f"/proc/self/fd/{group}") != "anon_inode:[fanotify]"


async def test_a_new_mount_is_marked(box: ProbeBox) -> None:
    """A mount the server adds later (a file rule) is marked: on its own when the sandbox's mount table
    changes, and by refresh() (the caller's, right after mounting)."""
    asker = Asker(box, HELD, delay=0)
    pid = box.sandbox.host_pid
    async with ExecHold(pid, asker.needs_asking, asker.ask, ask_timeout=30) as hold:
        before = hold.marked
        await asyncio.sleep(0.3)
        assert hold.refreshes == 0  # quiet while nothing changes
        # the server's way in (H-files does it from a thread): a bind of /home/user over itself
        code = await (await asyncio.create_subprocess_exec(
            "nsenter", f"--mount=/proc/{pid}/ns/mnt", "mount", "--bind", "/home/user", "/home/user")).wait()
        assert code == 0
        try:
            await until("the mount change to be seen", lambda: hold.refreshes)
            assert (await box.run(HELD, "new mount"))[1] == "new mount\n" and len(asker.asked) == 1
            assert hold.refreshes == 1
            assert hold.refresh() == before  # the new mount marked, the one it covers out of reach
        finally:
            await (await asyncio.create_subprocess_exec(
                "nsenter", f"--mount=/proc/{pid}/ns/mnt", "umount", "/home/user")).wait()
        await until("the unmount to be seen", lambda: hold.refreshes >= 2)
        assert (await box.run(HELD, "old mount"))[1] == "old mount\n" and len(asker.asked) == 2


async def test_mount_lookup_stays_in_the_sandbox(box: ProbeBox) -> None:
    """The mounts are opened by their sandbox paths below its root: a symlink the sandbox plants leads
    to its own files, never the host's, and every mark is checked against the mount's id."""
    await box.run("sh", "-c", "rm -f /tmp/up /tmp/host && ln -s / /tmp/up && ln -s /proc/1/root /tmp/host")
    pid = box.sandbox.host_pid
    listed = {m.point: m.id for m in exec_hold.mounts(pid)}
    root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_CLOEXEC)
    try:
        fd = exec_hold.open_in_root(root, "/tmp/up/home/user")
        try:
            assert exec_hold._mount_id(fd) == listed["/home/user"]
        finally:
            os.close(fd)
        with pytest.raises(OSError):  # a magic link (/proc/<pid>/root) is never followed
            os.close(exec_hold.open_in_root(root, "/tmp/host/etc"))
    finally:
        os.close(root)
    host = {m.id for m in exec_hold.mounts(os.getpid())}
    assert not host & set(listed.values())  # the sandbox's mounts are its own copies


async def test_vfork_spawner_freezes_fork_does_not(box: ProbeBox) -> None:
    """Why the agent must fork, not posix_spawn (vfork), while execs can be held: posix_spawn blocks the
    spawning thread, GIL held, until the child's exec is through; every other thread of the agent stops."""
    code = textwrap.dedent(f"""
        import os, sys, threading, time
        ticks = []
        stop = False
        def tick():
            while not stop:
                ticks.append(time.monotonic()); time.sleep(0.01)
        t = threading.Thread(target=tick); t.start(); time.sleep(0.1)
        if sys.argv[1] == 'spawn':
            pid = os.posix_spawn({HELD!r}, ['held', 'x'], {{}})
        else:
            pid = os.fork()
            if pid == 0:
                os.execv({HELD!r}, ['held', 'x'])
        os.waitpid(pid, 0)
        time.sleep(0.1); stop = True; t.join()
        print(max(b - a for a, b in zip(ticks, ticks[1:])))
    """)
    asker = Asker(box, HELD, delay=1.0)
    gaps = {}
    async with ExecHold(box.sandbox.host_pid, asker.needs_asking, asker.ask, ask_timeout=30):
        for how in ("spawn", "fork"):
            rc, out, err = await box.run("python3", "-c", code, how)
            assert rc == 0, err
            gaps[how] = float(out.split()[-1])
    print(f"the agent's other threads stopped for at most: posix_spawn {gaps['spawn']:.2f} s, "
          f"fork {gaps['fork']:.3f} s (exec held 1 s)")
    assert len(asker.asked) == 2 and gaps["spawn"] > 0.8 and gaps["fork"] < 0.3


def _unavailable_in_child(setup: str) -> str:
    """ExecHold's answer in a fresh process set up by `setup` (the host's own limits stay untouched)."""
    code = (f"from agentcell.policy.linux import exec_hold\n{setup}\n"
            "try:\n    exec_hold.new_group()\nexcept exec_hold.ExecHoldUnavailable as e:\n    print('unavailable:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_unavailable_is_typed_and_says_what_to_do() -> None:
    assert exec_hold.available() is None  # root, on this kernel
    # no group to be had (here: no fd for it; the same errno as fs.fanotify.max_user_groups reached)
    out = _unavailable_in_child("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (3, 3))")
    assert out.startswith("unavailable:") and "max_user_groups" in out and "sysctl -w" in out, out
    # not root
    out = _unavailable_in_child("import os; os.setgroups([]); os.setgid(65534); os.setuid(65534)")
    assert out.startswith("unavailable:") and "CAP_SYS_ADMIN" in out, out
