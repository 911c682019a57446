"""The state dir across a power cut (docs/reliability.md): agentcell/durable.py's writer killed at every
step by strace's fault injection (a naive write_text torn by the same harness), and torn state files of
each kind (paused-sandbox records and archives, snapshots, volume records, the event store) refused with
a clear message and moved aside by a real server, the good ones beside them still loading."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentcell import Sandbox
from agentcell import durable as durable_module
from agentcell.backends.base import new_cell_sandbox_id
from agentcell.record.events import event
from agentcell.record.store import EventStore
from agentcell.runtime import statedir
from agentcell.server.snapshots import Snapshot, SnapshotStore
from agentcell.templates.builds import BuildRegistry
from tests.servers import SERVE, ServerProcess

REPO = Path(__file__).resolve().parent.parent
DURABLE = REPO / "agentcell" / "durable.py"
STRACE = shutil.which("strace")
OLD = b"the old version\n" * 4
NEW = b"the new version, longer\n" * 3000  # 72 KB: not a size the old could be cut to
# the calls a crash is injected at, one kind at a time (strace counts each kind on its own)
STEPS = ("openat", "write", "fsync", "fdatasync", "rename", "renameat", "renameat2")

# The writers run in a bare interpreter (-S -I): durable.py is loaded alone, from its path.
ATOMIC = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("durable", sys.argv[1])
durable = importlib.util.module_from_spec(spec)
spec.loader.exec_module(durable)
durable.atomic_write(Path(sys.argv[2]), Path(sys.argv[3]).read_bytes())
"""
NAIVE = """
import sys
from pathlib import Path
Path(sys.argv[2]).write_bytes(Path(sys.argv[3]).read_bytes())
"""

needs_strace = pytest.mark.skipif(STRACE is None, reason="the crash tests inject faults with strace")
# the real servers' crash tests take every kind of step with scripts/test-reliability, a representative
# few in CI (the power cut at every step is benchmarks/chaos.py's, a few of them in test_reliability.py)
EVERY_STEP = os.environ.get("AGENTCELL_CRASH_EVERY_STEP") == "1"


def crash_at_every_step(writer: str, work: Path) -> dict[str, list[tuple[bytes, list[str]]]]:
    """Run `writer` (a script replacing work/d/target's OLD with NEW) under strace, SIGKILLed on entry to
    the n-th call of each kind in STEPS, n = 1, 2 ... until it finishes unkilled (then the target must
    hold NEW). Per kind: what each crash left, the target's bytes and the directory's other names."""
    script = work / "writer.py"
    script.write_text(writer)
    new = work / "new"
    new.write_bytes(NEW)
    d = work / "d"
    found: dict[str, list[tuple[bytes, list[str]]]] = {}
    for step in STEPS:
        found[step] = []
        for n in itertools.count(1):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
            (d / "target").write_bytes(OLD)
            run = subprocess.run(
                [STRACE, "-f", "-qq", "-o", "/dev/null", "-e", f"trace={step}",
                 "-e", f"inject={step}:signal=KILL:when={n}",
                 sys.executable, "-S", "-I", str(script), str(DURABLE), str(d / "target"), str(new)],
                capture_output=True, timeout=60)
            if run.returncode == 0:
                assert (d / "target").read_bytes() == NEW, f"{step} #{n}: finished, yet the target is not new"
                break
            assert run.returncode in (-9, 137), f"{step} #{n}: {run.returncode} {run.stderr.decode()[-500:]}"
            found[step].append(((d / "target").read_bytes(), sorted(p.name for p in d.iterdir() if p.name != "target")))
            assert n < 400, f"the writer never finished under {step} injection"
    return found


@needs_strace
def test_atomic_write_leaves_old_or_new_after_a_crash_at_every_step(tmp_path: Path) -> None:
    found = crash_at_every_step(ATOMIC, tmp_path)
    for step, crashes in found.items():
        for n, (content, _) in enumerate(crashes, 1):
            assert content in (OLD, NEW), f"a crash at {step} #{n} left {len(content)} bytes: torn"
    # the order of its steps, as the crashes show it: the data is synced before the rename, the
    # directory after it (a crash there finds the new version in place)
    assert [c for c, _ in found["fsync"]] == [OLD, NEW]
    renames = [c for step in ("rename", "renameat", "renameat2") for c, _ in found[step]]
    assert renames == [OLD]
    assert [c for c, _ in found["write"]] == [OLD]
    assert found["openat"][-1][0] == NEW  # the directory opened for its fsync, after the rename
    # a crash before the rename leaves a temporary file beside the target, which remove_temps clears
    content, others = found["write"][0]
    assert len(others) == 1 and others[0].startswith(".target.") and others[0].endswith(".tmp")
    d = tmp_path / "left"
    d.mkdir()
    (d / "target").write_bytes(OLD)
    (d / others[0]).write_bytes(NEW[:100])
    assert [p.name for p in durable_module.remove_temps(d)] == [others[0]]
    assert sorted(p.name for p in d.iterdir()) == ["target"] and (d / "target").read_bytes() == OLD


@needs_strace
def test_a_naive_write_is_torn_by_the_same_crashes(tmp_path: Path) -> None:
    """The harness can fail: write_text truncates the target, then writes it; killed in between, the
    target is neither version."""
    found = crash_at_every_step(NAIVE, tmp_path)
    torn = [(step, c) for step, crashes in found.items() for c, _ in crashes if c not in (OLD, NEW)]
    assert ("write", b"") in torn


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a FUSE filesystem (as root, like CI)")
def test_only_synced_writes_survive_the_power_cut_filesystem_and_make_dirs_is_synced(tmp_path: Path) -> None:
    """benchmarks/lose_unsynced.py, the power cut's filesystem, keeps what was fsynced and nothing else;
    on it, atomic_write into a directory that plain mkdir made is lost with that directory's entry (what
    chaos.py power-cut found of paused/), and into one durable.make_dirs made, kept; so is a state dir's
    owned directory and the parent it made (statedir.owned_dir)."""
    lose_unsynced = _power_cut_fs()
    with lose_unsynced.mounted(tmp_path / "fs") as fs:
        (fs.path / "settled").write_bytes(OLD)
        (fs.path / "a").mkdir()
        (fs.path / "b").mkdir()
        fs.control("settle")
        (fs.path / "settled").write_bytes(NEW)  # not synced: the old data after the cut
        (fs.path / "never-synced").write_bytes(NEW)  # nor its name
        (fs.path / "a" / "plain").mkdir()
        durable_module.atomic_write(fs.path / "a" / "plain" / "record", NEW)
        durable_module.make_dirs(fs.path / "b" / "made" / "deeper")
        durable_module.atomic_write(fs.path / "b" / "made" / "deeper" / "record", NEW)
        ca = statedir.owned_dir(str(fs.path / "b" / "new-state-dir" / "egress-ca"))  # its missing parent made too
        durable_module.atomic_write(Path(ca) / "key", NEW)
        fs.control("arm 1 /")
        with pytest.raises(OSError):  # the power is off: nothing more is written
            (fs.path / "after").write_bytes(NEW)
        fs.control(f"image {tmp_path / 'disk'}")
    disk = tmp_path / "disk"
    assert (disk / "settled").read_bytes() == OLD
    assert not (disk / "never-synced").exists() and not (disk / "after").exists()
    assert list((disk / "a").iterdir()) == []  # a/'s entries never synced: plain/, and the record in it, lost
    assert (disk / "b" / "made" / "deeper" / "record").read_bytes() == NEW
    assert (disk / "b" / "new-state-dir" / "egress-ca" / "key").read_bytes() == NEW


@needs_strace
def test_a_template_build_recorded_before_a_power_cut_is_there_after_it(tmp_path: Path) -> None:
    """A template and its build, recorded (the API answered) on a fresh state dir, then the power cut:
    both are on the disk afterwards. Before, the records were renamed into place unsynced, in
    directories made by a plain mkdir: the disk held neither."""
    lose_unsynced = _power_cut_fs()
    with lose_unsynced.mounted(tmp_path / "fs") as fs:
        reg = BuildRegistry(str(fs.path / "state" / "template-builds"))
        template, build = reg.request("app", ["v1"], None, 1, 512, set())
        reg.succeed(build)
        fs.control("arm 1 /")
        fs.control(f"image {tmp_path / 'disk'}")
    again = BuildRegistry(str(tmp_path / "disk" / "state" / "template-builds"))
    found = again.find("app", None)
    assert found is not None and found.template_id == template.template_id
    assert again.builds[build.build_id].status == "ready"


def _power_cut_fs() -> Any:
    """benchmarks/lose_unsynced.py, the power cut's filesystem."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import lose_unsynced
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return lose_unsynced


def test_read_json_refuses_torn_files_clearly(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    durable_module.write_json(good, {"a": [1, 2]})
    assert durable_module.read_json(good, "a test record", "do X") == {"a": [1, 2]}
    assert oct(good.stat().st_mode & 0o777) == "0o600"
    for name, data, reason in (("empty.json", b"", "it is empty"), ("cut.json", b'{"a": [1,', "not valid JSON"),
                               ("junk.json", b"\xff\xfe\x00junk", "not valid JSON")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(durable_module.TornFileError) as e:
            durable_module.read_json(tmp_path / name, "a test record", "do X")
        assert str(e.value).startswith(f"{tmp_path / name}: a test record is damaged ({reason}")
        assert str(e.value).endswith("; do X") and isinstance(e.value, ValueError)
    moved = durable_module.move_aside(tmp_path / "cut.json", tmp_path / "damaged")
    (tmp_path / "cut.json").write_bytes(b"again")
    again = durable_module.move_aside(tmp_path / "cut.json", tmp_path / "damaged")
    assert moved == tmp_path / "damaged" / "cut.json" and moved.read_bytes() == b'{"a": [1,'
    assert again != moved and again.read_bytes() == b"again"  # never over an earlier one


def test_a_cancelled_snapshot_commit_still_keeps_the_snapshot(tmp_path: Path) -> None:
    """commit() fsyncs in a thread: a caller cancelled meanwhile (a client gone) leaves it to finish, and
    the snapshot is then in the store and on disk, its reservation given back, never half-removed."""
    async def main() -> None:
        store = SnapshotStore(tmp_path / "snaps", 1 << 30, 10)
        store.load()
        tid, d, room = store.begin("n", None, 1 << 20)
        (d / "files.tar").write_bytes(b"x" * 10240)
        snap = Snapshot(template_id=tid, name="n", mode="filesystem", backend="linux", sandbox_id="s",
                        source_template="base", created_at=time.time(), size_bytes=10240)
        task = asyncio.ensure_future(store.commit(snap, room))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if store.find("n") is not None:
                break
            await asyncio.sleep(0.05)
        assert store.find("n") is snap and store.used_bytes() == 10240
        again = SnapshotStore(tmp_path / "snaps", 1 << 30, 10)
        again.load()
        assert [s.template_id for s in again.list()] == [tid]

    asyncio.run(main())


# --- a real server on a state dir with torn files of every kind ---------------------------------------


def _serve(log: Path, state: Path) -> ServerProcess:
    return ServerProcess(log, "--state-dir", str(state), "--egress-uplink", "none", "--standbys", "0",
                         "--volume-size-mb", "32", command=SERVE, start_timeout=180)


def _cut(data: bytes) -> bytes:
    return data[: len(data) // 2]


@pytest.mark.skipif(bool(os.environ.get("AGENTCELL_TEST_SERVER_URL")), reason="starts servers of its own")
@pytest.mark.skipif(os.geteuid() != 0, reason="volumes are loop-mounted ext4 images: a root server")
def test_a_server_sets_torn_state_aside_and_loads_the_rest(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with _serve(tmp_path / "one.log", state) as one:
        sbx = Sandbox.create(api_url=one.url, timeout=300)
        sbx.files.write("/home/user/kept.txt", "still here")
        snap = sbx.create_snapshot(name="good")
        assert sbx.pause(mode="filesystem")
        api = httpx.Client(base_url=one.url, timeout=120)
        volumes = [api.post("/volumes", json={"name": n}).json()["volumeID"] for n in ("vol-good", "vol-torn")]
    paused, snaps = state / "paused", state / "snapshots"
    record = (paused / f"{sbx.sandbox_id}.json").read_text()
    archive = (paused / f"{sbx.sandbox_id}.tar").read_bytes()
    [snap_dir] = [d for d in snaps.iterdir() if (d / "meta.json").exists()]
    meta = json.loads((snap_dir / "meta.json").read_text())

    # paused sandboxes: torn records (with and without their archive), a record whose archive is gone,
    # an archive with no record, a crashed write's temporary file
    ids = {kind: new_cell_sandbox_id() for kind in ("cut", "empty", "junk", "no-archive", "orphan", "elsewhere")}
    placed: dict[str, bytes] = {}

    def put(path: Path, data: bytes) -> None:
        path.write_bytes(data)
        placed[path.name] = data

    for kind, data in (("cut", _cut(record.encode())), ("empty", b""), ("junk", os.urandom(300)),
                       ("no-archive", record.encode()),
                       ("elsewhere", json.dumps({**json.loads(record), "backend": "nosuch"}).encode())):
        put(paused / f"{ids[kind]}.json", data.replace(sbx.sandbox_id.encode(), ids[kind].encode()))
    for kind in ("cut", "empty", "orphan", "elsewhere"):
        put(paused / f"{ids[kind]}.tar", archive)
    leftover = paused / f".{sbx.sandbox_id}.json.x1y2z3.tmp"
    leftover.write_text("{half a rec")

    # snapshots: a torn meta.json (cut, empty, junk), an archive cut short, one never finished
    torn_snaps = {kind: new_cell_sandbox_id() for kind in ("cut", "empty", "junk", "short", "unfinished")}
    for kind, tid in torn_snaps.items():
        shutil.copytree(snap_dir, snaps / tid)
        text = json.dumps({**meta, "template_id": tid, "name": None}).encode()
        (snaps / tid / "meta.json").write_bytes(
            {"cut": _cut(text), "empty": b"", "junk": os.urandom(200)}.get(kind, text))
        if kind == "short":
            os.truncate(snaps / tid / "files.tar", meta["size_bytes"] // 2)
        if kind == "unfinished":
            (snaps / tid / "meta.json").unlink()
    snap_bytes = {tid: {p.name: p.read_bytes() for p in (snaps / tid).iterdir()} for tid in torn_snaps.values()}

    # a volume's record cut short; the event store cut to a third
    vol_meta = state / "volumes" / volumes[1] / "volume.json"
    vol_torn = _cut(vol_meta.read_bytes())
    vol_meta.write_bytes(vol_torn)
    events = state / "events.db"
    events_torn = events.read_bytes()[: events.stat().st_size // 3]
    events.write_bytes(events_torn)

    with _serve(tmp_path / "two.log", state) as two:
        api = httpx.Client(base_url=two.url, timeout=120)
        listed = api.get("/v2/sandboxes", params={"state": "paused"}).json()
        assert [s["sandboxID"] for s in listed] == [sbx.sandbox_id]
        assert [s["snapshotID"] for s in api.get("/snapshots").json()] == [snap.snapshot_id]
        assert [v["volumeID"] for v in api.get("/volumes").json()] == [volumes[0]]
        # the good ones work: the paused sandbox resumes with its file, a create from the snapshot has it
        back = Sandbox.connect(sbx.sandbox_id, api_url=two.url)
        assert back.files.read("/home/user/kept.txt") == "still here"
        child = Sandbox.create(snap.snapshot_id, api_url=two.url)
        assert child.files.read("/home/user/kept.txt") == "still here"
        child.kill()
        back.kill()
        log = two.log()

    # nothing was deleted: every torn file is in damaged/, byte for byte
    damaged = paused / "damaged"
    assert {p.name: p.read_bytes() for p in damaged.iterdir()} == placed
    assert not leftover.exists()
    for kind, tid in torn_snaps.items():
        if kind == "unfinished":  # never existed (its id was never given out): removed, as before
            assert not (snaps / tid).exists()
        else:
            assert {p.name: p.read_bytes() for p in (snaps / "damaged" / tid).iterdir()} == snap_bytes[tid]
    assert vol_meta.read_bytes() == vol_torn  # left where it is, beside the volume's image
    [events_aside] = state.glob("events.db.damaged-*")
    assert events_aside.read_bytes() == events_torn

    # and the log says what, why, where it went and what to do
    lines = log.splitlines()

    def line(*parts: str) -> str:
        hits = [x for x in lines if all(p in x for p in parts)]
        assert hits, f"no log line with {parts}:\n{log[-6000:]}"
        return hits[0]

    for kind, reason in (("cut", "not valid JSON"), ("empty", "it is empty"), ("junk", "not valid JSON")):
        got = line("a kept paused sandbox cannot be resumed", f"{ids[kind]}.json", reason)
        assert str(damaged / f"{ids[kind]}.json") in got and "tar -tf" in got
    assert str(damaged / f"{ids['cut']}.tar") in line(f"{ids['cut']}.json: the record")
    line(f"{ids['no-archive']}.json", f"{ids['no-archive']}.tar, is missing")
    line(f"{ids['orphan']}.tar has no record", str(damaged / f"{ids['orphan']}.tar"))
    line(f"{ids['elsewhere']}.json: it ran on the nosuch backend", "move its record and archive back")
    line(f"{len(placed)} damaged or orphaned paused-sandbox files wait in", str(damaged))
    for kind, reason in (("cut", "not valid JSON"), ("empty", "it is empty"), ("junk", "not valid JSON"),
                         ("short", "bytes, meta.json says")):
        got = line("a snapshot cannot be used", torn_snaps[kind], reason)
        assert str(snaps / "damaged" / torn_snaps[kind]) in got
    line("snapshot", torn_snaps["unfinished"], "never finished")
    line("a volume cannot be mounted", str(vol_meta), "not valid JSON", "image.ext4")
    line("the event store", "is damaged", str(events_aside), ".recover")
    shutil.rmtree(state / "volumes", ignore_errors=True)  # 64 MiB of images (the server unmounted them)


# --- a real server killed at every step of a pause to disk and of a snapshot ---------------------------


def _crash_at(pid: int, step: str, n: int, paths: tuple[Path, ...], threads: bool) -> subprocess.Popen[bytes]:
    """strace attached to the running server `pid`, SIGKILLing it on entry to the n-th `step` call from now
    (only calls on `paths`, when given: strace's -P, which follows fds too). strace counts each thread's
    calls apart: `threads` attaches all of them (the calls made in worker threads), else the event
    loop's only."""
    assert STRACE is not None
    crasher = subprocess.Popen([STRACE, *(["-f"] if threads else []), "-qq", "-o", "/dev/null", "-p", str(pid),
                                "-e", f"trace={step}", "-e", f"inject={step}:signal=KILL:when={n}",
                                *(a for p in paths for a in ("-P", str(p)))])

    def attached() -> bool:
        tasks = os.listdir(f"/proc/{pid}/task") if threads else [str(pid)]
        return all(f"TracerPid:\t{crasher.pid}\n" in Path(f"/proc/{pid}/task/{t}/status").read_text() for t in tasks)

    deadline = time.monotonic() + 30
    while not attached():
        assert crasher.poll() is None and time.monotonic() < deadline, "strace did not attach"
        time.sleep(0.05)
    return crasher


def _crash_every_step(tmp_path: Path, what: str, steps: tuple[tuple[str, str, bool], ...]) -> dict[str, int]:
    """Per (step, paths-kind, all threads?): start a server, make a sandbox with a file, attach strace to kill the server
    at the n-th such call during `what` ("pause": to disk; "snapshot"), for n = 1, 2 ... until it
    finishes; after each kill a new server on the same state dir must start and hold the old state (no
    paused sandbox / snapshot) or the new one (there, with the file), never anything torn. Counts outcomes."""
    outcomes = {"old": 0, "new": 0, "orphan": 0, "finished": 0}
    run = itertools.count()
    for step, only, threads in steps:
        for n in itertools.count(1):
            assert n < 40, f"{what} never finished under {step} injection"
            state = tmp_path / f"state-{next(run)}"
            one = _serve(tmp_path / f"{state.name}-one.log", state).started()
            try:
                sbx = Sandbox.create(api_url=one.url, timeout=300)
                sbx.files.write("/home/user/kept.txt", "still here")
                paths = {"archive": (state / "paused", state / "paused" / f"{sbx.sandbox_id}.tar",
                                     state / "paused" / f"{sbx.sandbox_id}.json"),
                         "snapshots": (state / "snapshots",), "any": ()}[only]
                crasher = _crash_at(one.pid, step, n, paths, threads)
                with contextlib.suppress(httpx.HTTPError):
                    if what == "pause":
                        httpx.post(f"{one.url}/sandboxes/{sbx.sandbox_id}/pause", json={"memory": False}, timeout=120)
                    else:
                        httpx.post(f"{one.url}/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": "s"}, timeout=120)
                killed = _exits_soon(one)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    crasher.terminate()
                crasher.wait(timeout=30)
                one.stop()
            with _serve(tmp_path / f"{state.name}-two.log", state) as two:
                api = httpx.Client(base_url=two.url, timeout=120)
                paused = [s["sandboxID"] for s in api.get("/v2/sandboxes", params={"state": "paused"}).json()]
                snaps = [s["snapshotID"] for s in api.get("/snapshots").json()]
                got = paused if what == "pause" else snaps
                assert got in ([], [sbx.sandbox_id] if what == "pause" else ["s:default"]), got
                if got:
                    back = Sandbox.connect(sbx.sandbox_id, api_url=two.url) if what == "pause" else \
                        Sandbox.create("s:default", api_url=two.url)
                    assert back.files.read("/home/user/kept.txt") == "still here"
                    back.kill()
                log = two.log()
            assert "is damaged (" not in log and "Traceback" not in log, log[-4000:]  # nothing torn
            assert not (state / "snapshots" / "damaged").exists()
            assert len(list((state / "snapshots").iterdir())) == (len(got) if what == "snapshot" else 0)
            # nothing left behind unnoticed: what the resume did not take is in damaged/ (or nothing is)
            assert sorted(p.name for p in (state / "paused").glob("*")) in ([], ["damaged"])
            aside = sorted(p.name for p in (state / "paused" / "damaged").glob("*"))
            if not killed:  # past the last such call: it finished
                assert got and not aside
                outcomes["finished"] += 1
                break
            outcomes["new" if got else "old"] += 1
            if aside:  # a crash after the archive, before its record: set aside, said so
                assert not got and aside == [f"{sbx.sandbox_id}.tar"] and "has no record" in log
                outcomes["orphan"] += 1
            shutil.rmtree(state, ignore_errors=True)
    return outcomes


def _exits_soon(server: ServerProcess) -> bool:
    """Whether the server was killed (or is dying: the answer to the request may come first)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(timeout=2)
    return server.proc.poll() is not None


@needs_strace
@pytest.mark.skipif(bool(os.environ.get("AGENTCELL_TEST_SERVER_URL")), reason="starts servers of its own")
def test_a_server_killed_at_every_step_of_a_pause_to_disk(tmp_path: Path) -> None:
    """The archive's creation and writes and its fsyncs (a worker thread's), the record's temporary file's
    fsync, its rename and paused/'s fsync after it (the event loop's): old (no paused sandbox), an archive
    set aside, or new."""
    steps = (("openat", "archive", True), ("write", "archive", True), ("fsync", "any", True),
             ("rename", "any", True), ("fsync", "any", False), ("openat", "archive", False))
    if not EVERY_STEP:  # every fsync: the archive's (old), the record's before its rename (an orphan
        steps = (steps[2],)  # archive), paused/'s after it (new)
    got = _crash_every_step(tmp_path, "pause", steps)
    assert got["old"] and got["new"] and got["orphan"] and got["finished"] == len(steps), got


@needs_strace
@pytest.mark.skipif(bool(os.environ.get("AGENTCELL_TEST_SERVER_URL")), reason="starts servers of its own")
def test_a_server_killed_at_every_step_of_a_snapshot(tmp_path: Path) -> None:
    """The fsyncs (content, snapshots/, meta.json's temporary file, the snapshot's directory), the
    opening of snapshots/ and meta.json's rename: no snapshot (its directory removed) or the snapshot."""
    steps = (("openat", "snapshots", True), ("fsync", "any", True), ("rename", "any", True))
    if not EVERY_STEP:
        steps = (steps[1],)
    got = _crash_every_step(tmp_path, "snapshot", steps)
    assert got["old"] and got["new"] and got["finished"] == len(steps), got


@pytest.mark.skipif(bool(os.environ.get("AGENTCELL_TEST_SERVER_URL")), reason="starts servers of its own")
def test_a_fork_cut_short_by_a_crash_leaves_no_copy_behind(tmp_path: Path) -> None:
    """A fork copies its sandbox to <state>/forks/ and removes the copy once its sandboxes are made: a server
    killed in between left the copy there for good (up to twice the sandbox's disk, once per crash). The
    next server on the state dir removes it."""
    state = tmp_path / "state"
    one = _serve(tmp_path / "one.log", state).started()
    copies: list[Path] = []
    try:
        sbx = Sandbox.create(api_url=one.url, timeout=300)
        sbx.commands.run("head -c 150000000 /dev/urandom > /home/user/big.bin")  # a copy that takes a while

        def fork() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server dies under it
                httpx.post(f"{one.url}/sandboxes/{sbx.sandbox_id}/fork", json={"count": 2}, timeout=120)

        threading.Thread(target=fork, daemon=True).start()
        deadline = time.monotonic() + 60
        while not copies and time.monotonic() < deadline:
            copies = [p for p in (state / "forks").glob("*") if p.stat().st_size] if (state / "forks").exists() else []
            time.sleep(0.005)
        one.proc.kill()  # SIGKILL: mid-copy, or while the forks are being made
        one.proc.wait(timeout=30)
    finally:
        one.stop()
    assert copies, "the fork's copy was never seen under forks/"
    assert list((state / "forks").iterdir()), "the crash left no copy: nothing was tested"
    with _serve(tmp_path / "two.log", state) as two:
        assert not (state / "forks").exists() or not list((state / "forks").iterdir())
        sbx = Sandbox.create(api_url=two.url, timeout=60)  # and the server works
        assert sbx.commands.run("echo ok").stdout == "ok\n"
        sbx.kill()


# --- the event store --------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "zero-length", "garbage"])
def test_a_damaged_event_store_is_moved_aside_and_a_new_one_started(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "events.db"

    async def fill() -> None:
        store = EventStore(path)
        await store.start()
        store.begin("before")
        for i in range(3000):
            store.add("before", event("file.write", path=f"/tmp/{i}"))
        await store.flush()
        await store.close()  # checkpointed: everything is in events.db, no -wal

    asyncio.run(fill())
    data = path.read_bytes()
    torn = {"truncated": data[: len(data) // 3], "zero-length": b"", "garbage": os.urandom(len(data))}[damage]
    path.write_bytes(torn)

    async def reopen() -> list[dict]:
        store = EventStore(path)
        await store.start()
        try:
            assert not store.known("before")
            store.begin("after")
            store.add("after", event("process.exec", pid=1, path="/bin/true"))
            await store.flush()
            return [e async for e in store.follow("after")]
        finally:
            await store.close()

    with caplog.at_level(logging.ERROR, logger="agentcell.events"):
        got = asyncio.run(reopen())
    assert [e["kind"] for e in got] == ["process.exec"]  # the new store works
    [aside] = tmp_path.glob("events.db.damaged-*")
    assert aside.read_bytes() == torn  # kept as it was, never wiped
    assert aside.name[len("events.db.damaged-"):] <= time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    [message] = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert str(path) in message and str(aside) in message and "a new, empty one started" in message
    # and the new store is an ordinary one: reopened, it keeps what it has, nothing more is moved
    asyncio.run(_known_after_restart(path, "after"))
    assert len(list(tmp_path.glob("events.db.damaged-*"))) == 1


async def _known_after_restart(path: Path, sandbox_id: str) -> None:
    store = EventStore(path)
    await store.start()
    try:
        assert store.known(sandbox_id)
    finally:
        await store.close()
