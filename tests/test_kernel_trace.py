"""The kernel tracer (record/linux/kernel_trace.py): eBPF programs that report the execs, exits and
refused path syscalls of a host uid range. Real processes, exec'd as uids of a range no sandbox uses."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from agentcell.record.linux.audit_proc import Exit
from agentcell.record.linux.kernel_trace import DENIALS, Denial, Exec, KernelTrace, KernelTraceUnavailable

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loading eBPF needs root")

FIRST, LAST = 3_500_000, 3_500_009  # above every agentcell range of these tests, below 2^31


@pytest.fixture
def trace() -> Iterator[KernelTrace]:
    t = KernelTrace(FIRST, LAST, budget=50)
    try:
        yield t
    finally:
        t.close()


def as_uid(uid: int, *argv: str, cwd: str = "/") -> None:
    subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv], cwd=cwd,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def read_all(trace: KernelTrace) -> list[Exec | Denial | Exit]:
    time.sleep(0.05)
    return trace.read()


def execs_of(trace: KernelTrace) -> list[Exec]:
    return [e for e in read_all(trace) if isinstance(e, Exec)]


def test_an_exec_with_its_arguments_directory_and_binary(trace: KernelTrace) -> None:
    as_uid(FIRST, "/bin/sh", "-c", "cd /usr/lib && exec ./../bin/true 'two words' \"$(printf 'na\\303\\257ve')\"",
           cwd="/tmp")
    execs = execs_of(trace)
    sh = next(e for e in execs if e.argv[:2] == ["/bin/sh", "-c"])
    true = next(e for e in execs if e.argv[0] == "./../bin/true")
    assert sh.cwd == "/tmp" and sh.file == "/bin/sh" and sh.exe == "/usr/bin/dash" and sh.uid == FIRST
    # the same process exec'd again: its pid, its new program, where it was run from
    assert true.host_pid == sh.host_pid and true.comm == "true"
    assert true.argv == ["./../bin/true", "two words", "naïve"] and not true.argv_cut
    assert true.cwd == "/usr/lib" and true.file == "./../bin/true" and true.exe == "/usr/bin/true"
    assert true.pids == (true.host_pid,)  # the host's pid namespace: one level


def test_other_uids_are_not_traced(trace: KernelTrace) -> None:
    as_uid(LAST + 1, "/bin/true", "outside")
    as_uid(FIRST - 1, "/bin/true", "outside")
    as_uid(LAST, "/bin/true", "inside")
    assert [e.argv for e in execs_of(trace)] == [["/bin/true", "inside"]]


def test_long_arguments_are_cut_and_say_so(trace: KernelTrace) -> None:
    as_uid(FIRST, "/bin/true", "a", "x" * 70_000)
    (e,) = execs_of(trace)
    assert e.argv_cut and e.argv[:2] == ["/bin/true", "a"] and 60_000 < len(e.argv[2]) < 70_000


def test_a_flood_is_counted_over_the_budget_and_a_muted_uid_is_not_written(trace: KernelTrace) -> None:
    as_uid(FIRST + 1, "/bin/sh", "-c", "for i in $(seq 80); do /bin/true; done")
    execs = execs_of(trace)
    # sh, seq and 80 trues: the window's budget of 50 written (more if the loop outlasted a window),
    # the rest counted
    assert 50 <= len(execs) < 82 and len(execs) + trace.dropped(FIRST + 1) == 82
    trace.mute(FIRST + 2)
    as_uid(FIRST + 2, "/bin/true", "muted")
    assert execs_of(trace) == [] and trace.dropped(FIRST + 2) == 1
    trace.mute(FIRST + 2, False)
    as_uid(FIRST + 2, "/bin/true", "heard")
    assert [e.argv for e in execs_of(trace)] == [["/bin/true", "heard"]]
    assert trace.lost() == 0


def test_a_missing_compiler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    from agentcell.record.linux import bpf_build, kernel_trace

    monkeypatch.setattr(kernel_trace, "CACHE", tmp_path)  # (a checkout ships no compiled object: setup.py does)
    monkeypatch.setattr(bpf_build, "CLANGS", ("no-such-clang",))
    with pytest.raises(KernelTraceUnavailable, match="no clang"):
        KernelTrace(FIRST, LAST)


@pytest.mark.parametrize("denials", DENIALS)
def test_refused_path_calls_name_their_path_and_syscall(denials: str) -> None:
    """Either program: a refusal by the permission bits (EACCES), by ownership (EPERM), named as the call
    named it; a failure that is no refusal (ENOENT) is not one. A read-only mount's EROFS involves no
    permission check: only the sys_exit program ("syscalls") sees it."""
    with tempfile.TemporaryDirectory() as ro:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,mode=0777", "tmpfs", ro], check=True)
        trace = KernelTrace(FIRST, LAST, budget=50, denials=denials)
        try:
            as_uid(FIRST, "/bin/sh", "-c", "cat /root/.bashrc; cd /usr && rm -f lib/os-release; chmod 777 /etc/passwd; "
                   f"mkdir /proc/x; ls /tmp; touch {ro}/new", cwd="/tmp")
            denials_seen = {d.path: d for d in read_all(trace) if isinstance(d, Denial)}
        finally:
            trace.close()
            subprocess.run(["umount", ro], check=True)
    assert denials_seen["/root/.bashrc"].errno == 13 and denials_seen["/root/.bashrc"].nr == 257  # openat
    assert denials_seen["/root/.bashrc"].open_flags & 0o3 == 0  # a read
    assert denials_seen["/usr/lib/os-release"].nr == 263 and denials_seen["/usr/lib/os-release"].comm == "rm"  # relative
    assert denials_seen["/etc/passwd"].errno == 1 and denials_seen["/etc/passwd"].nr == 268  # fchmodat, EPERM
    if denials == "syscalls":
        assert denials_seen[f"{ro}/new"].errno == 30 and denials_seen[f"{ro}/new"].comm == "touch"
        assert len(denials_seen) == 4  # mkdir in /proc: ENOENT, not a refusal; ls: nothing refused
    else:
        assert len(denials_seen) == 3, denials_seen  # one event per refusal; EROFS unseen


def test_a_privileged_process_and_capability_checks_that_fail_no_call_write_nothing(trace: KernelTrace) -> None:
    """The capability program: root's checks (granted), and the capability checks a call makes without
    failing (an mmap's CAP_SYS_ADMIN for the overcommit, a chmod's CAP_FSETID, a link's mode check, a
    touch's CAP_FOWNER) are no refusal."""
    with tempfile.TemporaryDirectory() as shared:
        os.chmod(shared, 0o2777)  # set-group-ID, group root: a file made in it is of a group not the caller's
        with open(f"{shared}/theirs", "w"):
            os.chmod(f"{shared}/theirs", 0o666)
        as_uid(FIRST, "/usr/bin/python3", "-c", "import mmap, os, sys\n"
               "m = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE); m[0] = 1\n"
               f"p = '{shared}/f'; open(p, 'w').close(); os.chmod(p, 0o2755)\n"
               "open(p + '.mode', 'w').write(oct(os.stat(p).st_mode & 0o7777))\n"  # the kernel dropped S_ISGID
               # its own read-only file linked (as git does its objects; protected_hardlinks asks
               # whether it may read and write it first), another's writable file touched to now
               f"os.chmod(p, 0o444); os.link(p, '{shared}/g'); os.utime('{shared}/theirs')")
        assert open(f"{shared}/f.mode").read() == "0o755"
        assert os.stat(f"{shared}/f").st_mode & 0o7777 == 0o444 and os.path.exists(f"{shared}/g")
        subprocess.run(["/bin/sh", "-c", "cat /root/.bashrc > /dev/null"], check=False)  # root: nothing refused
        assert [d for d in read_all(trace) if isinstance(d, Denial)] == []


def test_exits_of_the_processes_that_exec_d_with_code_or_signal(trace: KernelTrace) -> None:
    # exit 3 after exec; killed by SIGKILL; a fork that never exec'd (the subshell) and a thread: no exit
    as_uid(FIRST, "/usr/bin/python3", "-c", "import os, signal, subprocess, threading\n"
           "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
           "subprocess.run(['/bin/sh', '-c', 'exit 3'])\n"
           "p = subprocess.Popen(['/bin/sleep', '30'])\n"
           # Popen returns once the exec closed its error pipe, before the exec's tracepoint fired: killed
           # then, sleep would have no exec written (nor its exit). Wait until it sleeps (nr 230).
           "import time; t = time.monotonic()\n"
           "while not open(f'/proc/{p.pid}/syscall').read().startswith('230 ') and time.monotonic() - t < 5: pass\n"
           "p.send_signal(signal.SIGKILL); p.wait()\n"
           "pid = os.fork()\n"
           "os._exit(0) if pid == 0 else os.waitpid(pid, 0)\n"
           "os._exit(7)")
    got = read_all(trace)
    execs = {e.host_pid: e for e in got if isinstance(e, Exec)}
    exits = [x for x in got if isinstance(x, Exit)]
    by_prog = {execs[x.host_pid].argv[0]: x for x in exits}
    assert len(exits) == len(by_prog) == 3  # python, sh, sleep: each once, each after its exec
    assert by_prog["/usr/bin/python3"].code == 7
    assert by_prog["/bin/sh"].code == 3
    assert by_prog["/bin/sleep"].signal == 9 and by_prog["/bin/sleep"].code is None
    for x in exits:
        assert got.index(execs[x.host_pid]) < got.index(x) and x.monotonic_ns >= execs[x.host_pid].monotonic_ns


def test_a_read_takes_at_most_its_limit_and_leaves_the_rest_in_order(trace: KernelTrace) -> None:
    as_uid(FIRST, "/bin/sh", "-c", "for i in 1 2 3 4 5 6; do /bin/echo $i; done")
    time.sleep(0.05)
    first = trace.read(4)
    rest = trace.read()
    assert len(first) == 4 and trace.read() == []
    execs = [e.argv for e in first + rest if isinstance(e, Exec)]
    assert execs == [["/bin/sh", "-c", "for i in 1 2 3 4 5 6; do /bin/echo $i; done"]] + [
        ["/bin/echo", str(i)] for i in range(1, 7)]
