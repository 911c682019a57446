"""Exec rules in the kernel (policy/linux/exec_lsm.py, bpf/exec_policy.bpf.c) and the files their patterns
name inside a sandbox (policy/linux/exec_targets.py), with real sandboxes of the linux backend and real
exec attempts in them.

Every refusal test first shows the same attempt succeeding without the rule (the sandbox's mode allow,
or before the mark), then refused with it: the test fails if the kernel does not enforce. The
enforcement tests need a kernel that loads BPF LSM programs: elsewhere they are skipped with
ExecPolicyUnavailable's reason (what the host lacks), which the first test checks is typed and says so.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import statistics
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from helpers import ProbeBox, probe_backend

from agentcell.backends.linux.backend import LinuxBackend
from agentcell.errors import BackendUnavailableError
from agentcell.policy.linux import exec_targets
from agentcell.policy.linux.exec_lsm import ExecLsm, ExecPolicyFull, ExecPolicyUnavailable
from agentcell.policy.linux.exec_targets import ExecPatternError
from agentcell.record.linux import bpf_build, bpf_objects

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/self/ns/user"),
                                reason="the linux backend needs root and user namespaces")

SHELLS = ("bash", "sh")  # the command shell: always allowed (the enforcer's rule)
LS_OUTPUT = "proc"  # `ls /` in a sandbox lists it
PYTHON = "/opt/agentcell/venv/bin/python3"  # the sandbox's python3 (first on its PATH)


@pytest.fixture(scope="module")
async def backend() -> AsyncIterator[LinuxBackend]:
    async with probe_backend() as be:
        yield be


_LOADED: list[ExecLsm | ExecPolicyUnavailable] = []


def _load() -> ExecLsm | ExecPolicyUnavailable:
    if not _LOADED:
        try:
            _LOADED.append(ExecLsm())
        except ExecPolicyUnavailable as e:
            _LOADED.append(e)
    return _LOADED[0]


@pytest.fixture(scope="module")
def lsm() -> Iterator[ExecLsm]:
    got = _load()
    if isinstance(got, ExecPolicyUnavailable):
        pytest.skip(f"exec rules cannot be enforced here: {got}")
    yield got


def teardown_module() -> None:
    if _LOADED and isinstance(_LOADED[0], ExecLsm):
        _LOADED[0].close()
        _LOADED.clear()


class Box(ProbeBox):
    slot = -1

    async def sh(self, script: str) -> tuple[int, str, str]:
        return await self.run("bash", "-c", script, timeout=30)

    @property
    def pid(self) -> int:
        return self.sandbox.host_pid


async def policed(backend: LinuxBackend, lsm: ExecLsm, mode: str, allow: tuple[str, ...] = (),
                  deny: tuple[str, ...] = (), once: tuple[str, ...] = (), setup: str = "") -> Box:
    """A sandbox under a policy: `setup` run first (without rules), then the patterns marked (the
    shells allowed), its loaders marked, its mode set."""
    b = await Box.create(backend)
    if setup:
        assert (await b.sh(setup))[0] == 0
    b.slot = lsm.add_sandbox(b.sandbox.host_uids)
    await apply(lsm, b, allow=(*SHELLS, *allow), deny=deny, once=once)
    for t in exec_targets.loaders(b.pid):
        lsm.mark_loader(b.slot, t.fd)
        os.close(t.fd)
    lsm.set_mode(b.slot, mode)
    return b


async def apply(lsm: ExecLsm, b: Box, **verdicts: tuple[str, ...]) -> None:
    for verdict, patterns in verdicts.items():
        targets = exec_targets.resolve(b.pid, patterns, extra_dirs=["/home/user/bin"])
        assert {t.pattern for t in targets} == set(patterns), f"{verdict}: some pattern matched nothing"
        for t in targets:
            lsm.mark(b.slot, t.fd, verdict)
            os.close(t.fd)


async def gone(backend: LinuxBackend, lsm: ExecLsm, b: Box) -> None:
    lsm.remove_sandbox(b.slot)
    await b.channel.close()
    await backend.kill(b.sandbox)


def refused(out: tuple[int, str, str]) -> bool:
    return out[0] == 126 and "Permission denied" in out[2]


# -- the host ----------------------------------------------------------------------------------------


def test_an_unavailable_host_is_a_typed_error_saying_what_is_missing() -> None:
    got = _load()
    if isinstance(got, ExecLsm):
        return  # this host enforces: the other tests run
    assert isinstance(got, BackendUnavailableError)
    assert any(w in str(got) for w in ("BPF LSM", "root", "BTF", "libbpf", "clang")), str(got)


def test_the_policy_object_compiles_under_its_own_name(tmp_path: os.PathLike[str]) -> None:
    """bpf_build names objects by their source's stem: the exec policy's and the tracer's side by side."""
    from agentcell.policy.linux import exec_lsm
    from agentcell.record.linux import kernel_trace

    obj = bpf_objects.compiled(exec_lsm.SOURCE, tmp_path, ExecPolicyUnavailable)
    assert obj.name.startswith("exec_policy-") and obj.name.endswith(f"-{bpf_build.machine()}.bpf.o")
    assert obj.read_bytes()[:4] == b"\x7fELF"
    assert bpf_build.object_name(kernel_trace.SOURCE.read_bytes()).startswith("kernel_trace-")
    assert bpf_objects.compiled(exec_lsm.SOURCE, tmp_path, ExecPolicyUnavailable) == obj  # cached


# -- patterns -> files in the sandbox ---------------------------------------------------------------


async def in_sandbox_identity(b: Box, path: str) -> tuple[int, int]:
    code, out, err = await b.sh(f"stat -L -c '%d %i' {shlex.quote(path)}")
    assert code == 0, err
    dev, ino = out.split()
    return int(dev), int(ino)


def open_in_usr() -> list[str]:
    """This process's fds of files under some /usr/ (exec_targets' fds of a sandbox's files)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/usr/"):
                found.append(fd)
    return found


def identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


async def test_patterns_name_the_sandboxs_files(backend: LinuxBackend) -> None:
    b = await Box.create(backend)
    try:
        targets = exec_targets.resolve(b.pid, ["python3", "git", "pip*", "/usr/bin/tru?", "no-such-program"])
        try:
            by = {(t.pattern, t.path): t.fd for t in targets}
            assert ("git", "/usr/bin/git") in by and ("/usr/bin/tru?", "/usr/bin/true") in by
            assert {p for (pat, p) in by if pat == "pip*"} >= {"/usr/bin/pip3"}
            assert not any(pat == "no-such-program" for pat, _ in by)
            for (_pat, path), fd in by.items():  # the file the sandbox's own lookup finds
                assert identity(fd) == await in_sandbox_identity(b, path), path
        finally:
            for t in targets:
                os.close(t.fd)
    finally:
        await b.channel.close()
        await backend.kill(b.sandbox)


async def test_symlinks_resolve_inside_the_sandbox_never_on_the_host(backend: LinuxBackend) -> None:
    """Absolute and ../-escaping symlinks the sandbox plants lead to its own files; a magic link (into
    /proc) leads nowhere."""
    b = await Box.create(backend)
    try:
        code, _, err = await b.sh("mkdir -p ~/bin && ln -s /etc/hostname ~/bin/abs && "
                                  "ln -s ../../../../../../../etc/hostname ~/bin/rel && "
                                  "ln -s /proc/self/root/etc/hostname ~/bin/magic")
        assert code == 0, err
        targets = exec_targets.resolve(b.pid, ["abs", "rel", "magic"], extra_dirs=["/home/user/bin"])
        try:
            assert sorted(t.pattern for t in targets) == ["abs", "rel"]
            theirs = await in_sandbox_identity(b, "/etc/hostname")
            ours = os.stat("/etc/hostname")
            for t in targets:
                assert identity(t.fd) == theirs != (ours.st_dev, ours.st_ino)
        finally:
            for t in targets:
                os.close(t.fd)
    finally:
        await b.channel.close()
        await backend.kill(b.sandbox)


async def test_a_pattern_matching_too_many_files_is_refused_naming_it(backend: LinuxBackend) -> None:
    b = await Box.create(backend)
    try:
        with pytest.raises(ExecPatternError, match=r"'\*' matches more than 256 files") as e:
            exec_targets.resolve(b.pid, ["git", "*"])
        assert e.value.pattern == "*"
        with pytest.raises(ExecPatternError, match="absolute path"):
            exec_targets.resolve(b.pid, ["bin/git"])
        with pytest.raises(ExecPatternError):
            exec_targets.resolve(b.pid, ["python3", "/usr/*/*"])
        assert not open_in_usr()  # what was opened is closed again
    finally:
        await b.channel.close()
        await backend.kill(b.sandbox)


async def test_the_loaders_are_found_and_resolution_is_fast(backend: LinuxBackend) -> None:
    b = await Box.create(backend)
    try:
        loaders = exec_targets.loaders(b.pid)
        try:
            assert "/lib64/ld-linux-x86-64.so.2" in [t.path for t in loaders]
            ld = next(t for t in loaders if t.path == "/lib64/ld-linux-x86-64.so.2")
            assert identity(ld.fd) == await in_sandbox_identity(b, "/lib64/ld-linux-x86-64.so.2")
        finally:
            for t in loaders:
                os.close(t.fd)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            targets = exec_targets.resolve(b.pid, ["python3", "git", "pip*"])
            times.append((time.perf_counter() - t0) * 1000)
            for t in targets:
                os.close(t.fd)
        t0 = time.perf_counter()
        for t in exec_targets.loaders(b.pid):
            os.close(t.fd)
        loader_ms = (time.perf_counter() - t0) * 1000
        print(f"\nresolve(python3, git, pip*): median {statistics.median(times):.2f} ms, min {min(times):.2f} ms; "
              f"loaders: {loader_ms:.2f} ms")
        assert statistics.median(times) < 20
    finally:
        await b.channel.close()
        await backend.kill(b.sandbox)


# -- enforcement -----------------------------------------------------------------------------------


async def test_an_allow_list_runs_what_it_allows_and_refuses_the_rest(backend: LinuxBackend, lsm: ExecLsm) -> None:
    b = await policed(backend, lsm, "allow", allow=("true",))
    try:
        assert (await b.sh("ls /"))[0] == 0  # mode allow: everything runs
        lsm.set_mode(b.slot, "deny")
        assert (await b.sh("/usr/bin/true"))[0] == 0
        out = await b.sh("ls /")
        assert refused(out) and LS_OUTPUT not in out[1], out
        refusals = [r for r in lsm.read_refusals() if r.slot == b.slot]
        assert any(r.hook == "exec" and r.name.endswith("ls") and r.uid in b.sandbox.host_uids for r in refusals)
    finally:
        await gone(backend, lsm, b)


async def test_a_deny_list_under_default_allow(backend: LinuxBackend, lsm: ExecLsm) -> None:
    b = await policed(backend, lsm, "allow")
    try:
        assert LS_OUTPUT in (await b.sh("ls /"))[1]
        await apply(lsm, b, deny=("ls",))
        assert refused(await b.sh("ls /"))
        assert (await b.sh("/usr/bin/true && echo fine"))[1].strip() == "fine"
    finally:
        await gone(backend, lsm, b)


async def test_the_loader_cannot_run_what_exec_would_refuse(backend: LinuxBackend, lsm: ExecLsm) -> None:
    ld = "/lib64/ld-linux-x86-64.so.2"
    b = await policed(backend, lsm, "allow")
    try:
        assert LS_OUTPUT in (await b.sh(f"{ld} /usr/bin/ls /"))[1]
        # default allow, ls denied: ld.so runs, but cannot map ls executable
        await apply(lsm, b, deny=("ls",))
        code, out, err = await b.sh(f"{ld} /usr/bin/ls /")
        assert code != 0 and LS_OUTPUT not in out, (code, out, err)
        assert any(r.hook == "mmap" for r in lsm.read_refusals() if r.slot == b.slot)
        # default deny: ld.so itself is not exec'd (true is allowed, but not through the loader)
        await apply(lsm, b, allow=("true",))
        lsm.set_mode(b.slot, "deny")
        assert (await b.sh("/usr/bin/true"))[0] == 0
        assert refused(await b.sh(f"{ld} /usr/bin/true"))
    finally:
        await gone(backend, lsm, b)


async def test_new_files_are_new_code(backend: LinuxBackend, lsm: ExecLsm) -> None:
    """Default deny: a copy of an allowed program is another file, refused."""
    b = await policed(backend, lsm, "allow", allow=("true", "cp", "chmod"))
    try:
        assert (await b.sh("cp /usr/bin/true ~/t && ~/t"))[0] == 0
        lsm.set_mode(b.slot, "deny")
        assert (await b.sh("/usr/bin/true"))[0] == 0
        assert refused(await b.sh("cp /usr/bin/true ~/t2 && ~/t2"))
    finally:
        await gone(backend, lsm, b)


async def test_other_names_of_a_denied_file_are_denied(backend: LinuxBackend, lsm: ExecLsm) -> None:
    """A hard link to a denied file, and a symlink named like an allowed program pointing at a denied one."""
    setup = ("mkdir -p ~/bin && cp /usr/bin/true ~/bin/prog && ln -s /usr/bin/ls ~/bin/true")
    b = await policed(backend, lsm, "allow", setup=setup)
    try:
        assert (await b.sh("ln ~/bin/prog ~/alias && ~/alias"))[0] == 0
        assert LS_OUTPUT in (await b.sh("~/bin/true /"))[1]
        await apply(lsm, b, deny=("/home/user/bin/prog", "ls"))
        assert refused(await b.sh("ln ~/bin/prog ~/alias2 && ~/alias2"))
        assert refused(await b.sh("~/alias"))
        assert refused(await b.sh("~/bin/true /"))
        # under default deny, with `true` allowed by name: the symlink is not `true`
        await apply(lsm, b, allow=("/usr/bin/true",))
        lsm.set_mode(b.slot, "deny")
        assert (await b.sh("/usr/bin/true"))[0] == 0
        assert refused(await b.sh("~/bin/true /"))
    finally:
        await gone(backend, lsm, b)


MEMFD_EXEC = ("import os\nfd = os.memfd_create('x', 0)\nos.write(fd, open('/usr/bin/true', 'rb').read())\n"
              "try:\n    os.execv(f'/proc/self/fd/{fd}', ['x'])\nexcept PermissionError:\n    print('EACCES')\n")


async def test_memfd_exec_is_refused_under_default_deny(backend: LinuxBackend, lsm: ExecLsm) -> None:
    b = await policed(backend, lsm, "allow", allow=("python3",))
    try:
        code, out, err = await b.run("python3", "-c", MEMFD_EXEC)
        assert code == 0 and "EACCES" not in out, err  # it ran /usr/bin/true's code
        lsm.set_mode(b.slot, "deny")
        code, out, err = await b.run("python3", "-c", MEMFD_EXEC)
        assert out.strip() == "EACCES", (code, out, err)
    finally:
        await gone(backend, lsm, b)


async def test_a_script_runs_if_its_interpreter_may(backend: LinuxBackend, lsm: ExecLsm) -> None:
    """The kernel checks a script's interpreter at the next round of the exec: `#!/usr/bin/tail -n1`
    prints the script's last line when tail may run, and is refused when it may not."""
    setup = "printf '#!/usr/bin/tail -n1\\nhello\\n' > ~/s && chmod +x ~/s"
    b = await policed(backend, lsm, "allow", setup=setup)
    try:
        assert (await b.sh("~/s"))[1].strip() == "hello"
        lsm.set_mode(b.slot, "deny")
        assert refused(await b.sh("~/s"))
        assert any(r.name == "/usr/bin/tail" for r in lsm.read_refusals() if r.slot == b.slot)
        await apply(lsm, b, allow=("tail",))
        assert (await b.sh("~/s"))[1].strip() == "hello"
        await apply(lsm, b, deny=("tail",))  # denied outright: also under default allow
        lsm.set_mode(b.slot, "allow")
        assert refused(await b.sh("~/s"))
    finally:
        await gone(backend, lsm, b)


async def test_once_lets_one_exec_through(backend: LinuxBackend, lsm: ExecLsm) -> None:
    b = await policed(backend, lsm, "deny")
    try:
        assert refused(await b.sh("/usr/bin/true"))
        await apply(lsm, b, once=("true",))
        [t] = exec_targets.resolve(b.pid, ["/usr/bin/true"])
        assert lsm.verdict(b.slot, t.fd) == "once"
        code, out, err = await b.sh("/usr/bin/true; echo $?; /usr/bin/true; echo $?")
        assert out.split() == ["0", "126"], (code, out, err)
        assert lsm.verdict(b.slot, t.fd) is None
        os.close(t.fd)
    finally:
        await gone(backend, lsm, b)


async def test_two_sandboxes_verdicts_on_one_file_are_their_own(backend: LinuxBackend, lsm: ExecLsm) -> None:
    """The runtime's interpreter is one file (a read-only bind of the server's store) in every sandbox:
    denied to one, allowed to the other; removing the first sandbox clears its verdict only."""
    a = await policed(backend, lsm, "allow", deny=(PYTHON,))
    b = await policed(backend, lsm, "deny", allow=(PYTHON,))
    try:
        [ta] = exec_targets.resolve(a.pid, [PYTHON])
        [tb] = exec_targets.resolve(b.pid, [PYTHON])
        assert identity(ta.fd) == identity(tb.fd)  # the same file
        assert lsm.verdict(a.slot, ta.fd) == "deny" and lsm.verdict(b.slot, tb.fd) == "allow"
        assert refused(await a.sh("python3 -c 'print(1)'"))
        assert (await b.sh("python3 -c 'print(1)'"))[1].strip() == "1"
        lsm.remove_sandbox(a.slot)
        assert lsm.verdict(b.slot, tb.fd) == "allow"
        a.slot = lsm.add_sandbox(a.sandbox.host_uids, "allow")  # (a fresh slot: nothing marked)
        assert lsm.verdict(a.slot, ta.fd) is None
        assert (await a.sh("python3 -c 'print(1)'"))[1].strip() == "1"
        os.close(ta.fd)
        os.close(tb.fd)
    finally:
        await gone(backend, lsm, a)
        await gone(backend, lsm, b)


async def test_remove_sandbox_clears_its_marks_and_pins(backend: LinuxBackend, lsm: ExecLsm) -> None:
    b = await policed(backend, lsm, "allow", deny=("ls",))
    try:
        assert refused(await b.sh("ls /"))
        assert len(lsm._slots[b.slot].pins) > 1  # the shells, ls, the loaders
        [t] = exec_targets.resolve(b.pid, ["/usr/bin/ls"])
        lsm.remove_sandbox(b.slot)
        assert open_in_usr() == [str(t.fd)]  # its pins are closed: only this test's fd is left
        assert LS_OUTPUT in (await b.sh("ls /"))[1]
        b.slot = lsm.add_sandbox(b.sandbox.host_uids, "allow")
        assert lsm.verdict(b.slot, t.fd) is None and not lsm.is_loader(t.fd)
        os.close(t.fd)
    finally:
        await gone(backend, lsm, b)


async def test_a_slot_marks_a_bounded_number_of_files(backend: LinuxBackend, lsm: ExecLsm) -> None:
    b = await policed(backend, lsm, "allow")
    limit, lsm.max_files = lsm.max_files, len(lsm._slots[b.slot].pins) + 1
    try:
        [t1, t2] = exec_targets.resolve(b.pid, ["/usr/bin/true", "/usr/bin/false"])
        lsm.mark(b.slot, t1.fd, "deny")
        with pytest.raises(ExecPolicyFull, match="narrow"):
            lsm.mark(b.slot, t2.fd, "deny")
        assert lsm.verdict(b.slot, t2.fd) is None
        os.close(t1.fd)
        os.close(t2.fd)
    finally:
        lsm.max_files = limit
        await gone(backend, lsm, b)
